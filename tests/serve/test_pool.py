"""The pooled runner gives what the reference runner gives: logits, positions and bytes, through slot
reuse and arena growth; the engine gives the same tokens on either."""

import pytest
import torch

from linearize.convert import convert
from linearize.hub import build_tiny_llama
from linearize.ops import fused_decode
from linearize.ops.dsla import DslaDecodeState
from linearize.serve.engine import Engine, EngineConfig
from linearize.serve.levels import LevelMemory
from linearize.serve.policy import parse_policy
from linearize.serve.pool import MIN_CAPACITY, MIN_SLOTS, PooledRunner, _Group
from linearize.serve.runner import MASK_ALIGN, next_positions
from linearize.serve.runner import Runner
from linearize.serve.sampling import SamplingParams
from linearize.spec import ConversionSpec

ORDER = [2, 0, 3]  # layer 1 is never converted


def family():
    model = build_tiny_llama(0, num_hidden_layers=4)  # 4 query heads on 2 KV heads: grouped
    spec = ConversionSpec.from_dict({"attention": "dsla", "layers": ORDER, "order": ORDER})
    convert(model, spec)
    return model, LevelMemory.from_spec(spec, model.config, dtype_bytes=4)


def run_both(model, levels, prompts, level_of, steps, gen, *, pooled=None):
    """Prefill each prompt (chunks of 8) on both runners, then decode ``steps`` forced tokens for all
    rows in one batch; returns the max |difference| of logits seen, and the two sequences lists."""
    ref, pool = Runner(model, levels), pooled or PooledRunner(model, levels)
    rs = [ref.new_sequence(level) for level in level_of]
    ps = [pool.new_sequence(level) for level in level_of]
    worst = 0.0
    for r, p, prompt in zip(rs, ps, prompts):
        for chunk in prompt.split(8):
            worst = max(worst, (ref.forward([r], chunk[None]) - pool.forward([p], chunk[None])).abs().max().item())
    for _ in range(steps):
        ids = torch.randint(3, 128, (len(rs), 1), generator=gen)
        worst = max(worst, (ref.forward(rs, ids) - pool.forward(ps, ids)).abs().max().item())
    return worst, rs, ps, pool


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_pooled_equals_reference_across_levels_chunks_and_growth(fused, monkeypatch):
    """Also: DSLA's decode steps run on the rows where they are in the pool (the fused state kernel
    under Triton's interpreter on CPU, or the torch step)."""
    model, levels = family()
    gen = torch.Generator().manual_seed(0)
    level_of = [0, 2, 3, 1, 0, 3]  # more rows than the first arena's slots
    lengths = [9, 4, 13, MIN_CAPACITY + 40, 1, 7]  # one prompt past the first capacity
    prompts = [torch.randint(3, 128, (n,), generator=gen) for n in lengths]
    assert len(level_of) > MIN_SLOTS
    in_pool = DslaDecodeState.in_pool.__func__
    calls = []
    monkeypatch.setattr(DslaDecodeState, "in_pool", classmethod(lambda cls, *a, **k: calls.append(1) or in_pool(cls, *a, **k)))
    if fused and not (fused_decode.triton_available() and fused_decode.interpreting()):
        pytest.skip("runs the kernels in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set where there is no GPU)")
    with fused_decode.use_fused(fused):
        worst, rs, ps, pool = run_both(model, levels, prompts, level_of, 6, gen)
    assert worst < 1e-5
    assert len(calls) == 6 * 3  # every decode step, in each of the three DSLA layers
    assert sorted(pool._dsla) == sorted(ORDER) and all(t.shape[1] == pool._slots + 1 for t in pool._dsla.values())  # + the scratch slot
    assert [p.position for p in ps] == [r.position for r in rs] == [n + 6 for n in lengths]
    assert [p.nbytes() for p in ps] == [r.nbytes() for r in rs]
    assert [p.nbytes_by_kind() for p in ps] == [r.nbytes_by_kind() for r in rs]
    assert pool.arena_bytes() > 0


