"""DSLA's prefill in two Triton kernels, both states together, the gates made where they are used.

``dsla_prefill`` on fla runs the two states as 2 Hq heads of one ``chunk_gla`` call: q and k written
twice, the values repeated to every query head with a column of ones for the normaliser (V = Dv + 1,
which fla tiles by 64, so a third tile holds one column), and both log-gates projected, passed
through log-sigmoid and written to memory in float32 (2 Hq F floats per token) before fla reads them
again for its cumulative sums. ``dsla_prefill_fused`` computes the same outputs and final states
this way:

- no pass of its own for the gates: the state kernel takes the gates' low-rank inputs x W_down
  (B, T, 2, R) and makes log alpha = logsigmoid(x W_down W_up + b) / 16 for the tile it needs, in
  float32 registers (a rank-R matmul per tile), summing them over the block as it goes;
- ``dsla_states``: one program per (row, query head, feature tile, value tile) walks the blocks of
  ``BLOCK`` tokens in order and keeps both states, S = diag(exp(G_end)) S + (phi(k) exp(G_end - G))^T v,
  storing them (in the input dtype) before each block, and the normaliser z beside them (float32),
  and the final states (float32) after the last block. The keys and values are loaded once for both
  states; the values are read per KV head (no repeated heads, no ones column);
- ``dsla_states`` also writes each token's log decay from its block's start, both gates, in
  float32 (B, T, 2, Hq, F): the cumulative sums it makes for its keys anyway. The output kernel
  reads them instead of making the gates again (at 128K tokens of a Llama-3-8B-shaped layer the
  op took 28.6 ms this way against 33.0 ms making them in both kernels; storing them in float16 gave
  28.1 ms at 8x the output error, and the gates' product as three bfloat16 tensor-core products, or
  the two states read one after the other, were slower);
- ``dsla_output``: one program per (block of ``BLOCK`` queries, row and query head, value tile):
  both states' reads from the state before the block, the causal part within the block, the
  normalisers, and the gamma mix, written token-major. Only a sub-block with a decay too strong to
  factor (below) makes its gates itself.

The block's causal part needs the pairwise decays exp(G_t - G_s), s <= t, per feature (G the log
decay from the block's start). Where no feature of either state decays by more than
e^-FACTORED_DECAY_LIMIT over the block (the states kernel stores each block's decay), they factor
into exp(G_t) exp(-G_s), both within e^+-30: the causal part is one matmul per state over the whole
block, as the torch kernel does under the same limit. A stronger decay takes sub-blocks of ``SUB``
queries. Where no sub-block decays by more than e^-FACTORED_DECAY_LIMIT (trained gates that pass
the limit over a block mostly stay within it over a sub-block), a sub-block's weights on the block's
keys up to its last token e factor at e: exp(G_t - G_e) in [1, e^LIMIT] and exp(G_e - G_s) <= 1, one
matmul per state and sub-block. Otherwise every exponent is <= 0: a sub-block reads the earlier
sub-blocks' keys as q exp(G - r) and k exp(r - G') with r the log decay at its start (both factors
<= 1), and its own keys one at a time, the decays taken pairwise. Everything is accumulated in float32.

``ops.dsla.dsla_attention`` stays the specification: tests/ops/test_fused_dsla.py compares outputs
and final states (on the GPU, and on the CPU through Triton's interpreter).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import fused_decode
from .common import EMPTY_DENOMINATOR
from .dsla import FACTORED_DECAY_LIMIT, GATE_NORMALISER, token_major_sizes
from .fused_prefill import _strides, state_tiled
from .states import DslaState

BLOCK = 64
"""Tokens per block: the states are stored before each block; one output program per block."""
BLOCKS = (16, 32, 64, 128)
"""The block lengths ``dsla_prefill_fused`` takes."""
SUB = 16
"""Queries per sub-block of the output kernel (its decays within a sub-block are taken pairwise)."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_TILES = ((64, 64, 4, 2), (64, 64, 8, 3), (32, 64, 4, 2), (32, 128, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (32, 32, 4, 3),
               (16, 16, 4, 2), (32, 128, 8, 2, 128))  # fmt: skip
