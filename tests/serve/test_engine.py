"""The engine: batched requests give the tokens each gives alone, under every policy; memory stays in
the budget at every step; preemption, raises and cancellation lose no request."""

import random

import pytest
import torch

from linearize.convert import convert, set_active
from linearize.hub import build_tiny_llama
from linearize.serve.engine import Engine, EngineConfig
from linearize.serve.levels import LevelMemory
from linearize.serve.policy import MemoryPolicy, Policy, parse_policy
from linearize.serve.sampling import SamplingParams

ORDER = [2, 0, 3, 1]


@pytest.fixture(scope="module")
def family():
    model = build_tiny_llama(0, num_hidden_layers=4, max_position_embeddings=2048)
    from linearize.spec import ConversionSpec

    spec = ConversionSpec.from_dict({"attention": "dsla", "order": ORDER})
    convert(model, spec)
    return model, LevelMemory.from_spec(spec, model.config, dtype_bytes=4)


def check_alone(model, request):
    """Every output token is the argmax of the model run alone over the request's tokens before it,
    at the level the engine generated that token at (greedy: the same tokens as running alone)."""
    for i, (token, level) in enumerate(zip(request.output, request.token_levels)):
        set_active(model, level)
        ids = torch.tensor([request.prompt + request.output[:i]])
        with torch.inference_mode():
            assert int(model(input_ids=ids).logits[0, -1].argmax()) == token, (request.id, i, level)


def workload(engine, n, seed, *, max_tokens=(3, 9), prompt=(2, 40)):
    rng = random.Random(seed)
    pending = [([rng.randrange(3, 128) for _ in range(rng.randrange(*prompt))], SamplingParams(max_tokens=rng.randrange(*max_tokens), temperature=0.0, ignore_eos=True))
               for _ in range(n)]  # fmt: skip
    return pending


def drive(engine, pending, *, arrivals_per_step=2):
    """Add requests a few per step (continuous batching), step until all finish; check memory each step."""
    steps = 0
    while pending or engine.has_work():
        for _ in range(min(arrivals_per_step, len(pending))):
            engine.add_request(*pending.pop(0))
        engine.step()
        assert engine.held_bytes() <= engine.config.kv_budget
        assert engine.used_bytes() <= engine.config.kv_budget
        steps += 1
        assert steps < 2000
    return engine.finished


@pytest.mark.parametrize("policy", ["softmax", "static:2", "static:4", "length-caps"])
def test_batched_equals_alone_for_static_policies(family, policy):
    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=24), policy=parse_policy(policy, levels))
    finished = drive(engine, workload(engine, 6, seed=1))
    assert len(finished) == 6 and all(r.finish_reason == "length" and len(r.output) == r.params.max_tokens for r in finished.values())
    for request in finished.values():
        check_alone(model, request)
    if policy == "static:2":
        assert {lv for r in finished.values() for lv in r.token_levels} == {2}


@pytest.mark.slow
def test_memory_policy_converts_before_preempting_and_stays_exact(family):
    model, levels = family
    per_request = levels.bytes(0, 200)  # a DSLA state weighs as much as 68 tokens of KV here: long requests gain
    engine = Engine(model, levels, EngineConfig(kv_budget=int(2.5 * per_request), max_step_tokens=128),
                    policy=MemoryPolicy(high=0.8, low=0.5, max_level=4))
    finished = drive(engine, workload(engine, 8, seed=2, max_tokens=(10, 20), prompt=(150, 250)))
    assert len(finished) == 8 and all(r.finish_reason == "length" for r in finished.values())
    assert engine.counters["conversions"] > 0
    assert any(len(set(r.token_levels)) > 1 for r in finished.values())  # a level rose mid-generation
    for request in finished.values():
        check_alone(model, request)
        assert request.token_levels == sorted(request.token_levels)  # levels only rise


