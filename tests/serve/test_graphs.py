"""The pooled runner's static decode step (``serve.graphs``): the same logits as the reference runner
for batches of mixed levels, padded buckets, slots out of order, reuse and growth (on the CPU the
static step runs eagerly; on CUDA it is captured and replayed as CUDA graphs)."""

import contextlib

import pytest
import torch

from linearize.ops import fused_decode
from linearize.serve.engine import Engine, EngineConfig
from linearize.serve.graphs import StaticDecode, bucket_rows
from linearize.serve.policy import parse_policy
from linearize.serve.pool import MIN_CAPACITY, PooledRunner
from linearize.serve.runner import Runner
from linearize.serve.sampling import SamplingParams

from .test_pool import family


def test_bucket_rows():
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 40, 41)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 40, 48]
    with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
        bucket_rows(0)


def _decode_both(model, levels, prompts, level_of, steps, gen, device="cpu", release=(), release_at=0, fused=None):
    """Prefill every prompt on the reference runner and on a pooled runner with static decoding, then
    decode ``steps`` forced tokens for all rows (row indices in ``release`` leave after step
    ``release_at``; ``fused``: the decode steps in ``use_fused(fused)``); returns the max |difference|
    of logits and the pooled runner."""
    ref, pool = Runner(model, levels), PooledRunner(model, levels, graphs=True)
    calls = []
    forward = StaticDecode.forward
    pool._static.forward = lambda *a, **k: calls.append(1) or forward(pool._static, *a, **k)
    rs = [ref.new_sequence(level) for level in level_of]
    ps = [pool.new_sequence(level) for level in level_of]
    worst = 0.0
    for r, p, prompt in zip(rs, ps, prompts):
        for chunk in prompt.to(device).split(8):
            worst = max(worst, (ref.forward([r], chunk[None]) - pool.forward([p], chunk[None])).abs().max().item())
    calls.clear()  # a one-token last chunk of a prompt is a decode step too
    for step in range(steps):
        ids = torch.randint(3, 128, (len(rs), 1), generator=gen).to(device)
        want = ref.forward(rs, ids)
        with fused_decode.use_fused(fused) if fused is not None else contextlib.nullcontext():
            got = pool.forward(ps, ids)
        worst = max(worst, (want - got).abs().max().item())
        if step == release_at and release:
            for j in sorted(release, reverse=True):
                pool.release(ps.pop(j))
                rs.pop(j)
    assert len(calls) == steps  # every decode step took the static path
    assert [p.position for p in ps] == [r.position for r in rs]
    return worst, pool


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_static_decode_equals_the_reference_runner(fused):
    """Six rows at levels 0-3 (a bucket of 8: two padding rows on the scratch slot; layers with
    converted and softmax rows side by side), one prompt past the first capacity (the arena grows),
    then three rows leave (a bucket of 4, slots with gaps). fused: the static steps through the slot
    attention and DSLA state kernels (Triton's interpreter on the CPU)."""
    if fused and not (fused_decode.triton_available() and fused_decode.interpreting()):
        pytest.skip("runs the kernels in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set where there is no GPU)")
    model, levels = family()
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 4, 13, MIN_CAPACITY + 40, 2, 7]
    prompts = [torch.randint(3, 128, (n,), generator=gen) for n in lengths]
    worst, pool = _decode_both(model, levels, prompts, [0, 2, 3, 1, 0, 3], 3 if fused else 5, gen, release=(1, 2, 4), fused=fused)
    assert worst < 1e-5
    assert {4, 8} <= set(pool._static._entries)  # (and 1: one-token last chunks of prompts)
    assert pool._static.captured == 0  # on the CPU nothing is captured


def test_static_decode_steps_aside_for_what_it_does_not_run():
    """A row that holds nothing yet (its first token is a decode-sized prefill) takes the eager path."""
    model, levels = family()
    pool = PooledRunner(model, levels, graphs=True)
    s = pool.new_sequence(2)
    assert not pool._static.supports([s], 2)
    pool.forward([s], torch.tensor([[5]]))
    assert pool._static.supports([s], 2) and not pool._static._entries


@pytest.mark.parametrize("policy", ["softmax", "length-caps", "memory"])
def test_engine_gives_the_same_tokens_with_static_decoding(policy):
    model, levels = family()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 40, 17, 3, 29)]
    outputs = {}
    for graphs in (False, True):
        engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=24, graphs=graphs), policy=parse_policy(policy, levels))
        engine.runner._static = StaticDecode(engine.runner, capture=False) if graphs else None  # eager static steps on the CPU
        ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
        done = engine.run()
        outputs[graphs] = [done[i].output for i in ids]
        assert bool(graphs) == bool(engine.runner._static and engine.runner._static._entries)  # static steps ran
    assert outputs[True] == outputs[False]