"""(BK, BV, num_warps, num_stages[, registers per thread at most]) that ``dsla_states`` is autotuned
over on a GPU (those that fit). The last: two 8-warp programs per SM instead of one (ptxas for sm_90
at the Llama-3-8B shape: 128 registers and 30 spilled, against 175 and none uncapped;
``scripts/kernel_resources.py``)."""
OUTPUT_TILES = ((32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (16, 16, 4, 1), (32, 128, 8, 2, 128))
"""(BK, BV, num_warps, num_stages[, registers per thread at most]) that ``dsla_output`` is autotuned
over on a GPU (those that fit). The last: two 8-warp programs per SM instead of one (128 registers
and 102 spilled, against 242 and none uncapped)."""


def applies(qf: Tensor, v: Tensor, rank: int) -> bool:
    """Whether ``dsla_prefill_fused`` runs for features ``qf`` (B, T, Hq, F) and values ``v``
    (B, T, Hkv, Dv) with gates of rank ``rank``: half precision, or float32 inside
    ``fused_decode.use_fused(True)``; F, Dv and the rank (padded to 16) powers of two from 16.
    The caller checks ``fused_prefill.for_inference`` (CUDA, no gradient, no padding)."""
    if qf.dtype not in DTYPES or v.dtype != qf.dtype or (qf.dtype == torch.float32 and not fused_decode.forced()):
        return False
    return fused_decode.tile_sized(qf.shape[-1], v.shape[-1], padded_rank(rank))


def padded_rank(rank: int) -> int:
    """The gates' rank as the kernels take it: the next power of two, at least 16 (zeros fill it)."""
    return max(16, 1 << (rank - 1).bit_length())


_log_gates: Any = None
"""A block's log-gates from the gates' low-rank inputs: a Triton function made by ``_kernels``."""
_cum_gates: Any = None
"""Where a token's cumulative log-gates lie in the float32 (B, T, 2, Hq, F) buffer: a Triton function made by ``_kernels``."""
_state_block: Any = None
"""``dsla_states``' step over one block: a Triton function made by ``_kernels``."""
_state_reads: Any = None
"""Both states' reads of the state before a block: a Triton function made by ``_kernels``."""
_mix_store: Any = None
"""The gamma mix of the two reads, stored: a Triton function made by ``_kernels``."""
_NORMALISER: Any = None
"""GATE_NORMALISER as a Triton constant (set by ``_kernels``)."""


class _Kernels(NamedTuple):
    states: Any
    output: Any


@functools.cache
def _kernels() -> _Kernels:
    import triton
    import triton.language as tl

    @triton.jit
    def log_gates(xr, up, bias, b, s, t, mt, ok, s_xb, s_xt, HF: tl.constexpr, R: tl.constexpr):
        """Log-gates of state ``s`` for tokens ``t`` (valid where ``mt``) and features ``ok`` of one
        head (``ok`` offset by the head): logsigmoid(x W_down W_up + b) / 16 in float32, 0 where
        not valid (no decay). The rank-R product is exact float32 ("ieee"): as "tf32" on sm90
        (Triton 3.6) the states kernel read out of bounds with 8 warps, the output kernel gave NaN with 16 x 16 tiles."""
        wr = tl.arange(0, R)
        x = tl.load(xr + b * s_xb + t[:, None] * s_xt + s * R + wr[None, :], mask=mt[:, None], other=0.0)  # (rows, R)
        u = tl.load(up + s * R * HF + wr[:, None] * HF + ok[None, :])  # (R, BK)
        z = tl.dot(x, u, input_precision="ieee") + tl.load(bias + s * HF + ok)[None, :]
        ls = tl.minimum(z, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(z)))  # logsigmoid
        return tl.where(mt[:, None], ls / _NORMALISER, 0.0)

    @triton.jit
    def cum_gates(cg, b, T, t, h, ok, F: tl.constexpr, HF: tl.constexpr):
        """Pointers to the first gate's cumulative log-gates of tokens ``t`` and features ``ok`` of
        head ``h`` in ``cg`` (B, T, 2, Hq, F) contiguous, float32 (the second gate's are HF further):
        the layout ``dsla_prefill_fused`` allocates, written by ``dsla_states``, read by ``dsla_output``.
        (Its body names ``tl``: the compiler resolves the annotations among the names a body uses.)"""
        row = tl.cast(b * T, t.dtype) + t  # (B, T) flattened
        return cg + row[:, None] * (2 * HF) + h * F + ok[None, :]

    @triton.jit
    def state_block(
        s1, s2, z1, z2, n, kf, values, xr, up, bias, hs, zs, ends, cg, T, TV, b, h, hk, ok, ov, iv,
        s_fb, s_ft, s_fh, s_vb, s_vt, s_vh, s_xb, s_xt, s_hb, s_hn, s_hs, s_hh, s_zb, s_zn, s_zs, s_zh,
        F: tl.constexpr, DV: tl.constexpr, HF: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        """Store both states (and normalisers) before block n and the block's cumulative log-gates;
        return the states after it. Tokens from TV on (<= T) are padding: no key, no value, no decay."""
        first = (ok * 0 + iv) == 0  # one value tile's programs store the per-feature vectors
        tile = ok[:, None] * DV + ov[None, :]  # (feature, value) within a head's stored state
        n = tl.cast(n, tl.int64)  # offsets past 2^31 elements: the stored states at 128K tokens, the features at 256K
        base = hs + b * s_hb + n * s_hn + h * s_hh
        tl.store(base + tile, s1.to(hs.dtype.element_ty))
        tl.store(base + s_hs + tile, s2.to(hs.dtype.element_ty))
        if NORM:
            zbase = zs + b * s_zb + n * s_zn + h * s_zh + ok
            tl.store(zbase, z1, mask=first)
            tl.store(zbase + s_zs, z2, mask=first)
        t = n * BLOCK + tl.arange(0, BLOCK)
        mt = t < T
        mv = t < TV  # the tokens that are not padding
        kt = tl.load(kf + b * s_fb + t[:, None] * s_ft + h * s_fh + ok[None, :], mask=mv[:, None], other=0.0).to(tl.float32)
        vt = tl.load(values + b * s_vb + t[:, None] * s_vt + hk * s_vh + ov[None, :], mask=mv[:, None], other=0.0)
        g1 = _log_gates(xr, up, bias, b, 0, t, mv, h * F + ok, s_xb, s_xt, HF=HF, R=R)  # (BLOCK, BK)
        g2 = _log_gates(xr, up, bias, b, 1, t, mv, h * F + ok, s_xb, s_xt, HF=HF, R=R)
        end1, end2 = tl.sum(g1, axis=0), tl.sum(g2, axis=0)  # (BK,): log decay over the block
        ebase = ends + b * s_zb + n * s_zn + h * s_zh + ok
        tl.store(ebase, end1, mask=first)
        tl.store(ebase + s_zs, end2, mask=first)
        c1, c2 = tl.cumsum(g1, axis=0), tl.cumsum(g2, axis=0)  # log decay from the block's start, per token
        cptr = _cum_gates(cg, b, T, t, h, ok, F=F, HF=HF)  # the output kernel reads them
        tl.store(cptr, c1, mask=mt[:, None] & first[None, :])
        tl.store(cptr + HF, c2, mask=mt[:, None] & first[None, :])
        k1 = kt * tl.exp(end1[None, :] - c1)  # each key decayed to the block's end
        k2 = kt * tl.exp(end2[None, :] - c2)
        prec: tl.constexpr = "ieee" if IEEE else "tf32"
        s1 = s1 * tl.exp(end1)[:, None] + tl.dot(tl.trans(k1.to(vt.dtype)), vt, input_precision=prec)
        s2 = s2 * tl.exp(end2)[:, None] + tl.dot(tl.trans(k2.to(vt.dtype)), vt, input_precision=prec)
        if NORM:
            z1 = z1 * tl.exp(end1) + tl.sum(k1, axis=0)
            z2 = z2 * tl.exp(end2) + tl.sum(k2, axis=0)
        return s1, s2, z1, z2

    @triton.jit
    def state_reads(num1, num2, den1, den2, q1, q2, hbase, zbase, ok, ov, s_hs, s_zs, DV: tl.constexpr, NORM: tl.constexpr,
                    IEEE: tl.constexpr):  # fmt: skip
        """Add both states' reads by the decayed queries q1, q2 (features ``ok``, values ``ov``) of the
        states before the block to the numerators, and of their normalisers to the denominators."""
        prec: tl.constexpr = "ieee" if IEEE else "tf32"
        st = ok[:, None] * DV + ov[None, :]
        h1 = tl.load(hbase + st)
        h2 = tl.load(hbase + s_hs + st)
        num1 += tl.dot(q1.to(h1.dtype), h1, input_precision=prec)
        num2 += tl.dot(q2.to(h2.dtype), h2, input_precision=prec)
        if NORM:
            den1 += tl.sum(q1 * tl.load(zbase + ok)[None, :], axis=1)
            den2 += tl.sum(q2 * tl.load(zbase + s_zs + ok)[None, :], axis=1)
        return num1, num2, den1, den2

    @triton.jit
    def mix_store(num1, num2, den1, den2, gm, scale, ptrs, mask, NORM: tl.constexpr, EPS: tl.constexpr):
        """gamma and 1 - gamma on the two reads, each over its normaliser (0 where that is empty) or
        times ``scale`` without one; stored at ``ptrs``."""
        if NORM:
            w1 = tl.where(den1 > EPS, gm / tl.where(den1 > EPS, den1, 1.0), 0.0)
            w2 = tl.where(den2 > EPS, (1.0 - gm) / tl.where(den2 > EPS, den2, 1.0), 0.0)
            o = num1 * w1[:, None] + num2 * w2[:, None]
        else:
            o = scale * (gm * num1 + (1.0 - gm) * num2)
        tl.store(ptrs, o.to(ptrs.dtype.element_ty), mask=mask)

    # Module globals: Triton's interpreter resolves the names a kernel calls among its function's
    # globals only (the compiler also reads closures).
    globals()["_NORMALISER"] = tl.constexpr(GATE_NORMALISER)
    globals()["_log_gates"] = log_gates
    globals()["_cum_gates"] = cum_gates
    globals()["_state_block"] = state_block
    globals()["_state_reads"] = state_reads
    globals()["_mix_store"] = mix_store

    @state_tiled(STATE_TILES, ["F", "DV", "BLOCK"], interpreted=(32, 64))
    @triton.jit
    def dsla_states(
        kf, values, xr, up, bias, h0, hs, zs, ends, cg, final, T, valid, n_rep, blocks, B,
        s_fb, s_ft, s_fh, s_vb, s_vt, s_vh, s_xb, s_xt, s_hb, s_hn, s_hs, s_hh, s_zb, s_zn, s_zs, s_zh,
        H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, W: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, NORM: tl.constexpr, IEEE: tl.constexpr, PIPELINED: tl.constexpr,
        PADDED: tl.constexpr,
    ):  # fmt: skip
        ik, iv = tl.program_id(0), tl.program_id(1)
        if PADDED:  # the tokens before valid[0] are the call's: the rest is padding
            TV = tl.minimum(tl.load(valid).to(tl.int32), T)
        else:
            TV = T
        r = tl.program_id(2).to(tl.int64)  # one (batch row, query head)
        b = r // H
        h = r % H
        hk = h // n_rep
        ok, ov = ik * BK + tl.arange(0, BK), iv * BV + tl.arange(0, BV)
        tile = ok[:, None] * W + ov[None, :]  # within one state (F, W), float32
        other = B * H * F * W  # the recent state's offset in (2, B, H, F, W)
        if HAS_H0:
            s1 = tl.load(h0 + r * F * W + tile)
            s2 = tl.load(h0 + other + r * F * W + tile)
            if NORM:
                z1 = tl.load(h0 + r * F * W + ok * W + DV)
                z2 = tl.load(h0 + other + r * F * W + ok * W + DV)
            else:
                z1 = tl.zeros([BK], tl.float32)
                z2 = tl.zeros([BK], tl.float32)
        else:
            s1 = tl.zeros([BK, BV], tl.float32)
            s2 = tl.zeros([BK, BV], tl.float32)
            z1 = tl.zeros([BK], tl.float32)
            z2 = tl.zeros([BK], tl.float32)
        HF: tl.constexpr = H * F
        if PIPELINED:  # a for loop, which Triton software-pipelines
            for n in range(0, blocks):
                s1, s2, z1, z2 = _state_block(s1, s2, z1, z2, n, kf, values, xr, up, bias, hs, zs, ends, cg, T, TV, b, h, hk, ok, ov, iv,
                                              s_fb, s_ft, s_fh, s_vb, s_vt, s_vh, s_xb, s_xt, s_hb, s_hn, s_hs, s_hh, s_zb, s_zn,
                                              s_zs, s_zh, F=F, DV=DV, HF=HF, R=R, BLOCK=BLOCK, NORM=NORM, IEEE=IEEE)  # fmt: skip
        else:  # Triton's interpreter takes no range() over a run-time bound with NumPy 2
            n = 0
            while n < blocks:
                s1, s2, z1, z2 = _state_block(s1, s2, z1, z2, n, kf, values, xr, up, bias, hs, zs, ends, cg, T, TV, b, h, hk, ok, ov, iv,
                                              s_fb, s_ft, s_fh, s_vb, s_vt, s_vh, s_xb, s_xt, s_hb, s_hn, s_hs, s_hh, s_zb, s_zn,
                                              s_zs, s_zh, F=F, DV=DV, HF=HF, R=R, BLOCK=BLOCK, NORM=NORM, IEEE=IEEE)  # fmt: skip
                n += 1
        tl.store(final + r * F * W + tile, s1)
        tl.store(final + other + r * F * W + tile, s2)
        if NORM:
            zmask = (ok * 0 + iv) == 0
            tl.store(final + r * F * W + ok * W + DV, z1, mask=zmask)
            tl.store(final + other + r * F * W + ok * W + DV, z2, mask=zmask)

    @state_tiled(OUTPUT_TILES, ["F", "DV", "BLOCK"], interpreted=(32, 64))
    @triton.jit
    def dsla_output(
        qf, kf, values, xr, up, bias, hs, zs, ends, cg, gamma, out, T, n_rep, scale,
        s_fb, s_ft, s_fh, s_vb, s_vt, s_vh, s_xb, s_xt, s_hb, s_hn, s_hs, s_hh, s_zb, s_zn, s_zs, s_zh, s_ob, s_ot, s_oh,
        H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr, IEEE: tl.constexpr, EPS: tl.constexpr, LIMIT: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements: the stored states at 128K tokens, the features at 256K
        r = tl.program_id(1).to(tl.int64)  # one (batch row, query head)
        iv = tl.program_id(2)
        b = r // H
        h = r % H
        hk = h // n_rep
        HF: tl.constexpr = H * F
        prec: tl.constexpr = "ieee" if IEEE else "tf32"
        ov = iv * BV + tl.arange(0, BV)
        ta = n * BLOCK + tl.arange(0, BLOCK)  # the block's tokens
        cs = tl.arange(0, SUB)
        gm = tl.load(gamma + h)
        hbase = hs + b * s_hb + n * s_hn + h * s_hh  # the states before the block
        zbase = zs + b * s_zb + n * s_zn + h * s_zh  # their normalisers
        ebase = ends + b * s_zb + n * s_zn + h * s_zh + tl.arange(0, F)
        lowest = tl.minimum(tl.min(tl.load(ebase), axis=0), tl.min(tl.load(ebase + s_zs), axis=0))
        sub_lowest = lowest
        if lowest < -LIMIT:
            # A stronger decay over the block. Each sub-block's own decay (from the token before it to
            # its last token, per feature, from the states kernel's cumulative gates) decides the form.
            NS: tl.constexpr = BLOCK // SUB
            sb = tl.arange(0, NS)
            real = n * BLOCK + sb * SUB < T  # sub-blocks holding a token
            fa = tl.arange(0, F)
            last = tl.minimum(n * BLOCK + sb * SUB + SUB - 1, T - 1)  # each sub-block's last token
            before = (sb > 0) & real  # the token before a sub-block lies in the block
            lptr = _cum_gates(cg, b, T, last, h, fa, F=F, HF=HF)
            bptr = _cum_gates(cg, b, T, n * BLOCK + sb * SUB - 1, h, fa, F=F, HF=HF)
            d1 = tl.load(lptr, mask=real[:, None], other=0.0) - tl.load(bptr, mask=before[:, None], other=0.0)
            d2 = tl.load(lptr + HF, mask=real[:, None], other=0.0) - tl.load(bptr + HF, mask=before[:, None], other=0.0)
            sub_lowest = tl.minimum(tl.min(tl.min(d1, axis=1), axis=0), tl.min(tl.min(d2, axis=1), axis=0))
        if lowest >= -LIMIT:
            # No feature decays by more than e^-LIMIT over the block (the states kernel stored each
            # block's decay): exp(G_t) exp(-G_s) stays within e^+-LIMIT, so the block's weights on
            # its own tokens are one matmul per state, over all its queries at once.
            mt = ta < T
            num1 = tl.zeros([BLOCK, BV], tl.float32)
            num2 = tl.zeros([BLOCK, BV], tl.float32)
            den1 = tl.zeros([BLOCK], tl.float32)
            den2 = tl.zeros([BLOCK], tl.float32)
            a1 = tl.zeros([BLOCK, BLOCK], tl.float32)
            a2 = tl.zeros([BLOCK, BLOCK], tl.float32)
            dt = qf.dtype.element_ty
            for kk in range(0, F // BK):
                ok = kk * BK + tl.arange(0, BK)
                qa = tl.load(qf + b * s_fb + ta[:, None] * s_ft + h * s_fh + ok[None, :], mask=mt[:, None], other=0.0).to(tl.float32)
                ka = tl.load(kf + b * s_fb + ta[:, None] * s_ft + h * s_fh + ok[None, :], mask=mt[:, None], other=0.0).to(tl.float32)
                cptr = _cum_gates(cg, b, T, ta, h, ok, F=F, HF=HF)  # the states kernel's cumulative log-gates
                c1 = tl.load(cptr, mask=mt[:, None], other=0.0)
                c2 = tl.load(cptr + HF, mask=mt[:, None], other=0.0)
                q1, q2 = qa * tl.exp(c1), qa * tl.exp(c2)
                a1 += tl.dot(q1.to(dt), tl.trans((ka * tl.exp(-c1)).to(dt)), input_precision=prec)
                a2 += tl.dot(q2.to(dt), tl.trans((ka * tl.exp(-c2)).to(dt)), input_precision=prec)
                num1, num2, den1, den2 = _state_reads(num1, num2, den1, den2, q1, q2, hbase, zbase, ok, ov, s_hs, s_zs, DV=DV,
                                                       NORM=NORM, IEEE=IEEE)  # fmt: skip
            causal = ta[:, None] >= ta[None, :]
            a1 = tl.where(causal, a1, 0.0)
            a2 = tl.where(causal, a2, 0.0)
            va = tl.load(values + b * s_vb + ta[:, None] * s_vt + hk * s_vh + ov[None, :], mask=mt[:, None], other=0.0)
            num1 += tl.dot(a1.to(va.dtype), va, input_precision=prec)
            num2 += tl.dot(a2.to(va.dtype), va, input_precision=prec)
            _mix_store(num1, num2, den1 + tl.sum(a1, axis=1), den2 + tl.sum(a2, axis=1), gm, scale,
                       out + b * s_ob + ta[:, None] * s_ot + h * s_oh + ov[None, :], mt[:, None], NORM=NORM, EPS=EPS)  # fmt: skip
        elif sub_lowest >= -LIMIT:
            # Every sub-block decays by at most e^-LIMIT: a sub-block's weights on the block's keys up
            # to its own last token e factor as exp(G_t - G_e) exp(G_e - G_s), the first within
            # [1, e^LIMIT] (t in the sub-block), the second <= 1 (s <= e): one matmul per state and
            # sub-block, from the states kernel's cumulative gates.
            mt = ta < T
            dt = qf.dtype.element_ty
            va = tl.load(values + b * s_vb + ta[:, None] * s_vt + hk * s_vh + ov[None, :], mask=mt[:, None], other=0.0)
            for si in range(0, BLOCK // SUB):
                ti = n * BLOCK + si * SUB + cs  # this sub-block's queries
                mi = ti < T
                e = tl.minimum(n * BLOCK + si * SUB + SUB - 1, T - 1)  # its last token, the reference
                upto = (ta <= e) & mt  # the block's keys up to it
                num1 = tl.zeros([SUB, BV], tl.float32)
                num2 = tl.zeros([SUB, BV], tl.float32)
                den1 = tl.zeros([SUB], tl.float32)
                den2 = tl.zeros([SUB], tl.float32)
                a1 = tl.zeros([SUB, BLOCK], tl.float32)
                a2 = tl.zeros([SUB, BLOCK], tl.float32)
                for kk in range(0, F // BK):
                    ok = kk * BK + tl.arange(0, BK)
                    qi = tl.load(qf + b * s_fb + ti[:, None] * s_ft + h * s_fh + ok[None, :], mask=mi[:, None], other=0.0).to(tl.float32)
                    ka = tl.load(kf + b * s_fb + ta[:, None] * s_ft + h * s_fh + ok[None, :], mask=upto[:, None], other=0.0).to(tl.float32)
                    ciptr = _cum_gates(cg, b, T, ti, h, ok, F=F, HF=HF)
                    ci1 = tl.load(ciptr, mask=mi[:, None], other=0.0)
                    ci2 = tl.load(ciptr + HF, mask=mi[:, None], other=0.0)
                    captr = _cum_gates(cg, b, T, ta, h, ok, F=F, HF=HF)
                    ca1 = tl.load(captr, mask=upto[:, None], other=0.0)
                    ca2 = tl.load(captr + HF, mask=upto[:, None], other=0.0)
                    ceptr = cg + (b * T + e) * (2 * HF) + h * F + ok
                    ce1 = tl.load(ceptr)
                    ce2 = tl.load(ceptr + HF)
                    q1 = qi * tl.exp(tl.where(mi[:, None], ci1 - ce1[None, :], 0.0))
                    q2 = qi * tl.exp(tl.where(mi[:, None], ci2 - ce2[None, :], 0.0))
                    k1 = ka * tl.exp(tl.where(upto[:, None], ce1[None, :] - ca1, 0.0))
                    k2 = ka * tl.exp(tl.where(upto[:, None], ce2[None, :] - ca2, 0.0))
                    a1 += tl.dot(q1.to(dt), tl.trans(k1.to(dt)), input_precision=prec)
                    a2 += tl.dot(q2.to(dt), tl.trans(k2.to(dt)), input_precision=prec)
                    num1, num2, den1, den2 = _state_reads(num1, num2, den1, den2, qi * tl.exp(ci1), qi * tl.exp(ci2), hbase, zbase, ok,
                                                           ov, s_hs, s_zs, DV=DV, NORM=NORM, IEEE=IEEE)  # fmt: skip
                causal = ti[:, None] >= ta[None, :]
                a1 = tl.where(causal, a1, 0.0)
                a2 = tl.where(causal, a2, 0.0)
                num1 += tl.dot(a1.to(va.dtype), va, input_precision=prec)
                num2 += tl.dot(a2.to(va.dtype), va, input_precision=prec)
                _mix_store(num1, num2, den1 + tl.sum(a1, axis=1), den2 + tl.sum(a2, axis=1), gm, scale,
                           out + b * s_ob + ti[:, None] * s_ot + h * s_oh + ov[None, :], mi[:, None], NORM=NORM, EPS=EPS)  # fmt: skip
        else:  # a sub-block decays by more: every exponent <= 0, its own keys one at a time
            for si in range(0, BLOCK // SUB):  # loops, not unrolled: a short compile
                ti = n * BLOCK + si * SUB + cs  # this sub-block's queries
                mi = ti < T
                before = ta < n * BLOCK + si * SUB  # the block's tokens before this sub-block
                mb = before & (ta < T)
                num1 = tl.zeros([SUB, BV], tl.float32)
                num2 = tl.zeros([SUB, BV], tl.float32)
                den1 = tl.zeros([SUB], tl.float32)
                den2 = tl.zeros([SUB], tl.float32)
                a1 = tl.zeros([SUB, BLOCK], tl.float32)  # weights on the earlier sub-blocks' tokens
                a2 = tl.zeros([SUB, BLOCK], tl.float32)
                d1 = tl.zeros([SUB, SUB], tl.float32)  # weights within the sub-block
                d2 = tl.zeros([SUB, SUB], tl.float32)
                for kk in range(0, F // BK):
                    ok = kk * BK + tl.arange(0, BK)
                    qi = tl.load(qf + b * s_fb + ti[:, None] * s_ft + h * s_fh + ok[None, :], mask=mi[:, None], other=0.0).to(tl.float32)
                    ki = tl.load(kf + b * s_fb + ti[:, None] * s_ft + h * s_fh + ok[None, :], mask=mi[:, None], other=0.0).to(tl.float32)
                    l1 = tl.cumsum(_log_gates(xr, up, bias, b, 0, ti, mi, h * F + ok, s_xb, s_xt, HF=HF, R=R), axis=0)  # from the sub-block's start
                    l2 = tl.cumsum(_log_gates(xr, up, bias, b, 1, ti, mi, h * F + ok, s_xb, s_xt, HF=HF, R=R), axis=0)
                    if si > 0:  # the earlier sub-blocks: q exp(l) and k exp(r - G), r the log decay at this sub-block's start
                        ka = tl.load(kf + b * s_fb + ta[:, None] * s_ft + h * s_fh + ok[None, :], mask=mb[:, None], other=0.0)
                        ka = ka.to(tl.float32)
                        ga1 = _log_gates(xr, up, bias, b, 0, ta, mb, h * F + ok, s_xb, s_xt, HF=HF, R=R)
                        ga2 = _log_gates(xr, up, bias, b, 1, ta, mb, h * F + ok, s_xb, s_xt, HF=HF, R=R)
                        r1, r2 = tl.sum(ga1, axis=0), tl.sum(ga2, axis=0)  # (BK,)
                        kd1 = ka * tl.exp(r1[None, :] - tl.cumsum(ga1, axis=0))
                        kd2 = ka * tl.exp(r2[None, :] - tl.cumsum(ga2, axis=0))
                        q1, q2 = qi * tl.exp(l1), qi * tl.exp(l2)
                        dt = qf.dtype.element_ty  # both factors <= 1: the input dtype holds them
                        a1 += tl.dot(q1.to(dt), tl.trans(kd1.to(dt)), input_precision=prec)
                        a2 += tl.dot(q2.to(dt), tl.trans(kd2.to(dt)), input_precision=prec)
                        q1, q2 = q1 * tl.exp(r1)[None, :], q2 * tl.exp(r2)[None, :]  # decayed from the block's start
                    else:
                        q1, q2 = qi * tl.exp(l1), qi * tl.exp(l2)
                    num1, num2, den1, den2 = _state_reads(num1, num2, den1, den2, q1, q2, hbase, zbase, ok, ov, s_hs, s_zs, DV=DV,
                                                           NORM=NORM, IEEE=IEEE)  # fmt: skip
                    for j in range(0, SUB):  # within the sub-block: one key at a time, decays taken pairwise
                        row = cs[:, None] == j
                        kj = tl.sum(tl.where(row, ki, 0.0), axis=0)  # (BK,)
                        lj1 = tl.sum(tl.where(row, l1, 0.0), axis=0)
                        lj2 = tl.sum(tl.where(row, l2, 0.0), axis=0)
                        causal = cs[:, None] >= j
                        c1 = tl.sum(qi * kj[None, :] * tl.exp(tl.where(causal, l1 - lj1[None, :], float("-inf"))), axis=1)  # (SUB,)
                        c2 = tl.sum(qi * kj[None, :] * tl.exp(tl.where(causal, l2 - lj2[None, :], float("-inf"))), axis=1)
                        d1 += tl.where(cs[None, :] == j, c1[:, None], 0.0)
                        d2 += tl.where(cs[None, :] == j, c2[:, None], 0.0)
                vi = tl.load(values + b * s_vb + ti[:, None] * s_vt + hk * s_vh + ov[None, :], mask=mi[:, None], other=0.0)
                num1 += tl.dot(d1.to(vi.dtype), vi, input_precision=prec)
                num2 += tl.dot(d2.to(vi.dtype), vi, input_precision=prec)
                if si > 0:
                    va = tl.load(values + b * s_vb + ta[:, None] * s_vt + hk * s_vh + ov[None, :], mask=mb[:, None], other=0.0)
                    num1 += tl.dot(a1.to(va.dtype), va, input_precision=prec)
                    num2 += tl.dot(a2.to(va.dtype), va, input_precision=prec)
                _mix_store(num1, num2, den1 + tl.sum(a1, axis=1) + tl.sum(d1, axis=1), den2 + tl.sum(a2, axis=1) + tl.sum(d2, axis=1),
                           gm, scale, out + b * s_ob + ti[:, None] * s_ot + h * s_oh + ov[None, :], mi[:, None], NORM=NORM, EPS=EPS)  # fmt: skip

    return _Kernels(states=dsla_states, output=dsla_output)


def gate_inputs(x: Tensor, down: Tensor, rank: int) -> Tensor:
    """The gates' low-rank inputs x W_down (B, T, 2, R) in float32 for ``dsla_prefill_fused``: x
    (B, T, hidden), ``down`` (2 rank, hidden) both gates' down projections stacked (history first);
    R = ``padded_rank(rank)``, the padding zero."""
    b, t, _ = x.shape
    xr = torch.nn.functional.linear(x.to(down.dtype), down).float().view(b, t, 2, rank)
    pad = padded_rank(rank) - rank
    return torch.nn.functional.pad(xr, (0, pad)) if pad else xr.contiguous()


def gate_weights(up: Tensor, bias: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Both gates' up projections as ``dsla_prefill_fused`` takes them: ``up`` (2, Hq F, rank) (the
    two ``nn.Linear`` weights stacked) -> (2, R, Hq F) float32 with zero rows to R =
    ``padded_rank(rank)``; ``bias`` (2, Hq F) -> float32."""
    u = up.float().transpose(1, 2)
    pad = padded_rank(rank) - rank
    u = torch.nn.functional.pad(u, (0, 0, 0, pad)) if pad else u
    return u.contiguous(), bias.float().contiguous()


def dsla_prefill_fused(
    qf: Tensor,
    kf: Tensor,
    v: Tensor,
    xr: Tensor,
    up: Tensor,
    bias: Tensor,
    gamma: Tensor,
    *,
    state: DslaState | None = None,
    scale: float | None = None,
    normalize: bool = False,
    block: int = BLOCK,
    valid: Tensor | None = None,
) -> tuple[Tensor, DslaState]:
    """DSLA's prefill: ``dsla_attention`` with log-gates logsigmoid(xr W_up + b) / 16, without
    padding, or padded at the end: ``valid`` a one-element integer tensor on qf's device, the tokens
    from valid[0] on padding (every row's), which leave the states as they are (no key or value, no
    decay; their outputs are undefined). A device value: a CUDA graph captures the call once for
    every count.

    qf and kf (B, T, Hq, F) token-major features (kf for every query head), v (B, T, Hkv, Dv); xr
    (B, T, 2, R) the gates' low-rank inputs (``gate_inputs``), ``up`` (2, R, Hq F) and ``bias``
    (2, Hq F) their up projections (``gate_weights``), history first; gamma 0-dim or (Hq,) in
    [0, 1]; ``state`` the states the call continues (zeros when None); ``scale`` multiplies q
    without a normaliser (default F ** -0.5). Returns o (B, Hq, T, Dv) in qf's dtype (a view of a
    token-major tensor) and the final states in float32, as ``dsla_attention``. ``block``: tokens per
    stored state and per output program (a power of two from ``SUB``; the kernels' tiles scale with it)."""
    b, t, hq, nf, hkv, dv = token_major_sizes(qf, kf, v)
    r = xr.shape[-1]
    width = dv + int(normalize)
    if xr.shape != (b, t, 2, r) or up.shape != (2, r, hq * nf) or bias.shape != (2, hq * nf) or r != padded_rank(r):
        raise ValueError(f"gate inputs {tuple(xr.shape)}, up {tuple(up.shape)} and bias {tuple(bias.shape)} must be (B, T, 2, R), "
                         f"(2, R, Hq F) and (2, Hq F) = {(b, t, 2, 'R')}, {(2, 'R', hq * nf)}, {(2, hq * nf)} with R a power of two "
                         "from 16 (gate_inputs, gate_weights)")  # fmt: skip
    if not fused_decode.tile_sized(nf, dv):
        raise ValueError(f"features ({nf}) and value size ({dv}) must be powers of two from 16 for the fused prefill")
    if qf.dtype not in DTYPES or kf.dtype != qf.dtype or v.dtype != qf.dtype:
        raise ValueError(f"qf, kf and v must share one dtype of {DTYPES}, got {qf.dtype}, {kf.dtype} and {v.dtype}")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block}")
    gamma = torch.as_tensor(gamma, device=qf.device, dtype=torch.float32)
    if gamma.numel() not in (1, hq):
        raise ValueError(f"gamma must be a scalar or have one value per query head ({hq}), got {tuple(gamma.shape)}")
    gamma = gamma.reshape(-1).expand(hq).contiguous()
    scale = nf**-0.5 if scale is None else scale
    final = torch.empty(2, b, hq, nf, width, device=qf.device, dtype=torch.float32)  # every element written
    out = torch.empty(b, t, hq, dv, device=qf.device, dtype=qf.dtype)
    if t == 0:
        final.zero_()
        if state is not None:
            final[0], final[1] = state.history, state.recent
        return out.transpose(1, 2), DslaState(history=final[0], recent=final[1])
    blocks = -(-t // block)
    hs = torch.empty(b, blocks, 2, hq, nf, dv, device=qf.device, dtype=qf.dtype)  # states before each block
    # each token's log decay from its block's start, per gate and feature (the layout: cum_gates)
    cg = torch.empty(b, t, 2, hq, nf, device=qf.device, dtype=torch.float32)
    zs = torch.empty(b, blocks, 2, hq, nf, device=qf.device, dtype=torch.float32)  # normalisers before each block
    ends = torch.empty_like(zs)  # each block's log decay per feature
    h0 = None
    if state is not None:
        for s in (state.history, state.recent):
            if s.shape != (b, hq, nf, width):
                raise ValueError(f"state has shape {tuple(s.shape)}, expected {(b, hq, nf, width)}")
        h0 = torch.stack((state.history, state.recent)).float().contiguous()  # (2, B, Hq, F, W)
    if qf.stride() != kf.stride():
        raise ValueError(f"qf and kf must have the same strides, got {qf.stride()} and {kf.stride()}")
    k = _kernels()
    interp = fused_decode.interpreting()
    ieee = qf.dtype == torch.float32
    xs, up, bias = (x.float().contiguous() for x in (xr, up, bias))
    hz = (hs.stride(0), hs.stride(1), hs.stride(2), hs.stride(3))
    zz = (zs.stride(0), zs.stride(1), zs.stride(2), zs.stride(3))
    strides = (*_strides(kf, 3), *_strides(v, 3), xs.stride(0), xs.stride(1), *hz, *zz)

    def state_grid(meta):
        return (nf // meta["BK"], dv // meta["BV"], b * hq)

    if valid is not None and (valid.numel() != 1 or valid.device != qf.device or valid.dtype.is_floating_point):
        raise ValueError(f"valid must be a one-element integer tensor on {qf.device}, got {valid.dtype} {tuple(valid.shape)} on {valid.device}")
    k.states[state_grid](
        kf, v, xs, up, bias, final if h0 is None else h0, hs, zs, ends, cg, final, t, final if valid is None else valid, hq // hkv, blocks,
        b, *strides, H=hq, F=nf, DV=dv, W=width, R=r, BLOCK=block, HAS_H0=h0 is not None, NORM=normalize, IEEE=ieee,
        PIPELINED=not interp, PADDED=valid is not None,
    )  # fmt: skip

    def output_grid(meta):
        return (blocks, b * hq, dv // meta["BV"])

    k.output[output_grid](
        qf, kf, v, xs, up, bias, hs, zs, ends, cg, gamma, out, t, hq // hkv, scale, *strides, *_strides(out, 3),
        H=hq, F=nf, DV=dv, R=r, BLOCK=block, SUB=SUB, NORM=normalize, IEEE=ieee, EPS=EMPTY_DENOMINATOR, LIMIT=FACTORED_DECAY_LIMIT,
    )  # fmt: skip
    return out.transpose(1, 2), DslaState(history=final[0], recent=final[1])

