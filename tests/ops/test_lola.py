"""LoLA attention: the chunked op against the per-token reference, the trained hybrid and closed forms."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from linearize.ops.common import repeat_kv
from linearize.ops.hybrid import hybrid_attention, hybrid_attention_reference
from linearize.ops.lola import lola_attention, lola_attention_reference, self_recall_error
from linearize.ops.states import BatchState, LinearState, LolaState


def hedgehog(heads: int, d: int, seed: int):
    """phi(x) = [softmax(x W), softmax(-x W)] with a random per-head W (D x D): F = 2D."""
    w = torch.randn(heads, d, d, generator=torch.Generator().manual_seed(seed)) / d**0.5

    def phi(x):  # (B, H, T, D) -> (B, H, T, 2D)
        z = torch.einsum("bhtd,hdf->bhtf", x, w.to(x.dtype))
        return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1)

    return phi


def make(b=2, hq=4, hkv=2, t=24, d=8, seed=0):
    """Random q, k, v and the op's keyword arguments other than window/sparse."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, hkv, t, d, generator=g)
    v = torch.randn(b, hkv, t, d, generator=g)
    kw = dict(
        phi_q=hedgehog(hq, d, seed + 1),
        phi_k=hedgehog(hq, d, seed + 2),
        window_factor=0.1 + 0.8 * torch.rand(hq, generator=g),
    )
    return q, k, v, kw


def left_padding(b: int, t: int, pads: list[int]) -> torch.Tensor:
    return torch.arange(t)[None, :] >= torch.tensor(pads)[:, None]  # (B, T)


