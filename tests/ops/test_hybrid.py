import importlib.util
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from linearize.ops.common import repeat_kv
from linearize.ops.hybrid import hybrid_attention, hybrid_attention_reference, hybrid_state_empty
from linearize.ops.states import HybridState

MODES = list(itertools.product(["joint", "gate"], [False, True], ["both", "window", "linear"]))


def mode_id(m):
    return f"{m[0]}-{'overlap' if m[1] else 'nooverlap'}-{m[2]}"


# (B, T, Hq, Hkv, D, window, chunk)
CASES = [
    (2, 37, 4, 2, 8, 5, 8),  # GQA, T not a multiple of the chunk
    (1, 12, 2, 2, 4, 32, 8),  # window larger than T
    (2, 16, 4, 1, 8, 3, 16),  # chunk = T, window smaller than the chunk
]


def case_id(c):
    return "B{}-T{}-Hq{}-Hkv{}-D{}-W{}-C{}".format(*c)


class Hedgehog(torch.nn.Module):
    """Tiny learnable hedgehog-style map: [softmax(x W), softmax(-x W)] per head."""

    def __init__(self, heads, dim, feats, dtype, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(
            torch.eye(dim, feats, dtype=dtype) + 0.3 * torch.randn(heads, dim, feats, generator=g, dtype=dtype)
        )

    def forward(self, x):
        p = torch.einsum("bhtd,hdf->bhtf", x, self.weight.to(x.dtype))  # (B, H, T, f)
        return torch.cat([p.softmax(-1), (-p).softmax(-1)], dim=-1)  # (B, H, T, 2f)


def setup(case, dtype=torch.float64, seed=0):
    b, t, hq, hkv, d, window, _ = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, t, d, generator=g, dtype=dtype)
    params = {
        "phi_q": Hedgehog(hq, d, d // 2, dtype, seed + 1),
        "phi_k": Hedgehog(hq, d, d // 2, dtype, seed + 2),
        "window": window,
        "window_factor": torch.rand(hq, generator=g, dtype=dtype) * 0.8 + 0.1,
        "gate": torch.rand(hq, generator=g, dtype=dtype),
    }
    return q, k, v, params


def kw(params, mode):
    mix, overlap, branches = mode
    return dict(params, mix=mix, overlap=overlap, branches=branches)


def assert_states_close(a: HybridState, b: HybridState, **tol):
    for x, y in zip(a.tensors(), b.tensors()):
        if x.is_floating_point():
            torch.testing.assert_close(x, y, **tol)
        else:
            assert torch.equal(x, y)


def state_loss(state: HybridState) -> torch.Tensor:
    """A loss that reaches every floating tensor of the state, each with its own weights."""
    g = torch.Generator().manual_seed(99)
    return sum((x * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum() for x in state.tensors() if x.is_floating_point())


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_matches_reference_outputs_states_gradients(case, mode, padded):
    """Fast path == the reference loop: outputs, final state and the gradients of every input
    through both (a left-padded last row with ``padded``)."""
    q, k, v, params = setup(case)
    args = kw(params, mode)
    if padded:
        args["valid"] = torch.ones(case[0], case[1], dtype=torch.bool)
        args["valid"][-1, :5] = False
    leaves = [q, k, v, args["window_factor"], args["gate"], args["phi_q"].weight, args["phi_k"].weight]
    for x in leaves:
        x.requires_grad_()
    w = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)

    def run(fn, **extra):
        out, state = fn(q, k, v, **args, **extra)
        loss = (out * w).sum() + state_loss(state)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
        return out, state, grads

    ref_out, ref_state, ref_grads = run(hybrid_attention_reference)
    out, state, grads = run(hybrid_attention, chunk=case[-1])
    torch.testing.assert_close(out, ref_out)
    assert_states_close(state, ref_state)
    for name, g, r in zip(["q", "k", "v", "window_factor", "gate", "phi_q", "phi_k"], grads, ref_grads):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"d{name}: {m}")
    if padded:
        assert torch.all(out[-1, :, :5] == 0)


@pytest.mark.parametrize("mode", [("joint", False, "both"), ("gate", True, "both")], ids=mode_id)
def test_float32(mode):
    q, k, v, params = setup(CASES[0], dtype=torch.float32)
    ref, ref_state = hybrid_attention_reference(q, k, v, **kw(params, mode))
    out, state = hybrid_attention(q, k, v, **kw(params, mode), chunk=8)
    assert out.dtype == torch.float32 and state.linear.kv.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_states_close(state, ref_state, rtol=1e-5, atol=1e-5)


def test_bfloat16_output_dtype_and_float32_state():
    q, k, v, params = setup(CASES[0], dtype=torch.float32)
    out, state = hybrid_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw(params, MODES[0]), chunk=8)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert all(x.dtype == torch.float32 for x in state.tensors() if x.is_floating_point())


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_left_padding_equals_unpadded_row(mode):
    case = (2, 23, 4, 2, 8, 5, 8)
    q, k, v, params = setup(case, seed=3)
    pad = 7
    valid = torch.ones(2, 23, dtype=torch.bool)
    valid[1, :pad] = False
    out, state = hybrid_attention(q, k, v, **kw(params, mode), valid=valid, chunk=8)
    alone, alone_state = hybrid_attention(q[1:, :, pad:], k[1:, :, pad:], v[1:, :, pad:], **kw(params, mode), chunk=8)
    full0, full0_state = hybrid_attention(q[:1], k[:1], v[:1], **kw(params, mode), chunk=8)
    assert torch.all(out[1, :, :pad] == 0)
    torch.testing.assert_close(out[1:, :, pad:], alone)
    torch.testing.assert_close(out[:1], full0)
    assert_states_close(state.select([1]), alone_state)
    assert_states_close(state.select([0]), full0_state)


