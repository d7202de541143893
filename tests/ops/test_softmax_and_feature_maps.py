"""Feature maps, softmax over a KV state, sinks-only and zero attention against their references."""

from __future__ import annotations

import math

import pytest
import torch

from linearize.ops.feature_maps import FIXED_FEATURE_MAPS, hedgehog, hedgehog_pair, hedgehog_reference
from linearize.ops.softmax import (
    sinks_attention,
    sinks_attention_reference,
    softmax_attention,
    softmax_attention_reference,
    zero_attention,
)


def qkv(b=2, hq=4, hkv=2, t=13, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g))


@pytest.mark.parametrize("width", [8, 4], ids=["square", "rectangular"])
def test_hedgehog_matches_loop_and_gradients(width):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, width, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, width, generator=g, dtype=torch.float64, requires_grad=True)
    out = hedgehog(x, w, b)
    assert out.shape == (2, 3, 5, 2 * width)
    torch.testing.assert_close(out, hedgehog_reference(x, w, b).double(), atol=1e-6, rtol=1e-5)  # reference is float32
    torch.testing.assert_close(out.sum(-1), torch.full((2, 3, 5), 2.0, dtype=torch.float64))  # two softmaxes
    assert torch.autograd.gradcheck(hedgehog, (x, w, b))


def test_fixed_maps_are_defined():
    x = torch.linspace(-2, 2, 9)
    torch.testing.assert_close(FIXED_FEATURE_MAPS["elu"](x), torch.nn.functional.elu(x) + 1)
    assert (FIXED_FEATURE_MAPS["relu"](x) >= 0).all() and (FIXED_FEATURE_MAPS["exp"](x) > 0).all()
    assert torch.equal(FIXED_FEATURE_MAPS["identity"](x), x)


def test_softmax_state_decode_matches_full_with_padding():
    q, k, v = qkv()
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, :4] = False
    full, state_full = softmax_attention(q, k, v, valid=valid)
    out1, st = softmax_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], valid=valid[:, :9])
    outs = [out1]
    for t in range(9, 13):
        o, st = softmax_attention(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], valid=valid[:, t : t + 1], state=st)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2)[:, :, 4:], full[:, :, 4:])
    # padded row equals the row run alone
    alone, _ = softmax_attention(q[1:, :, 4:], k[1:, :, 4:], v[1:, :, 4:])
    torch.testing.assert_close(full[1:, :, 4:], alone)
    assert torch.equal(full[1, :, :4], torch.zeros_like(full[1, :, :4]))


@pytest.mark.parametrize("n_sinks", [1, 3, 8])
def test_sinks_decode_matches_reference(n_sinks):
    q, k, v = qkv(t=12)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :3] = False
    ref = sinks_attention_reference(q, k, v, n_sinks=n_sinks, valid=valid)
    full, _ = sinks_attention(q, k, v, n_sinks=n_sinks, valid=valid)
    torch.testing.assert_close(full, ref)
    out, st = sinks_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], n_sinks=n_sinks, valid=valid[:, :2])
    outs = [out]
    for t in range(2, 12):
        o, st = sinks_attention(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], n_sinks=n_sinks, valid=valid[:, t : t + 1], state=st)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2), ref)
    assert st.keys.shape[2] == n_sinks
    assert int(st.valid[1].sum()) == min(n_sinks, 12)


def test_sinks_reference_only_looks_at_first_tokens():
    q, k, v = qkv(b=1, t=10)
    out = sinks_attention_reference(q, k, v, n_sinks=2)
    v2 = v.clone()
    v2[:, :, 2:] += 5.0  # changing non-sink values changes nothing
    torch.testing.assert_close(sinks_attention_reference(q, k, v2, n_sinks=2), out)


def test_zero_attention_shape():
    q, _, v = qkv()
    assert torch.equal(zero_attention(q, v), torch.zeros(2, 4, 13, 8))


def padding(b: int, t: int, padded: bool) -> torch.Tensor | None:
    """None, or left padding of 4 tokens in the last row."""
    if not padded:
        return None
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[-1, :4] = False
    return valid


SHAPES = [(2, 4, 2, 13, 8), (1, 2, 2, 6, 4), (2, 3, 1, 9, 16)]


def shape_id(s):
    return "B{}-Hq{}-Hkv{}-T{}-D{}".format(*s)