def test_a_call_shares_one_aligned_additive_mask_and_one_value_buffer(monkeypatch):
    """Within one forward call, every softmax layer reads the same additive mask (0 where a key is
    visible, -inf elsewhere, rows laid out on MASK_ALIGN elements so SDPA takes it as it is), and every
    DSLA layer's decode step writes its values into one buffer."""
    model, levels = family()
    pool = PooledRunner(model, levels)
    seqs = [pool.new_sequence(3) for _ in range(3)]
    gen = torch.Generator().manual_seed(1)
    for seq, n in zip(seqs, (5, 9, 2)):
        pool.forward([seq], torch.randint(3, 128, (1, n), generator=gen))
    ids = torch.randint(3, 128, (3, 1), generator=gen)
    group = _Group.make((0, 1, 2), seqs, next_positions(seqs, ids), 1, ids.device)
    mask = group.mask(2, torch.float32)
    assert mask is group.mask(2, torch.float32) and mask.stride(-2) % MASK_ALIGN == 0 and mask.stride(-1) == 1
    allowed = group.allowed.repeat(1, 2, 1)[:, None]
    assert torch.equal(mask == 0, allowed) and bool((mask[~allowed] == float("-inf")).all())
    buffers = []
    in_pool = DslaDecodeState.in_pool.__func__
    monkeypatch.setattr(DslaDecodeState, "in_pool", classmethod(lambda cls, *a, **k: buffers.append(in_pool(cls, *a, **k)) or buffers[-1]))
    pool.forward(seqs, ids)
    assert len(buffers) == len(ORDER) and all(b.values is buffers[0].values for b in buffers)


def test_a_reused_slot_starts_clean():
    """A released slot's stale keys and states must not leak into the next request that takes it."""
    model, levels = family()
    gen = torch.Generator().manual_seed(1)
    pool = PooledRunner(model, levels)
    for level in (3, 0, 2):  # fill every layer's pools with one request's memory, then free it
        s = pool.new_sequence(level)
        pool.forward([s], torch.randint(3, 128, (1, 30), generator=gen))
        pool.release(s)
    prompts = [torch.randint(3, 128, (n,), generator=gen) for n in (5, 11)]
    worst, *_ = run_both(model, levels, prompts, [2, 0], 4, gen, pooled=pool)
    assert worst < 1e-5


@pytest.mark.parametrize("keep", [(5, 2, 3), (9, 0), (4, 6, 1, 7)])
def test_rows_out_of_slot_order_with_gaps_between_them(keep):
    """Rows whose slots are not 0..B-1 in order: the span view with idle slots (a few gaps) and the
    gathered copy (a span more than three times the rows) both give the reference logits."""
    model, levels = family()
    gen = torch.Generator().manual_seed(3)
    ref, pool = Runner(model, levels), PooledRunner(model, levels)
    taken = [pool.new_sequence(0) for _ in range(max(keep) + 1)]
    for s in taken:
        pool.release(s)
    slots = [pool.new_sequence(0) for _ in range(max(keep) + 1)]  # lowest first: slot k at index k
    assert [s.slot for s in slots] == list(range(max(keep) + 1))
    for s in slots:
        if s.slot not in keep:
            pool.release(s)
    level_of = [(2, 0, 3, 1)[j % 4] for j in range(len(keep))]
    ps = []
    for slot, level in zip(keep, level_of):
        s = slots[slot]
        s.level = level
        ps.append(s)
    rs = [ref.new_sequence(level) for level in level_of]
    worst = 0.0
    for r, p, n in zip(rs, ps, (7, 12, 3, 9)):
        ids = torch.randint(3, 128, (1, n), generator=gen)
        worst = max(worst, (ref.forward([r], ids) - pool.forward([p], ids)).abs().max().item())
    for _ in range(4):
        ids = torch.randint(3, 128, (len(rs), 1), generator=gen)
        worst = max(worst, (ref.forward(rs, ids) - pool.forward(ps, ids)).abs().max().item())
    assert worst < 1e-5


def test_the_arena_stops_at_its_slot_limit():
    model, levels = family()
    pool = PooledRunner(model, levels, max_slots=5)
    held = [pool.new_sequence() for _ in range(5)]
    with pytest.raises(RuntimeError, match="all 5 slots are taken"):
        pool.new_sequence()
    pool.release(held[2])
    assert pool.new_sequence().slot == 2


