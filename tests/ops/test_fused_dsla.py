"""DSLA's fused prefill (``linearize.ops.fused_dsla``) against ``dsla_prefill`` on the torch kernel
(itself tested against the float32 loop): outputs and both final states, from an empty and a
continued state, with and without the normaliser, for gates of every strength (on the GPU when
there is one, else in Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from linearize.ops import fused_decode, fused_dsla
from linearize.ops.dsla import FACTORED_DECAY_LIMIT, dsla_prefill, init_gate_bias, log_gate
from linearize.ops.states import DslaState

pytestmark = pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, F, DV = 4, 2, 32, 16


def _inputs(b: int, t: int, rank: int, gen: torch.Generator, normalize: bool, strength: float, shift: float | None = None, f: int = F):
    """Features (softmax rows with a normaliser: non-negative, as a feature map's), values, the gates'
    low-rank inputs and up projections (history near 0.999, recent near 0.9; ``strength`` scales the
    data-dependent part and, when large, pushes the recent gate's pre-activation far below 0, by
    ``shift`` where given)."""

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    qf, kf = rand(b, t, HQ, f), rand(b, t, HQ, f)
    if normalize:
        qf, kf = qf.softmax(-1), (2 * kf).softmax(-1)
    v = rand(b, t, HKV, DV)
    xr = rand(b, t, 2, rank)
    up = strength * rand(2, HQ * f, rank) / rank**0.5
    bias = torch.stack([torch.full((HQ * f,), init_gate_bias(a)) for a in (0.999, 0.9)]) + rand(2, HQ * f)
    if strength > 1 or shift is not None:
        bias[1] -= 20 * strength if shift is None else shift  # log gates far below -1 per token: decays the factored form could not hold
    return [x.to(DEVICE) for x in (qf, kf, v, xr, up, bias)]


def _log_gates(xr, up, bias, heads=HQ):
    b, t = xr.shape[:2]
    z = torch.einsum("btsr,sor->btso", xr.double(), up.double()) + bias.double()[None, None]  # (B, T, 2, Hq F)
    return log_gate(z).float().view(b, t, 2, heads, -1)


def _reference(qf, kf, v, xr, up, bias, gamma, state, normalize, scale=None):
    """``dsla_prefill`` (torch kernel) with the log-gates made from the same low-rank inputs."""
    g = _log_gates(xr, up, bias, qf.shape[2])
    return dsla_prefill(qf, kf, v, g, gamma, state=state, scale=scale, backend="torch", chunk=16, normalize=normalize)


def _lowest_block_decay(xr, up, bias, block: int = fused_dsla.BLOCK) -> float:
    """The strongest decay of any feature over any block of ``block`` tokens (log, <= 0)."""
    g = _log_gates(xr, up, bias)
    blocks = torch.nn.functional.pad(g, (0, 0, 0, 0, 0, 0, 0, -g.shape[1] % block))
    return blocks.unflatten(1, (-1, block)).sum(2).min().item()


def _fused(qf, kf, v, xr, up, bias, gamma, state, normalize, scale=None, block=fused_dsla.BLOCK):
    rank = xr.shape[-1]
    r = fused_dsla.padded_rank(rank)
    xs = torch.nn.functional.pad(xr, (0, r - rank))
    u, c = fused_dsla.gate_weights(up, bias, rank)
    with fused_decode.use_fused(True):
        return fused_dsla.dsla_prefill_fused(qf, kf, v, xs, u, c, gamma, state=state, scale=scale, normalize=normalize, block=block)


def _states_close(got: DslaState, want: DslaState, tol: float) -> None:
    for g, w in zip((got.history, got.recent), (want.history, want.recent)):
        torch.testing.assert_close(g, w.float(), atol=tol, rtol=tol)


# tokens before (the state the call continues), tokens in the call, gate rank, gate strength
CASES = [(0, 1, 16, 1.0), (0, 70, 16, 1.0), (0, 150, 8, 1.0), (40, 129, 16, 1.0), (0, 100, 16, 6.0), (30, 64, 16, 6.0)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"prior{c[0]}-t{c[1]}-r{c[2]}-s{c[3]:g}")
@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "raw"])
@torch.no_grad()
def test_fused_dsla_prefill_equals_the_torch_kernel(case, normalize):
    """Grouped heads, per-head gamma; calls of 1 token, of part of a block, of several blocks, and
    continuing a state; gates up to e^-20 per token (every exponent the kernels take stays <= 0)."""
    prior, t, rank, strength = case
    gen = torch.Generator().manual_seed(t + prior + rank)
    gamma = torch.rand(HQ, generator=gen).to(DEVICE)
    state = None
    if prior:
        _, state = _reference(*_inputs(2, prior, rank, gen, normalize, strength), gamma, None, normalize)
    args = _inputs(2, t, rank, gen, normalize, strength)
    want, want_state = _reference(*args, gamma, state, normalize)
    got, got_state = _fused(*args, gamma, state, normalize)
    assert got.shape == want.shape == (2, HQ, t, DV)
    strong = _lowest_block_decay(*args[3:]) < -FACTORED_DECAY_LIMIT
    assert strong == (strength > 1)  # the weak gates take the one-matmul blocks, the strong ones the sub-blocks
    # With decays of e^-7 per token the log decays summed within a block reach -450, whose float32
    # rounding (3e-5) is the relative error of the decays taken from them (the torch kernel sums
    # each pair's decay on its own).
    tol = 1e-4 if strong else 2e-5
    torch.testing.assert_close(got, want, atol=2e-5, rtol=tol)
    _states_close(got_state, want_state, tol)


@pytest.mark.parametrize("prior, t, strength", [(0, 150, 1.0), (40, 129, 6.0)])
@torch.no_grad()
def test_as_many_features_as_value_columns_equal_the_torch_kernel(prior, t, strength):
    """A rectangular Hedgehog map's features (d' = d: as many features as value columns, LoLCATs'
    8B size) take the same kernels and give the same outputs and states."""
    gen = torch.Generator().manual_seed(t + prior)
    gamma = torch.rand(HQ, generator=gen).to(DEVICE)
    state = None
    if prior:
        _, state = _reference(*_inputs(2, prior, 16, gen, True, strength, f=DV), gamma, None, True)
    args = _inputs(2, t, 16, gen, True, strength, f=DV)
    want, want_state = _reference(*args, gamma, state, True)
    got, got_state = _fused(*args, gamma, state, True)
    tol = 1e-4 if strength > 1 else 2e-5
    torch.testing.assert_close(got, want, atol=2e-5, rtol=tol)
    _states_close(got_state, want_state, tol)
    assert got_state.history.shape[2] == DV  # (B, Hq, F, ...): d' = DV features


@pytest.mark.parametrize("prior, t, block", [(0, 100, 64), (30, 150, 64), (0, 90, 32), (10, 140, 128)])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "raw"])
@torch.no_grad()
def test_blocks_that_decay_more_than_their_sub_blocks_hold_equal_the_torch_kernel(prior, t, block, normalize):
    """Gates near e^-1.2 per token: a block's decay passes e^-30, its sub-blocks' stay within it, so the
    output kernel factors each sub-block's weights at its last token (one matmul per sub-block)."""
    gen = torch.Generator().manual_seed(t + prior + block)
    gamma = torch.rand(HQ, generator=gen).to(DEVICE)
    state = None
    if prior:
        _, state = _reference(*_inputs(1, prior, 16, gen, normalize, 1.0, shift=17.0), gamma, None, normalize)
    args = _inputs(1, t, 16, gen, normalize, 1.0, shift=17.0)
    assert _lowest_block_decay(*args[3:], block=block) < -FACTORED_DECAY_LIMIT  # not the one-matmul blocks ...
    assert _lowest_block_decay(*args[3:], block=fused_dsla.SUB) > -FACTORED_DECAY_LIMIT  # ... nor the pairwise sub-blocks
    want, want_state = _reference(*args, gamma, state, normalize)
    got, got_state = _fused(*args, gamma, state, normalize, block=block)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    _states_close(got_state, want_state, 1e-4)