@pytest.mark.parametrize("mode", [("joint", False, "both"), ("gate", True, "both"), ("joint", True, "linear")], ids=mode_id)
def test_interior_padding_equals_real_tokens_alone(mode):
    """Padding anywhere (not only on the left) is skipped: windows count real tokens."""
    q, k, v, params = setup((1, 30, 4, 2, 8, 4, 8), seed=4)
    valid = torch.rand(1, 30, generator=torch.Generator().manual_seed(5)) > 0.35
    keep = valid[0].nonzero().flatten()
    out, state = hybrid_attention(q, k, v, **kw(params, mode), valid=valid, chunk=8)
    ref, ref_state = hybrid_attention_reference(q, k, v, **kw(params, mode), valid=valid)
    alone, alone_state = hybrid_attention(q[:, :, keep], k[:, :, keep], v[:, :, keep], **kw(params, mode), chunk=8)
    torch.testing.assert_close(out, ref)
    assert_states_close(state, ref_state)
    torch.testing.assert_close(out[:, :, keep], alone)
    assert torch.all(out[:, :, ~valid[0]] == 0)
    assert_states_close(state, alone_state)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_split_prefill_and_decode_equal_one_call(mode, seed):
    b, t, window = 2, 29, 6
    q, k, v, params = setup((b, t, 4, 2, 8, window, 4), seed=seed)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :4] = False  # left padding in the first piece
    full, full_state = hybrid_attention(q, k, v, **kw(params, mode), valid=valid, chunk=4)

    g = torch.Generator().manual_seed(10 + seed)
    prefill = 18
    cuts = sorted(torch.randperm(prefill - 1, generator=g)[:3].add(1).tolist())
    bounds = [0, *cuts, prefill] + list(range(prefill + 1, t + 1))  # pieces, then one token at a time
    state, outs = None, []
    for lo, hi in itertools.pairwise(bounds):
        sl = slice(lo, hi)
        o, state = hybrid_attention(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], **kw(params, mode), valid=valid[:, sl], state=state, chunk=4
        )
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full)
    assert_states_close(state, full_state)


def test_state_is_mode_independent_and_modes_switch_at_run_time():
    q, k, v, params = setup((2, 25, 4, 2, 8, 5, 4), seed=6)
    states = [hybrid_attention(q[:, :, :15], k[:, :, :15], v[:, :, :15], **kw(params, m), chunk=4)[1] for m in MODES]
    for s in states[1:]:
        assert_states_close(s, states[0])
    for mode in MODES:
        full, _ = hybrid_attention(q, k, v, **kw(params, mode), chunk=4)
        rest, _ = hybrid_attention(q[:, :, 15:], k[:, :, 15:], v[:, :, 15:], **kw(params, mode), state=states[0], chunk=4)
        torch.testing.assert_close(rest, full[:, :, 15:])


