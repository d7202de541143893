"""LoLA's fused decode step (``ops.fused_lola``: selection, state pass, cache update and read in two
kernels) against the torch decode step and the chunked op: outputs and memory token by token; its
fused prefill and its training path (the kernels' choices, a differentiable read of every chunk)
against the chunk loop (on the GPU when there is one, else in Triton's interpreter on the CPU)."""

from __future__ import annotations

import functools

import pytest
import torch

from linearize.ops import fused_decode, fused_lola
from linearize.ops import lola as lola_ops
from linearize.ops.feature_maps import hedgehog
from linearize.ops.lola import LolaDecodeState, lola_attention, lola_decode_step
from torch import Tensor

pytestmark = pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def vector_recalls(monkeypatch):
    """Kept recalls as vectors [phi S, phi z] unless a test asks for the scalars (``SCALAR_RECALLS``,
    the module's default, which the scalar tests set themselves)."""
    monkeypatch.setattr(fused_lola, "SCALAR_RECALLS", False)


@pytest.fixture(params=["two-kernels", "one-kernel"])
def step_kernels(request, monkeypatch):
    """Run a decode-step test with the step as two kernels (errors, then commit) and as one
    (``ONE_KERNEL_ROWS`` 0: one program per (row, query head) does both)."""
    monkeypatch.setattr(fused_lola, "ONE_KERNEL_ROWS", None if request.param == "two-kernels" else 0)
    return request.param


def _maps(hq: int, d: int, f: int, dtype=torch.float32):
    """Random Hedgehog maps for queries and keys: (phi_q, phi_k, (weight, bias) of phi_k)."""
    g = torch.Generator().manual_seed(7)
    wq, wk = (torch.randn(hq, d, f, generator=g).to(DEVICE, dtype) * 0.5 for _ in range(2))
    bq, bk = (torch.randn(hq, f, generator=g).to(DEVICE, dtype) * 0.1 for _ in range(2))
    return functools.partial(hedgehog, weight=wq, bias=bq), functools.partial(hedgehog, weight=wk, bias=bk), (wk, bk)


def _run(*, d, f, dv, separate, reads, sinks=1, weight_tokens=0, lam=4, steps=9, duplicate=False, keep_recalls=True):
    torch.manual_seed(3)
    read_state, read_sparse = reads
    b, hq, hkv, w = 2, 4, 2, 3
    phi_q, phi_k, key_map = _maps(hq, d, f)
    options = dict(window_factor=torch.rand(hq, device=DEVICE), sinks=sinks, linear_weight=[0.2, 0.5, 1.0, 0.0],
                   weight_tokens=weight_tokens, read_state=read_state, read_sparse=read_sparse)  # fmt: skip
    kw = dict(phi_q=phi_q, phi_k=phi_k, window=w, sparse=lam, **options)

    def token(t):
        q, k, v = torch.randn(b, hq, t, d, device=DEVICE), torch.randn(b, hkv, t, d, device=DEVICE), torch.randn(b, hkv, t, dv, device=DEVICE)
        if duplicate:  # every token the same: equal errors everywhere, so only the tie rules choose
            k, v = k[:, :, :1].expand_as(k).contiguous(), v[:, :, :1].expand_as(v).contiguous()
        lin = dict(q_lin=torch.randn_like(q), k_lin=k + 0.5) if separate else {}
        return q, k, v, lin

    q, k, v, lin = token(11)
    _, state = lola_attention(q, k, v, chunk=3, **kw, **lin)
    runs = [LolaDecodeState.from_state(state, phi_q=phi_q, phi_k=phi_k, scale=d**-0.5, dtype=torch.float32, key_map=key_map,
                                       keep_recalls=keep_recalls, **options) for _ in range(2)]  # fmt: skip
    assert (runs[1].recall is not None) == keep_recalls
    calls = []
    kernel = fused_lola.lola_step
    for _ in range(steps):
        q, k, v, lin = token(1)
        want, state = lola_attention(q, k, v, chunk=1, state=state, **kw, **lin)
        outs = []
        for fused, ds in zip((False, True), runs):
            with fused_decode.use_fused(fused), pytest.MonkeyPatch.context() as mp:
                mp.setattr(fused_lola, "lola_step", lambda *a: calls.append(1) or kernel(*a))
                outs.append(lola_decode_step(ds, q, k, v, **lin))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1], want, atol=1e-5, rtol=1e-5)
    assert len(calls) == steps  # the fused run took the kernel every step, the torch run never
    for ds in runs:  # [S | z] rows padded to the alignment, the padding still zero after both kinds of step
        assert ds.linear.shape[-1] == fused_lola.state_width(dv) and not ds.linear[..., dv + 1 :].any()
    got, ref = runs[1].canonical(), runs[0].canonical()
    assert torch.equal(got.sparse.positions, ref.sparse.positions) and torch.equal(got.sparse.valid, ref.sparse.valid)
    for a, r, c in zip(got.tensors(), ref.tensors(), state.tensors()):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    assert torch.equal(runs[1].held, runs[0].held)


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize(
    "dims,reads",
    [((16, 16, 16), (True, True)), ((12, 6, 10), (True, True)), ((16, 8, 70), (True, False)), ((12, 6, 10), (False, True))],
    ids=["D16-f16-hybrid", "D12-f6-Dv10-hybrid", "D16-f8-Dv70-no-sparse", "D12-f6-Dv10-no-state"],
)
@torch.no_grad()
def test_fused_step_equals_the_torch_step(dims, reads):
    """9 tokens from a state past the window and the cache's capacity (GQA, one sink): outputs,
    every memory tensor and the tokens held equal the torch step's and the chunked op's; masked
    blocks of every axis (D 12, f 6, Dv 10 and 70)."""
    d, f, dv = dims
    _run(d=d, f=f, dv=dv, separate=False, reads=reads)


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize("align", [1, 8])
@torch.no_grad()
def test_fused_step_with_other_state_row_alignments(monkeypatch, align):
    """[S | z] rows of exactly Dv + 1 floats (``STATE_ALIGN`` 1: Dv 10 gives 11) or padded to 8
    (16): the same outputs and memory as the torch step and the chunked op."""
    monkeypatch.setattr(fused_lola, "STATE_ALIGN", align)
    assert fused_lola.state_width(10) == (11 if align == 1 else 16)
    _run(d=12, f=6, dv=10, separate=False, reads=(True, True), steps=4)


@pytest.mark.usefixtures("step_kernels")
@torch.no_grad()
def test_fused_step_with_separate_feature_map_inputs_and_length_weight(monkeypatch):
    """Keys before RoPE for the feature map (the cache keeps both), the weight falling with length,
    no sink, and the cache in several blocks (lambda 70: errors in blocks of 16 rows, the least
    found 16 at a time, the last block ragged)."""
    monkeypatch.setattr(fused_lola, "BLOCK_ROWS", 16)
    monkeypatch.setattr(fused_lola, "SELECT_BLOCK", 16)
    _run(d=16, f=16, dv=16, separate=True, reads=(True, True), weight_tokens=3, sinks=0, lam=70, steps=5)


