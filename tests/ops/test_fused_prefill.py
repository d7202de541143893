"""The fused hybrid prefill (``linearize.ops.fused_prefill``) against the exact hybrid: outputs and
every state tensor, from an empty, a partly filled and a full window (on the GPU when there is one,
else in Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from linearize.layers.feature_map import HedgehogFeatureMap
from linearize.ops import fused_decode, fused_prefill
from linearize.ops.hybrid import hybrid_attention

pytestmark = pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, D = 4, 2, 16


def _maps(seed: int, features: int = 2 * D):
    torch.manual_seed(seed)
    maps = []
    for _ in range(2):
        m = HedgehogFeatureMap(HQ, D, features, seed=seed)
        with torch.no_grad():
            m.weight.add_(0.3 * torch.randn_like(m.weight))  # away from the identity start
            m.bias.normal_()
        maps.append(m.to(DEVICE))
    return maps


def _qkv(b: int, t: int, gen: torch.Generator):
    return [torch.randn(b, h, t, D, generator=gen).to(DEVICE) for h in (HQ, HKV, HKV)]


def _assert_states_equal(got, want, tol):
    for g, w in zip(got.tensors(), want.tensors()):
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        else:
            assert torch.equal(g, w)


# window, tokens before (the state the call continues), tokens in the call
CASES = [(16, 0, 150), (64, 5, 150), (80, 70, 40), (64, 200, 129), (64, 3, 1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c[0]}-prior{c[1]}-t{c[2]}")
@pytest.mark.parametrize("mix", ["joint", "gate"])
@pytest.mark.parametrize("separate", [False, True], ids=["rope", "separate"])
@torch.no_grad()
def test_fused_prefill_equals_the_exact_hybrid(case, mix, separate):
    """Grouped heads, learned Hedgehog maps, random per-head mix factors; the windows span two and
    three key tiles, the calls start from an empty window, a partly filled one and a full one."""
    window, prior, t = case
    gen = torch.Generator().manual_seed(sum(case))
    phi_q, phi_k = _maps(window + prior)
    factor = torch.rand(HQ, generator=gen).to(DEVICE)
    args = dict(phi_q=phi_q, phi_k=phi_k, window=window, mix=mix, **({"window_factor": factor} if mix == "joint" else {"gate": factor}))
    state = None
    extra_prior = _qkv(2, prior, gen) + (_qkv(2, prior, gen)[:2] if separate else [])
    if prior:
        lin = {"q_lin": extra_prior[3], "k_lin": extra_prior[4]} if separate else {}
        _, state = hybrid_attention(*extra_prior[:3], **args, **lin)
    q, k, v = _qkv(2, t, gen)
    lin = dict(zip(("q_lin", "k_lin"), _qkv(2, t, gen)[:2])) if separate else {}
    want, want_state = hybrid_attention(q, k, v, **args, state=state, **lin)
    with fused_decode.use_fused(True):
        got, got_state = fused_prefill.hybrid_prefill(q, k, v, **args, state=state, **lin)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    _assert_states_equal(got_state, want_state, 2e-5)


@pytest.mark.parametrize("mix", ["joint", "gate"])
@torch.no_grad()
def test_rectangular_maps_take_the_fused_prefill_exactly(mix):
    """Hedgehog maps of d' = d features (a d x d/2 projection, LoLCATs' 8B size), continuing a state."""
    gen = torch.Generator().manual_seed(11)
    phi_q, phi_k = _maps(11, features=D)
    factor = torch.rand(HQ, generator=gen).to(DEVICE)
    args = dict(phi_q=phi_q, phi_k=phi_k, window=64, mix=mix, **({"window_factor": factor} if mix == "joint" else {"gate": factor}))
    _, state = hybrid_attention(*_qkv(2, 70, gen), **args)
    q, k, v = _qkv(2, 150, gen)
    want, want_state = hybrid_attention(q, k, v, **args, state=state)
    with fused_decode.use_fused(True):
        got, got_state = fused_prefill.hybrid_prefill(q, k, v, **args, state=state)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    _assert_states_equal(got_state, want_state, 2e-5)
    assert got_state.linear.kv.shape[2:] == (D, D)  # (B, Hq, F, Dv): d' = d features


@torch.no_grad()
def test_fused_prefill_in_pieces_equals_one_call():
    """Prefill in three fused calls, each continuing the state the last one left, equals one exact call."""
    gen = torch.Generator().manual_seed(3)
    phi_q, phi_k = _maps(3)
    q, k, v = _qkv(1, 200, gen)
    args = dict(phi_q=phi_q, phi_k=phi_k, window=64)
    want, want_state = hybrid_attention(q, k, v, **args)
    outs, state = [], None
    with fused_decode.use_fused(True):
        for lo, hi in ((0, 37), (37, 101), (101, 200)):
            o, state = fused_prefill.hybrid_prefill(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], **args, state=state)
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), want, atol=2e-5, rtol=2e-5)
    _assert_states_equal(state, want_state, 2e-5)


def test_unknown_numerator_is_named():
    q, k, v = _qkv(1, 4, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="unknown numerator 'cuda'; valid: \\('kernel', 'fla'\\)"):
        fused_prefill.hybrid_prefill(q, k, v, phi_q=torch.exp, phi_k=torch.exp, window=4, numerator="cuda")


def test_hybrid_attention_takes_the_fused_prefill_for_inference_only(monkeypatch):
    """hybrid_attention hands a call to the fused prefill only without gradients, without a padding
    mask, for the non-overlapping two-branch hybrid and tile-sized heads; what it returns then is
    the fused path's."""
    calls = []
    real = fused_prefill.hybrid_prefill
    monkeypatch.setattr(fused_prefill, "hybrid_prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(4)
    phi_q, phi_k = _maps(4)
    q, k, v = _qkv(2, 70, gen)
    args = dict(phi_q=phi_q, phi_k=phi_k, window=16)

    def taken(q=q, k=k, v=v, **extra) -> bool:
        calls.clear()
        hybrid_attention(q, k, v, **(args | extra))
        return bool(calls)

    with fused_decode.use_fused(True):
        with torch.no_grad():
            assert taken()
            assert not taken(valid=torch.ones(2, 70, dtype=torch.bool, device=DEVICE))
            assert not taken(overlap=True)
            assert not taken(branches="window")
            assert not taken(q=q[..., :8], k=k[..., :8], v=v[..., :8], phi_q=torch.exp, phi_k=torch.exp)  # head size 8: below the tiles
        assert not taken()  # gradients on
    with fused_decode.use_fused(False), torch.no_grad():
        assert not taken()


@pytest.mark.parametrize("numerator", fused_prefill.NUMERATORS)
@pytest.mark.parametrize("mix", ["joint", "gate"])
@torch.no_grad()
def test_bfloat16_prefill_is_close_to_the_float32_hybrid(mix, numerator):
    """bf16 inputs with either numerator (the states before each block stored in bf16, or fla's)
    against the exact hybrid in float32, on the GPU at a Llama head size (in Triton's interpreter,
    its bfloat16 mended by conftest, at head size 32 over 4 blocks): within bf16 precision."""
    if numerator == "fla":
        pytest.importorskip("fla")
    torch.manual_seed(5)
    b, hq, hkv, d, t = (2, 8, 2, 128, 1000) if DEVICE == "cuda" else (1, 4, 2, 32, 230)
    phi_q, phi_k = (HedgehogFeatureMap(hq, d, 2 * d, seed=s).to(DEVICE) for s in (0, 1))
    q, k, v = (torch.randn(b, h, t, d, device=DEVICE) for h in (hq, hkv, hkv))
    factor = torch.rand(hq, device=DEVICE)
    args = dict(window=64, mix=mix, **({"window_factor": factor} if mix == "joint" else {"gate": factor}))
    want, want_state = hybrid_attention(q, k, v, phi_q=phi_q, phi_k=phi_k, **args)
    got, got_state = fused_prefill.hybrid_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), phi_q=phi_q, phi_k=phi_k,
                                                  numerator=numerator, **args)  # fmt: skip
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_state.linear.kv, want_state.linear.kv, atol=0.2, rtol=3e-2)
    torch.testing.assert_close(got_state.linear.k_sum, want_state.linear.k_sum, atol=0.2, rtol=1e-2)