def named_tensors(state: BatchState, prefix: str = ""):
    for f in dataclasses.fields(state):
        x = getattr(state, f.name)
        if isinstance(x, BatchState):
            yield from named_tensors(x, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", x


def assert_states_equal(a: BatchState, b: BatchState, atol: float = 1e-5) -> None:
    for (name, x), (_, y) in zip(named_tensors(a), named_tensors(b), strict=True):
        if x is None or y is None:
            assert x is None and y is None, f"{name}: set in one state only"
        elif x.is_floating_point():
            torch.testing.assert_close(x, y, atol=atol, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


def causal_softmax(q, k, v, valid):
    """Exact causal softmax attention over real tokens; zeros at padded queries."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    t = q.shape[2]
    ok = torch.ones(t, t, dtype=torch.bool).tril() & valid[:, None, None, :]  # (B, 1, T, T)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~ok, -torch.inf)
    return torch.where(valid[:, None, :, None], scores.softmax(-1) @ v, 0)


CASES = {
    "B2-Hq4-Hkv2-T29-D8-w4-s3": dict(b=2, hq=4, hkv=2, t=29, d=8, window=4, sparse=3),
    "B1-Hq2-Hkv2-T23-D4-w1-s0": dict(b=1, hq=2, hkv=2, t=23, d=4, window=1, sparse=0),
    "B2-Hq2-Hkv1-T30-D8-w6-s1": dict(b=2, hq=2, hkv=1, t=30, d=8, window=6, sparse=1),
    "B1-Hq2-Hkv1-T12-D8-w3-s20": dict(b=1, hq=2, hkv=1, t=12, d=8, window=3, sparse=20),
}


@pytest.mark.parametrize("chunk", [1, 2, 5, 16], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_matches_reference(case, padded, chunk):
    """Fast path == the reference loop (same chunking), outputs and final state, for every chunk
    length (chunk 16 is capped at each case's window)."""
    case = dict(case)
    window, sparse = case.pop("window"), case.pop("sparse")
    q, k, v, kw = make(**case)
    valid = left_padding(case["b"], case["t"], [3] + [0] * (case["b"] - 1)) if padded else None
    if padded:
        valid[0, 10] = False  # a hole mid-sequence as well
    ref, ref_state = lola_attention_reference(q, k, v, window=window, sparse=sparse, chunk=chunk, valid=valid, **kw)
    out, state = lola_attention(q, k, v, window=window, sparse=sparse, chunk=chunk, valid=valid, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_states_equal(state, ref_state)
    assert state.sparse.keys.shape == (case["b"], case["hq"], sparse, case["d"])


@pytest.mark.parametrize("chunk", [1, 3, 4], ids=lambda c: f"C{c}")
def test_gradients_match_reference(chunk):
    """Gradients (q, k, v, window factor) of the fast path == those of the reference loop. The
    selection is discrete: the gradient flows through what is read and kept, not through the choice."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=17)
    valid = left_padding(2, 17, [2, 0])
    factor = kw.pop("window_factor")
    grads = []
    for fn in (lola_attention, lola_attention_reference):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, factor)]
        out, state = fn(*leaves[:3], window=4, sparse=3, chunk=chunk, valid=valid, window_factor=leaves[3], **kw)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        loss = (out * w).sum() + state.linear.kv.sum() + state.sparse.values.sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for name, g_fast, g_ref in zip("qkvf", *grads):
        torch.testing.assert_close(g_fast, g_ref, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("chunk", [1, 3, 5, 16], ids=lambda c: f"C{c}")
def test_sparse_covering_all_tokens_is_exact_softmax(chunk):
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=21)
    valid = left_padding(2, 21, [4, 0])
    expected = causal_softmax(q, k, v, valid)
    out, state = lola_attention(q, k, v, window=5, sparse=21, chunk=chunk, valid=valid, **kw)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not state.linear.k_sum.any()
    ref, _ = lola_attention_reference(q, k, v, window=5, sparse=21, chunk=chunk, valid=valid, **kw)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


NO_SPARSE = {"w5-T40": (5, 40), "w64-T150": (64, 150)}


@pytest.mark.parametrize("chunk", [1, 3, 16, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("window, t", list(NO_SPARSE.values()), ids=list(NO_SPARSE))
def test_no_sparse_is_joint_hybrid(window, t, chunk):
    """lambda = 0 is the trained joint, non-overlap hybrid for ANY chunk length: outputs and final
    state, with padding (left and a hole) and GQA. This replaces the old closed form, in which
    query i of a chunk saw only eta - C + i + 1 exact tokens: evicting the chunk's leavers before
    attending made chunked prefill differ from the hybrid the model was trained as."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=t)
    valid = left_padding(2, t, [0, 7])
    valid[0, 20] = False
    out, state = lola_attention(q, k, v, window=window, sparse=0, chunk=chunk, valid=valid, **kw)
    hyb, hyb_state = hybrid_attention(q, k, v, window=window, mix="joint", overlap=False, valid=valid, **kw)
    torch.testing.assert_close(out, hyb, atol=1e-5, rtol=1e-5)
    assert_states_equal(state.window, hyb_state.window)
    assert_states_equal(state.linear, hyb_state.linear)
    assert state.sparse.keys.shape[2] == 0
    if window == 5:
        spec, _ = hybrid_attention_reference(q, k, v, window=window, mix="joint", overlap=False, valid=valid, **kw)
        torch.testing.assert_close(out, spec, atol=1e-5, rtol=1e-5)
        ref, ref_state = lola_attention_reference(q, k, v, window=window, sparse=0, chunk=chunk, valid=valid, **kw)
        torch.testing.assert_close(ref, spec, atol=1e-5, rtol=1e-5)
        assert_states_equal(ref_state, state)


@pytest.mark.parametrize("sparse", [0, 3], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("chunk", [3, 4, 16], ids=lambda c: f"C{c}")
def test_chunked_prefill_then_decode(chunk, sparse):
    """Prefill with chunk C, then token-by-token decode == one call over the rest at C = 1 (decode
    is the C = 1 step); with lambda = 0 it also == one call with chunk C over everything, whatever C."""
    t, p, window = 30, 12, 6
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=t)
    valid = left_padding(2, t, [0, 5])
    args = dict(window=window, sparse=sparse, **kw)
    head, head_state = lola_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], chunk=chunk, valid=valid[:, :p], **args)
    outs, state = [head], head_state
    with torch.inference_mode():
        for i in range(p, t):
            step = slice(i, i + 1)
            out, state = lola_attention(
                q[:, :, step], k[:, :, step], v[:, :, step], chunk=chunk, valid=valid[:, step], state=state, **args
            )
            outs.append(out)
    decoded = torch.cat(outs, dim=2)
    tail, tail_state = lola_attention(
        q[:, :, p:], k[:, :, p:], v[:, :, p:], chunk=1, valid=valid[:, p:], state=head_state, **args
    )
    torch.testing.assert_close(decoded, torch.cat([head, tail], dim=2), atol=1e-5, rtol=1e-5)
    assert_states_equal(state, tail_state)
    if sparse == 0:
        full, full_state = lola_attention(q, k, v, chunk=chunk, valid=valid, **args)
        torch.testing.assert_close(decoded, full, atol=1e-5, rtol=1e-5)
        assert_states_equal(state, full_state)


@pytest.mark.parametrize("chunk", [3, 6], ids=lambda c: f"C{c}")
def test_chunked_prefill_is_causal(chunk):
    """With lambda > 0 and C > 1 the selection runs once per chunk over tokens from before the chunk
    only: changing the tokens after t (even in t's own chunk) leaves the outputs up to t alone."""
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=24)
    out, _ = lola_attention(q, k, v, window=6, sparse=2, chunk=chunk, **kw)
    for t0 in (13, 16):
        changed = []
        for i, x in enumerate((q, k, v)):
            x = x.clone()
            x[:, :, t0 + 1 :] = torch.randn(x[:, :, t0 + 1 :].shape, generator=torch.Generator().manual_seed(t0 + i))
            changed.append(x)
        out2, _ = lola_attention(*changed, window=6, sparse=2, chunk=chunk, **kw)
        torch.testing.assert_close(out2[:, :, : t0 + 1], out[:, :, : t0 + 1], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(out2[:, :, t0 + 1 :], out[:, :, t0 + 1 :])


def test_decode_after_prefill_equals_chunk1_prefill():
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=30)
    valid = left_padding(2, 30, [0, 5])
    full, full_state = lola_attention(q, k, v, window=4, sparse=3, chunk=1, valid=valid, **kw)
    p = 12
    outs = []
    out, state = lola_attention(
        q[:, :, :p], k[:, :, :p], v[:, :, :p], window=4, sparse=3, chunk=1, valid=valid[:, :p], **kw
    )
    outs.append(out)
    with torch.inference_mode():
        for t in range(p, 30):
            step = slice(t, t + 1)
            out, state = lola_attention(
                q[:, :, step], k[:, :, step], v[:, :, step],
                window=4, sparse=3, valid=valid[:, step], state=state, **kw,
            )
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)
    assert_states_equal(state, full_state)


@pytest.mark.parametrize("chunk", [1, 4], ids=lambda c: f"C{c}")
def test_split_prefill_equals_one_prefill(chunk):
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=32)
    full, full_state = lola_attention(q, k, v, window=6, sparse=4, chunk=chunk, **kw)
    outs, state = [], None
    for lo, hi in [(0, 8), (8, 20), (20, 32)]:
        out, state = lola_attention(
            q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], window=6, sparse=4, chunk=chunk, state=state, **kw
        )
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)
    assert_states_equal(state, full_state)