def test_layers_every_row_runs_converted_run_their_converted_path_alone(monkeypatch):
    """Once a row has run every layer as softmax (every layer has its key pool), a static decode step
    runs the converted path alone at the layers every row runs converted (one slot attention call per
    other layer): all the converted ones where the rows share one level, those below the lowest level
    where they do not; rows of mixed levels run both paths where only some rows are converted. The
    logits equal the reference runner's either way, and the graphs are keyed by the lowest and
    highest levels."""
    import linearize.serve.graphs as graphs

    calls = []
    original = graphs.slot_attention
    monkeypatch.setattr(graphs, "slot_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model, levels = family()
    gen = torch.Generator().manual_seed(5)
    ref, pool = Runner(model, levels), PooledRunner(model, levels, graphs=True)
    mix = (0, 1, 2, 2, 2)
    rs = [ref.new_sequence(lv) for lv in mix]
    ps = [pool.new_sequence(lv) for lv in mix]
    for r, p in zip(rs, ps):  # the level-0 row first: every layer's key pool is made
        prompt = torch.randint(3, 128, (1, 9), generator=gen)
        ref.forward([r], prompt), pool.forward([p], prompt)
    layers = len(pool._layers)
    for rows, expected, key in ((slice(2, 5), layers - 2, (2, 2)), (slice(1, 5), layers - 1, (1, 2)), (slice(0, 4), layers, (0, 2))):
        for _ in range(2):
            calls.clear()
            ids = torch.randint(3, 128, (len(mix[rows]), 1), generator=gen)
            want, got = ref.forward(rs[rows], ids), pool.forward(ps[rows], ids)
            assert (want - got).abs().max().item() < 1e-5
            assert len(calls) == expected, (rows, len(calls))
        assert key in pool._static._entries[4].warm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_decode_equals_the_reference_runner_on_cuda():
    model, levels = family()
    model.cuda()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=gen) for n in (9, 300, 4, 13, 2)]
    worst, pool = _decode_both(model, levels, prompts, [0, 3, 2, 1, 0], 6, gen, device="cuda", release=(2,), release_at=2)
    assert worst < 2e-3
    assert pool._static.captured == 2  # buckets 8 (steps 0-2) and 4 (steps 3-5), each run once, captured, then replayed


def test_closing_frees_the_pools_and_graphs_at_once():
    """The static decoder holds its runner weakly (no reference cycle keeps pools alive until a
    collection), and ``Engine.close`` frees the pools and graphs while references remain."""
    import gc
    import weakref

    model, levels = family()
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=24), policy=parse_policy("length-caps", levels))
    engine.runner._static = StaticDecode(engine.runner, capture=False)
    for n in (5, 30):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run()
    runner, static = engine.runner, engine.runner._static
    assert runner.arena_bytes() > 0 and static._entries
    gc.disable()
    try:
        alive = weakref.ref(runner)
        del runner
        engine.close()
        assert engine.runner.arena_bytes() == 0 and not static._entries
        del engine
        assert alive() is None  # freed by reference counting alone
    finally:
        gc.enable()


def _prefill_both(plans, device="cpu"):
    """Feed each plan's prompt (level, chunk lengths) to the reference runner and to a pooled runner
    with static steps, then decode 3 tokens for all; returns (max |difference| of logits, the chunk
    lengths that took the static prefill, the pooled runner)."""
    from linearize.serve.graphs import StaticPrefill

    model, levels = family()
    model.to(device)
    gen = torch.Generator().manual_seed(3)
    ref, pool = Runner(model, levels), PooledRunner(model, levels, graphs=True)
    calls = []
    forward = StaticPrefill.forward
    pool._static_prefill.forward = lambda *a, **k: calls.append(a[1].shape[1]) or forward(pool._static_prefill, *a, **k)
    rs, ps, worst = [], [], 0.0
    for level, sizes in plans:
        r, p = ref.new_sequence(level), pool.new_sequence(level)
        for n in sizes:
            chunk = torch.randint(3, 128, (1, n), generator=gen).to(device)
            worst = max(worst, (ref.forward([r], chunk) - pool.forward([p], chunk)).abs().max().item())
        rs.append(r), ps.append(p)
    for _ in range(3):
        ids = torch.randint(3, 128, (len(rs), 1), generator=gen).to(device)
        worst = max(worst, (ref.forward(rs, ids) - pool.forward(ps, ids)).abs().max().item())
    assert [p.position for p in ps] == [r.position for r in rs]
    return worst, calls, pool


