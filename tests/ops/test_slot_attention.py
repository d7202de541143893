"""Slot attention over keys kept in slot pools: one query token per row, each row its own length
(decode), and one row's causal prefill chunk. The kernels (on the GPU when there is one, else in
Triton's interpreter on the CPU) against the float32 references, and the references against softmax
attention on the row's tokens."""

from __future__ import annotations

import pytest
import torch

from linearize.ops import fused_decode
from linearize.ops.softmax import (
    combine_parts,
    slot_attention,
    slot_attention_reference,
    slot_prefill_attention,
    slot_prefill_attention_reference,
    softmax_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pools(slots, hkv, cap, d, dv, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(slots, hkv, cap, d, generator=g).to(device, dtype)
    values = torch.randn(slots, hkv, cap, dv, generator=g).to(device, dtype)
    return keys, values


@torch.no_grad()
def test_reference_is_softmax_attention_over_the_rows_tokens():
    """Row b of the reference equals causal softmax attention of its query over the first lengths[b]
    tokens of its slot (grouped heads); a row of length 0 gives 0."""
    keys, values = _pools(5, 2, 40, 8, 6)
    slots, lengths = torch.tensor([3, 0, 4, 1]), torch.tensor([40, 1, 17, 0])
    q = torch.randn(4, 6, 8)
    got = slot_attention_reference(q, keys, values, slots, lengths, 0.3)
    for b in range(4):
        n = int(lengths[b])
        if n == 0:
            assert got[b].abs().max() == 0
            continue
        k, v = keys[slots[b], :, :n][None], values[slots[b], :, :n][None]  # (1, Hkv, n, D): the row's tokens
        # the query as the last of n tokens: causal attention lets it see all n
        qs = torch.cat([torch.zeros(1, 6, n - 1, 8), q[b][None, :, None]], dim=2)
        want, _ = softmax_attention(qs, k, v, scale=0.3)
        torch.testing.assert_close(got[b], want[0, :, -1], atol=1e-5, rtol=1e-5)


def test_parts_combine_to_the_whole_softmax():
    torch.manual_seed(0)
    s, v = torch.randn(3, 50), torch.randn(50, 4)
    whole = torch.softmax(s, -1) @ v
    parts = [(0, 7), (7, 7), (7, 30), (30, 50)]  # one empty part
    o, m, l = [], [], []
    for a, b in parts:
        if a == b:
            o.append(torch.zeros(3, 4)), m.append(torch.full((3,), float("-inf"))), l.append(torch.zeros(3))
            continue
        mx = s[:, a:b].max(-1).values
        e = torch.exp(s[:, a:b] - mx[:, None])
        o.append(e @ v[a:b]), m.append(mx), l.append(e.sum(-1))
    got = combine_parts(torch.stack(o, 1), torch.stack(m, 1), torch.stack(l, 1))
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
    empty = combine_parts(torch.zeros(1, 2, 4), torch.full((1, 2), float("-inf")), torch.zeros(1, 2))
    assert torch.equal(empty, torch.zeros(1, 4))


@pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
@pytest.mark.parametrize("shape", [(1, 1, 16, 16), (3, 2, 8, 24), (4, 1, 37, 70)], ids=["mha", "gqa3", "D37-Dv70"])
@pytest.mark.parametrize("cap", [64, 300])
@torch.no_grad()
def test_kernel_equals_the_reference(shape, cap):
    """Rows of lengths 0, 1, a block edge and the whole capacity, slots out of order and shared by two
    rows (a scratch slot): the kernel's combined parts equal the float32 reference."""
    n_rep, hkv, d, dv = shape
    keys, values = _pools(6, hkv, cap, d, dv, device=DEVICE)
    slots = torch.tensor([5, 0, 2, 2, 3], device=DEVICE)
    lengths = torch.tensor([cap, 0, 1, 64, cap - 3], device=DEVICE)
    q = torch.randn(5, hkv * n_rep, d, device=DEVICE)
    want = slot_attention_reference(q, keys, values, slots, lengths, d**-0.5)
    with fused_decode.use_fused(True):
        assert fused_decode.enabled(q)
        got = slot_attention(q, keys, values, slots, lengths, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got[1].abs().max() == 0  # length 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@torch.no_grad()
def test_kernel_in_bfloat16_on_cuda():
    keys, values = _pools(9, 8, 4096, 128, 128, torch.bfloat16, "cuda")
    slots = torch.arange(8, device="cuda")
    lengths = torch.tensor([1, 63, 64, 65, 1000, 2048, 4095, 4096], device="cuda")
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    want = slot_attention_reference(q, keys, values, slots, lengths, 128**-0.5)
    torch.testing.assert_close(slot_attention(q, keys, values, slots, lengths, 128**-0.5), want, atol=2e-2, rtol=2e-2)


@torch.no_grad()
def test_prefill_reference_is_causal_softmax_attention_over_the_rows_tokens():
    """Query t of a chunk at start s equals causal softmax attention of the row's tokens 0..s + t
    (grouped heads): the chunk's queries as the last T of s + T tokens."""
    keys, values = _pools(4, 2, 50, 8, 6)
    q = torch.randn(6, 9, 8)  # (Hq, T, D): 3 query heads per KV head
    for start, slot in ((0, 2), (13, 1), (41, 3)):
        got = slot_prefill_attention_reference(q, keys, values, torch.tensor([start, slot]), 0.3)
        n = start + 9
        k, v = keys[slot, :, :n][None], values[slot, :, :n][None]
        qs = torch.cat([torch.zeros(1, 6, start, 8), q[None]], dim=2)
        want, _ = softmax_attention(qs, k, v, scale=0.3)
        torch.testing.assert_close(got, want[0, :, start:], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
@pytest.mark.parametrize("shape", [(1, 1, 16, 16), (3, 2, 8, 24), (2, 1, 37, 70)], ids=["mha", "gqa3", "D37-Dv70"])
@pytest.mark.parametrize("t", [64, 70])
@torch.no_grad()
def test_prefill_kernel_equals_the_reference(shape, t):
    """Chunks from position 0, across block edges, and ending at the capacity; a chunk that is not a
    whole number of blocks: the kernel equals the float32 reference."""
    n_rep, hkv, d, dv = shape
    cap = 200
    keys, values = _pools(3, hkv, cap, d, dv, device=DEVICE)
    q = torch.randn(hkv * n_rep, t, d, device=DEVICE)
    for start, slot in ((0, 0), (37, 2), (64, 1), (cap - t, 2)):
        meta = torch.tensor([start, slot], device=DEVICE)
        want = slot_prefill_attention_reference(q, keys, values, meta, d**-0.5)
        with fused_decode.use_fused(True):
            assert fused_decode.enabled(q)
            got = slot_prefill_attention(q, keys, values, meta, d**-0.5)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@torch.no_grad()
def test_prefill_kernel_in_bfloat16_on_cuda():
    keys, values = _pools(3, 8, 4096, 128, 128, torch.bfloat16, "cuda")
    q = torch.randn(32, 448, 128, device="cuda", dtype=torch.bfloat16)
    for start, slot in ((0, 0), (1000, 1), (4096 - 448, 2)):
        meta = torch.tensor([start, slot], device="cuda")
        want = slot_prefill_attention_reference(q, keys, values, meta, 128**-0.5)
        torch.testing.assert_close(slot_prefill_attention(q, keys, values, meta, 128**-0.5), want, atol=2e-2, rtol=2e-2)