@pytest.mark.parametrize("n_rep", [1, 2])
@pytest.mark.parametrize("width", [16, 8], ids=["tiled", "torch-fallback"])
@torch.no_grad()
def test_hedgehog_token_major_equals_the_map_on_repeated_heads(n_rep, width):
    """The token-major Hedgehog kernel (each KV head read once for its query heads) equals the
    module's map on the repeated heads, transposed; f = 8 takes the torch fallback."""
    gen = torch.Generator().manual_seed(6)
    m = HedgehogFeatureMap(HQ, D, 2 * width, seed=6).to(DEVICE)
    with torch.no_grad():
        m.weight.add_(0.5 * torch.randn(m.weight.shape, generator=gen).to(DEVICE))
    x = torch.randn(2, HQ // n_rep, 70, D, generator=gen).to(DEVICE)
    with fused_decode.use_fused(True):
        got = m.token_major(x, n_rep)
    want = m(x.repeat_interleave(n_rep, dim=1)).transpose(1, 2)
    assert got.shape == (2, 70, HQ, 2 * width) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n_rep", [1, 2])
@torch.no_grad()
def test_hedgehog_token_major_in_bfloat16_rounds_as_the_map(n_rep):
    """In bfloat16 the kernel rounds the projection to bfloat16 before its softmaxes, as the
    module's map does (its projection is a bfloat16 tensor): within a bfloat16 step of the map on
    the repeated heads, and closer to it than the unrounded float32 projection would be."""
    gen = torch.Generator().manual_seed(8)
    m = HedgehogFeatureMap(HQ, D, 32, seed=8).to(DEVICE)
    m.weight.add_(2.0 * torch.randn(m.weight.shape, generator=gen).to(DEVICE))
    x = (3 * torch.randn(2, HQ // n_rep, 70, D, generator=gen)).to(DEVICE, torch.bfloat16)
    with fused_decode.use_fused(True):
        got = m.token_major(x, n_rep).float()
    want = m(x.repeat_interleave(n_rep, dim=1)).transpose(1, 2).float()
    unrounded = m.float()(x.float().repeat_interleave(n_rep, dim=1)).transpose(1, 2)  # what the float32 projection gives
    torch.testing.assert_close(got, want, atol=8e-3, rtol=2e-2)
    assert (got - want).abs().mean() < 0.5 * (unrounded - want).abs().mean()