@pytest.mark.parametrize("prior, t, pad, strength, shift", [(0, 70, 58, 1.0, None), (40, 100, 28, 1.0, 17.0), (0, 1, 63, 6.0, None),
                                                        (30, 128, 64, 1.0, None)])  # fmt: skip
@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "raw"])
@torch.no_grad()
def test_a_call_padded_at_the_end_equals_the_call_without_the_padding(prior, t, pad, strength, shift, normalize):
    """``valid``: the tokens from valid[0] on are padding (random features, values and gates, as a
    padded chunk's would be): the outputs of the tokens before it and the final states equal the
    torch kernel's on those tokens alone, with weak, factored and pairwise blocks, from an empty and
    a continued state; the padding ends inside a block and on a block's edge."""
    gen = torch.Generator().manual_seed(t + pad + prior)
    gamma = torch.rand(HQ, generator=gen).to(DEVICE)
    state = None
    if prior:
        _, state = _reference(*_inputs(1, prior, 16, gen, normalize, strength, shift), gamma, None, normalize)
    args = _inputs(1, t + pad, 16, gen, normalize, strength, shift)
    real = [x[:, :t] for x in args[:4]] + args[4:]
    want, want_state = _reference(*real, gamma, state, normalize)
    rank = 16
    u, c = fused_dsla.gate_weights(args[4], args[5], rank)
    with fused_decode.use_fused(True):
        got, got_state = fused_dsla.dsla_prefill_fused(*args[:3], args[3], u, c, gamma, state=state, normalize=normalize,
                                                       valid=torch.tensor([t], device=DEVICE))  # fmt: skip
    unpadded, _ = _fused(*real, gamma, state, normalize)
    assert got.shape == (1, HQ, t + pad, DV)
    torch.testing.assert_close(got[:, :, :t], want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[:, :, :t], unpadded, atol=2e-6, rtol=2e-6)
    _states_close(got_state, want_state, 1e-4)
    with pytest.raises(ValueError, match="one-element integer tensor"):
        fused_dsla.dsla_prefill_fused(*args[:3], args[3], u, c, gamma, valid=torch.tensor([1.0, 2.0], device=DEVICE))