def test_preemption_by_recompute_loses_nothing(family):
    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=int(2.2 * levels.bytes(0, 30)), max_step_tokens=64), policy=parse_policy("softmax", levels))
    finished = drive(engine, workload(engine, 6, seed=3, max_tokens=(8, 16), prompt=(20, 28)), arrivals_per_step=6)
    assert engine.counters["preemptions"] > 0
    assert len(finished) == 6 and all(r.finish_reason == "length" and len(r.output) == r.params.max_tokens for r in finished.values())
    for request in finished.values():
        check_alone(model, request)


def test_cancellation_frees_memory_at_once(family):
    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=64))
    a = engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    b = engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    before = engine.held_bytes()
    assert engine.abort(a)
    assert 0 < engine.held_bytes() < before
    assert engine.get(a).finish_reason == "abort" and not engine.abort(a) and not engine.abort("nope")
    engine.run()
    assert engine.get(b).finish_reason == "length" and engine.held_bytes() == 0


def test_too_long_is_rejected_not_lost(family):
    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=levels.bytes(0, 50), max_step_tokens=64), policy=parse_policy("softmax", levels))
    big = engine.add_request(list(range(3, 103)), SamplingParams(max_tokens=4))
    ok = engine.add_request(list(range(3, 13)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run()
    assert engine.get(big).finish_reason == "rejected" and engine.get(ok).finish_reason == "length"


def test_sampled_requests_do_not_depend_on_their_batch(family):
    model, levels = family
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    alone = Engine(model, levels, EngineConfig(kv_budget=10**9))
    rid = alone.add_request(list(range(5, 25)), params)
    alone.run()
    alone_greedy = Engine(model, levels, EngineConfig(kv_budget=10**9))
    gid = alone_greedy.add_request(list(range(9, 21)), greedy)
    alone_greedy.run()
    busy = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=16))
    for k in range(4):
        busy.add_request(list(range(7, 30 + k)), SamplingParams(max_tokens=6, temperature=1.0, seed=k))
    rid2 = busy.add_request(list(range(5, 25)), params)
    gid2 = busy.add_request(list(range(9, 21)), greedy)  # greedy rows decode beside sampled ones
    busy.run()
    assert busy.get(rid2).output == alone.get(rid).output
    assert busy.get(gid2).output == alone_greedy.get(gid).output


def test_bad_requests_name_the_problem(family):
    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9))
    with pytest.raises(ValueError, match="token ids in 0..127"):
        engine.add_request([5, 500])
    with pytest.raises(ValueError, match="non-empty"):
        engine.add_request([])
    engine.add_request([5], request_id="x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request([6], request_id="x")
    with pytest.raises(ValueError, match="kv_budget must be a positive integer, got 0"):
        EngineConfig(kv_budget=0)


class RaiseOnce(Policy):
    """Starts every request at level 1 and raises request 'r' to level 3 once it holds ``at`` tokens."""

    name = "raise-once"

    def __init__(self, at):
        self.at, self.done = at, False

    def admission_level(self, prompt_tokens, final_tokens, memory):
        return 1

    def raises(self, running, memory):
        for r in running:
            if r.id == "r" and not self.done and r.tokens >= self.at:
                self.done = True
                return {"r": 3}
        return {}

    def level_cap(self, levels):
        return levels.max_level


def test_a_level_raised_mid_generation_continues_as_if_converted_from_the_first_token(family):
    """After the raise, the request's memory is what it would be had layers order[1:3] run converted
    from its first token: its next tokens and logits equal that run's on the same tokens."""
    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=64), policy=RaiseOnce(at=30))
    prompt = list(range(5, 30))
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), request_id="r")
    engine.add_request(list(range(40, 52)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), request_id="other")
    engine.run()
    r = engine.get("r")
    assert r.token_levels[0] == 1 and r.token_levels[-1] == 3 and r.raises == 1 and engine.counters["conversions"] == 2
    switch = r.token_levels.index(3)
    set_active(model, 3)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + r.output[:-1]])).logits[0]
    assert r.output[switch:] == logits[len(prompt) - 1 + switch :].argmax(-1).tolist()
    check_alone(model, engine.get("other"))


