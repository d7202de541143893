import importlib.util

import pytest
import torch

from linearize.ops.linear_attn import linear_attention, linear_attention_numden, linear_attention_reference
from linearize.ops.states import LinearState

HAS_FLA = importlib.util.find_spec("fla") is not None
needs_fla_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_FLA), reason="backend 'fla' needs CUDA and flash-linear-attention"
)

# (B, T, H, F, Dv, chunk)
CASES = [(2, 37, 4, 8, 16, 8), (1, 64, 2, 6, 4, 64), (2, 5, 3, 4, 3, 16), (1, 9, 1, 3, 2, 1)]


def case_id(c):
    return "B{}-T{}-H{}-F{}-Dv{}-C{}".format(*c)


def make_inputs(b, t, h, f, dv, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, t, f, generator=g, dtype=dtype).to(device)
    k = torch.rand(b, h, t, f, generator=g, dtype=dtype).to(device)
    v = torch.randn(b, h, t, dv, generator=g, dtype=dtype).to(device)
    return q, k, v


def random_state(b, h, f, dv, dtype=torch.float64, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return LinearState(
        kv=torch.randn(b, h, f, dv, generator=g, dtype=dtype).to(device),
        k_sum=(torch.rand(b, h, f, generator=g, dtype=dtype) * 3).to(device),
    )


def assert_states_close(a: LinearState, b: LinearState, **tol):
    torch.testing.assert_close(a.kv, b.kv, **tol)
    torch.testing.assert_close(a.k_sum, b.k_sum, **tol)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "state"])
def test_torch_matches_reference(case, with_state):
    b, t, h, f, dv, chunk = case
    q, k, v = make_inputs(b, t, h, f, dv)
    state = random_state(b, h, f, dv) if with_state else None
    ref, ref_state = linear_attention_reference(q, k, v, state)
    out, out_state = linear_attention(q, k, v, state, chunk=chunk)
    torch.testing.assert_close(out, ref)
    assert_states_close(out_state, ref_state)


@pytest.mark.parametrize("case", CASES[:2], ids=case_id)
def test_float32(case):
    b, t, h, f, dv, chunk = case
    q, k, v = make_inputs(b, t, h, f, dv, dtype=torch.float32)
    ref, ref_state = linear_attention_reference(q, k, v)
    out, out_state = linear_attention(q, k, v, chunk=chunk)
    assert out.dtype == torch.float32 and out_state.kv.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_states_close(out_state, ref_state, rtol=1e-5, atol=1e-5)


def test_bfloat16_output_dtype_and_float32_state():
    q, k, v = make_inputs(1, 10, 2, 4, 3, dtype=torch.bfloat16)
    out, state = linear_attention(q, k, v, chunk=4)
    assert out.dtype == torch.bfloat16
    assert state.kv.dtype == torch.float32 and state.k_sum.dtype == torch.float32


@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_gradients_match_reference(case):
    b, t, h, f, dv, chunk = case
    q, k, v = (x.requires_grad_() for x in make_inputs(b, t, h, f, dv))
    s = random_state(b, h, f, dv)
    kv0, z0 = s.kv.requires_grad_(), s.k_sum.requires_grad_()
    w = torch.randn(b, h, t, dv, dtype=torch.float64)
    inputs = (q, k, v, kv0, z0)

    def grads(fn):
        out, st = fn(q, k, v, LinearState(kv0, z0))
        loss = (out * w).sum() + st.kv.sum() + st.k_sum.square().sum()
        return torch.autograd.grad(loss, inputs)

    ref = grads(linear_attention_reference)
    got = grads(lambda *a: linear_attention(*a, chunk=chunk))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)


def test_numden_parts():
    q, k, v = make_inputs(2, 13, 2, 5, 3)
    num, den, _ = linear_attention_numden(q, k, v, chunk=4)
    kv = torch.einsum("bhtf,bhtd->bhtfd", k, v).cumsum(dim=2)  # (B, H, T, F, Dv)
    z = k.cumsum(dim=2)  # (B, H, T, F)
    torch.testing.assert_close(num, torch.einsum("bhtf,bhtfd->bhtd", q, kv))
    torch.testing.assert_close(den, (q * z).sum(-1))


@pytest.mark.parametrize("split", [1, 6, 12], ids=lambda s: f"split{s}")
def test_state_continuation(split):
    q, k, v = make_inputs(2, 13, 2, 5, 3)
    full, full_state = linear_attention(q, k, v, chunk=4)
    a, sa = linear_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], chunk=4)
    b, sb = linear_attention(q[:, :, split:], k[:, :, split:], v[:, :, split:], sa, chunk=4)
    torch.testing.assert_close(torch.cat([a, b], dim=2), full)
    assert_states_close(sb, full_state)


def test_zero_denominator_gives_zero():
    q, k, v = make_inputs(1, 6, 1, 3, 2)
    k[:, :, :3] = 0  # e.g. padding keys zeroed by the caller: nothing to attend to yet
    out, _ = linear_attention(q, k, v, chunk=2)
    ref, _ = linear_attention_reference(q, k, v)
    assert torch.all(out[:, :, :3] == 0)
    torch.testing.assert_close(out, ref)