@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("strength", [1.0, 6.0], ids=["weak", "strong"])
@torch.no_grad()
def test_other_block_lengths_equal_the_torch_kernel(block, strength):
    """Blocks of 16 (one sub-block), 32 and 128 tokens (eight sub-blocks), continuing a state."""
    gen = torch.Generator().manual_seed(block)
    gamma = torch.rand(HQ, generator=gen).to(DEVICE)
    _, state = _reference(*_inputs(1, 20, 16, gen, True, strength), gamma, None, True)
    args = _inputs(1, 150, 16, gen, True, strength)
    want, want_state = _reference(*args, gamma, state, True)
    got, got_state = _fused(*args, gamma, state, True, block=block)
    tol = 1e-4 if strength > 1 else 2e-5
    torch.testing.assert_close(got, want, atol=2e-5, rtol=tol)
    _states_close(got_state, want_state, tol)


@pytest.mark.parametrize("strength", [1.0, 6.0], ids=["weak", "strong"])
@torch.no_grad()
def test_several_feature_and_value_tiles_equal_the_torch_kernel(strength):
    """F 64 and Dv 128: several feature tiles and (in Triton's interpreter, tiles of at most 32 x 64)
    several value tiles, so the cumulative log-gates the state kernel writes for the output kernel
    come from one value tile's programs, one feature tile each."""
    gen = torch.Generator().manual_seed(11)
    f, dv, hq, hkv, t = 64, 128, 2, 1, 140
    qf, kf = torch.randn(1, t, hq, f, generator=gen).softmax(-1), torch.randn(1, t, hq, f, generator=gen).softmax(-1)
    v = torch.randn(1, t, hkv, dv, generator=gen)
    xr = torch.randn(1, t, 2, 16, generator=gen)
    up = strength * torch.randn(2, hq * f, 16, generator=gen) / 4
    bias = torch.stack([torch.full((hq * f,), init_gate_bias(a)) for a in (0.999, 0.9)]) + torch.randn(2, hq * f, generator=gen)
    if strength > 1:
        bias[1] -= 20 * strength
    args = [x.to(DEVICE) for x in (qf, kf, v, xr, up, bias)]
    gamma = torch.rand(hq, generator=gen).to(DEVICE)
    want, want_state = _reference(*args, gamma, None, True)
    got, got_state = _fused(*args, gamma, None, True)
    tol = 1e-4 if strength > 1 else 2e-5
    torch.testing.assert_close(got, want, atol=2e-5, rtol=tol)
    _states_close(got_state, want_state, tol)


