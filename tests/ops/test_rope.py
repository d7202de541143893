"""The RoPE kernel (``linearize.ops.rope``) against transformers' Llama RoPE (on the GPU when there
is one, else in Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from linearize.ops import fused_decode
from linearize.ops.rope import apply_rope, applies, rope, rope_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b: int, cos_rows: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(b + cos_rows)
    q = torch.randn(b, 37, 3, 16, generator=gen).to(DEVICE, dtype).transpose(1, 2)  # (B, H, T, D) as a projection views it
    k = torch.randn(b, 37, 1, 16, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    angle = torch.randn(cos_rows, 37, 8, generator=gen).repeat(1, 1, 2).to(DEVICE)  # as rotary_emb: halves repeated
    return q, k, angle.cos().to(dtype), angle.sin().to(dtype)


def test_reference_is_transformers_rope():
    q, k, cos, sin = _inputs(2, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(rope_reference(q, cos, sin), want_q) and torch.equal(rope_reference(k, cos, sin), want_k)


@pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
@pytest.mark.parametrize("cos_rows", [1, 2], ids=["cos-broadcast", "cos-per-row"])
@torch.no_grad()
def test_kernel_equals_the_reference(cos_rows):
    """Strided (B, H, T, D) views in, a token-major result out; cos shared by the batch or per row."""
    q, k, cos, sin = _inputs(2, cos_rows)
    with fused_decode.use_fused(True):
        assert applies(q, cos)
        got_q, got_k = apply_rope(q, k, cos, sin)
    assert got_q.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(got_q, rope_reference(q, cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, rope_reference(k, cos, sin), atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_kernel_in_bfloat16_is_within_an_ulp_of_transformers():
    q, k, cos, sin = _inputs(2, 1, torch.bfloat16)
    want, _ = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rope(q, cos, sin).float(), want.float(), atol=2e-2, rtol=1e-2)


def test_reference_without_the_kernel_or_with_gradients():
    q, k, cos, sin = _inputs(1, 1)
    with fused_decode.use_fused(False), torch.no_grad():
        assert not applies(q, cos)
    with fused_decode.use_fused(True):
        assert not applies(q, cos)  # gradients on
    with torch.no_grad(), fused_decode.use_fused(True):
        assert not applies(q[..., :12], cos[..., :12])  # half the head size (6) is not a power of two


def test_bad_shapes_are_named():
    q, _, cos, sin = _inputs(2, 1)
    with pytest.raises(ValueError, match="cos"):
        rope(q, cos[:, :5], sin[:, :5])