def check_capacity(state: LolaState, k, v, valid, phi_k, window: int, sparse: int) -> None:
    """Slot counts within capacity, and window U sparse U written = every real token seen, once."""
    n_rep = state.sparse.keys.shape[1] // k.shape[1]
    k_phi = phi_k(repeat_kv(k, n_rep))  # (B, Hq, T, F)
    v = repeat_kv(v, n_rep)
    for b in range(k.shape[0]):
        real = valid[b].nonzero().flatten()  # sequence index of each real token
        win_pos = state.window.positions[b][state.window.valid[b]].tolist()
        assert len(win_pos) == min(window, len(real))
        assert win_pos == list(range(len(real) - len(win_pos), len(real)))  # the last eta real tokens
        for h in range(k_phi.shape[1]):
            sp = state.sparse.positions[b, h]
            held = state.sparse.valid[b, h]
            n_sparse = int(held.sum())
            assert n_sparse <= sparse and held[:n_sparse].all()  # invalid slots last
            sp_pos = sp[:n_sparse].tolist()
            assert sp_pos == sorted(sp_pos) and (sp[n_sparse:] == -1).all()
            assert not set(sp_pos) & set(win_pos)
            written = real[[i for i in range(len(real)) if i not in set(sp_pos) | set(win_pos)]]
            kv = k_phi[b, h, written].T @ v[b, h, written]  # (F, Dv)
            torch.testing.assert_close(state.linear.kv[b, h], kv, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(state.linear.k_sum[b, h], k_phi[b, h, written].sum(0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3], ids=lambda c: f"C{c}")
def test_exact_capacity(chunk):
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=40)
    valid = torch.rand(2, 40, generator=torch.Generator().manual_seed(3)) > 0.2
    state, lo = None, 0
    for hi in [7, 8, 9, 20, 21, 33, 40]:
        step = slice(lo, hi)
        _, state = lola_attention(
            q[:, :, step], k[:, :, step], v[:, :, step],
            window=4, sparse=3, chunk=chunk, valid=valid[:, step], state=state, **kw,
        )
        check_capacity(state, k[:, :, :hi], v[:, :, :hi], valid[:, :hi], kw["phi_k"], window=4, sparse=3)
        lo = hi


@pytest.mark.parametrize("chunk", [1, 4], ids=lambda c: f"C{c}")
def test_left_padding_equals_unpadded_row(chunk):
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=25)
    valid = left_padding(2, 25, [6, 0])
    q[0, :, :6] = torch.nan  # whatever sits in padding must not leak
    out, state = lola_attention(q, k, v, window=4, sparse=3, chunk=chunk, valid=valid, **kw)
    alone, alone_state = lola_attention(q[:1, :, 6:], k[:1, :, 6:], v[:1, :, 6:], window=4, sparse=3, chunk=chunk, **kw)
    assert (out[0, :, :6] == 0).all()
    torch.testing.assert_close(out[:1, :, 6:], alone, atol=1e-5, rtol=1e-5)
    assert_states_equal(state.select([0]), alone_state)


@pytest.mark.parametrize("chunk", [1, 4], ids=lambda c: f"C{c}")
def test_gqa_equals_repeated_kv(chunk):
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=27)
    out, state = lola_attention(q, k, v, window=5, sparse=3, chunk=chunk, **kw)
    mha, mha_state = lola_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), window=5, sparse=3, chunk=chunk, **kw)
    torch.testing.assert_close(out, mha, atol=1e-5, rtol=1e-5)
    assert_states_equal(state.sparse, mha_state.sparse)
    assert_states_equal(state.linear, mha_state.linear)
    torch.testing.assert_close(state.window.keys, mha_state.window.keys[:, ::2])


@pytest.mark.parametrize(
    "t, n_dup, window, sparse, chunk, expected",
    [(5, 3, 1, 2, 1, [0, 3]), (4, 2, 2, 1, 2, [0])],
    ids=["T5-w1-s2-C1", "T4-w2-s1-C2"],
)
def test_tie_break_keeps_earlier_position(t, n_dup, window, sparse, chunk, expected):
    """Duplicated (k, v) tokens have equal SRE; the earliest stays in the cache."""
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=t)
    k[:, :, 1:n_dup], v[:, :, 1:n_dup] = k[:, :, :1], v[:, :, :1]
    _, state = lola_attention(q, k, v, window=window, sparse=sparse, chunk=chunk, **kw)
    assert state.sparse.positions[0].tolist() == [expected] * 2
    _, ref_state = lola_attention_reference(q, k, v, window=window, sparse=sparse, chunk=chunk, **kw)
    assert ref_state.sparse.positions[0].tolist() == [expected] * 2


FLAGS = {"state+sparse": (True, True), "no-state": (False, True), "no-sparse": (True, False), "window-only": (False, False)}