@torch.no_grad()
def test_fused_dsla_prefill_in_pieces_equals_one_call():
    """Three fused calls, each continuing the states the last one left, equal one torch call."""
    gen = torch.Generator().manual_seed(3)
    args = _inputs(1, 170, 16, gen, True, 1.0)
    gamma = torch.tensor(0.3, device=DEVICE)
    want, want_state = _reference(*args, gamma, None, True)
    state, outs = None, []
    for lo, hi in ((0, 50), (50, 64 + 50), (114, 170)):
        piece = [x[:, lo:hi] for x in args[:4]] + args[4:]
        o, state = _fused(*piece, gamma, state, True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), want, atol=2e-5, rtol=2e-5)
    _states_close(state, want_state, 2e-5)


@torch.no_grad()
def test_fused_dsla_prefill_names_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    qf, kf, v, xr, up, bias = _inputs(1, 8, 16, gen, True, 1.0)
    u, c = fused_dsla.gate_weights(up, bias, 16)
    with pytest.raises(ValueError, match="gate inputs"):
        fused_dsla.dsla_prefill_fused(qf, kf, v, xr[..., :8], u, c, torch.tensor(0.5))
    with pytest.raises(ValueError, match="powers of two"):
        fused_dsla.dsla_prefill_fused(qf[..., :24], kf[..., :24], v, xr, u[..., : HQ * 24], c[:, : HQ * 24], torch.tensor(0.5))
    with pytest.raises(ValueError, match="gamma"):
        fused_dsla.dsla_prefill_fused(qf, kf, v, xr, u, c, torch.rand(3))
    with pytest.raises(ValueError, match="share one dtype"):
        fused_dsla.dsla_prefill_fused(qf, kf.double(), v, xr, u, c, torch.tensor(0.5))
    with pytest.raises(ValueError, match="block must be one of"):
        fused_dsla.dsla_prefill_fused(qf, kf, v, xr, u, c, torch.tensor(0.5), block=48)


def test_padded_rank():
    assert [fused_dsla.padded_rank(r) for r in (1, 8, 16, 17, 32)] == [16, 16, 16, 32, 32]


@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "raw"])
@torch.no_grad()
def test_bfloat16_fused_dsla_prefill_is_close_to_float32(normalize):
    """bf16 features and values (states stored in bf16 before each block) against the float32
    torch kernel, on the GPU at a Llama head size (F 256, Dv 128; in Triton's interpreter, its
    bfloat16 mended by conftest, at F 64, Dv 32 over 4 blocks): within bf16 precision."""
    torch.manual_seed(5)
    b, hq, hkv, f, dv, t, rank = (2, 8, 2, 256, 128, 1000, 16) if DEVICE == "cuda" else (1, 2, 1, 64, 32, 230, 16)
    qf, kf = torch.randn(b, t, hq, f, device=DEVICE), torch.randn(b, t, hq, f, device=DEVICE)
    if normalize:
        qf, kf = qf.softmax(-1), kf.softmax(-1)
    v = torch.randn(b, t, hkv, dv, device=DEVICE)
    xr = torch.randn(b, t, 2, rank, device=DEVICE)
    up = torch.randn(2, hq * f, rank, device=DEVICE) / 4
    bias = torch.stack([torch.full((hq * f,), init_gate_bias(a), device=DEVICE) for a in (0.999, 0.9)])
    gamma = torch.rand(hq, device=DEVICE)
    qf, kf, v = (x.bfloat16() for x in (qf, kf, v))  # the reference takes the same (rounded) inputs
    want, want_state = _reference(qf.float(), kf.float(), v.float(), xr, up, bias, gamma, None, normalize)
    u, c = fused_dsla.gate_weights(up, bias, rank)
    got, got_state = fused_dsla.dsla_prefill_fused(qf, kf, v, xr, u, c, gamma, normalize=normalize)
    assert got.dtype == torch.bfloat16
    if normalize:  # a normalised read is a weighted mean of values: compare each element
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    else:
        # The raw read sums up to ~1000 decayed products of random sign: bf16 errors (states stored,
        # decayed keys) scale with the summands, so a read that cancels to a small norm has a large
        # relative error. Each row's error is taken against its head's mean row norm.
        err = (got.float() - want).norm(dim=-1)
        scale = want.norm(dim=-1).mean(dim=-1, keepdim=True)
        assert (err / scale).max() < 2e-2, (err / scale).max()
        assert (err / want.norm(dim=-1)).median() < 1e-2
    for g, w in zip((got_state.history, got_state.recent), (want_state.history, want_state.recent)):
        assert ((g - w).norm() / w.norm()) < 1e-2