def test_explicit_empty_state_equals_none():
    case = CASES[0]
    q, k, v, params = setup(case)
    b, _, hq, hkv, d, window, _ = case
    empty = hybrid_state_empty(b, hkv, hq, window, d, d, d, dtype=torch.float64)
    a, sa = hybrid_attention(q, k, v, **kw(params, MODES[0]), chunk=8)
    c, sc = hybrid_attention(q, k, v, **kw(params, MODES[0]), state=empty, chunk=8)
    torch.testing.assert_close(a, c)
    assert_states_close(sa, sc)


@pytest.mark.parametrize("fn", [hybrid_attention, hybrid_attention_reference], ids=["fast", "reference"])
def test_window_covering_all_tokens_is_exact_softmax(fn):
    q, k, v, params = setup((2, 19, 4, 2, 8, 19, 8), seed=7)
    out, _ = fn(q, k, v, **kw(params, ("joint", False, "both")))
    exact = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    torch.testing.assert_close(out, exact)


@pytest.mark.parametrize("fn", [hybrid_attention, hybrid_attention_reference], ids=["fast", "reference"])
def test_hand_computed_case(fn):
    """One head, D = 1, scale 1, phi = 1, window 2, f = 0.5, joint, no overlap.

    k = [0, ln 3, 0], q = [0, 1, 1], v = [1, 2, 4].
    t=0: o = v0 = 1.
    t=1: window {0, 1}, weights e^0 : e^ln3 = 1 : 3 -> (1 + 6) / 4 = 1.75.
    t=2: window {1, 2}, m = ln 3, window terms 0.5 * (1, 1/3); older {0} adds phi.phi = 1:
         (0.5 * 2 + 0.5 / 3 * 4 + 1) / (0.5 * 4 / 3 + 1) = (8/3) / (5/3) = 1.6
         (the linear term is not rescaled by exp(-m)).
    """
    d = torch.float64
    q = torch.tensor([0.0, 1.0, 1.0], dtype=d).view(1, 1, 3, 1)
    k = torch.tensor([0.0, torch.log(torch.tensor(3.0)).item(), 0.0], dtype=d).view(1, 1, 3, 1)
    v = torch.tensor([1.0, 2.0, 4.0], dtype=d).view(1, 1, 3, 1)
    one = lambda x: torch.ones_like(x)
    out, state = fn(q, k, v, phi_q=one, phi_k=one, window=2, window_factor=torch.tensor([0.5], dtype=d), scale=1.0)
    torch.testing.assert_close(out.flatten(), torch.tensor([1.0, 1.75, 1.6], dtype=d))
    torch.testing.assert_close(state.linear.kv.flatten(), torch.tensor([1.0], dtype=d))  # token 0 is older
    assert state.window.positions.tolist() == [[1, 2]]


def test_padded_queries_are_zero_and_finite():
    q, k, v, params = setup((2, 10, 4, 2, 8, 3, 4), seed=8)
    valid = torch.zeros(2, 10, dtype=torch.bool)
    valid[1, 6:] = True  # row 0 is all padding
    for mode in MODES:
        out, state = hybrid_attention(q, k, v, **kw(params, mode), valid=valid, chunk=4)
        assert torch.isfinite(out).all()
        assert torch.all(out[0] == 0) and torch.all(out[1, :, :6] == 0)
        assert not state.window.valid[0].any() and torch.all(state.linear.kv[0] == 0)