@pytest.mark.parametrize("read_state, read_sparse", list(FLAGS.values()), ids=list(FLAGS))
def test_read_flags(read_state, read_sparse):
    """After a decode step the memory attended is exactly the returned state: check the formula."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=20)
    _, state = lola_attention(q[:, :, :19], k[:, :, :19], v[:, :, :19], window=4, sparse=3, chunk=1, **kw)
    flags = dict(read_state=read_state, read_sparse=read_sparse)
    step = slice(19, 20)
    out, new = lola_attention(q[:, :, step], k[:, :, step], v[:, :, step], window=4, sparse=3, state=state, **flags, **kw)
    default_out, default = lola_attention(q[:, :, step], k[:, :, step], v[:, :, step], window=4, sparse=3, state=state, **kw)
    assert_states_equal(new, default, atol=0)  # what is kept does not depend on what is read

    keys = repeat_kv(new.window.keys, 2)  # (B, Hq, eta, D), all valid after 20 tokens
    values = repeat_kv(new.window.values, 2)
    if read_sparse:
        assert new.sparse.valid.all()
        keys, values = torch.cat([keys, new.sparse.keys], 2), torch.cat([values, new.sparse.values], 2)
    qt = q[:, :, step]  # (B, Hq, 1, D)
    scores = qt @ keys.transpose(-1, -2) * 8**-0.5  # (B, Hq, 1, N)
    p = kw["window_factor"][None, :, None, None] * torch.exp(scores - scores.amax(-1, keepdim=True))
    num, den = p @ values, p.sum(-1)
    if read_state:
        q_phi = kw["phi_q"](qt)  # (B, Hq, 1, F)
        num, den = num + q_phi @ new.linear.kv, den + (q_phi @ new.linear.k_sum.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, num / den.unsqueeze(-1), atol=1e-5, rtol=1e-5)
    if (read_state, read_sparse) != (True, True):
        assert not torch.allclose(out, default_out, atol=1e-4)


def test_sre_on_empty_state_is_value_norm():
    k_phi = torch.rand(2, 3, 5, 6)
    v = torch.randn(2, 3, 5, 4)
    empty = LinearState.zeros(2, 3, 6, 4)
    torch.testing.assert_close(self_recall_error(k_phi, v, empty), v.norm(dim=-1))


def test_sre_is_l2_recall_error():
    k_phi, v = torch.rand(5, 6), torch.randn(5, 4)
    state = LinearState(kv=torch.randn(6, 4), k_sum=torch.rand(6))
    readout = torch.stack([state.kv.T @ k_phi[i] / (k_phi[i] @ state.k_sum) for i in range(5)])
    torch.testing.assert_close(self_recall_error(k_phi, v, state), (readout - v).norm(dim=-1))


def test_bf16_inputs_keep_float32_state():
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=10)
    with torch.no_grad():
        out, state = lola_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=3, sparse=2, chunk=4, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert all(x.dtype == torch.float32 for x in (state.window.keys, state.sparse.values, state.linear.kv))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(window=0), "window"),
        (dict(sparse=-1), "sparse"),
        (dict(chunk=0), "chunk"),
        (dict(window_factor=torch.full((3,), 0.5)), "window_factor"),
        (dict(window=5), "state.window.keys"),
    ],
    ids=["window0", "sparse-1", "chunk0", "factor-shape", "state-window"],
)
def test_invalid_arguments_raise(change, match):
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=6)
    _, state = lola_attention(q, k, v, window=4, sparse=2, **kw)
    args = dict(kw, window=4, sparse=2, chunk=2, state=state) | change
    with pytest.raises(ValueError, match=match):
        lola_attention(q, k, v, **args)


# --- separate feature-map inputs (q_lin / k_lin, e.g. q and k before RoPE) -------------------------
def linear_inputs(q, k, seed=20):
    """Random feature-map inputs, unrelated to q and k (as q/k before RoPE would be, at any position)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)


