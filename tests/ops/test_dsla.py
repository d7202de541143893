"""DSLA: the chunked torch backend and fla's kernels against the float32 loop reference."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import linearize.ops.dsla as dsla_ops
from linearize.ops.common import repeat_kv
from linearize.ops.dsla import (
    GATE_NORMALISER,
    dsla_attention,
    dsla_attention_reference,
    dsla_prefill,
    gate_half_life,
    gla_reference,
    init_gate_bias,
    log_gate,
)
from linearize.ops.states import DslaState

NAMES = ("q", "k", "v", "g1", "g2", "gamma", "history", "recent")


@dataclass(frozen=True)
class Case:
    b: int
    t: int
    hq: int
    dk: int
    hkv: int | None = None  # None: no GQA
    dv: int | None = None  # None: Dk
    chunk: int = 32

    @property
    def id(self) -> str:
        parts = [f"B{self.b}", f"T{self.t}", f"H{self.hq}"]
        parts += [f"KV{self.hkv}"] if self.hkv else []
        parts += [f"D{self.dk}"] + ([f"Dv{self.dv}"] if self.dv else []) + [f"C{self.chunk}"]
        return "-".join(parts)


def make_inputs(c: Case, dtype=torch.float32, device="cpu", seed=0) -> dict[str, torch.Tensor]:
    """Random inputs: a slow (history) and a strong (recent) gate, gamma, and a non-zero initial state."""
    gen = torch.Generator().manual_seed(seed)
    hkv, dv = c.hkv or c.hq, c.dv or c.dk

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {
        "q": randn(c.b, c.hq, c.t, c.dk),
        "k": randn(c.b, hkv, c.t, c.dk),
        "v": randn(c.b, hkv, c.t, dv),
        "g1": F.logsigmoid(randn(c.b, c.hq, c.t, c.dk) + 4) / GATE_NORMALISER,  # alpha ~ 0.999
        "g2": F.logsigmoid(randn(c.b, c.hq, c.t, c.dk)),  # alpha ~ 0.5: decays hard within a chunk
        "gamma": torch.tensor(0.3, dtype=torch.float64),
        "history": randn(c.b, c.hq, c.dk, dv),
        "recent": randn(c.b, c.hq, c.dk, dv),
    }
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}


def left_padded(x: dict[str, torch.Tensor], pad: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Row 0 gets ``pad`` NaN tokens on the left (row 1 loses its first ``pad`` tokens to padding)."""
    t = x["q"].shape[2]
    valid = torch.ones(x["q"].shape[0], t, dtype=torch.bool)
    valid[:, :pad] = False
    out = dict(x)
    for n in ("q", "k", "v", "g1", "g2"):
        shifted = torch.cat([torch.full_like(x[n][:1, :, :pad], float("nan")), x[n][:1, :, : t - pad]], dim=2)
        out[n] = torch.cat([shifted, x[n][1:]], dim=0)
        out[n][1:, :, :pad] = float("nan")
    return out, valid