def test_decode_from_nothing_single_token():
    q, k, v, params = setup((1, 1, 2, 2, 4, 4, 64), seed=9)
    out, state = hybrid_attention(q, k, v, **kw(params, MODES[0]))
    torch.testing.assert_close(out, v)  # one token attends to itself
    assert state.window.valid.tolist() == [[False, False, False, True]]
    assert state.window.positions.tolist() == [[-1, -1, -1, 0]]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"mix": "sum"}, "mix"),
        ({"branches": "swa"}, "branches"),
        ({"window": 0}, "window"),
        ({"window_factor": torch.ones(3)}, "window_factor"),
        ({"gate": torch.ones(2, 2)}, "gate"),
    ],
    ids=["mix", "branches", "window", "window_factor-shape", "gate-shape"],
)
@pytest.mark.parametrize("fn", [hybrid_attention, hybrid_attention_reference], ids=["fast", "reference"])
def test_bad_arguments(fn, bad, match):
    q, k, v, params = setup((1, 4, 4, 2, 4, 2, 4))
    args = dict(kw(params, ("joint", False, "both")), **bad)
    with pytest.raises(ValueError, match=match):
        fn(q, k, v, **args)


def test_state_window_size_must_match():
    q, k, v, params = setup((1, 4, 4, 2, 4, 2, 4))
    state = hybrid_state_empty(1, 2, 4, 3, 4, 4, 4)
    with pytest.raises(ValueError, match="window"):
        hybrid_attention(q, k, v, **kw(params, MODES[0]), state=state)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("fla") is not None),
    reason="backend 'fla' needs CUDA and flash-linear-attention",
)
@pytest.mark.parametrize("mode", [("joint", False, "both"), ("gate", True, "linear")], ids=mode_id)
def test_fla_backend_matches_torch_on_gpu(mode):
    q, k, v, params = setup((2, 150, 4, 2, 16, 32, 64), dtype=torch.float32)  # F = 16, as in test_linear_attn
    params = dict(
        params,
        phi_q=params["phi_q"].cuda(),
        phi_k=params["phi_k"].cuda(),
        window_factor=params["window_factor"].cuda(),
        gate=params["gate"].cuda(),
    )
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    ref, ref_state = hybrid_attention(q, k, v, **kw(params, mode), backend="torch")
    out, state = hybrid_attention(q, k, v, **kw(params, mode), backend="fla")
    print(f"hybrid fla vs torch max abs error {mode_id(mode)}: {(out - ref).abs().max().item():.3e}")
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert_states_close(state, ref_state, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("fla") is not None),
    reason="backend 'fla' needs CUDA and flash-linear-attention",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_backend_at_smollm2_shapes(dtype):
    """SmolLM2's layer: 9 query heads, 3 KV heads, head dim 64, square hedgehog (128 features), window 64."""
    b, t, hq, hkv, d, window = 2, 1024, 9, 3, 64, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).cuda().to(dtype) for h in (hq, hkv, hkv))
    phi_q, phi_k = Hedgehog(hq, d, d, torch.float32, 1).cuda(), Hedgehog(hq, d, d, torch.float32, 2).cuda()
    args = dict(phi_q=lambda x: phi_q(x.float()), phi_k=lambda x: phi_k(x.float()), window=window,
                window_factor=torch.full((hq,), 0.1, device="cuda"), mix="joint", overlap=False, branches="both")
    ref, ref_state = hybrid_attention_reference(q.float(), k.float(), v.float(), **args)
    out, state = hybrid_attention(q, k, v, **args, backend="fla")
    err = (out.float() - ref).abs().max().item()
    print(f"hybrid fla ({dtype}) vs float32 reference at SmolLM2 shapes, T={t}: max abs error {err:.3e}")
    tol = 2e-2 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(state.linear.kv, ref_state.linear.kv, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_attention_weights_reproduce_the_output(mode):
    from linearize.ops.hybrid import hybrid_attention_weights

    q, k, v, params = setup((2, 11, 4, 2, 8, 3, 0))
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, :3] = False
    weights = hybrid_attention_weights(q, k, **kw(params, mode), valid=valid)  # (B, Hq, T, T)
    out, _ = hybrid_attention_reference(q, k, v, **kw(params, mode), valid=valid)
    torch.testing.assert_close(weights @ repeat_kv(v, 2), out)
    assert (weights.triu(diagonal=1) == 0).all()  # causal
    if mode[0] == "joint" or mode[2] != "both":
        sums = weights.sum(-1)[valid[:, None, :].expand(-1, 4, -1)]
        torch.testing.assert_close(sums, torch.ones_like(sums))