@pytest.mark.parametrize("chunk", [1, 2, 5, 16], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_linear_inputs_match_reference(case, chunk):
    """With q_lin/k_lin (padding, a hole, GQA): fast path == reference, outputs and final state,
    including the window's and the sparse cache's feature-map keys; and the feature maps do read them."""
    case = dict(case)
    window, sparse = case.pop("window"), case.pop("sparse")
    q, k, v, kw = make(**case)
    q_lin, k_lin = linear_inputs(q, k)
    valid = left_padding(case["b"], case["t"], [3] + [0] * (case["b"] - 1))
    valid[0, 10] = False
    args = dict(window=window, sparse=sparse, chunk=chunk, valid=valid, q_lin=q_lin, k_lin=k_lin, **kw)
    ref, ref_state = lola_attention_reference(q, k, v, **args)
    out, state = lola_attention(q, k, v, **args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_states_equal(state, ref_state)
    assert state.window.linear_keys.shape == state.window.keys.shape
    assert state.sparse.linear_keys.shape == state.sparse.keys.shape == (case["b"], case["hq"], sparse, case["d"])
    # every held token keeps its own k_lin next to its k
    for b in range(case["b"]):
        real = valid[b].nonzero().flatten()
        for h in range(case["hq"]):
            g = h // (case["hq"] // case["hkv"])
            held = state.sparse.valid[b, h]
            idx = real[state.sparse.positions[b, h][held]]
            torch.testing.assert_close(state.sparse.linear_keys[b, h][held], k_lin[b, g, idx])
            torch.testing.assert_close(state.sparse.keys[b, h][held], k[b, g, idx])
        idx = real[state.window.positions[b][state.window.valid[b]]]
        torch.testing.assert_close(state.window.linear_keys[b][:, state.window.valid[b]], k_lin[b][:, idx])
    if sparse < case["t"]:  # some token reaches the linear state
        plain, _ = lola_attention(q, k, v, window=window, sparse=sparse, chunk=chunk, valid=valid, **kw)
        assert not torch.allclose(plain, out, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 3, 4], ids=lambda c: f"C{c}")
def test_linear_inputs_gradients_match_reference(chunk):
    """Gradients of q, k, v, q_lin, k_lin and the window factor agree with the reference loop."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=17)
    q_lin, k_lin = linear_inputs(q, k)
    valid = left_padding(2, 17, [2, 0])
    factor = kw.pop("window_factor")
    grads = []
    for fn in (lola_attention, lola_attention_reference):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, q_lin, k_lin, factor)]
        out, state = fn(*leaves[:3], window=4, sparse=3, chunk=chunk, valid=valid, window_factor=leaves[5],
                        q_lin=leaves[3], k_lin=leaves[4], **kw)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        loss = (out * w).sum() + state.linear.kv.sum() + state.sparse.values.sum() + state.sparse.linear_keys.sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for name, g_fast, g_ref in zip(["q", "k", "v", "q_lin", "k_lin", "f"], *grads):
        assert g_ref.abs().sum() > 0, f"d{name} is zero"
        torch.testing.assert_close(g_fast, g_ref, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("chunk", [1, 3, 16], ids=lambda c: f"C{c}")
def test_linear_inputs_no_sparse_is_joint_hybrid(chunk):
    """lambda = 0 with q_lin/k_lin == hybrid_attention with the same q_lin/k_lin (joint, non-overlap),
    for any chunk: outputs and final state (the window's feature-map keys included)."""
    t, window = 40, 5
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=t)
    q_lin, k_lin = linear_inputs(q, k)
    valid = left_padding(2, t, [0, 7])
    valid[0, 20] = False
    lin = dict(q_lin=q_lin, k_lin=k_lin)
    out, state = lola_attention(q, k, v, window=window, sparse=0, chunk=chunk, valid=valid, **lin, **kw)
    hyb, hyb_state = hybrid_attention(q, k, v, window=window, mix="joint", overlap=False, valid=valid, **lin, **kw)
    torch.testing.assert_close(out, hyb, atol=1e-5, rtol=1e-5)
    assert hyb_state.window.linear_keys is not None
    assert_states_equal(state.window, hyb_state.window)
    assert_states_equal(state.linear, hyb_state.linear)
    assert state.sparse.linear_keys.shape == (2, 4, 0, 8)
    spec, _ = hybrid_attention_reference(q, k, v, window=window, mix="joint", overlap=False, valid=valid, **lin, **kw)
    torch.testing.assert_close(out, spec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 5, 16], ids=lambda c: f"C{c}")