def run(fn, x: dict[str, torch.Tensor], *, seed=1, **kwargs):
    """Forward + backward of a random linear loss on the output and both final states."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    state = DslaState(history=leaves["history"], recent=leaves["recent"])
    o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g1"], leaves["g2"], leaves["gamma"], state=state, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device) for t in (o, s.history, s.recent)]
    loss = sum((t.double() * c).sum() for t, c in zip((o, s.history, s.recent), cot))  # same cotangents for every dtype
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o.detach(), s.history.detach(), s.recent.detach(), dict(zip(NAMES, grads))


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float) -> None:
    err = (ref.double() - out.double()).abs().max().item()
    assert torch.allclose(out.double(), ref.double(), atol=atol, rtol=rtol), f"{name}: max abs error {err:.3e}"


def assert_same_run(ref, out, atol: float, rtol: float) -> None:
    for name, r, o in zip(("o", "history", "recent"), ref[:3], out[:3]):
        assert_close(name, r, o, atol, rtol)
    for name in NAMES:
        assert_close(f"d{name}", ref[3][name], out[3][name], atol, rtol)


CASES = [
    Case(b=1, t=1, hq=2, dk=8),
    Case(b=2, t=37, hq=4, dk=16, chunk=16),
    Case(b=2, t=64, hq=4, dk=16),
    Case(b=1, t=50, hq=4, dk=16, hkv=2, dv=8, chunk=8),
    Case(b=2, t=45, hq=6, dk=8, hkv=3, dv=12),
]
TOL = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-10, 1e-10)}


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chunked_matches_reference(case: Case, dtype: torch.dtype, padded: bool) -> None:
    """Outputs, both final states and the gradients of every input (q, k, v, both gates, gamma,
    both initial states); ``padded``: NaN-filled left padding in every row."""
    x, valid = make_inputs(case, dtype), None
    if padded:
        x, valid = left_padded(x, pad=case.t // 4)
    ref = run(dsla_attention_reference, x, valid=valid)
    out = run(dsla_attention, x, chunk=case.chunk, valid=valid)
    assert out[0].dtype == dtype and out[1].dtype == dtype
    assert_same_run(ref, out, *TOL[dtype])


@pytest.mark.parametrize("log_alpha", [-20.0, -200.0], ids=lambda a: f"logalpha{a:g}")
def test_strong_decay_is_finite_and_exact(log_alpha: float) -> None:
    case = Case(b=2, t=70, hq=2, dk=8)
    x = make_inputs(case)
    strong = torch.rand(x["g2"].shape, generator=torch.Generator().manual_seed(3)) < 0.5
    x["g2"] = torch.where(strong, torch.full_like(x["g2"], log_alpha), x["g2"])  # mixed: exp(b) would overflow
    x["g1"] = torch.full_like(x["g1"], log_alpha)
    ref = run(dsla_attention_reference, x)
    out = run(dsla_attention, x)
    for t in (*out[:3], *out[3].values()):
        assert torch.isfinite(t).all()
    assert_same_run(ref, out, 1e-4, 1e-4)


@pytest.mark.parametrize("fn", [dsla_attention_reference, dsla_attention], ids=["reference", "torch"])
@pytest.mark.parametrize("gamma", [1.0, 0.0], ids=["gamma1-history", "gamma0-recent"])
def test_gamma_extremes_reduce_to_single_state_gla(fn, gamma: float) -> None:
    x = make_inputs(Case(b=2, t=40, hq=4, dk=8, hkv=2))
    o, _ = fn(x["q"], x["k"], x["v"], x["g1"], x["g2"], torch.tensor(gamma))
    gate = x["g1"] if gamma == 1.0 else x["g2"]
    o_gla, _ = gla_reference(x["q"], x["k"], x["v"], gate)
    assert_close("o", o_gla, o, 1e-5, 1e-5)


def test_per_head_gamma() -> None:
    x = make_inputs(Case(b=1, t=20, hq=4, dk=8))
    gamma = torch.tensor([0.0, 0.25, 0.5, 1.0])
    o, _ = dsla_attention(x["q"], x["k"], x["v"], x["g1"], x["g2"], gamma)
    for h, gh in enumerate(gamma):
        o_h, _ = dsla_attention_reference(x["q"], x["k"], x["v"], x["g1"], x["g2"], gh)
        assert_close(f"o[head {h}]", o_h[:, h], o[:, h], 1e-5, 1e-5)


def test_gqa_equals_repeated_kv() -> None:
    x = make_inputs(Case(b=2, t=33, hq=6, dk=8, hkv=2))
    o, s = dsla_attention(x["q"], x["k"], x["v"], x["g1"], x["g2"], x["gamma"])
    k, v = repeat_kv(x["k"], 3), repeat_kv(x["v"], 3)
    o_rep, s_rep = dsla_attention(x["q"], k, v, x["g1"], x["g2"], x["gamma"])
    assert_close("o", o_rep, o, 1e-6, 1e-6)
    assert_close("history", s_rep.history, s.history, 1e-6, 1e-6)


@pytest.mark.parametrize("fn", [dsla_attention_reference, dsla_attention], ids=["reference", "torch"])
def test_left_padding_equals_row_alone(fn) -> None:
    case, pad = Case(b=2, t=41, hq=4, dk=8, hkv=2), 7
    x = make_inputs(case)
    xp, valid = left_padded(x, pad)
    o, s, _, grads = run(fn, xp, valid=valid)
    alone = {n: x[n][:1] for n in ("history", "recent")} | {"gamma": x["gamma"]}
    alone |= {n: x[n][:1, :, : case.t - pad] for n in ("q", "k", "v", "g1", "g2")}
    o_alone, s_alone, _, _ = run(fn, alone)
    assert_close("o", o_alone[0], o[0, :, pad:], 1e-5, 1e-5)
    assert_close("history", s_alone[0], s[0], 1e-5, 1e-5)
    assert (o[:, :, :pad] == 0).all(), "outputs at padding must be zeros"
    for name, g in grads.items():
        assert torch.isfinite(g).all(), f"NaN at padding leaked into d{name}"


@pytest.mark.parametrize("fn", [dsla_attention_reference, partial(dsla_attention, chunk=8)], ids=["reference", "torch"])
def test_prefill_in_pieces_then_decode_equals_one_call(fn) -> None:
    case = Case(b=2, t=30, hq=4, dk=8, hkv=2, dv=4)
    x, valid = left_padded(make_inputs(case), pad=5)
    args = (x["q"], x["k"], x["v"], x["g1"], x["g2"])
    o_full, s_full = fn(*args, x["gamma"], valid=valid)
    state, pieces = None, []
    for lo, hi in [(0, 3), (3, 20), *((i, i + 1) for i in range(20, case.t))]:
        o, state = fn(*(a[:, :, lo:hi] for a in args), x["gamma"], valid=valid[:, lo:hi], state=state)
        pieces.append(o)
    assert_close("o", o_full, torch.cat(pieces, dim=2), 1e-5, 1e-5)
    assert_close("history", s_full.history, state.history, 1e-5, 1e-5)
    assert_close("recent", s_full.recent, state.recent, 1e-5, 1e-5)


@pytest.mark.parametrize("alpha, z", [(0.999, 4.127), (0.9, -1.481), (0.5, -11.090)], ids=["a0.999", "a0.9", "a0.5"])
def test_init_gate_bias(alpha: float, z: float) -> None:
    bias = init_gate_bias(alpha)
    assert bias == pytest.approx(z, abs=1e-3)
    log_alpha = F.logsigmoid(torch.tensor(bias, dtype=torch.float64)).item() / GATE_NORMALISER
    assert math.exp(log_alpha) == pytest.approx(alpha, rel=1e-12)


def test_gate_half_life() -> None:
    assert gate_half_life(0.999) == pytest.approx(692.8, abs=0.1)
    assert gate_half_life(0.9) == pytest.approx(6.58, abs=0.01)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 1.5], ids=lambda a: f"a{a}")
def test_gate_helpers_reject_alpha_outside_open_unit_interval(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        init_gate_bias(alpha)
    with pytest.raises(ValueError, match="alpha"):
        gate_half_life(alpha)


def test_bad_arguments_raise() -> None:
    x = make_inputs(Case(b=1, t=4, hq=2, dk=8))
    args = (x["q"], x["k"], x["v"], x["g1"], x["g2"], x["gamma"])
    with pytest.raises(ValueError, match=r"'torch', 'fla'"):
        dsla_attention(*args, backend="triton")
    with pytest.raises(ValueError, match="log_alpha_recent"):
        dsla_attention(*args[:4], x["g2"][..., :4], x["gamma"])
    with pytest.raises(ValueError, match="gamma"):
        dsla_attention(*args[:5], torch.ones(3))


def test_fla_backend_without_fla_raises_runtime_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "fla.ops.gla", None)  # import fails whether or not fla is installed
    x = make_inputs(Case(b=1, t=4, hq=2, dk=8))
    with pytest.raises(RuntimeError, match="flash-linear-attention"):
        dsla_attention(x["q"], x["k"], x["v"], x["g1"], x["g2"], x["gamma"], backend="fla")


# --- GPU: fla's kernels against the reference ---------------------------------------------------

GPU_CASES = [
    Case(b=2, t=1, hq=4, dk=64, hkv=2),  # decode: fused_recurrent_gla
    Case(b=2, t=37, hq=4, dk=64, hkv=2, dv=32),  # short prefill: fused_recurrent_gla
    Case(b=2, t=300, hq=4, dk=64, hkv=2),  # prefill: chunk_gla
]
# relative RMS error (fla's own test metric): rms(out - ref) / rms(ref)
GPU_TOL = {torch.float32: 1e-2, torch.bfloat16: 2e-2}  # fla's float32 chunk_gla uses tf32 dots: ~1e-3


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla (fla-core) is not installed")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a CUDA GPU")
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_fla_matches_reference(case: Case, dtype: torch.dtype, padded: bool) -> None:
    x = make_inputs(case, device="cuda")
    for n in ("q", "k", "v"):
        x[n] = x[n].to(dtype)
    valid = None
    if padded:
        valid = torch.ones(case.b, case.t, dtype=torch.bool, device="cuda")
        valid[0, : case.t // 3] = False
    ref = run(dsla_attention_reference, {n: t.float() for n, t in x.items()}, valid=valid)
    out = run(dsla_attention, x, valid=valid, backend="fla")
    assert out[0].dtype == dtype and out[1].dtype == torch.float32
    tol = GPU_TOL[dtype]
    pairs = list(zip(("o", "history", "recent"), ref[:3], out[:3]))
    pairs += [(f"d{n}", ref[3][n], out[3][n]) for n in NAMES]
    for name, r, o in pairs:
        diff = o.float() - r.float()
        ratio = (diff.pow(2).mean().sqrt() / r.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()
        assert ratio <= tol, f"{name}: relative rms error {ratio:.2e} > {tol:.0e}, max abs error {diff.abs().max().item():.3e}"


def normalized_inputs(c: Case, dtype=torch.float32, device="cpu", seed=0) -> dict[str, torch.Tensor]:
    """Inputs of the normalised form: non-negative q and k (a feature map's output) and states with a
    normaliser column (positive, as a real prefix leaves it)."""
    x = make_inputs(c, torch.float64, seed=seed)
    x["q"], x["k"] = F.softplus(x["q"]), F.softplus(x["k"])
    for n in ("history", "recent"):
        x[n] = torch.cat([x[n], x[n][..., :1].abs() + 1.0], dim=-1)
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_normalized_chunked_matches_reference(case: Case, dtype: torch.dtype, padded: bool) -> None:
    x, valid = normalized_inputs(case, dtype), None
    if padded:
        x, valid = left_padded(x, pad=case.t // 4)
    ref = run(partial(dsla_attention_reference, normalize=True), x, valid=valid)
    out = run(partial(dsla_attention, normalize=True, chunk=case.chunk), x, valid=valid)
    dv = (case.dv or case.dk)
    assert out[0].shape[-1] == dv and out[1].shape[-1] == dv + 1
    assert_same_run(ref, out, *TOL[dtype])


def test_normalized_read_is_a_convex_combination_of_values() -> None:
    """With gates of 1 (no decay) and no initial state, each state's read is normalised linear
    attention: a weighted mean of the values so far, so it stays within their range."""
    case = Case(b=1, t=20, hq=2, dk=8)
    x = normalized_inputs(case)
    zeros = torch.zeros_like(x["g1"])
    o, _ = dsla_attention(x["q"], x["k"], x["v"], zeros, zeros, x["gamma"], normalize=True)
    kv = (x["k"] @ x["q"].transpose(-1, -2)).transpose(-1, -2).tril()  # (B, H, T, T): q_t . k_s for s <= t
    expected = (kv / kv.sum(-1, keepdim=True)) @ x["v"]
    assert_close("o", expected, o, 1e-5, 1e-5)


@pytest.mark.parametrize("fn", [dsla_attention_reference, partial(dsla_attention, chunk=8)], ids=["reference", "torch"])
def test_normalized_prefill_in_pieces_then_decode_equals_one_call(fn) -> None:
    case = Case(b=2, t=30, hq=4, dk=8, hkv=2, dv=4)
    x = normalized_inputs(case)
    valid = torch.ones(case.b, case.t, dtype=torch.bool)
    valid[0, :5] = False
    args = (x["q"], x["k"], x["v"], x["g1"], x["g2"])
    o_full, s_full = fn(*args, x["gamma"], valid=valid, normalize=True)
    state, pieces = None, []
    for lo, hi in [(0, 3), (3, 20), *((i, i + 1) for i in range(20, case.t))]:
        o, state = fn(*(a[:, :, lo:hi] for a in args), x["gamma"], valid=valid[:, lo:hi], state=state, normalize=True)
        pieces.append(o)
    assert_close("o", o_full[1:], torch.cat(pieces, dim=2)[1:], 1e-5, 1e-5)
    assert_close("o", o_full[0, :, 5:], torch.cat(pieces, dim=2)[0, :, 5:], 1e-5, 1e-5)
    assert_close("history", s_full.history, state.history, 1e-5, 1e-5)
    assert_close("recent", s_full.recent, state.recent, 1e-5, 1e-5)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla (fla-core) is not installed")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_normalized_fla_matches_reference(case: Case, dtype: torch.dtype) -> None:
    x = normalized_inputs(case, device="cuda")
    for n in ("q", "k", "v"):
        x[n] = x[n].to(dtype)
    ref = run(partial(dsla_attention_reference, normalize=True), {n: t.float() for n, t in x.items()})
    out = run(partial(dsla_attention, normalize=True, backend="fla"), x)
    for name, r, o in zip(("o", "history", "recent"), ref[:3], out[:3]):
        diff = o.float() - r.float()
        ratio = (diff.pow(2).mean().sqrt() / r.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()
        assert ratio <= GPU_TOL[dtype], f"{name}: relative rms error {ratio:.2e}"


# --- the reference against a brute force on python floats -------------------------------------------
def brute_force_dsla(x: dict[str, torch.Tensor], valid: torch.Tensor, normalize: bool):
    """The unrolled closed form with explicit loops on python floats: for each state,
    S_t = S_0 prod_{j<=t} alpha_j + sum_{i<=t} k_i v_i^T prod_{i<j<=t} alpha_j (per key dimension,
    over real tokens only), read o = scale q_t^T S_t (divided by its normaliser column with
    ``normalize``), then mixed by gamma per head."""
    b_size, hq, t_len, dk = x["q"].shape
    hkv, dv = x["k"].shape[1], x["v"].shape[-1]
    width = dv + 1 if normalize else dv
    q, k, v, g1, g2, s1, s2 = (x[n].tolist() for n in ("q", "k", "v", "g1", "g2", "history", "recent"))
    gamma = x["gamma"].expand(hq).tolist()
    valid = valid.tolist()
    out = [[[[0.0] * dv for _ in range(t_len)] for _ in range(hq)] for _ in range(b_size)]
    finals = {}
    for b in range(b_size):
        real = [t for t in range(t_len) if valid[b][t]]
        for h in range(hq):
            kh = h // (hq // hkv)
            for p, t in enumerate(real + [None]):  # None: the final state after the last real token
                upto = real[: p + 1] if t is not None else real
                vals = {i: v[b][kh][i] + [1.0] for i in upto}  # v and, for the normaliser column, 1
                reads = []
                for name, gates, s0 in (("history", g1, s1), ("recent", g2, s2)):
                    # log of the product of alpha[d] over the real tokens after i (-1: all) up to t
                    log_decay = {(i, d): sum(gates[b][h][j][d] for j in upto if j > i) for i in [-1, *upto] for d in range(dk)}
                    s = [[s0[b][h][d][e] * math.exp(log_decay[-1, d])
                          + sum(k[b][kh][i][d] * vals[i][e] * math.exp(log_decay[i, d]) for i in upto)
                          for e in range(width)] for d in range(dk)]
                    if t is None:
                        finals.setdefault(name, {})[(b, h)] = s
                        continue
                    r = [sum(q[b][h][t][d] * s[d][e] for d in range(dk)) / math.sqrt(dk) for e in range(width)]
                    if normalize:
                        r = [y / r[dv] if r[dv] > 1e-12 else 0.0 for y in r[:dv]]
                    reads.append(r)
                if t is not None:
                    out[b][h][t] = [gamma[h] * y1 + (1 - gamma[h]) * y2 for y1, y2 in zip(*reads)]
    states = {n: torch.tensor([[finals[n][(b, h)] for h in range(hq)] for b in range(b_size)], dtype=torch.float64)
              for n in ("history", "recent")}
    return torch.tensor(out, dtype=torch.float64), states


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_reference_equals_brute_force(normalize: bool) -> None:
    case = Case(b=2, t=6, hq=4, dk=2, hkv=2, dv=3)
    x = normalized_inputs(case, torch.float64) if normalize else make_inputs(case, torch.float64)
    x["gamma"] = torch.tensor([0.0, 0.3, 0.6, 1.0], dtype=torch.float64)
    valid = torch.tensor([[True] * 6, [False, False, True, False, True, True]])  # left padding, a hole
    o, s = dsla_attention_reference(x["q"], x["k"], x["v"], x["g1"], x["g2"], x["gamma"], valid=valid,
                                    state=DslaState(history=x["history"], recent=x["recent"]), normalize=normalize)
    want_o, want_s = brute_force_dsla(x, valid, normalize)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(s.history, want_s["history"])
    torch.testing.assert_close(s.recent, want_s["recent"])
    assert (o[1, :, [0, 1, 3]] == 0).all()


def test_log_gate_uses_the_gate_normaliser() -> None:
    z = torch.tensor([-3.0, 0.0, 4.127], dtype=torch.bfloat16)
    g = log_gate(z)
    assert g.dtype == torch.float32 and (g <= 0).all()
    torch.testing.assert_close(g, F.logsigmoid(z.float()) / GATE_NORMALISER)
    assert GATE_NORMALISER == 16.0
    assert math.exp(log_gate(torch.tensor(init_gate_bias(0.9), dtype=torch.float64)).item()) == pytest.approx(0.9, rel=1e-12)


def _token_major(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q, k (repeated to every query head), v and the gates of ``x`` laid out token-major (B, T, H, D)."""
    n_rep = x["q"].shape[1] // x["k"].shape[1]
    out = {n: x[n].transpose(1, 2).contiguous() for n in ("q", "v")}
    out["k"] = repeat_kv(x["k"], n_rep).transpose(1, 2).contiguous()
    out["g"] = torch.stack((x["g1"], x["g2"]), dim=2).transpose(1, 3).contiguous()  # (B, T, 2, Hq, Dk), history first
    return out


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalised"])
@pytest.mark.parametrize("case", [Case(b=2, t=45, hq=4, dk=8, hkv=2, dv=6, chunk=16), Case(b=1, t=70, hq=2, dk=8)], ids=lambda c: c.id)
@torch.no_grad()
def test_token_major_prefill_equals_dsla_attention(case: Case, normalize: bool) -> None:
    """``dsla_prefill`` on token-major tensors (the values repeated to the query heads and given
    their ones column inside): the output and both states of ``dsla_attention`` on the (B, H, T, D)
    views, from a non-zero state."""
    x = (normalized_inputs if normalize else make_inputs)(case)
    state = DslaState(history=x["history"], recent=x["recent"])
    want = dsla_attention(x["q"], x["k"], x["v"], x["g1"], x["g2"], x["gamma"], state=state, normalize=normalize, chunk=case.chunk)
    tm = _token_major(x)
    got = dsla_prefill(tm["q"], tm["k"], tm["v"], tm["g"], x["gamma"], state=state, normalize=normalize, chunk=case.chunk,
                       backend="torch")  # fmt: skip
    for g, w in zip((got[0], got[1].history, got[1].recent), (want[0], want[1].history, want[1].recent)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalised"])
@torch.no_grad()
def test_token_major_prefill_runs_both_states_in_one_gla_call(monkeypatch, normalize: bool) -> None:
    """The two states are 2 Hq heads of one GLA call (one kernel sequence on fla), from an empty
    state, with a gamma per query head: still ``dsla_attention``'s output and states."""
    case = Case(b=3, t=21, hq=4, dk=8, hkv=2, dv=6, chunk=8)
    x = (normalized_inputs if normalize else make_inputs)(case)
    gamma = torch.tensor([0.0, 0.3, 0.7, 1.0])
    want = dsla_attention(x["q"], x["k"], x["v"], x["g1"], x["g2"], gamma, normalize=normalize, chunk=case.chunk)
    calls = []
    gla = dsla_ops.BACKENDS["torch"]
    monkeypatch.setitem(dsla_ops.BACKENDS, "torch", lambda q, *a: calls.append(q.shape) or gla(q, *a))
    tm = _token_major(x)
    got = dsla_prefill(tm["q"], tm["k"], tm["v"], tm["g"], gamma, normalize=normalize, chunk=case.chunk, backend="torch")
    assert calls == [(3, 8, 21, 8)]  # one call over (B, 2 Hq, T, Dk)
    for g, w in zip((got[0], got[1].history, got[1].recent), (want[0], want[1].history, want[1].recent)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert got[1].history.is_contiguous() and got[1].recent.is_contiguous()


def test_token_major_prefill_names_bad_shapes() -> None:
    tm = _token_major(make_inputs(Case(b=1, t=5, hq=4, dk=8, hkv=2)))
    with pytest.raises(ValueError, match="log_alphas has shape"):
        dsla_prefill(tm["q"], tm["k"], tm["v"], tm["g"][:, :4], torch.tensor(0.5), backend="torch")
    with pytest.raises(ValueError, match="unknown DSLA backend 'cuda'"):
        dsla_prefill(tm["q"], tm["k"], tm["v"], tm["g"], torch.tensor(0.5), backend="cuda")


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla (fla-core) is not installed")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a CUDA GPU")
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalised"])
@torch.no_grad()
def test_token_major_prefill_on_fla_in_bfloat16(normalize: bool) -> None:
    """On the GPU in bf16 with fla: the same numbers as ``dsla_attention`` on the views (fla both)."""
    case = Case(b=2, t=300, hq=4, dk=64, hkv=2)
    x = {n: t.cuda() for n, t in (normalized_inputs if normalize else make_inputs)(case).items()}
    for n in ("q", "k", "v"):
        x[n] = x[n].bfloat16()
    state = DslaState(history=x["history"], recent=x["recent"])
    want = dsla_attention(x["q"], x["k"], x["v"], x["g1"], x["g2"], x["gamma"], state=state, normalize=normalize, backend="fla")
    tm = _token_major(x)
    got = dsla_prefill(tm["q"], tm["k"], tm["v"], tm["g"], x["gamma"], state=state, normalize=normalize, backend="fla")
    assert got[0].transpose(1, 2).is_contiguous()  # fla's outputs are token-major, and so is their mix
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1].history, want[1].history, atol=2e-2, rtol=2e-2)