@pytest.mark.usefixtures("step_kernels")
@torch.no_grad()
def test_fused_step_breaks_ties_as_the_torch_step():
    """Every token alike, so every candidate's error is equal: the newest position among the
    least and the leaving token losing every tie decide, as in the torch step."""
    _run(d=16, f=16, dv=16, separate=False, reads=(True, True), sinks=0, duplicate=True)


def test_fused_step_rejects_bad_arguments():
    b, hq, hkv, lam, d, f, dv, eta = 1, 2, 1, 4, 16, 8, 16, 3

    def z(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=DEVICE)

    args = dict(held=z(b, hq, dtype=torch.long), qphi=z(b * hq, 2 * f), q=z(b, hq, d), cache_keys=z(b, hq, lam, d), cache_map_keys=None,
                cache_values=z(b, hq, lam, dv), cache_valid=z(b, hq, lam, dtype=torch.bool), cache_positions=z(b, hq, lam, dtype=torch.long),
                leave_keys=z(b, hkv, d), leave_map_keys=None, leave_values=z(b, hkv, dv), leave_valid=z(b, dtype=torch.bool),
                leave_positions=z(b, dtype=torch.long), window_keys=z(b, hkv, eta, d), window_values=z(b, hkv, eta, dv),
                window_valid=z(b, eta, dtype=torch.bool), window_map_keys=None, window_index=z((), dtype=torch.long), weight=z(hq, d, f),
                bias=z(hq, f), factor=z(hq), sinks=0, scale=1.0,
                weight_tokens=0, read_state=True, read_sparse=True)  # fmt: skip
    none = dict.fromkeys(("recall", "pending", "recall_ok", "deferred", "deferred_count", "cache_features"))
    with pytest.raises(ValueError, match="linear must have shape"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv), **args, **none)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **{**args, "weight": args["weight"].half(), "bias": args["bias"].half()}, **none)
    with pytest.raises(ValueError, match="together"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **{**args, "cache_map_keys": z(b, hq, lam, d)}, **none)
    with pytest.raises(ValueError, match="recall, pending, recall_ok, deferred and deferred_count together"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**none, "recall": z(b * hq, lam, dv + 1)})
    kept = dict(recall=z(b * hq, lam, fused_lola.recall_width(dv)), pending=z(b * hq, 2 * f + dv + 1), recall_ok=z(b, dtype=torch.int32),
                deferred=z(b * hq, 4, 2 * f + dv + 1), deferred_count=z(b * hq, dtype=torch.int32), cache_features=None)
    with pytest.raises(ValueError, match="recall must have shape"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**kept, "recall": z(b * hq, lam, dv + 1)})
    with pytest.raises(ValueError, match="recall_ok must be torch.int32"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**kept, "recall_ok": z(b, dtype=torch.bool)})
    with pytest.raises(ValueError, match="K a power of two"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**kept, "deferred": z(b * hq, 3, 2 * f + dv + 1)})
    with pytest.raises(ValueError, match="window_index must have shape"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **{**args, "window_index": z(1, dtype=torch.long)}, **none)
    with pytest.raises(ValueError, match="window_map_keys must have shape"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **{**args, "window_map_keys": z(b, hkv, eta + 1, d)}, **none)
    scalars = dict(recall=z(b * hq, lam, fused_lola.SCALAR_RECALL_WIDTH), pending=z(b * hq, fused_lola.pending_width(2 * f, dv, True)),
                   recall_ok=z(b, dtype=torch.int32), deferred=None, deferred_count=None, cache_features=None)  # fmt: skip
    with pytest.raises(ValueError, match="recall must have shape"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**scalars, "recall": kept["recall"]})
    with pytest.raises(ValueError, match="pending must have shape"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**scalars, "pending": kept["pending"]})
    with pytest.raises(ValueError, match="the first three alone"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**scalars, "deferred_count": kept["deferred_count"]})
    with pytest.raises(ValueError, match="cache_features are kept only with scalar recalls"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**kept, "cache_features": z(b * hq, lam, 2 * f)})
    with pytest.raises(ValueError, match="cache_features must be torch.float32"):
        fused_lola.lola_step(z(b * hq, 2 * f, dv + 1), **args, **{**scalars, "cache_features": z(b * hq, lam, 2 * f, dtype=torch.bfloat16)})


def test_no_custom_op_gives_a_mutated_argument_a_default():
    """A dispatcher may leave out trailing arguments equal to their defaults before the autograd
    version bump indexes an op's mutated ones: torch 2.11's did, and LoLA's decode step without kept
    recalls (five None) raised IndexError on an H200. So no mutated argument of a linearize op has
    a default, and every caller passes them."""
    ops = [fused_lola.lola_step, fused_lola.lola_prefill, fused_decode.hybrid_linear_step, fused_decode.dsla_state_step,
           fused_decode.dsla_decode_inputs, fused_decode.hybrid_window_read, fused_decode.slot_attention_partials,
           fused_decode.slot_prefill_attention]  # fmt: skip
    mutated = 0
    for op in ops:
        schema = op._opoverload._schema
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                mutated += 1
                assert not arg.has_default_value(), f"{schema.name}: mutated argument {arg.name} has a default"
    assert mutated >= 14  # lola_step's 12, the hybrid's and DSLA's state


def _recall_drift(ds: LolaDecodeState, phi_k) -> float:
    """How far the kept recalls, with the pending write added, are from phi(k) [S | z] of every
    valid cache slot recomputed from the state (the invariant the errors kernel relies on)."""
    b, hq, lam, _ = ds.cache_keys.shape
    phi = phi_k(ds.cache_keys.float())  # (B, Hq, L, F)
    f = phi.shape[-1]
    dv = ds.values.shape[-1]
    want = phi @ ds.linear_state().view(b, hq, f, -1)[..., : dv + 1]  # (B, Hq, L, Dv + 1)
    pend = ds.pending.view(b, hq, -1)
    a = phi @ pend[..., :f, None]  # (B, Hq, L, 1)
    got = ds.recall.view(b, hq, lam, -1)[..., : want.shape[-1]] + a * pend[..., None, f:]
    return float((got - want)[ds.cache_valid].abs().max())


def _small_memory():
    """A float32 LoLA memory of 12 random tokens (2 rows, 4 query heads on 2 KV heads, D 16, f 8, Dv 12,
    window 3, lambda 4, one sink) and its decode state as the decode settings make it: (b, hq, f, dv,
    lambda, phi_k, the op's arguments, a token maker, the op's state, the decode state)."""
    torch.manual_seed(5)
    b, hq, hkv, d, f, dv, w, lam = 2, 4, 2, 16, 8, 12, 3, 4
    phi_q, phi_k, key_map = _maps(hq, d, f)
    options = dict(window_factor=torch.rand(hq, device=DEVICE), sinks=1, linear_weight=0.5)
    kw = dict(phi_q=phi_q, phi_k=phi_k, window=w, sparse=lam, **options)

    def token(t):
        return torch.randn(b, hq, t, d, device=DEVICE), torch.randn(b, hkv, t, d, device=DEVICE), torch.randn(b, hkv, t, dv, device=DEVICE)

    _, state = lola_attention(*token(12), chunk=4, **kw)
    ds = LolaDecodeState.from_state(state, phi_q=phi_q, phi_k=phi_k, scale=d**-0.5, dtype=torch.float32, key_map=key_map, **options)
    return b, hq, f, dv, lam, phi_k, kw, token, state, ds