def test_each_step_says_what_it_ran(family):
    """``last_step``: the first step prefills the prompts in chunks within the step's token budget
    and decodes nothing; a later step decodes every running request, then prefills with the rest."""
    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=16), policy=parse_policy("softmax", levels))
    engine.add_request(list(range(3, 13)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request(list(range(3, 28)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    first = engine.last_step
    assert (first.decode_rows, first.decode_s, first.prefill_tokens, first.prefill_chunks) == (0, 0.0, 16, 2) and first.prefill_s > 0
    engine.step()  # the first request decodes; the second's prompt goes on (19 of its 25 tokens are left)
    second = engine.last_step
    assert (second.decode_rows, second.prefill_tokens, second.prefill_chunks) == (1, 15, 1) and second.decode_s > 0
    assert engine.counters["prefill_tokens"] == 31 and engine.counters["prefill_chunks"] == 3


@pytest.fixture(params=["words", "smollm2"])
def tokenizer_and_text(request):
    """A word-level tokenizer, and SmolLM2's byte-level BPE (skipped without the model's GGUF), each
    with a text to stream (the BPE's with characters of two to four bytes)."""
    from linearize.hub import build_tiny_tokenizer, find_smollm2_gguf, load_gguf_tokenizer

    if request.param == "words":
        return build_tiny_tokenizer(), "w3 w17 w5 w99 w4 w4 w120"
    try:
        gguf = find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    from types import SimpleNamespace

    config = SimpleNamespace(eos_token_id=2, pad_token_id=2, max_position_embeddings=8192)
    return load_gguf_tokenizer(gguf, config), "Naïve café — 東京タワー 🚀🚀 x  y\n\tz, \"quoted\" ünïcödé 🤖"


def test_streamed_text_joins_to_the_whole_decode(family, tokenizer_and_text):
    """The engine decodes each new token's text from a short window (the tokens since its last piece
    and that piece), not the whole output: the pieces, end-of-sequence tokens among them, still join to
    the decode of the whole output, multi-byte characters split across tokens included."""
    from linearize.serve.engine import Request
    from linearize.serve.sampling import StopChecker

    tokenizer, text = tokenizer_and_text
    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9), tokenizer=tokenizer, eos_token_ids=[2])
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[:3] + [2] + ids[3:] + [2]  # an end-of-sequence token inside (ignore_eos) and at the end
    request = Request("r", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True))
    request.stop_checker = StopChecker(())
    pieces = []
    for token in ids:
        request.output.append(token)
        pieces.append(engine._text_delta(request)[0])
    want = tokenizer.decode([t for t in ids if t != 2], skip_special_tokens=True)
    assert "".join(pieces) == request.text == want
    assert sum(1 for p in pieces if p) > len(ids) // 3  # streamed as it goes, not at the end
    if "🚀" in text:  # the byte-level BPE splits some of these characters across tokens
        assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_prefill_chunks_launch_before_the_decode_tokens_are_read(family, monkeypatch):
    """Within a step the decode forward is launched, then the prefill chunks, and only then are the
    decode's tokens read (on a GPU the chunks' host work overlaps the decode's device work); a
    decoding request is never taken for a prefill chunk while its token is out."""
    from linearize.serve import engine as engine_module

    model, levels = family
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=16), policy=parse_policy("softmax", levels))
    engine.add_request(list(range(3, 10)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the first prompt in, its first token out
    engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=3, ignore_eos=True))
    events = []
    forward, tokens = engine.runner.forward, engine_module._NextTokens.tokens
    monkeypatch.setattr(engine.runner, "forward", lambda seqs, ids: events.append(("forward", tuple(ids.shape))) or forward(seqs, ids))
    monkeypatch.setattr(engine_module._NextTokens, "tokens", lambda self: events.append(("tokens", len(self.requests))) or tokens(self))
    engine.step()
    assert events == [("forward", (1, 1)), ("forward", (1, 15)), ("tokens", 1)]
    assert engine.last_step.decode_rows == 1 and engine.last_step.prefill_tokens == 15
    assert len(engine.get(engine.running[0].id).output) == 2
