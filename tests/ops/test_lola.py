"""LoLA attention: the chunked op against the per-token reference and against closed forms."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from linearize.ops.common import repeat_kv
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
        if x.is_floating_point():
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


def chunked_joint_hybrid(q, k, v, *, phi_q, phi_k, window_factor, window, chunk):
    """Joint hybrid with non-overlap, quadratic form: query t of the chunk starting at c0 (n tokens)
    sees keys [c0 + n - window, t] explicitly (softmax with f) and keys older than that through LA."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    t = q.shape[2]
    pos = torch.arange(t)
    c0 = pos // chunk * chunk
    bound = c0 + torch.clamp(t - c0, max=chunk) - window  # (T,) first explicit key of each query
    explicit = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= bound[:, None])  # (T, T)
    older = pos[None, :] < bound[:, None]  # (T, T)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~explicit, -torch.inf)
    p = window_factor[None, :, None, None] * torch.exp(scores - scores.amax(-1, keepdim=True))
    a = (phi_q(q) @ phi_k(k).transpose(-1, -2)) * older  # (B, H, T, T) linear weights, not rescaled
    return (p @ v + a @ v) / (p.sum(-1) + a.sum(-1)).unsqueeze(-1)


CASES = {
    "B2-Hq4-Hkv2-T29-D8-w4-s3": dict(b=2, hq=4, hkv=2, t=29, d=8, window=4, sparse=3),
    "B1-Hq2-Hkv2-T23-D4-w1-s0": dict(b=1, hq=2, hkv=2, t=23, d=4, window=1, sparse=0),
    "B2-Hq2-Hkv1-T30-D8-w6-s1": dict(b=2, hq=2, hkv=1, t=30, d=8, window=6, sparse=1),
    "B1-Hq2-Hkv1-T12-D8-w3-s20": dict(b=1, hq=2, hkv=1, t=12, d=8, window=3, sparse=20),
}


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_chunk1_matches_reference(case, padded):
    case = dict(case)
    window, sparse = case.pop("window"), case.pop("sparse")
    q, k, v, kw = make(**case)
    valid = left_padding(case["b"], case["t"], [3] + [0] * (case["b"] - 1)) if padded else None
    if padded:
        valid[0, 10] = False  # a hole mid-sequence as well
    ref, ref_state = lola_attention_reference(q, k, v, window=window, sparse=sparse, valid=valid, **kw)
    out, state = lola_attention(q, k, v, window=window, sparse=sparse, chunk=1, valid=valid, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_states_equal(state, ref_state)
    assert state.sparse.keys.shape == (case["b"], case["hq"], sparse, case["d"])


@pytest.mark.parametrize("chunk", [1, 3, 5, 16], ids=lambda c: f"C{c}")
def test_sparse_covering_all_tokens_is_exact_softmax(chunk):
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=21)
    valid = left_padding(2, 21, [4, 0])
    expected = causal_softmax(q, k, v, valid)
    out, state = lola_attention(q, k, v, window=5, sparse=21, chunk=chunk, valid=valid, **kw)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not state.linear.k_sum.any()
    if chunk == 1:
        ref, _ = lola_attention_reference(q, k, v, window=5, sparse=21, valid=valid, **kw)
        torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4], ids=lambda c: f"C{c}")
def test_no_sparse_is_joint_hybrid(chunk):
    q, k, v, kw = make(b=2, hq=4, hkv=2, t=26)
    expected = chunked_joint_hybrid(q, k, v, window=5, chunk=chunk, **kw)
    out, _ = lola_attention(q, k, v, window=5, sparse=0, chunk=chunk, **kw)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if chunk == 1:
        ref, _ = lola_attention_reference(q, k, v, window=5, sparse=0, **kw)
        torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


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
    if chunk == 1:
        _, ref_state = lola_attention_reference(q, k, v, window=window, sparse=sparse, **kw)
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
