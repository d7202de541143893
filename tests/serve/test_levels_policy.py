"""Levels of a nested family count a request's bytes exactly; policies decide levels as documented."""

import pytest
import torch

from linearize.cache import cache_kwargs, cache_nbytes, output_cache
from linearize.convert import convert
from linearize.hub import build_tiny_llama
from linearize.serve.levels import LevelMemory
from linearize.serve.policy import LengthCapsPolicy, MemoryPolicy, MemoryView, RequestView, StaticPolicy, parse_policy
from linearize.spec import ConversionSpec

ORDER = [3, 0, 2, 1]


def family(active: int):
    model = build_tiny_llama(0, num_hidden_layers=4)
    spec = ConversionSpec.from_dict({"attention": "dsla", "order": ORDER, "active": active})
    convert(model, spec)
    return model, spec


@pytest.mark.parametrize("level", [0, 1, 3, 4])
def test_level_bytes_equal_the_cache_after_prefill(level):
    model, spec = family(level)
    ids = torch.randint(0, 128, (1, 37))
    with torch.inference_mode():
        cache = output_cache(model(input_ids=ids, use_cache=True, **cache_kwargs(None)))
    levels = LevelMemory.from_spec(spec, model.config, dtype_bytes=4)
    assert levels.converted_layers(level) == frozenset(ORDER[:level])
    assert sum(cache_nbytes(cache).values()) == levels.bytes(level, 37)


def test_saving_is_the_difference_of_levels():
    model, spec = family(0)
    levels = LevelMemory.from_spec(spec, model.config)
    for level in range(4):
        for tokens in (1, 100, 5000):
            assert levels.saving(level, tokens) == levels.bytes(level, tokens) - levels.bytes(level + 1, tokens)
    assert levels.saving(4, 5000) == 0
    with pytest.raises(ValueError, match=r"level must be an integer in 0\.\.4.*got 5"):
        levels.bytes(5, 10)


def test_a_model_without_order_cannot_run_levels():
    model = build_tiny_llama(0)
    with pytest.raises(ValueError, match="nested family"):
        LevelMemory.from_spec(ConversionSpec.from_dict({"attention": "dsla"}), model.config)


def _levels(n_layers=32):
    model = build_tiny_llama(0, num_hidden_layers=n_layers)
    spec = ConversionSpec.from_dict({"attention": "dsla", "order": list(range(n_layers))})
    return LevelMemory.from_spec(spec, model.config)


def test_length_caps_follow_the_paper():
    levels = _levels(32)
    view = MemoryView(budget=10**12, used=0, levels=levels)
    policy = LengthCapsPolicy()
    assert [policy.admission_level(n, n + 10, view) for n in (100, 2047, 2048, 4095, 4096, 8191, 8192, 50000)] == [4, 4, 8, 8, 12, 12, 16, 16]
    assert _levels(30).level_for(0.125) == 4 and _levels(30).level_for(0.375) == 11


def test_parse_policy_forms_and_errors():
    levels = _levels(32)
    assert isinstance(parse_policy("static:25%", levels), StaticPolicy) and parse_policy("static:25%", levels).level == 8
    assert parse_policy("static:3", levels).level == 3
    assert parse_policy("memory", levels, max_level=16).max_level == 16
    for bad in ("static:33", "static:-1", "static:x", "static:150%", "static:%"):
        with pytest.raises(ValueError, match=r"static needs a level in 0\.\.32"):
            parse_policy(bad, levels)
    with pytest.raises(ValueError, match="unknown policy 'fast'.*softmax, static:K, static:P%, length-caps, memory"):
        parse_policy("fast", levels)
    with pytest.raises(ValueError, match="water marks"):
        parse_policy("memory", levels, high=0.5, low=0.8)


def test_a_memory_policy_string_sets_its_own_marks_and_cap():
    """memory:high=..:low=..:max-level=.. overrides the server's marks and cap for that policy alone;
    the rest keep the server's."""
    levels = _levels(32)
    policy = parse_policy("memory:high=1.0:max-level=8", levels, max_level=16, high=0.9, low=0.6)
    assert (policy.high, policy.low, policy.max_level) == (1.0, 0.6, 8)
    assert (parse_policy("memory:low=0.3", levels).low, parse_policy("memory:low=0.3", levels).high) == (0.3, 0.9)
    view = MemoryView(budget=100 * 2**20, used=95 * 2**20, levels=levels)  # 95%: over 0.9, under 1.0
    running = [RequestView("a", 4000, 0), RequestView("b", 2000, 0)]
    assert parse_policy("memory", levels).raises(running, view)  # the default marks raise at 95%
    assert parse_policy("memory:high=1.0", levels).raises(running, view) == {}  # only past the whole budget
    for bad in ("memory:fast=1", "memory:high", "memory:high=x", "memory:max-level=40", "memory:max-level=1.5", "memory:"):
        with pytest.raises(ValueError, match=r"is not one of high=H, low=L .* or max-level=K \(0\.\.32\)"):
            parse_policy(bad, levels)
    with pytest.raises(ValueError, match="water marks"):
        parse_policy("memory:low=0.95", levels)


def test_memory_policy_admits_low_when_memory_is_free_and_high_when_it_binds():
    levels = _levels(8)
    budget = 20 * levels.bytes(0, 1000)
    policy = MemoryPolicy(high=0.9, low=0.5, max_level=6)
    assert policy.admission_level(900, 1000, MemoryView(budget, 0, levels)) == 0
    tight = MemoryView(budget, int(0.88 * budget), levels)
    level = policy.admission_level(900, 1000, tight)
    assert 0 < level <= 6
    assert tight.used + levels.bytes(level, 1000) <= 0.9 * budget < tight.used + levels.bytes(level - 1, 1000)
    assert policy.admission_level(900, 10**6, tight) == 6  # nothing fits: the cap, never above


def test_memory_policy_raises_the_longest_first_until_under_the_marks():
    levels = _levels(8)
    running = [RequestView("short", 200, 0), RequestView("long", 8000, 0), RequestView("mid", 3000, 1)]
    used = sum(levels.bytes(r.level, r.tokens) for r in running)
    policy = MemoryPolicy(high=0.9, low=0.5, max_level=5)
    assert policy.raises(running, MemoryView(int(used / 0.85), used, levels)) == {}  # under the high mark
    budget = int(used / 1.2)
    new = policy.raises(running, MemoryView(budget, used, levels))
    assert new["long"] > 0 and all(v <= 5 for v in new.values())
    assert all(new[r.id] > r.level for r in running if r.id in new)  # levels only rise
    after = sum(levels.bytes(new.get(r.id, r.level), r.tokens) for r in running)
    assert after <= 0.7 * budget or all(new.get(r.id, r.level) == 5 for r in running if r.tokens > 200)
    if "short" in new:
        assert new["long"] == 5  # the short one rises only once the long one is at the cap