def _steps_against_the_op(ds, state, kw, token, pattern):
    """Decode one random token per entry of ``pattern`` (True: the fused step, False: the torch
    step), checking each output against the chunked op and, after the caller's checks (this yields
    whether the step was fused), the state ``ds`` stands for against the op's."""
    b, hq = ds.held.shape
    f, dv = ds.linear.shape[1], ds.values.shape[-1]
    for fused in pattern:
        q, k, v = token(1)
        want, state = lola_attention(q, k, v, chunk=1, state=state, **kw)
        with fused_decode.use_fused(fused):
            got = lola_decode_step(ds, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        yield fused
        sz = ds.linear_state().view(b, hq, f, -1)
        torch.testing.assert_close(sz[..., :dv], state.linear.kv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sz[..., dv], state.linear.k_sum, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize("deferred", [2, 4, 8])
@torch.no_grad()
def test_kept_recalls_stay_the_state_products_and_survive_torch_steps(monkeypatch, deferred):
    """The fused step keeps each cache slot's recall [phi S, phi z] (plus the write pending) equal
    to the product recomputed from the state, step after step; a torch step in between marks the
    recalls stale, and the next fused step computes them again from the state. The state's writes
    are deferred (2, 4 or 8 at most: [S | z] takes them every 2 or 4 tokens, or only when a torch
    step needs it): outputs follow the chunked op throughout, and the state the decode state stands
    for is the op's."""
    monkeypatch.setattr(fused_lola, "DEFERRED_WRITES", deferred)
    b, hq, f, dv, lam, phi_k, kw, token, state, ds = _small_memory()
    assert ds.recall is not None and ds.recall.shape == (b * hq, lam, 16) and not ds.recall_ok.any()  # Dv + 1 = 13, padded
    for fused in _steps_against_the_op(ds, state, kw, token, (True, True, True, False, True, True, False, False, True)):
        if fused:
            assert ds.recall_ok.all()
            assert _recall_drift(ds, phi_k) < 1e-4
        else:
            assert not ds.recall_ok.any() and not ds.deferred_count.any()
        sz = ds.linear_state().view(b, hq, 2 * f, -1)
        assert sz.shape[-1] == fused_lola.state_width(dv) == 16 and not sz[..., dv + 1 :].any()  # Dv + 1 = 13, padded with zeros
    assert ds.deferred.shape[1] == deferred


SCALAR_CASES = {
    "D16-f16-hybrid": dict(d=16, f=16, dv=16, separate=False, reads=(True, True)),
    "D12-f6-Dv10-hybrid": dict(d=12, f=6, dv=10, separate=False, reads=(True, True)),
    "D16-f8-Dv70-no-sparse": dict(d=16, f=8, dv=70, separate=False, reads=(True, False)),
    "D12-f6-Dv10-no-state": dict(d=12, f=6, dv=10, separate=False, reads=(False, True)),
    "separate-length-weight-blocks": dict(d=16, f=16, dv=16, separate=True, reads=(True, True), weight_tokens=3, sinks=0, lam=70, steps=5),
}


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize("features", [False, True], ids=["features-made", "features-kept"])
@pytest.mark.parametrize("case", list(SCALAR_CASES.values()), ids=list(SCALAR_CASES))
@torch.no_grad()
def test_fused_step_with_scalar_recalls_equals_the_torch_step(monkeypatch, case, features):
    """The cache slots' recalls kept as scalars (``SCALAR_RECALLS``), their features made from their
    keys or kept (``KEPT_FEATURES``): the same outputs, memory and choices as the torch step and the
    chunked op, token by token (the separate case with lambda 70 in blocks of 16 candidates)."""
    monkeypatch.setattr(fused_lola, "SCALAR_RECALLS", True)
    monkeypatch.setattr(fused_lola, "KEPT_FEATURES", features)
    monkeypatch.setattr(fused_lola, "BLOCK_ROWS", 16)
    monkeypatch.setattr(fused_lola, "SELECT_BLOCK", 16)
    _run(**case)


def _scalar_drift(ds: LolaDecodeState, phi_k) -> tuple[float, float]:
    """How far the kept recall scalars, with the pending write added, are from (v . phi S, |phi S|^2,
    phi z) of every valid cache slot recomputed from the state, and the pending leaving token's
    (the window ring's oldest) from its own recomputed: the invariants the errors kernel relies on
    (largest differences relative to each scalar's scale)."""
    b, hq, lam, _ = ds.cache_keys.shape
    dv = ds.values.shape[-1]
    n_rep = hq // ds.keys.shape[1]

    def scalars(phi: Tensor, v: Tensor) -> Tensor:  # (B, Hq, N, F), (B, Hq, N, Dv) -> (B, Hq, N, 3) against the state now
        n = phi @ ds.linear_state().view(b, hq, phi.shape[-1], -1)[..., : dv + 1]
        return torch.stack([(v * n[..., :dv]).sum(-1), n[..., :dv].square().sum(-1), n[..., dv]], -1)

    def off(got: Tensor, want: Tensor) -> float:
        got, want = got.reshape(-1, 3), want.reshape(-1, 3)
        return float(((got - want).abs() / (want.abs().amax(dim=0) + 1e-6)).max()) if got.numel() else 0.0

    phi = phi_k(ds.cache_keys.float())  # (B, Hq, L, F)
    f = phi.shape[-1]
    v = ds.cache_values.float()
    pend = ds.pending.view(b, hq, 1, -1)
    row, u, vsq = pend[..., f : f + dv + 1], pend[..., f + dv + 1 : 2 * f + dv + 1], pend[..., 2 * f + dv + 1]
    c = (phi * pend[..., :f]).sum(-1)  # (B, Hq, L)
    kept = ds.recall.view(b, hq, lam, -1)
    got = torch.stack([kept[..., 0] + c * (v * row[..., :dv]).sum(-1), kept[..., 1] + c * (2 * (phi * u).sum(-1) + c * vsq),
                       kept[..., 2] + c * row[..., dv]], -1)  # fmt: skip
    valid = ds.cache_valid
    cache = off(got[valid], scalars(phi, v)[valid])
    i = ds.index.view(1)
    keys = ds.keys if ds.linear_keys is None else ds.linear_keys
    phi_l = phi_k(keys.index_select(2, i).float().repeat_interleave(n_rep, 1))  # (B, Hq, 1, F)
    v_l = ds.values.index_select(2, i).float().repeat_interleave(n_rep, 1)
    leave = off(pend[..., 2 * f + dv + 2 : 2 * f + dv + 5], scalars(phi_l, v_l))
    return cache, leave


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize("features", [False, True], ids=["features-made", "features-kept"])
@torch.no_grad()
def test_scalar_recalls_stay_the_state_products_and_survive_torch_steps(monkeypatch, features):
    """The kept recall scalars (plus the write pending) equal those recomputed from the state, and
    the pending leaving token's equal its own, step after step; a torch step in between marks them
    stale and the next fused step computes them from the state again; outputs follow the chunked
    op and the state is the op's throughout (no deferred writes). Kept features equal the map's on
    every valid slot's key."""
    monkeypatch.setattr(fused_lola, "SCALAR_RECALLS", True)
    monkeypatch.setattr(fused_lola, "KEPT_FEATURES", features)
    b, hq, f, dv, lam, phi_k, kw, token, state, ds = _small_memory()
    assert ds.recall.shape == (b * hq, lam, 4) and ds.pending.shape == (b * hq, 4 * f + dv + 5) and ds.deferred is None
    assert not ds.recall_ok.any()
    for fused in _steps_against_the_op(ds, state, kw, token, (True, True, True, False, True, True, False, False, True, True)):
        if fused:
            assert ds.recall_ok.all()
            cache, leave = _scalar_drift(ds, phi_k)
            assert cache < 1e-5 and leave < 1e-5, (cache, leave)
            assert (ds.cache_features is not None) == features
            if features:
                want = phi_k(ds.cache_keys.float())[ds.cache_valid]  # (valid slots, F)
                got = ds.cache_features.view(*ds.cache_valid.shape, -1)[ds.cache_valid]
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        else:
            assert not ds.recall_ok.any()


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize("per_sm", [1, 2], ids=["both-rows-one-program", "a-program-per-row"])
@torch.no_grad()
def test_scalar_recalls_of_one_stale_row_are_computed_again(monkeypatch, per_sm):
    """One batch row's recall scalars marked stale and overwritten while the other row's stay
    current: the next fused step computes that row's from the state and keeps the other's, whether
    one program of the stale pass checks both rows or each row has its own
    (``STALE_PROGRAMS_PER_SM``): outputs follow the chunked op and every row's scalars equal those
    recomputed from the state."""
    monkeypatch.setattr(fused_lola, "SCALAR_RECALLS", True)
    monkeypatch.setattr(fused_lola, "STALE_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(fused_lola, "_sm_count", lambda device: 1)  # the grouping as the interpreter sees it, on any device
    b, hq, f, dv, lam, phi_k, kw, token, state, ds = _small_memory()
    assert fused_lola.stale_rows_per_program(b * hq, ds.linear.device) == (b * hq if per_sm == 1 else hq)
    steps = _steps_against_the_op(ds, state, kw, token, (True,) * 4)
    for i, _ in enumerate(steps):
        assert ds.recall_ok.all()
        cache, leave = _scalar_drift(ds, phi_k)
        assert cache < 1e-5 and leave < 1e-5, (i, cache, leave)
        if i == 1:  # row 1's scalars lost: the next step must compute them from the state
            ds.recall_ok[1] = 0
            ds.recall.view(b, hq, lam, -1)[1] = 123.0


@pytest.mark.usefixtures("step_kernels")
@torch.no_grad()
def test_fused_step_without_kept_recalls():
    """With ``keep_recalls`` off the state keeps no recalls and every step scores the cache from
    the state: the same outputs and memory as the torch step and the chunked op."""
    _run(d=16, f=16, dv=16, separate=False, reads=(True, True), steps=5, keep_recalls=False)


def _bfloat16_runs(b, hq, hkv, d, *, f, lam, w, tokens, chunk, keep_recalls=True, **options):
    """A bfloat16 model's LoLA memory after ``tokens`` random tokens (the chunked op), and two decode
    states of it: (the op's arguments, the state, [decode state, decode state])."""
    phi_q, phi_k, key_map = _maps(hq, d, f, torch.bfloat16)
    options = dict(window_factor=torch.rand(hq, device=DEVICE), **options)
    kw = dict(phi_q=phi_q, phi_k=phi_k, window=w, sparse=lam, **options)
    x = [torch.randn(b, h, tokens, d, device=DEVICE, dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
    _, state = lola_attention(*x, chunk=chunk, **kw)
    runs = [LolaDecodeState.from_state(state, phi_q=phi_q, phi_k=phi_k, scale=d**-0.5, dtype=torch.bfloat16, key_map=key_map,
                                       keep_recalls=keep_recalls, **options) for _ in range(2)]  # fmt: skip
    return kw, state, runs


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize("keep_recalls,split,scalars", [(True, True, False), (True, True, True), (True, True, "features"), (False, True, False),
                                                         (False, False, False)],
                         ids=["kept-recalls", "scalar-recalls", "scalar-recalls-features", "state", "state-one-product"])
@torch.no_grad()
def test_fused_step_in_bfloat16(monkeypatch, keep_recalls, split, scalars):
    """A bfloat16 model, on a GPU at the Llama-3-8B layer's sizes (D 128, f 128, lambda 256, 32
    query heads on 8 KV heads; in Triton's interpreter, its bfloat16 mended by conftest, at D 32,
    lambda 32): the fused step's choices, outputs and memory follow the torch step's over 16
    tokens, with the slots' recalls kept (and the writes deferred past a fold) or scored from the
    state, its products on the state's bfloat16 part and the rest or (``SPLIT_STATE`` off) on its
    bfloat16 part alone."""
    monkeypatch.setattr(fused_lola, "SPLIT_STATE", split)
    monkeypatch.setattr(fused_lola, "SCALAR_RECALLS", bool(scalars))
    monkeypatch.setattr(fused_lola, "KEPT_FEATURES", scalars == "features")
    torch.manual_seed(0)
    b, hq, hkv, d, lam, w, tokens = (4, 32, 8, 128, 256, 64, 1024) if DEVICE == "cuda" else (2, 4, 2, 32, 32, 16, 160)
    _, _, runs = _bfloat16_runs(b, hq, hkv, d, f=d, lam=lam, w=w, tokens=tokens, chunk=w, sinks=4, linear_weight=0.1,
                                keep_recalls=keep_recalls)  # fmt: skip
    assert (runs[0].recall is not None) == keep_recalls
    differ = 0
    for _ in range(16):
        q, k, v = (torch.randn(b, h, 1, d, device=DEVICE, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        before = runs[0].linear_state().view(b, hq, -1).clone()
        outs = []
        for fused, ds in zip((False, True), runs):
            with fused_decode.use_fused(fused):
                outs.append(lola_decode_step(ds, q, k, v).float())
        # A near-tie between two candidates may go either way (the kernel's products keep ~16 bits
        # of the state's mantissa): count the heads whose choice differs this step, check every
        # other head's output and memory, then continue both from the torch step's memory.
        flipped = (runs[1].cache_positions != runs[0].cache_positions).any(-1)  # (B, Hq)
        differ += int(flipped.sum())
        torch.testing.assert_close(outs[1][~flipped], outs[0][~flipped], atol=2e-2, rtol=2e-2)
        # This step's write into [S | z] to 20% per head (on an H200 some heads differed by more
        # than 5%): a bfloat16 projection rounded one unit the other way (the products' order
        # differs from cuBLAS's) moves a feature by a few percent; another token written would
        # differ by about all of it.
        got = runs[1].linear_state().view(b, hq, -1)[~flipped] - before[~flipped]
        want = runs[0].linear_state().view(b, hq, -1)[~flipped] - before[~flipped]
        assert ((got - want).norm(dim=-1) <= 0.2 * want.norm(dim=-1) + 1e-4).all()
        for name in ("keys", "values", "valid", "positions", "index", "next_position", "cache_keys", "cache_values", "cache_valid",
                     "cache_positions", "linear", "held"):  # fmt: skip
            getattr(runs[1], name).copy_(getattr(runs[0], name))
        if keep_recalls:
            runs[1].recall_ok.mul_((~flipped.any(-1)).int())  # a row whose cache was replaced: its kept recalls are stale
            if runs[1].deferred_count is not None:
                runs[1].deferred_count.zero_()  # the state copied holds every write
    # On an H200: 42 of 2,048 head steps (2.1%). The features themselves are bfloat16-rounded
    # projections, so two candidates within about a percent of each other are a tie at that precision.
    print(f"choices differing: {differ} of {16 * b * hq} head steps")  # shown with -s: the rate each precision gives
    assert differ <= 0.05 * 16 * b * hq, f"the fused choice differs from the torch step's in {differ} of {16 * b * hq} head steps"


@torch.no_grad()
def test_bfloat16_memory_is_kept_in_bfloat16_and_read_exactly():
    """A bfloat16 model's decode state keeps its keys and values in bfloat16 (they come from its
    projections, so nothing is lost): canonical() gives back the chunked op's float32 state, and the
    torch step (and on a GPU the fused one, its selection products split in two bfloat16 halves)
    continues it as the chunked op does. Not the fused step in Triton's interpreter: its bfloat16
    products are wrong there (Triton 3.6)."""
    torch.manual_seed(4)
    b, hq, hkv, d = 2, 4, 2, 16
    kw, state, runs = _bfloat16_runs(b, hq, hkv, d, f=16, lam=4, w=3, tokens=11, chunk=3, sinks=1, linear_weight=0.5)
    assert runs[0].keys.dtype == runs[0].cache_values.dtype == torch.bfloat16
    for got, want in zip(runs[0].canonical().tensors(), state.tensors()):
        assert torch.equal(got, want)
    for _ in range(6):
        q, k, v = (torch.randn(b, h, 1, d, device=DEVICE, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        want, state = lola_attention(q, k, v, chunk=1, state=state, **kw)
        for fused, ds in zip((False, True), runs):
            if fused and DEVICE == "cpu":
                continue
            with fused_decode.use_fused(fused):
                torch.testing.assert_close(lola_decode_step(ds, q, k, v).float(), want.float(), atol=2e-2, rtol=2e-2)
    tol = 1e-4 if DEVICE == "cpu" else 3e-2  # on a GPU, bfloat16 products of other shapes round the features differently
    for ds in runs if DEVICE == "cuda" else runs[:1]:
        got = ds.canonical()
        assert torch.equal(got.sparse.positions, state.sparse.positions)
        torch.testing.assert_close(got.linear.kv, state.linear.kv, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- the chunked prefill


def _prefill_pair(*, b=2, hq=4, hkv=2, t=37, d=16, f=8, dv=16, w=8, lam=6, chunk=4, separate=False, padded=False,
                  duplicate=False, dtype=torch.float32, **options):  # fmt: skip
    """``lola_attention`` from an empty memory through the torch loop and through the fused prefill:
    ((output, state) torch, (output, state) fused, calls of the kernel)."""
    torch.manual_seed(5)
    phi_q, phi_k, _ = _maps(hq, d, f, dtype)
    q, k, v = (torch.randn(b, h, t, x, device=DEVICE, dtype=dtype) for h, x in ((hq, d), (hkv, d), (hkv, dv)))
    if duplicate:  # every token the same: equal errors everywhere, so only the tie rules choose
        k, v = k[:, :, :1].expand_as(k).contiguous(), v[:, :, :1].expand_as(v).contiguous()
    lin = dict(q_lin=torch.randn_like(q), k_lin=k + 0.5) if separate else {}
    valid = None
    if padded:  # row 1 left-padded by 5, row 0 right-padded by 3
        valid = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
        valid[1, :5] = False
        valid[0, -3:] = False
    kw = dict(phi_q=phi_q, phi_k=phi_k, window=w, sparse=lam, chunk=chunk, valid=valid,
              window_factor=torch.rand(hq, device=DEVICE), **lin, **options)  # fmt: skip
    calls = []
    kernel = fused_lola.lola_prefill
    with fused_decode.use_fused(False):
        ref = lola_attention(q, k, v, **kw)
    with fused_decode.use_fused(True), pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_lola, "lola_prefill", lambda *a: calls.append(1) or kernel(*a))
        got = lola_attention(q, k, v, **kw)
    return ref, got, calls


def _assert_same_prefill(ref, got, atol=1e-5):
    (out_r, st_r), (out_g, st_g) = ref, got
    torch.testing.assert_close(out_g, out_r, atol=atol, rtol=atol)
    assert torch.equal(st_g.sparse.positions, st_r.sparse.positions) and torch.equal(st_g.sparse.valid, st_r.sparse.valid)
    assert torch.equal(st_g.window.positions, st_r.window.positions) and torch.equal(st_g.window.valid, st_r.window.valid)
    for a, r in zip(st_g.tensors(), st_r.tensors()):
        torch.testing.assert_close(a, r, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    "case",
    [
        dict(sinks=1, linear_weight=[0.2, 0.5, 1.0, 0.0]),
        dict(separate=True, padded=True, sinks=2, weight_tokens=10, linear_weight=0.3),
        dict(padded=True, read_state=False, d=12, dv=10, f=6),
        dict(read_sparse=False, separate=True, chunk=3, w=5),
        dict(lam=21, chunk=8, w=8, t=70, hkv=1, dv=70),
        dict(recall="memory", sinks=1, linear_weight=[0.2, 0.5, 1.0, 0.0]),
        dict(recall="memory", separate=True, padded=True, sinks=2, weight_tokens=10, d=12, dv=10),
        dict(recall="memory", lam=21, chunk=8, w=8, t=70, hkv=1, dv=70),
    ],
    ids=["gqa-sink-weights", "separate-padded-length-weight", "no-state-masked-dims", "no-sparse-chunk-below-window",
         "cache-in-blocks-one-kv-head", "memory-gqa-sink-weights", "memory-separate-padded-masked-dims", "memory-one-kv-head"],
)
@torch.no_grad()
def test_fused_prefill_equals_the_chunked_op(case):
    """The fused prefill (one program per row and head, the chunks in a loop) against the torch
    chunked op from an empty memory: the output and every memory tensor (window, sparse cache with
    its positions, linear state). Cases: grouped heads with a sink and a weight per head; the
    feature maps' own inputs, padding on both sides, the length weight; no state read with ragged
    head dims; no cache read, a chunk shorter than the window; a cache of 21 slots in blocks of 16
    (lambda not a multiple of the block) on one KV head, Dv 70; and three of them with recall
    "memory" (the older candidates' recall error computed in the selection kernel)."""
    ref, got, calls = _prefill_pair(**case)
    assert calls == [1]
    _assert_same_prefill(ref, got)


@pytest.mark.parametrize("separate", [False, True], ids=["rotated", "separate"])
@torch.no_grad()
def test_fused_prefill_with_hedgehog_modules_makes_their_features_in_one_kernel(separate):
    """With Hedgehog map modules (a converted layer's), the fused prefill makes the features with
    the maps' kernel into head-major buffers (keys not repeated), one launch per map: the output
    and memory of the torch loop over the same modules."""
    from linearize.layers.feature_map import HedgehogFeatureMap

    torch.manual_seed(5)
    b, hq, hkv, t, d = 2, 4, 2, 37, 16
    maps = [HedgehogFeatureMap(hq, d, 2 * d, seed=s).to(DEVICE) for s in (1, 2)]
    for m in maps:
        m.weight.mul_(0.5).add_(0.3 * torch.randn_like(m.weight))
        m.bias.normal_(0, 0.1)
    q, k, v = (torch.randn(b, h, t, d, device=DEVICE) for h in (hq, hkv, hkv))
    lin = dict(q_lin=torch.randn_like(q), k_lin=k + 0.5) if separate else {}
    kw = dict(phi_q=maps[0], phi_k=maps[1], window=8, sparse=6, chunk=4, window_factor=torch.rand(hq, device=DEVICE), sinks=1,
              linear_weight=[0.2, 0.5, 1.0, 0.0], **lin)  # fmt: skip
    with fused_decode.use_fused(False):
        ref = lola_attention(q, k, v, **kw)
    calls = []
    with fused_decode.use_fused(True), pytest.MonkeyPatch.context() as mp:
        for m in maps:
            kernel = m.token_major
            mp.setattr(m, "token_major", lambda x, n_rep, out=None, kernel=kernel: calls.append((x.shape[1], n_rep)) or kernel(x, n_rep, out=out))
        got = lola_attention(q, k, v, **kw)
    assert sorted(calls) == [(hkv, hq // hkv), (hq, 1)]  # the keys' heads once each, for their query heads
    _assert_same_prefill(ref, got, atol=1e-4)


@pytest.mark.parametrize(
    "case",
    [dict(sinks=1, linear_weight=[0.2, 0.5, 1.0, 0.0]), dict(separate=True, padded=True, sinks=2, weight_tokens=10, d=12, dv=20, f=12),
     dict(recall="memory", lam=21, chunk=8, w=8, t=70, hkv=1, dv=70)],
    ids=["gqa-sink-weights", "separate-padded-masked-tiles", "memory-one-kv-head"],
)
@torch.no_grad()
def test_fused_prefill_with_the_state_in_tiles_equals_the_chunked_op(monkeypatch, case):
    """The selection reading [S | z] from memory in tiles of 16 x 16 (as it does where the state
    is too large to hold in registers, ``PREFILL_RESIDENT_FLOATS``), several tiles on each axis,
    the last ones ragged: the same output and memory as the torch op."""
    monkeypatch.setattr(fused_lola, "PREFILL_RESIDENT_FLOATS", 0)
    monkeypatch.setattr(fused_lola, "PREFILL_BLOCK_FEATURES", 16)
    monkeypatch.setattr(fused_lola, "PREFILL_BLOCK_VALUES", 16)
    ref, got, calls = _prefill_pair(**case)
    assert calls == [1]
    _assert_same_prefill(ref, got)


@pytest.mark.parametrize("read_state", [True, False])
@torch.no_grad()
def test_fused_prefill_in_segments_equals_the_chunked_op(monkeypatch, read_state):
    """Room for the saved states of 3 chunks only: the prompt's 10 chunks run as segments (each
    selected, then read, the state and the cache carried over), and the result is the torch op's."""
    f, dv, rows = 8, 16, 2 * 4
    monkeypatch.setattr(fused_lola, "PREFILL_SAVED_BYTES", 3 * rows * (2 * f * dv + 2 * f) * 4)
    ref, got, calls = _prefill_pair(padded=True, sinks=1, weight_tokens=12, read_state=read_state, f=f, dv=dv)
    assert calls == [1]
    _assert_same_prefill(ref, got)


@torch.no_grad()
def test_fused_prefill_with_a_chunk_read_by_several_programs(monkeypatch):
    """A chunk of 24 queries (a block of 32) read 16 queries per program: each program's window
    starts at its first query, the last one's queries past the chunk are masked."""
    monkeypatch.setattr(fused_lola, "PREFILL_READ_QUERIES", 16)
    ref, got, calls = _prefill_pair(chunk=24, w=32, t=70, padded=True, sinks=1, weight_tokens=20, linear_weight=0.4)
    assert calls == [1]
    _assert_same_prefill(ref, got)


@torch.no_grad()
def test_fused_prefill_breaks_ties_as_the_chunked_op():
    """Every token alike, so all candidates' errors tie: the stable sort's rule (the earlier
    candidate first) decides which are kept, as in the torch op."""
    ref, got, _ = _prefill_pair(duplicate=True, sinks=0)
    _assert_same_prefill(ref, got)


@torch.no_grad()
def test_fused_prefill_only_from_an_empty_memory_and_without_gradients():
    """A call that continues a state or has no sparse cache takes the torch op. One that asks for
    gradients takes the kernels for the choice of the caches only (without gradients) and reads
    through torch (``lola_given_caches``), so its output has a gradient; with padding it takes the
    torch op."""
    torch.manual_seed(1)
    phi_q, phi_k, _ = _maps(2, 16, 8)
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    kw = dict(phi_q=phi_q, phi_k=phi_k, window=4, window_factor=torch.ones(2, device=DEVICE), chunk=4)
    calls = []
    kernel = fused_lola.lola_prefill
    with fused_decode.use_fused(True), pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_lola, "lola_prefill", lambda *a: calls.append(1) or kernel(*a))
        _, state = lola_attention(q, k, v, sparse=3, **kw)
        assert calls == [1]
        lola_attention(q, k, v, sparse=3, state=state, **kw)
        lola_attention(q, k, v, sparse=0, **kw)
        assert calls == [1]
        with torch.enable_grad():
            out, _ = lola_attention(q.clone().requires_grad_(), k, v, sparse=3, **kw)
            assert out.requires_grad and calls == [1, 1]
            padded = torch.ones(1, 9, dtype=torch.bool, device=DEVICE)
            padded[0, 0] = False
            out, _ = lola_attention(q.clone().requires_grad_(), k, v, sparse=3, valid=padded, **kw)
            assert out.requires_grad and calls == [1, 1]


@pytest.mark.parametrize("read_state", [True, False])
@torch.no_grad()
def test_selection_alone_keeps_what_the_whole_prefill_keeps(monkeypatch, read_state):
    """``output=False`` (the training path's call): one selection over every chunk and no read; the
    linear state, the last cache and every chunk's cache equal the whole prefill's (run in segments
    of 3 chunks here), and the output is empty."""
    b, hq, hkv, t, d, f, dv = 2, 4, 2, 37, 8, 8, 16
    torch.manual_seed(4)
    q, k = torch.randn(b, hq, t, d, device=DEVICE), torch.randn(b, hkv, t, d, device=DEVICE)
    v = torch.randn(b, hkv, t, dv, device=DEVICE)
    qphi, kphi = torch.rand(b, hq, t, f, device=DEVICE), torch.rand(b, hq, t, f, device=DEVICE)
    args = [q, k, v, qphi, kphi, torch.tensor([t, 29], device=DEVICE), 0.5 + torch.rand(hq, device=DEVICE),
            torch.rand(hq, device=DEVICE)]  # fmt: skip
    options = dict(window=8, sparse=5, chunk=4, sinks=1, scale=0.3, weight_tokens=0, read_state=read_state, read_sparse=True)
    monkeypatch.setattr(fused_lola, "PREFILL_SAVED_BYTES", 3 * b * hq * (2 * f * dv + 2 * f) * 4)
    whole = fused_lola.lola_prefill(*args, **options)
    alone = fused_lola.lola_prefill(*args, **options, output=False)
    assert whole[0].shape == (b, hq, t, dv) and alone[0].shape == (b, hq, 0, dv)
    assert whole[4].shape == (b, hq, 10, 5) and bool((whole[4] >= 0).any())
    for name, w, a in zip(("S", "z", "positions", "caches"), whole[1:], alone[1:]):
        assert torch.equal(a, w), name


def test_fused_prefill_rejects_bad_arguments():
    b, hq, hkv, t, d, f = 1, 2, 1, 5, 16, 8
    q, k = torch.zeros(b, hq, t, d, device=DEVICE), torch.zeros(b, hkv, t, d, device=DEVICE)
    phi = torch.zeros(b, hq, t, f, device=DEVICE)
    args = [q, k, k, phi, phi, torch.full((b,), t, device=DEVICE), torch.ones(hq, device=DEVICE), torch.ones(hq, device=DEVICE)]
    options = dict(window=4, sparse=2, chunk=4, sinks=0, scale=1.0, weight_tokens=0, read_state=True, read_sparse=True)
    with pytest.raises(ValueError, match="chunk"):
        fused_lola.lola_prefill(*args, **{**options, "chunk": 5})
    with pytest.raises(ValueError, match="sparse cache"):
        fused_lola.lola_prefill(*args, **{**options, "sparse": 0})
    with pytest.raises(ValueError, match="one dtype"):
        fused_lola.lola_prefill(*[x.half() if i < 5 else x for i, x in enumerate(args)], **options)
    with pytest.raises(ValueError, match="qphi must have shape"):
        fused_lola.lola_prefill(*args[:3], phi[..., :4], *args[4:], **options)
    with pytest.raises(ValueError, match="n_real must be torch.int64"):
        fused_lola.lola_prefill(*args[:5], args[5].int(), *args[6:], **options)


@pytest.mark.parametrize("recall", ["state", "memory"])
@pytest.mark.parametrize("shape", ["llama3-8b", "llama3-8b-rect", "smollm2"])
@torch.no_grad()
def test_fused_prefill_in_bfloat16(monkeypatch, recall, shape):
    """A bfloat16 model, on a GPU at the Llama-3-8B layer's sizes (D 128, f 128, window 64, lambda
    256, 32 query heads on 8 KV heads; its [S | z] read in tiles) and at SmolLM2's (D 64, f 64, 9
    query heads on 3; [S | z] held in registers; "llama3-8b-rect": the 8B sizes with a rectangular
    map, f 64, LoLCATs' 128 features, [S | z] held in registers), 2,048 tokens in 4 segments (each read on the
    second stream beside the next one's selection); in Triton's interpreter (its bfloat16 mended by
    conftest) at D 16, lambda 24, 160 tokens in 3 segments, the state in tiles of 16 or in registers:
    the fused prefill keeps almost the same cache as the torch op (a near-tie at bfloat16 precision
    may go the other way, and the state then differs by that token) and its output follows the
    torch op's, with either recall rule."""
    if DEVICE != "cuda":
        hq, hkv, d, t, w, lam = 4, 2, 16, 160, 16, 24
    else:
        hq, hkv, d, t, w, lam = (9, 3, 64, 2048, 64, 256) if shape == "smollm2" else (32, 8, 128, 2048, 64, 256)
    f = d // 2 if shape == "llama3-8b-rect" else d  # the maps' projection width: 2 f features
    if DEVICE == "cuda":
        monkeypatch.setattr(fused_lola, "PREFILL_SEGMENT_CHUNKS", 8)
        assert (2 * f * d <= fused_lola.PREFILL_RESIDENT_FLOATS) == (shape != "llama3-8b")
    else:
        monkeypatch.setattr(fused_lola, "PREFILL_SAVED_BYTES", 4 * 4 * hq * (2 * f * d + 2 * f))  # segments of 4 chunks
        if shape == "llama3-8b":  # [S | z] in tiles, several per axis
            for name in ("PREFILL_BLOCK_FEATURES", "PREFILL_BLOCK_VALUES", "PREFILL_BLOCK_CACHE", "PREFILL_READ_BLOCK_FEATURES"):
                monkeypatch.setattr(fused_lola, name, 16)
            monkeypatch.setattr(fused_lola, "PREFILL_RESIDENT_FLOATS", 0)
    (out_r, st_r), (out_g, st_g), calls = _prefill_pair(b=1, hq=hq, hkv=hkv, t=t, d=d, f=f, dv=d, w=w, lam=lam, chunk=w,
                                                        dtype=torch.bfloat16, sinks=4, linear_weight=0.1, recall=recall)  # fmt: skip
    assert calls == [1]
    same = (st_g.sparse.positions == st_r.sparse.positions).float().mean().item()
    assert same >= 0.95, f"only {same:.1%} of the cache's slots hold the torch op's tokens"
    err = (out_g.float() - out_r.float()).abs().mean() / out_r.float().abs().mean()
    assert err <= 2e-2, f"mean relative output difference {err:.3g}"
    assert torch.equal(st_g.window.positions, st_r.window.positions)
    torch.testing.assert_close(st_g.window.keys, st_r.window.keys)


# ----------------------------------------------------------------------------- the training path


def _trainable_maps(hq: int, d: int, f: int):
    """Hedgehog maps whose weights ask for gradients, as in attention transfer: (phi_q, phi_k, [weights])."""
    g = torch.Generator().manual_seed(11)
    wq, wk = ((torch.randn(hq, d, f, generator=g) * 0.5).to(DEVICE).requires_grad_(True) for _ in range(2))
    bias = torch.zeros(hq, f, device=DEVICE)
    return functools.partial(hedgehog, weight=wq, bias=bias), functools.partial(hedgehog, weight=wk, bias=bias), [wq, wk]


TRAINING_CASES = {
    "gqa-sinks-weights": dict(window=8, sparse=5, chunk=4, t=37, sinks=1, linear_weight=[0.2, 0.5, 1.0, 0.0]),
    "chunk-equals-window": dict(window=6, sparse=7, chunk=6, t=40, weight_tokens=9),
    "separate-maps": dict(window=8, sparse=4, chunk=2, t=23, separate=True, sinks=2, linear_weight=0.3, weight_tokens=7),
    "no-state": dict(window=4, sparse=3, chunk=4, t=21, read_state=False),
    "no-sparse-read": dict(window=4, sparse=6, chunk=2, t=19, read_sparse=False, sinks=1),
    "shorter-than-the-window": dict(window=8, sparse=3, chunk=4, t=6),
    "memory-separate-maps": dict(window=8, sparse=4, chunk=4, t=31, separate=True, sinks=1, recall="memory"),
}


@pytest.mark.parametrize("case", list(TRAINING_CASES.values()), ids=list(TRAINING_CASES))
def test_training_path_equals_the_chunk_loop(case, monkeypatch):
    """With gradients asked for (of the feature maps' weights, as in attention transfer, and of q, k,
    v and the window factor), no padding and the window a multiple of the chunk, the kernels choose
    each chunk's cache without gradients and ``lola_given_caches`` reads every chunk at once: the
    output, the memory and every gradient equal the chunk loop's (run from an explicit empty
    memory), in float32."""
    case = dict(case)
    t, separate = case.pop("t"), case.pop("separate", False)
    b, hq, hkv, d, f = 2, 4, 2, 8, 8
    torch.manual_seed(3)
    q, k, v = (torch.randn(b, h, t, d, device=DEVICE) for h in (hq, hkv, hkv))
    lin = (torch.randn_like(q), torch.randn_like(k)) if separate else None
    phi_q, phi_k, maps = _trainable_maps(hq, d, f)
    factor = 0.1 + 0.8 * torch.rand(hq, device=DEVICE)
    calls = []
    given = lola_ops.lola_given_caches
    monkeypatch.setattr(lola_ops, "lola_given_caches", lambda *a, **kw: calls.append(1) or given(*a, **kw))
    results = []
    for explicit_state in (False, True):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, factor)]
        extra = {} if lin is None else dict(q_lin=lin[0].clone().requires_grad_(True), k_lin=lin[1].clone().requires_grad_(True))
        if explicit_state:  # the chunk loop
            extra["state"] = lola_ops.lola_state_empty(b, hq, hkv, case["window"], case["sparse"], d, d, 2 * f, DEVICE,
                                                       linear_keys=separate)  # fmt: skip
        with fused_decode.use_fused(True):
            out, state = lola_attention(*leaves[:3], phi_q=phi_q, phi_k=phi_k, window_factor=leaves[3], **case, **extra)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        loss = (out * w).sum() + state.linear.kv.sum() + 0.1 * state.linear.k_sum.sum() + state.sparse.values.sum()
        wrt = leaves + maps + [extra[n] for n in ("q_lin", "k_lin") if n in extra]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)  # phi_q is unread without the state
        results.append((out, state, [torch.zeros_like(x) if g is None else g for g, x in zip(grads, wrt)]))
    assert calls == [1]  # the first call read every chunk at once, the second ran the loop
    (out_p, st_p, g_p), (out_l, st_l, g_l) = results
    torch.testing.assert_close(out_p, out_l, atol=1e-5, rtol=1e-4)
    assert torch.equal(st_p.sparse.positions, st_l.sparse.positions)
    for a, r in zip(st_p.tensors(), st_l.tensors()):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)
    for i, (a, r) in enumerate(zip(g_p, g_l)):
        if i < 3 or (i < 5 and t > case["window"] and case.get("read_state", True)):
            assert r.abs().sum() > 0, f"gradient {i} is zero"  # the maps are read once a token has left the window
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4, msg=lambda m, i=i: f"gradient {i}: {m}")


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_mixed_dtypes_of_autocast_take_the_kernels_in_the_narrowest(monkeypatch, grad):
    """Under autocast the projections come in bfloat16 and the RoPE'd q/k in float32. Both fused
    paths read them in bfloat16 (as autocast's softmax attention does) instead of falling back to
    the chunk loop: the result equals the all-bfloat16 call, and the output keeps q's dtype."""
    torch.manual_seed(2)
    b, hq, hkv, t, d, f = 1, 4, 2, 24, 8, 8
    q, k = torch.randn(b, hq, t, d, device=DEVICE), torch.randn(b, hkv, t, d, device=DEVICE)
    v, q_lin, k_lin = torch.randn(b, hkv, t, d, device=DEVICE).bfloat16(), torch.randn_like(q).bfloat16(), torch.randn_like(k).bfloat16()
    phi_q, phi_k, maps = _trainable_maps(hq, d, f)
    kw = dict(phi_q=phi_q, phi_k=phi_k, window=8, sparse=5, chunk=4, sinks=1, window_factor=torch.full((hq,), 0.5, device=DEVICE))
    seen = []
    kernel = fused_lola.lola_prefill
    monkeypatch.setattr(fused_lola, "lola_prefill", lambda *a: seen.append({x.dtype for x in a[:5]}) or kernel(*a))
    with fused_decode.use_fused(True), torch.set_grad_enabled(grad), torch.autocast(DEVICE, dtype=torch.bfloat16):
        if not grad:
            for m in maps:
                m.requires_grad_(False)
        mixed, mem = lola_attention(q, k, v, q_lin=q_lin, k_lin=k_lin, **kw)
        low, mem_low = lola_attention(q.bfloat16(), k.bfloat16(), v, q_lin=q_lin, k_lin=k_lin, **kw)
    assert seen == [{torch.bfloat16}] * 2
    assert mixed.dtype == torch.float32 and mixed.requires_grad == grad
    torch.testing.assert_close(mixed, low.float(), atol=0, rtol=0)
    assert torch.equal(mem.sparse.positions, mem_low.sparse.positions)


def test_training_path_only_where_it_applies(monkeypatch):
    """Padding, a chunk that does not divide the window, no gradient asked for, or the kernels turned
    off keep the other paths."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, h, 17, 8, device=DEVICE) for h in (4, 2, 2))
    phi_q, phi_k, _ = _trainable_maps(4, 8, 8)
    kw = dict(phi_q=phi_q, phi_k=phi_k, sparse=3, chunk=4, window_factor=torch.ones(4, device=DEVICE))
    padded = torch.ones(2, 17, dtype=torch.bool, device=DEVICE)
    padded[1, :2] = False
    calls = []
    given = lola_ops.lola_given_caches
    monkeypatch.setattr(lola_ops, "lola_given_caches", lambda *a, **kw_: calls.append(1) or given(*a, **kw_))
    with fused_decode.use_fused(True):
        lola_attention(q, k, v, window=6, **kw)
        assert lola_attention(q, k, v, window=4, valid=padded, **kw)[0].requires_grad
        with torch.no_grad():
            lola_attention(q, k, v, window=4, **kw)
    with fused_decode.use_fused(False):
        assert lola_attention(q, k, v, window=4, **kw)[0].requires_grad
    assert calls == []
    with fused_decode.use_fused(True):
        assert lola_attention(q, k, v, window=4, **kw)[0].requires_grad
    assert calls == [1]