def test_linear_inputs_sparse_covering_all_tokens_is_exact_softmax(chunk):
    """lambda >= T: everything is read exactly with the RoPE'd q/k; the linear inputs play no role."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=21)
    q_lin, k_lin = linear_inputs(q, k)
    valid = left_padding(2, 21, [4, 0])
    expected = causal_softmax(q, k, v, valid)
    args = dict(window=5, sparse=21, chunk=chunk, valid=valid, q_lin=q_lin, k_lin=k_lin, **kw)
    out, state = lola_attention(q, k, v, **args)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not state.linear.k_sum.any()
    ref, _ = lola_attention_reference(q, k, v, **args)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sparse", [0, 3], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("chunk", [1, 3, 16], ids=lambda c: f"C{c}")
def test_linear_inputs_prefill_then_decode(chunk, sparse):
    """Prefill with chunk C, then token-by-token decode == one call over the rest at C = 1; at C = 1 or
    lambda = 0 also == one call over everything; split/merge of the state per request round-trips."""
    t, p, window = 30, 12, 6
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=t)
    q_lin, k_lin = linear_inputs(q, k)
    valid = left_padding(2, t, [0, 5])
    args = dict(window=window, sparse=sparse, chunk=chunk, **kw)

    def call(lo, hi, state=None, **extra):
        s = slice(lo, hi)
        return lola_attention(q[:, :, s], k[:, :, s], v[:, :, s], q_lin=q_lin[:, :, s], k_lin=k_lin[:, :, s],
                              valid=valid[:, s], state=state, **(args | extra))

    head, head_state = call(0, p)
    outs, state = [head], head_state
    with torch.inference_mode():
        for i in range(p, t):
            out, state = call(i, i + 1, state)
            outs.append(out)
    decoded = torch.cat(outs, dim=2)
    tail, tail_state = call(p, t, head_state, chunk=1)
    torch.testing.assert_close(decoded, torch.cat([head, tail], dim=2), atol=1e-5, rtol=1e-5)
    assert_states_equal(state, tail_state)
    if sparse == 0 or chunk == 1:
        full, full_state = call(0, t)
        torch.testing.assert_close(decoded, full, atol=1e-5, rtol=1e-5)
        assert_states_equal(state, full_state)
    assert_states_equal(LolaState.merge(state.split([1, 1])), state, atol=0)


def test_selection_follows_the_linear_keys_recall_error():
    """SRE(k, v | H, s) uses phi(k_lin): the memory (cache, state) depends on v and k_lin only, not on
    the softmax's q/k; it is the memory plain LoLA keeps when its keys ARE k_lin; and at each decode
    step the kept candidates are the top-lambda by ||H^T phi(k_lin) / phi(k_lin)^T s - v||, which here
    differ from those phi(k) would keep. (Unit-norm values, so that the ranking rests on the recall.)"""
    window, sparse, t = 3, 2, 26
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=t, seed=3)
    v = v / v.norm(dim=-1, keepdim=True)
    q_lin, k_lin = linear_inputs(q, k, seed=4)
    args = dict(window=window, sparse=sparse, chunk=1, **kw)
    _, state = lola_attention(q, k, v, q_lin=q_lin, k_lin=k_lin, **args)
    _, ref_state = lola_attention_reference(q, k, v, q_lin=q_lin, k_lin=k_lin, **args)
    assert_states_equal(state, ref_state)
    _, as_keys = lola_attention(q, k_lin, v, **args)  # plain LoLA whose keys are k_lin
    assert_states_equal(state.sparse, dataclasses.replace(as_keys.sparse, keys=state.sparse.keys, linear_keys=as_keys.sparse.keys))
    assert_states_equal(state.linear, as_keys.linear)
    _, other_qk = lola_attention(q.flip(2), k.flip(2), v, q_lin=q_lin, k_lin=k_lin, **args)  # other softmax inputs
    assert torch.equal(other_qk.sparse.positions, state.sparse.positions)
    _, plain = lola_attention(q, k, v, **args)  # selection by phi(k) instead: another memory
    assert not torch.equal(plain.sparse.positions, state.sparse.positions)

    # Decode steps by hand: candidates = G U the window's oldest token, scored against (H, s).
    _, st = lola_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], q_lin=q_lin[:, :, :10], k_lin=k_lin[:, :, :10], **args)
    differs = 0
    for i in range(10, t):
        cand_v = torch.cat([st.sparse.values, repeat_kv(st.window.values[:, :, :1], 2)], dim=2)  # (1, Hq, L+1, Dv)
        cand_pos = torch.cat([st.sparse.positions, st.window.positions[:, None, :1].expand(1, 2, 1)], dim=2)
        cand_lk = torch.cat([st.sparse.linear_keys, repeat_kv(st.window.linear_keys[:, :, :1], 2)], dim=2)
        cand_k = torch.cat([st.sparse.keys, repeat_kv(st.window.keys[:, :, :1], 2)], dim=2)
        err = self_recall_error(kw["phi_k"](cand_lk), cand_v, st.linear)  # (1, Hq, L+1)
        err_k = self_recall_error(kw["phi_k"](cand_k), cand_v, st.linear)
        kept = cand_pos.gather(-1, err.topk(sparse, dim=-1).indices).sort(-1).values
        kept_k = cand_pos.gather(-1, err_k.topk(sparse, dim=-1).indices).sort(-1).values
        s = slice(i, i + 1)
        _, st = lola_attention(q[:, :, s], k[:, :, s], v[:, :, s], q_lin=q_lin[:, :, s], k_lin=k_lin[:, :, s], state=st, **args)
        assert torch.equal(kept, st.sparse.positions), f"step {i}"
        differs += int(not torch.equal(kept_k, kept))
    assert differs > 0  # the RoPE'd keys' recall error would have kept other tokens
    assert_states_equal(st, state)


def test_linear_inputs_equal_to_q_k_give_plain_lola():
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=20)
    args = dict(window=4, sparse=3, chunk=3, **kw)
    plain, plain_state = lola_attention(q, k, v, **args)
    same, same_state = lola_attention(q, k, v, q_lin=q, k_lin=k, **args)
    torch.testing.assert_close(same, plain)
    torch.testing.assert_close(same_state.window.linear_keys, plain_state.window.keys)
    torch.testing.assert_close(same_state.sparse.linear_keys, plain_state.sparse.keys)
    assert_states_equal(same_state.linear, plain_state.linear)


def test_linear_inputs_cannot_switch_mid_sequence():
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=6)
    q_lin, k_lin = linear_inputs(q, k)
    args = dict(window=4, sparse=2, **kw)
    _, plain_state = lola_attention(q, k, v, **args)
    _, sep_state = lola_attention(q, k, v, q_lin=q_lin, k_lin=k_lin, **args)
    with pytest.raises(ValueError, match="does not keep separate feature-map keys but this call gives q_lin/k_lin"):
        lola_attention(q, k, v, q_lin=q_lin, k_lin=k_lin, state=plain_state, **args)
    with pytest.raises(ValueError, match="keeps separate feature-map keys but this call does not give q_lin/k_lin"):
        lola_attention(q, k, v, state=sep_state, **args)
    half = dataclasses.replace(sep_state, sparse=plain_state.sparse)  # window with, cache without: malformed
    with pytest.raises(ValueError, match="sparse cache does not keep"):
        lola_attention(q, k, v, q_lin=q_lin, k_lin=k_lin, state=half, **args)
    for fn in (lola_attention, lola_attention_reference):
        with pytest.raises(ValueError, match="go together"):
            fn(q, k, v, q_lin=q_lin, **args)
        with pytest.raises(ValueError, match="expected those of"):
            fn(q, k, v, q_lin=q_lin, k_lin=k_lin[:, :, :3], **args)
    with pytest.raises(ValueError, match="merge"):
        LolaState.merge([plain_state, sep_state])


# --- attention sinks and the linear term's weight -------------------------------------------------
SINK_CASES = {
    "w4-s3-sinks2-lw0.25": dict(window=4, sparse=3, sinks=2, linear_weight=0.25),
    "w3-s2-sinks2-lw1": dict(window=3, sparse=2, sinks=2, linear_weight=1.0),
    "w4-s3-sinks0-lw0": dict(window=4, sparse=3, sinks=0, linear_weight=0.0),
    "w5-s4-sinks1-lw3": dict(window=5, sparse=4, sinks=1, linear_weight=3.0),
    "w4-s3-sinks1-per-head": dict(window=4, sparse=3, sinks=1, linear_weight=[1.0, 0.0, 0.03, 0.3]),
    "w3-s2-sinks0-lw1-tokens3": dict(window=3, sparse=2, sinks=0, linear_weight=1.0, weight_tokens=3),
    "w4-s3-sinks1-per-head-tokens6": dict(window=4, sparse=3, sinks=1, linear_weight=[1.0, 0.0, 0.03, 0.3], weight_tokens=6),
}


@pytest.mark.parametrize("chunk", [1, 3, 16], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("case", list(SINK_CASES.values()), ids=list(SINK_CASES))
def test_sinks_and_linear_weight_match_reference(case, chunk):
    """Fast path == the reference loop with sinks and a linear weight: outputs, final state and
    gradients, with padding; and the sinks are in the sparse cache at the end of every row."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=26)
    valid = left_padding(2, 26, [3, 0])
    factor = kw.pop("window_factor")
    results = []
    for fn in (lola_attention, lola_attention_reference):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, factor)]
        out, state = fn(*leaves[:3], chunk=chunk, valid=valid, window_factor=leaves[3], **case, **kw)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        loss = (out * w).sum() + state.linear.kv.sum() + state.sparse.values.sum()
        results.append((out, state, torch.autograd.grad(loss, leaves)))
    (out, state, g_fast), (ref, ref_state, g_ref) = results
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_states_equal(state, ref_state)
    for name, a, b in zip("qkvf", g_fast, g_ref):
        # with linear_weight 0 the window factor cancels: its gradient is round-off around 0
        atol = 1e-4 if name == "f" and 0 in np.atleast_1d(case["linear_weight"]) else 1e-5
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")
    for s in range(case["sinks"]):
        assert (state.sparse.positions == s).any(-1).all(), f"sink {s} was evicted"