def test_a_reserved_arena_serves_without_growing():
    """After the engine reserves max_running requests of N tokens (its pools sized once), serving
    requests within that grows nothing (the runner's generation, what captured graphs depend on,
    stays) and gives the tokens an unreserved engine gives; a request past N still grows it."""
    model, levels = family()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 300, 17, 3, 29, 11)]
    outputs = {}
    for reserved in (False, True):
        engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=64, max_running=6), policy=parse_policy("length-caps", levels))
        engine.add_request(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.run()  # every layer's pool exists (length-caps: level 1 on short prompts)
        if reserved:
            engine.reserve(320)
            assert (engine.runner._slots, engine.runner._capacity) == (6, 320)
            generation = engine.runner.generation
        ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
        done = engine.run()
        outputs[reserved] = [done[i].output for i in ids]
        if reserved:
            assert engine.runner.generation == generation
            engine.add_request([3 + i % 120 for i in range(397)], SamplingParams(max_tokens=1, ignore_eos=True))
            engine.run()
            assert engine.runner._capacity >= 398 and engine.runner.generation > generation
    assert outputs[True] == outputs[False]
    with pytest.raises(ValueError, match="reserve needs slots >= 1 and capacity >= 1, got 0 and 5"):
        PooledRunner(model, levels).reserve(0, 5)


def test_released_sequences_cannot_run_and_bad_rows_are_refused():
    model, levels = family()
    pool = PooledRunner(model, levels)
    s = pool.new_sequence(1)
    pool.release(s)
    with pytest.raises(ValueError, match="released sequence"):
        pool.forward([s], torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="one row per sequence"):
        pool.forward([pool.new_sequence()], torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"level must be an integer in 0\.\.3"):
        pool.new_sequence(4)


@pytest.mark.parametrize("policy", ["softmax", "static:2", "length-caps"])
def test_engine_gives_the_same_tokens_on_either_runner(policy):
    model, levels = family()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 40, 17, 3, 29)]
    outputs = {}
    for runner in ("reference", "pooled"):
        engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=24, runner=runner),
                        policy=parse_policy(policy, levels))  # fmt: skip
        ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
        done = engine.run()
        outputs[runner] = [done[i].output for i in ids]
    assert outputs["pooled"] == outputs["reference"]


def test_engine_frees_slots_and_refuses_unknown_runners():
    model, levels = family()
    engine = Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=16))
    for n in (6, 9, 4):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.run()
    runner = engine.runner
    assert isinstance(runner, PooledRunner) and sorted(runner._free) == list(range(runner._slots))
    with pytest.raises(ValueError, match="runner must be one of pooled, reference, got 'paged'"):
        EngineConfig(kv_budget=1, runner="paged")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pooled_equals_reference_on_cuda():
    """On CUDA the pooled runner's softmax runs on the fused SDPA kernels and DSLA on fla's."""
    model, levels = family()
    model.cuda()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=gen).cuda() for n in (9, 300, 4, 13, 1)]
    ref, pool = Runner(model, levels), PooledRunner(model, levels)
    rs = [ref.new_sequence(level) for level in (0, 3, 2, 1, 0)]
    ps = [pool.new_sequence(level) for level in (0, 3, 2, 1, 0)]
    worst = 0.0
    for r, p, prompt in zip(rs, ps, prompts):
        for chunk in prompt.split(64):
            worst = max(worst, (ref.forward([r], chunk[None]) - pool.forward([p], chunk[None])).abs().max().item())
    for _ in range(4):
        ids = torch.randint(3, 128, (len(rs), 1), generator=gen).cuda()
        worst = max(worst, (ref.forward(rs, ids) - pool.forward(ps, ids)).abs().max().item())
    assert worst < 2e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_the_runners_rms_norm_equals_the_models(device):
    """The runners' norm (torch's fused RMSNorm on CUDA, the module elsewhere) gives the module's
    numbers: in float32 to rounding, in bfloat16 within one unit in the last place."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from linearize.serve.runner import rms_norm

    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-7)):
        norm = LlamaRMSNorm(256, eps=1e-5).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(256, generator=gen).to(device=device, dtype=dtype))
        x = (4 * torch.randn(7, 3, 256, generator=gen)).to(device=device, dtype=dtype)
        want, got = norm(x), rms_norm(norm, x)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)