def test_bad_backend():
    q, k, v = make_inputs(1, 4, 1, 2, 2)
    with pytest.raises(ValueError, match="valid"):
        linear_attention(q, k, v, backend="triton")


@pytest.mark.skipif(HAS_FLA, reason="fla is installed here")
def test_fla_missing_is_clear():
    q, k, v = make_inputs(1, 4, 1, 2, 2)
    with pytest.raises(RuntimeError, match="torch"):
        linear_attention(q, k, v, backend="fla")


# ---------------------------------------------------------------- GPU: fla vs reference


# fla autotunes and compiles each new kernel variant on first use (tens of seconds each on the GPU
# machine), so the GPU cases share F = 16 and Dv = 16.
@needs_fla_gpu
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "state"])
@pytest.mark.parametrize(
    "case", [(2, 200, 4, 16, 16), (1, 77, 2, 16, 16), (2, 1, 2, 16, 16)], ids=lambda c: "B{}-T{}-H{}-F{}-Dv{}".format(*c)
)
def test_fla_matches_reference(case, with_state):
    b, t, h, f, dv = case
    q, k, v = make_inputs(b, t, h, f, dv, dtype=torch.float32, device="cuda")
    q, k = q / f, k / f  # keep sums O(t)
    state = random_state(b, h, f, dv, dtype=torch.float32, device="cuda") if with_state else None
    leaves = [q, k, v] + ([state.kv, state.k_sum] if with_state else [])
    for x in leaves:
        x.requires_grad_()
    w = torch.randn(b, h, t, dv, device="cuda")

    def run(fn):
        out, st = fn(q, k, v, state)
        loss = (out * w).sum() + st.kv.sum() + st.k_sum.sum()
        return out, st, torch.autograd.grad(loss, leaves)

    ref_out, ref_state, ref_grads = run(linear_attention_reference)
    out, st, grads = run(lambda *a: linear_attention(*a, backend="fla"))
    errors = {
        "out": (out - ref_out).abs().max().item(),
        "state_kv": (st.kv - ref_state.kv).abs().max().item(),
        "state_z": (st.k_sum - ref_state.k_sum).abs().max().item(),
    }
    errors.update({f"grad{i}": (g - r).abs().max().item() for i, (g, r) in enumerate(zip(grads, ref_grads))})
    print(f"fla vs reference max abs error {case} state={with_state}: {errors}")
    tol = {"rtol": 2e-2, "atol": 2e-2}  # fla's fp32 path may use TF32 dots
    torch.testing.assert_close(out, ref_out, **tol)
    assert_states_close(st, ref_state, **tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol)


@needs_fla_gpu
def test_fla_bfloat16_close_to_reference():
    q, k, v = make_inputs(2, 300, 4, 16, 16, dtype=torch.float32, device="cuda")
    ref, ref_state = linear_attention_reference(q, k, v)
    out, st = linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend="fla")
    print(f"fla bf16 vs float32 reference max abs error: out {(out.float() - ref).abs().max().item():.3e}")
    assert out.dtype == torch.bfloat16 and st.kv.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2)
    assert_states_close(st, ref_state, rtol=2e-2, atol=1.0)


def brute_force_linear(q, k, v, state):
    """Python floats, explicit sums over the keys up to t (no recurrence): the definition."""
    b_size, h_size, t_len, f = q.shape
    dv = v.shape[-1]
    q, k, v, s0, z0 = q.tolist(), k.tolist(), v.tolist(), state.kv.tolist(), state.k_sum.tolist()
    out = []
    for b in range(b_size):
        heads = []
        for h in range(h_size):
            rows = []
            for t in range(t_len):
                num = [sum(q[b][h][t][i] * s0[b][h][i][c] for i in range(f)) for c in range(dv)]
                den = sum(q[b][h][t][i] * z0[b][h][i] for i in range(f))
                for j in range(t + 1):
                    a = sum(q[b][h][t][i] * k[b][h][j][i] for i in range(f))
                    num = [num[c] + a * v[b][h][j][c] for c in range(dv)]
                    den += a
                rows.append([x / den if den > 1e-12 else 0.0 for x in num])
            heads.append(rows)
        out.append(heads)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "state"])
def test_reference_equals_brute_force(with_state):
    q, k, v = make_inputs(2, 6, 2, 3, 2, seed=7)
    k[0, :, :2] = 0  # nothing to attend to yet in row 0: the output is 0 there (without a state)
    state = random_state(2, 2, 3, 2, seed=8) if with_state else LinearState.zeros(2, 2, 3, 2, dtype=torch.float64)
    ref, ref_state = linear_attention_reference(q, k, v, state)
    torch.testing.assert_close(ref, brute_force_linear(q, k, v, state))
    torch.testing.assert_close(ref_state.kv, state.kv + torch.einsum("bhtf,bhtd->bhfd", k, v))
    torch.testing.assert_close(ref_state.k_sum, state.k_sum + k.sum(2))
    if not with_state:
        assert torch.all(ref[0, :, :2] == 0)