def test_sinks_stay_while_others_are_evicted_and_decode_continues():
    """A sink survives any number of decode steps, while without sinks the same token is evicted."""
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=40)
    args = dict(window=3, sparse=2, chunk=1, **kw)
    kept = {}
    for sinks in (0, 1):
        _, state = lola_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], sinks=sinks, **args)
        for i in range(8, 40):
            step = slice(i, i + 1)
            _, state = lola_attention(q[:, :, step], k[:, :, step], v[:, :, step], state=state, sinks=sinks, **args)
        kept[sinks] = (state.sparse.positions == 0).any(-1)  # (B, Hq)
    assert kept[1].all()
    assert not kept[0].all()


def test_linear_weight_zero_equals_hiding_the_state():
    """linear_weight 0 reads exactly what read_state=False reads; the state kept is the same."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=21)
    a, sa = lola_attention(q, k, v, window=4, sparse=3, chunk=4, linear_weight=0.0, **kw)
    b, sb = lola_attention(q, k, v, window=4, sparse=3, chunk=4, read_state=False, **kw)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert_states_equal(sa, sb, atol=0)


def test_per_head_linear_weights_read_each_head_as_its_own_weight():
    """A weight per query head gives each head exactly the output of that weight for all heads;
    what is kept does not depend on the weights."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=23)
    weights = [0.5, 0.0, 2.0, 0.01]
    out, state = lola_attention(q, k, v, window=4, sparse=3, chunk=4, sinks=1, linear_weight=weights, **kw)
    for h, w in enumerate(weights):
        one, one_state = lola_attention(q, k, v, window=4, sparse=3, chunk=4, sinks=1, linear_weight=w, **kw)
        torch.testing.assert_close(out[:, h], one[:, h], atol=1e-6, rtol=1e-6)
        assert_states_equal(state, one_state, atol=0)


def test_weight_tokens_scale_the_linear_term_by_the_states_token_count():
    """weight_tokens N: a state holding n > N tokens is read with weight N / n. A bound no state
    reaches reads as 0 (off); decode continues a prefill exactly as a chunk-1 prefill does; the
    state's token count is what was written into it."""
    from linearize.ops.lola import state_tokens

    q, k, v, kw = make(b=2, hq=4, hkv=2, t=30)
    valid = left_padding(2, 30, [0, 5])
    args = dict(window=4, sparse=3, sinks=1, valid=valid, **kw)
    off, off_state = lola_attention(q, k, v, chunk=4, **args)
    far, far_state = lola_attention(q, k, v, chunk=4, weight_tokens=1000, **args)
    torch.testing.assert_close(far, off, atol=0, rtol=0)
    on, on_state = lola_attention(q, k, v, chunk=4, weight_tokens=4, **args)
    assert not torch.allclose(on, off)
    assert_states_equal(on_state, off_state, atol=0)  # what is kept does not depend on the read
    # 30 real tokens in row 0 (25 in row 1), 4 in the window, 3 in the cache: the rest in the state
    assert state_tokens(on_state).tolist() == [[23] * 4, [18] * 4]

    full, full_state = lola_attention(q, k, v, chunk=1, weight_tokens=4, **args)
    p = 12
    outs = []
    pre = dict(args, valid=valid[:, :p])
    out, state = lola_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], chunk=1, weight_tokens=4, **pre)
    outs.append(out)
    for t in range(p, 30):
        step = slice(t, t + 1)
        out, state = lola_attention(q[:, :, step], k[:, :, step], v[:, :, step], weight_tokens=4,
                                    **dict(args, valid=valid[:, step]), state=state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)
    assert_states_equal(state, full_state)


@pytest.mark.parametrize("fn", [lola_attention, lola_attention_reference], ids=["fast", "reference"])
@pytest.mark.parametrize("bad", [-1, 2.5, True], ids=["negative", "float", "bool"])
def test_weight_tokens_invalid_raise(fn, bad):
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=6)
    with pytest.raises(ValueError, match=f"weight_tokens must be an integer >= 0 \\(0: off\\), got {bad!r}"):
        fn(q, k, v, window=2, sparse=3, weight_tokens=bad, **kw)