# --- separate feature-map inputs (q_lin / k_lin, e.g. q and k before RoPE) -------------------------
def separate_inputs(q, k, seed=20):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(q.shape, generator=g, dtype=q.dtype), torch.randn(k.shape, generator=g, dtype=k.dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_separate_feature_inputs_match_reference(case, mode):
    """The feature maps see q_lin/k_lin, the window softmax q/k: outputs, final state (with the
    window's feature-map keys) and gradients of every input agree with the quadratic form."""
    q, k, v, params = setup(case, seed=11)
    q_lin, k_lin = separate_inputs(q, k)
    args = kw(params, mode)
    leaves = [q, k, v, q_lin, k_lin, args["phi_q"].weight, args["phi_k"].weight]
    for x in leaves:
        x.requires_grad_()
    w = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)

    def run(fn, **extra):
        out, state = fn(q, k, v, **args, q_lin=q_lin, k_lin=k_lin, **extra)
        grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True, materialize_grads=True)
        return out, state, grads

    ref_out, ref_state, ref_grads = run(hybrid_attention_reference)
    out, state, grads = run(hybrid_attention, chunk=case[-1])
    torch.testing.assert_close(out, ref_out)
    assert state.window.linear_keys is not None
    assert_states_close(state, ref_state)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    linear_reads = mode[2] == "linear" or (mode[2] == "both" and (mode[1] or case[5] < case[1]))
    if linear_reads:  # the linear branch reads the feature-map inputs, not q/k
        plain, _ = hybrid_attention(q, k, v, **args, chunk=case[-1])
        assert not torch.allclose(plain, out)


def test_separate_feature_inputs_equal_to_q_k_give_the_plain_hybrid():
    q, k, v, params = setup(CASES[0], seed=12)
    args = kw(params, MODES[0])
    plain, plain_state = hybrid_attention(q, k, v, **args, chunk=8)
    same, same_state = hybrid_attention(q, k, v, **args, q_lin=q, k_lin=k, chunk=8)
    torch.testing.assert_close(same, plain)
    torch.testing.assert_close(same_state.window.linear_keys, plain_state.window.keys)
    torch.testing.assert_close(same_state.linear.kv, plain_state.linear.kv)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_separate_feature_inputs_split_prefill_decode_and_padding_equal_one_call(mode):
    b, t, window = 2, 27, 5
    q, k, v, params = setup((b, t, 4, 2, 8, window, 4), seed=13)
    q_lin, k_lin = separate_inputs(q, k, seed=14)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :6] = False  # left padding
    args = kw(params, mode)
    full, full_state = hybrid_attention(q, k, v, **args, q_lin=q_lin, k_lin=k_lin, valid=valid, chunk=4)
    ref, _ = hybrid_attention_reference(q, k, v, **args, q_lin=q_lin, k_lin=k_lin, valid=valid)
    torch.testing.assert_close(full, ref)
    state, outs = None, []
    for lo, hi in itertools.pairwise([0, 9, 16] + list(range(17, t + 1))):
        sl = slice(lo, hi)
        o, state = hybrid_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], **args, q_lin=q_lin[:, :, sl],
                                    k_lin=k_lin[:, :, sl], valid=valid[:, sl], state=state, chunk=4)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full)
    assert_states_close(state, full_state)
    merged = HybridState.merge(state.split([1, 1]))
    assert_states_close(merged, state)


def test_separate_feature_inputs_cannot_switch_mid_sequence():
    q, k, v, params = setup(CASES[0], seed=15)
    q_lin, k_lin = separate_inputs(q, k)
    args = kw(params, MODES[0])
    _, plain_state = hybrid_attention(q, k, v, **args, chunk=8)
    _, sep_state = hybrid_attention(q, k, v, **args, q_lin=q_lin, k_lin=k_lin, chunk=8)
    with pytest.raises(ValueError, match="cannot switch"):
        hybrid_attention(q, k, v, **args, q_lin=q_lin, k_lin=k_lin, state=plain_state, chunk=8)
    with pytest.raises(ValueError, match="cannot switch"):
        hybrid_attention(q, k, v, **args, state=sep_state, chunk=8)
    with pytest.raises(ValueError, match="go together"):
        hybrid_attention(q, k, v, **args, q_lin=q_lin, chunk=8)
    with pytest.raises(ValueError, match="merge"):
        HybridState.merge([plain_state, sep_state])