@pytest.mark.parametrize("fused, dsla_kernels", [(False, False), (True, True), (True, False)], ids=["torch", "fused", "fused-gla"])
def test_static_prefill_equals_the_reference_runner(fused, dsla_kernels, monkeypatch):
    """Prompts fed in chunks of 64 to 192 tokens (first chunks and continuations, every level, a
    prompt that grows the arena's capacity), their last chunks ragged (padded to 64 on the static
    path): every chunk's logits, the positions and the decode after equal the reference runner's,
    and every chunk whose pools exist took the static path. fused: the static steps through the
    slot kernels (Triton's interpreter on the CPU), DSLA's prefill through its fused kernels
    (dsla_kernels) or through ``dsla_prefill`` with the padding masked (fused-gla)."""
    import linearize.layers.dsla as dsla_layers
    from linearize.ops import fused_dsla
    from linearize.serve.graphs import PREFILL_ALIGN

    if fused and not (fused_decode.triton_available() and fused_decode.interpreting()):
        pytest.skip("runs the kernels in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set where there is no GPU)")
    inside, taken = [], set()  # the prefill functions the static chunks' DSLA layers ran
    padded = dsla_layers.DslaAttention.prefill_padded

    def counted_padded(self, *a, **k):
        inside.append(1)
        try:
            return padded(self, *a, **k)
        finally:
            inside.pop()

    monkeypatch.setattr(dsla_layers.DslaAttention, "prefill_padded", counted_padded)
    for module, name in ((fused_dsla, "dsla_prefill_fused"), (dsla_layers, "dsla_prefill")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: (inside and taken.add(name)) or real(*a, **k))
    if not dsla_kernels:
        monkeypatch.setattr(fused_dsla, "applies", lambda *a: False)
    with fused_decode.use_fused(fused):
        worst, calls, pool = _prefill_both([(0, [64, 64, 5]), (3, [128, 64, 30]), (2, [64, 192, 64, 3]), (1, [64, 7])])
    assert worst < 1e-5
    # chunks run static once their layers' pools exist: the first (level 0) and the first at level 3 make them;
    # a ragged one on the static buffers of the next multiple of 64
    assert calls == [64, 5, 64, 30, 64, 192, 64, 3, 64, 7]
    assert set(pool._static_prefill._entries) == {PREFILL_ALIGN, 3 * PREFILL_ALIGN}
    assert taken == (set() if not fused else {"dsla_prefill_fused" if dsla_kernels else "dsla_prefill"})  # torch: the masked hybrid mode
    assert pool._capacity > 256  # the 323-token prompt grew it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_prefill_equals_the_reference_runner_on_cuda():
    """Chunks of one length, level and kind (first or not) run eagerly once, are captured the next
    time and replayed after: the logits still equal the reference runner's."""
    worst, calls, pool = _prefill_both([(0, [64, 64, 64, 64, 9]), (2, [64, 64, 64, 64, 3]), (2, [64, 128, 128, 128, 5])], "cuda")
    assert worst < 2e-3
    assert pool._static_prefill.captured >= 3  # (64, level 0), (64, level 2), (128, level 2), continuations


@pytest.mark.parametrize("policy", ["softmax", "length-caps"])
def test_engine_cuts_chunks_for_static_prefill_and_gives_the_same_tokens(policy):
    """With static steps the engine cuts a prompt's chunks to multiples of 64 (all but the last); the
    tokens equal those of the reference runner cut the same way."""
    from linearize.serve.graphs import StaticPrefill

    model, levels = family()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (150, 40, 203)]
    outputs, chunks = {}, {}
    for runner in ("reference", "pooled"):
        engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=100, runner=runner), policy=parse_policy(policy, levels))
        if runner == "pooled":
            engine.runner._static = StaticDecode(engine.runner, capture=False)
            engine.runner._static_prefill = StaticPrefill(engine.runner, capture=False)
        else:
            engine.runner.prefill_align = 64
        ids = [engine.add_request(p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) for p in prompts]
        sizes = []
        forward = engine.runner.forward
        engine.runner.forward = lambda seqs, x, forward=forward, sizes=sizes: sizes.append(x.shape[1]) or forward(seqs, x)
        done = engine.run()
        outputs[runner], chunks[runner] = [done[i].output for i in ids], sizes
        if runner == "pooled":
            assert engine.runner._static_prefill._entries  # chunks took the static path
    assert outputs["pooled"] == outputs["reference"] and chunks["pooled"] == chunks["reference"]
    prefill = [n for n in chunks["pooled"] if n > 1]
    # a 100-token budget: 64 of the first prompt (the 36 left would make a small chunk: the step stops), then its last 86
    assert prefill[:2] == [64, 86]