def grads_of(fn, leaves, w):
    out = fn(*leaves)
    return out, torch.autograd.grad((out * w).sum(), leaves)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_softmax_matches_reference_outputs_state_gradients(shape, padded):
    b, hq, hkv, t, d = shape
    q, k, v = qkv(b, hq, hkv, t, d, seed=2)
    valid = padding(b, t, padded)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    w = torch.randn(b, hq, t, d, generator=torch.Generator().manual_seed(3))
    state = {}

    def fast(*a):
        out, state["kv"] = softmax_attention(*a, valid=valid)
        return out

    out, grads = grads_of(fast, leaves, w)
    ref, ref_grads = grads_of(lambda *a: softmax_attention_reference(*a, valid=valid), leaves, w)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")
    # The final state is the sequence itself: every token, padding marked invalid.
    assert torch.equal(state["kv"].keys, k) and torch.equal(state["kv"].values, v)
    assert torch.equal(state["kv"].valid, torch.ones(b, t, dtype=torch.bool) if valid is None else valid)
    if padded:
        assert torch.all(ref[-1, :, :4] == 0)


@pytest.mark.parametrize("n_sinks", [1, 3, 8], ids=lambda n: f"sinks{n}")
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
def test_sinks_gradients_match_reference(padded, n_sinks):
    q, k, v = qkv(t=12, seed=4)
    valid = padding(2, 12, padded)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    w = torch.randn(2, 4, 12, 8, generator=torch.Generator().manual_seed(5))
    out, grads = grads_of(lambda *a: sinks_attention(*a, n_sinks=n_sinks, valid=valid)[0], leaves, w)
    ref, ref_grads = grads_of(lambda *a: sinks_attention_reference(*a, n_sinks=n_sinks, valid=valid), leaves, w)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


def brute_force_softmax(q, k, v, valid, n_first=None):
    """Python floats and explicit loops over rows, heads, queries and keys: the definition."""
    b_size, hq, t_len, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    q, k, v, valid = q.tolist(), k.tolist(), v.tolist(), valid.tolist()
    out = [[[[0.0] * dv for _ in range(t_len)] for _ in range(hq)] for _ in range(b_size)]
    for b in range(b_size):
        real = [t for t in range(t_len) if valid[b][t]]
        for h in range(hq):
            g = h // (hq // hkv)
            for p, t in enumerate(real):
                keys = real[: p + 1] if n_first is None else real[: min(p + 1, n_first)]
                s = [sum(q[b][h][t][i] * k[b][g][j][i] for i in range(d)) / math.sqrt(d) for j in keys]
                e = [math.exp(x - max(s)) for x in s]
                out[b][h][t] = [sum(e[n] * v[b][g][j][c] for n, j in enumerate(keys)) / sum(e) for c in range(dv)]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("n_sinks", [None, 1, 2], ids=["softmax", "sinks1", "sinks2"])
def test_references_equal_brute_force(n_sinks):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, h, 6, 3, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    valid = torch.tensor([[True] * 6, [False, False, True, False, True, True]])  # left padding and a hole
    if n_sinks is None:
        ref = softmax_attention_reference(q, k, v, valid=valid)
    else:
        ref = sinks_attention_reference(q, k, v, n_sinks=n_sinks, valid=valid)
    torch.testing.assert_close(ref, brute_force_softmax(q, k, v, valid, n_sinks))


def test_hedgehog_pair_equals_the_reference_map():
    """``hedgehog_pair`` (both maps as one batched projection, k's heads grouped) equals the plain
    float32 loop of each map, k's features once per query head of its KV head."""
    torch.manual_seed(3)
    b, hq, hkv, d, f = 2, 6, 2, 8, 5
    weight, bias = torch.randn(2 * hq, d, f), torch.randn(2 * hq, 1, f)
    q, k = torch.randn(b, hq, d), torch.randn(b, hkv, d)
    qf, kf = hedgehog_pair(q, k, weight, bias)
    want_q = hedgehog_reference(q[:, :, None], weight[:hq], bias[:hq, 0])[:, :, 0]
    want_k = hedgehog_reference(k.repeat_interleave(hq // hkv, dim=1)[:, :, None], weight[hq:], bias[hq:, 0])[:, :, 0]
    torch.testing.assert_close(qf, want_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(kf, want_k, atol=1e-6, rtol=1e-5)