# --- the reference against a brute force on python floats -------------------------------------------
def brute_force_hybrid(q, k, v, valid, phi, *, window, mix, overlap, branches, f, g):
    """methods.md section 1 with explicit loops over rows, heads, queries and keys on python floats.
    ``phi`` acts on each head alike, so it is applied to the KV heads before any repetition."""
    b_size, hq, t_len, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    qp, kp = phi(q).tolist(), phi(k).tolist()
    q, k, v, valid, f, g = q.tolist(), k.tolist(), v.tolist(), valid.tolist(), f.tolist(), g.tolist()

    def dot(x, y):
        return sum(a * b for a, b in zip(x, y))

    def ratio(num, den):
        return [x / den for x in num] if den > 1e-12 else [0.0] * dv

    out = [[[[0.0] * dv for _ in range(t_len)] for _ in range(hq)] for _ in range(b_size)]
    older_kv = [[[[0.0] * dv for _ in range(len(kp[0][0][0]))] for _ in range(hq)] for _ in range(b_size)]
    for b in range(b_size):
        real = [t for t in range(t_len) if valid[b][t]]
        for h in range(hq):
            kh = h // (hq // hkv)
            for p, t in enumerate(real):
                win = real[max(0, p - window + 1) : p + 1]
                lin = real[: p + 1] if (overlap or branches == "linear") else real[: max(0, p - window + 1)]
                s = [dot(q[b][h][t], k[b][kh][j]) / math.sqrt(d) for j in win]
                e = [math.exp(x - max(s)) for x in s]
                a = [dot(qp[b][h][t], kp[b][kh][j]) for j in lin]
                sw_num = [sum(e[n] * v[b][kh][j][c] for n, j in enumerate(win)) for c in range(dv)]
                la_num = [sum(a[n] * v[b][kh][j][c] for n, j in enumerate(lin)) for c in range(dv)]
                if branches == "window":
                    o = ratio(sw_num, sum(e))
                elif branches == "linear":
                    o = ratio(la_num, sum(a))
                elif mix == "joint":  # one denominator; the linear term is not rescaled by exp(-max)
                    o = ratio([f[h] * x + y for x, y in zip(sw_num, la_num)], f[h] * sum(e) + sum(a))
                else:
                    o = [g[h] * x + (1 - g[h]) * y for x, y in zip(ratio(sw_num, sum(e)), ratio(la_num, sum(a)))]
                out[b][h][t] = o
            for j in real[: max(0, len(real) - window)]:  # the state: tokens older than the last window
                for i, phi_i in enumerate(kp[b][kh][j]):
                    older_kv[b][h][i] = [x + phi_i * y for x, y in zip(older_kv[b][h][i], v[b][kh][j])]
    return torch.tensor(out, dtype=torch.float64), torch.tensor(older_kv, dtype=torch.float64)


@pytest.mark.parametrize("window", [1, 2, 3], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_reference_equals_brute_force(mode, window):
    mix, overlap, branches = mode
    g = torch.Generator().manual_seed(30)
    q, k, v = (torch.randn(2, h, 7, 3, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    valid = torch.tensor([[True] * 7, [False, False, True, True, False, True, True]])  # left padding, a hole
    f, gate = torch.rand(4, generator=g, dtype=torch.float64), torch.rand(4, generator=g, dtype=torch.float64)
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    out, state = hybrid_attention_reference(q, k, v, phi_q=phi, phi_k=phi, window=window, mix=mix, overlap=overlap,
                                            branches=branches, window_factor=f, gate=gate, valid=valid)
    want_out, want_kv = brute_force_hybrid(q, k, v, valid, phi, window=window, mix=mix, overlap=overlap,
                                           branches=branches, f=f, g=gate)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(state.linear.kv, want_kv)
    n_real = valid.sum(1).tolist()
    for b in range(2):
        kept = list(range(max(0, n_real[b] - window), n_real[b]))
        assert state.window.positions[b].tolist() == [-1] * (window - len(kept)) + kept