@pytest.mark.parametrize("change, match", [(dict(sinks=4), "sinks must lie"), (dict(sinks=-1), "sinks must lie"),
                                           (dict(linear_weight=-0.5), "linear_weight must be"),
                                           (dict(linear_weight=[1.0, 0.5, 0.1]), r"linear_weight must be one number or 2"),
                                           (dict(linear_weight=[1.0, float("nan")]), "finite and >= 0")],
                         ids=["sinks>sparse", "sinks<0", "weight<0", "weights-per-head-count", "weight-nan"])
def test_sinks_and_weight_invalid_raise(change, match):
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=6)
    with pytest.raises(ValueError, match=match):
        lola_attention(q, k, v, window=2, sparse=3, **change, **kw)



# --- recall "memory": a candidate recalled by the older candidates is not held again ------------------
@pytest.mark.parametrize("chunk", [1, 3, 16], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("separate", [False, True], ids=["rope-maps", "separate-maps"])
@pytest.mark.parametrize("case", [dict(window=4, sparse=3, sinks=1), dict(window=3, sparse=5, sinks=0, weight_tokens=4)],
                         ids=["w4-s3-sinks1", "w3-s5-tokens4"])
def test_memory_recall_matches_reference(case, separate, chunk):
    """recall="memory": the chunk loop == the reference loop (outputs, final state, gradients), with
    padding, grouped heads and separate feature-map inputs; it keeps a different cache than
    recall="state" on the same inputs (the option does something)."""
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=27)
    valid = left_padding(2, 27, [0, 4])
    lin = {"q_lin": torch.randn(q.shape, generator=torch.Generator().manual_seed(7)),
           "k_lin": torch.randn(k.shape, generator=torch.Generator().manual_seed(8))} if separate else {}
    results = []
    for fn in (lola_attention, lola_attention_reference):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out, state = fn(*leaves, chunk=chunk, valid=valid, recall="memory", **case, **lin, **kw)
        loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum() + state.linear.kv.sum()
        results.append((out, state, torch.autograd.grad(loss, leaves)))
    (out, state, g_fast), (ref, ref_state, g_ref) = results
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_states_equal(state, ref_state)
    for name, a, b in zip("qkv", g_fast, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")
    _, plain = lola_attention(q, k, v, chunk=chunk, valid=valid, **case, **lin, **kw)
    assert not torch.equal(plain.sparse.positions, state.sparse.positions)


def test_memory_recall_holds_a_repeated_token_once():
    """Two alternating tokens repeated, with one distinct token early on: "state" recall fills the
    cache with copies of the repeated tokens (the state recalls them only as a blur) and evicts the
    distinct one; "memory" recall keeps the oldest copy of each repeated token and the distinct one."""
    d, t = 16, 60
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, d, generator=g) * 3  # two repeated keys, sharp under the softmax scale
    values = torch.randn(2, d, generator=g)
    k = base[torch.arange(t) % 2].clone()
    v = values[torch.arange(t) % 2].clone()
    k[5], v[5] = torch.randn(d, generator=g) * 3, torch.randn(d, generator=g) * 0.1  # the distinct token: a small value
    k, v = k[None, None], v[None, None]  # (1, 1, T, D)
    q = torch.randn(1, 1, t, d, generator=g)
    phi = hedgehog(1, d, 3)
    kw = dict(phi_q=phi, phi_k=phi, window_factor=torch.ones(1), window=4, sparse=4, chunk=4)
    held = {}
    for recall in ("state", "memory"):
        _, state = lola_attention(q, k, v, recall=recall, **kw)
        assert state.sparse.valid.all()
        held[recall] = state.sparse.positions[0, 0].tolist()
    assert 5 not in held["state"]  # four copies of the repeated tokens
    assert held["memory"][:3] == [0, 1, 5]  # the first copy of each, the distinct token (the last slot: any copy)


@pytest.mark.parametrize("fn", [lola_attention, lola_attention_reference], ids=["fast", "reference"])
def test_recall_invalid_raises(fn):
    q, k, v, kw = make(b=1, hq=2, hkv=1, t=6)
    with pytest.raises(ValueError, match=r"recall must be one of \('state', 'memory'\), got 'cache'"):
        fn(q, k, v, window=2, sparse=3, recall="cache", **kw)


def test_per_head_weights_are_kept_on_the_device_once():
    """``on_device`` copies option values to a device once per value (no copy, hence no wait for the
    stream, in later forwards), as a normal tensor even under inference mode; on their own device
    they come back as they are (contiguous: the kernels read them so)."""
    from linearize.ops.common import head_weights, on_device

    w = head_weights([0.5, 1.0, 0.0], 3)
    assert on_device(w, "cpu") is w
    one = on_device(head_weights(0.5, 3), "cpu")  # one number for every head, made a contiguous tensor by head_weights
    assert one.is_contiguous() and one.tolist() == [0.5] * 3
    meta = torch.device("meta")  # another device than the weights'; a meta tensor holds no values
    with torch.inference_mode():
        first = on_device(w, meta)
    again = on_device(head_weights([0.5, 1.0, 0.0], 3), meta)
    assert again is first and first.device == meta and first.shape == (3,) and first.dtype == torch.float32
    assert not first.is_inference()
    assert on_device(head_weights(0.5, 3), meta) is not first  # other values: another tensor