def test_warm_up_runs_every_static_step_shape_twice(monkeypatch):
    """The replay's graph warm-up runs each decode bucket up to max_running (10 rows fill the bucket
    of 16), every row at one level and with a row at each lower level of the lowest and lows beside the others,
    and each aligned prefill chunk length up to the step budget, first chunk and
    continuation, at each level, at least twice (the second run is where a graph is captured); the
    engine's records are clear after, and a runner without static steps is left alone."""
    from collections import Counter

    from linearize.serve.graphs import StaticPrefill
    from linearize.serve.replay import warm_up_graphs

    runs: Counter = Counter()
    for cls in (StaticDecode, StaticPrefill):
        def counted(self, entry, key, original=cls._step):
            runs[(type(self).__name__, repr(entry), key)] += 1
            return original(self, entry, key)

        monkeypatch.setattr(cls, "_step", counted)
    model, levels = family()
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=128, max_running=10), policy=parse_policy("length-caps", levels))
    engine.runner._static = StaticDecode(engine.runner, capture=False)
    engine.runner._static_prefill = StaticPrefill(engine.runner, capture=False)
    engine.reserve(300)
    assert warm_up_graphs(engine, list(range(3, 120)), [0, 1, 2], lows=[1]) > 0
    for level in (0, 1, 2):
        for rows in (1, 2, 4, 8, 16):
            assert runs[("StaticDecode", f"batch {rows}", (level, level))] >= 2, (rows, level)
            for low in (0, 1):  # and with a row at the lowest level, or at one of lows, beside the others
                if low < level and rows > 1:
                    assert runs[("StaticDecode", f"batch {rows}", (low, level))] >= 2, (rows, low, level)
        for tokens in (64, 128):
            for first in (True, False):
                assert runs[("StaticPrefill", f"{tokens} tokens", (level, first))] >= 2, (tokens, level, first)
    assert not engine.finished and not engine.has_work() and engine.config.max_step_tokens == 128
    assert str(engine.policy) == "length-caps"
    plain = Engine(model, levels, EngineConfig(kv_budget=10**9))
    assert warm_up_graphs(plain, [5], [0]) == 0  # on the CPU the engine takes no static steps


def test_graph_levels_are_the_policys_admissions_and_the_warm_up_levels():
    from linearize.serve.replay import ReplayRequest, graph_levels, warm_up_levels_of

    model, levels = family()
    requests = [ReplayRequest(0.0, [5] * n, 4, 0, 0) for n in (100, 3000)]
    caps = Engine(model, levels, EngineConfig(kv_budget=10**9), policy=parse_policy("length-caps", levels))
    cap = caps.policy.level_cap(levels)
    assert graph_levels(caps, requests) == sorted({levels.level_for(0.125), levels.level_for(0.25), *warm_up_levels_of(cap)})
    assert graph_levels(Engine(model, levels, EngineConfig(kv_budget=10**9)), requests) == [0]  # softmax


def test_most_running_counts_the_smallest_prompts_that_fit_the_budget():
    """The largest batch a replay can take: its smallest prompts at their fewest bytes, within the
    budget and max_running; a converted level that makes a request smaller raises the count."""
    from linearize.serve.replay import ReplayRequest, most_running

    model, levels = family()
    requests = [ReplayRequest(0.0, [5] * n, 4, 0, 0) for n in (50, 60, 200, 300, 3000)]
    one = levels.bytes(0, 50)
    budget = levels.bytes(0, 50) + levels.bytes(0, 60) + levels.bytes(0, 200)
    softmax = Engine(model, levels, EngineConfig(kv_budget=budget), policy=parse_policy("softmax", levels))
    assert most_running(softmax, requests) == 3
    assert most_running(Engine(model, levels, EngineConfig(kv_budget=budget, max_running=2)), requests) == 2
    assert most_running(Engine(model, levels, EngineConfig(kv_budget=one // 2)), requests) == 1  # none fits: one runs alone
    long = [ReplayRequest(0.0, [5] * 3000, 4, 0, 0)] * 5
    budget = 2 * levels.bytes(0, 3000) + 1
    assert most_running(Engine(model, levels, EngineConfig(kv_budget=budget)), long) == 2
    top = levels.max_level
    assert 5 * levels.bytes(top, 3000) <= budget  # converted, all five fit
    assert most_running(Engine(model, levels, EngineConfig(kv_budget=budget), policy=parse_policy(f"static:{top}", levels)), long) == 5
