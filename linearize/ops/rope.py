"""Rotary position embedding (RoPE) as one Triton kernel per tensor, for inference on the GPU.

Transformers' ``apply_rotary_pos_emb`` computes x cos + rotate_half(x) sin in five elementwise
kernels over the (B, H, T, D) views the projections give (two products, a negation, a
concatenation, a sum), each a strided pass over x: at 32K tokens of an 8B-shaped layer that is
about 2 ms of a 10 ms hybrid prefill, and about eight launches per decode step. ``rope`` reads x,
cos and sin once and writes the result once, token-major, in x's dtype (computed in float32 and
rounded once, where transformers rounds after each operation: at most a unit in the last place
apart in half precision). ``apply_rope`` takes it where ``applies`` says so (the fused kernels on
for the device, no gradient, not inside ``torch.compile``, which fuses RoPE itself) and
``rope_reference`` (transformers' operations, in the same order) otherwise; the kernel is tested
against both.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from . import fused_decode

BT = 32
"""Tokens per program."""


def applies(x: Tensor, cos: Tensor) -> bool:
    """Whether ``apply_rope`` takes the kernel for ``x`` (B, H, T, D): the fused kernels are on for
    its device (``fused_decode.enabled``), nothing needs a gradient, no compilation is under way,
    half the head size is a power of two, and cos is (B or 1, T, D) as the model's rotary embedding
    gives it (other shapes take the reference, which broadcasts)."""
    b, _, t, d = x.shape
    half = d // 2
    return (fused_decode.enabled(x) and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and d == 2 * half and half & (half - 1) == 0 and cos.dim() == 3 and cos.shape[0] in (1, b) and cos.shape[1:] == (t, d))  # fmt: skip


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(
        x, cos, sin, out, T, s_xb, s_xh, s_xt, s_cb, s_ct, s_sb, s_st, s_ob, s_ot, s_oh,
        H: tl.constexpr, HALF: tl.constexpr, BT: tl.constexpr,
    ):  # fmt: skip
        blk = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)  # one (batch row, head)
        b = r // H
        h = r % H
        t = blk * BT + tl.arange(0, BT)
        mt = t[:, None] < T
        oh = tl.arange(0, HALF)[None, :]
        px = x + b * s_xb + h * s_xh + t[:, None] * s_xt + oh
        x1 = tl.load(px, mask=mt, other=0.0).to(tl.float32)
        x2 = tl.load(px + HALF, mask=mt, other=0.0).to(tl.float32)
        pc = cos + b * s_cb + t[:, None] * s_ct + oh
        ps = sin + b * s_sb + t[:, None] * s_st + oh
        c1 = tl.load(pc, mask=mt, other=0.0).to(tl.float32)
        c2 = tl.load(pc + HALF, mask=mt, other=0.0).to(tl.float32)
        s1 = tl.load(ps, mask=mt, other=0.0).to(tl.float32)
        s2 = tl.load(ps + HALF, mask=mt, other=0.0).to(tl.float32)
        po = out + b * s_ob + t[:, None] * s_ot + h * s_oh + oh
        tl.store(po, (x1 * c1 - x2 * s1).to(out.dtype.element_ty), mask=mt)  # x cos + (-x2, x1) sin, first half
        tl.store(po + HALF, (x2 * c2 + x1 * s2).to(out.dtype.element_ty), mask=mt)

    return rope_kernel


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, D) (its last axis contiguous) rotated by cos and sin (B or 1, T, D) as
    transformers' Llama does: (B, H, T, D) in x's dtype, a view of a token-major (B, T, H, D) tensor."""
    b, h, t, d = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("x, cos and sin must be contiguous in their last axis")
    if cos.shape != sin.shape or cos.shape[-2:] != (t, d) or cos.shape[0] not in (1, b):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be ({b} or 1, {t}, {d}) for x {tuple(x.shape)}")
    out = torch.empty(b, t, h, d, device=x.device, dtype=x.dtype)
    if x.numel() == 0:
        return out.transpose(1, 2)
    cb = cos.stride(0) if cos.shape[0] == b else 0
    sb = sin.stride(0) if sin.shape[0] == b else 0
    _kernel()[(-(-t // BT), b * h)](
        x, cos, sin, out, t, x.stride(0), x.stride(1), x.stride(2), cb, cos.stride(1), sb, sin.stride(1),
        out.stride(0), out.stride(1), out.stride(2), H=h, HALF=d // 2, BT=BT, num_warps=4,
    )  # fmt: skip
    return out.transpose(1, 2)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x cos + rotate_half(x) sin with rotate_half(x) = [-x2, x1], cos/sin broadcast over heads:
    transformers' Llama RoPE, operation for operation."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(q, k) rotated: the kernel where ``applies``, else ``rope_reference``."""
    if applies(q, cos):
        return rope(q, cos, sin), rope(k, cos, sin)
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)
