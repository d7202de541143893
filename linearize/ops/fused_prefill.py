"""The hybrid's prefill in the input dtype, in three Triton kernels.

``hybrid_attention`` in its exact form works in float32 on query chunks: it copies q/k/v and the
feature maps to float32, repeats the KV heads, gives fla a ones column beside the values (V = Dv + 1)
for the denominator, and computes the window with about fifteen torch operations on unfolded key
blocks. ``hybrid_prefill`` computes the same outputs and state (non-overlapping mix, every token
real) this way:

- the feature maps once, token-major (B, T, Hq, F) in the input dtype: for Hedgehog one kernel
  (``hedgehog_token_major``) that reads each KV head's keys once for its query heads, projects and
  takes both softmaxes in registers;
- ``chunk_states``: the linear state S = sum phi(k) v^T before each block of ``BM`` tokens (stored
  in the input dtype, accumulated in float32) and after the last, each program walking the blocks
  of one (row, head, feature tile, value tile) in order; the values are read per KV head, from the
  state's window or the call's tokens (no repeated heads, no ones column);
- ``window_mix``, one program per block of ``BM`` queries and query head: the window's scores
  against the key tiles it spans (online softmax, keeping the row max the joint mix needs), its
  weights on the values; the linear numerator and denominator (the state and the prefix of phi(k)
  before the block, plus the block's own causal part); the joint or gate mix, written token-major
  so o_proj reads it without a copy.

Everything is accumulated in float32. The exact form stays the specification:
tests/ops/test_fused_prefill.py compares outputs and every state tensor (on the GPU, and on the CPU
through Triton's interpreter).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import fused_decode
from .common import EMPTY_DENOMINATOR, FeatureFn, gqa_groups
from .feature_maps import hedgehog
from .states import HybridState, LinearState, WindowState

BM = 64
"""Queries per program of the window kernel (and tokens per block of the denominator's prefix)."""
BN = 64
"""Keys per tile of the window kernel."""
BT_FEATURES = 64
"""Tokens per program of the Hedgehog kernel."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNK_STATE_TILES = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3), (32, 64, 4, 2), (32, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 3),
                     (16, 16, 4, 2))
"""(BK, BV, num_warps, num_stages) that ``chunk_states`` is autotuned over on a GPU (those whose
tiles fit the feature and value sizes; the smallest, 16 x 16, always does)."""
NUMERATORS = ("kernel", "fla")
"""Where ``hybrid_prefill`` takes the linear numerator from: its own kernels, or fla's chunk kernel."""


def for_inference(x: Tensor, valid: Tensor | None) -> bool:
    """Whether a prefill on ``x`` may take a fused inference form: the fused kernels are on for its
    device (``fused_decode.enabled``: CUDA by default), nothing needs a gradient, every token is
    real (no padding mask)."""
    return valid is None and not torch.is_grad_enabled() and fused_decode.enabled(x)


def applies(q: Tensor, k: Tensor, v: Tensor, *, valid: Tensor | None, branches: str, overlap: bool, phi_q: FeatureFn) -> bool:
    """Whether ``hybrid_attention`` takes ``hybrid_prefill`` for this call: ``for_inference``, the
    hybrid is the non-overlapping two-branch one, q is half precision (float32 inputs keep the exact
    path unless forced with ``use_fused(True)``), and the head and feature sizes are tile-sized."""
    if not for_inference(q, valid) or branches != "both" or overlap:
        return False
    if q.dtype not in DTYPES or (q.dtype == torch.float32 and not fused_decode.forced()):
        return False
    return fused_decode.tile_sized(q.shape[-1], v.shape[-1], num_features(phi_q, q))


def num_features(phi: FeatureFn, x: Tensor) -> int:
    """How many features ``phi`` makes of a token of ``x`` (B, H, T, d): the map's ``num_features``
    where it has one, else what it makes of one token."""
    count = getattr(phi, "num_features", None)
    return count(x.shape[-1]) if count is not None else phi(x[:1, :, :1]).shape[-1]


def state_tiled(configs: tuple[tuple[int, ...], ...], keys: list[str], interpreted: tuple[int, int]):
    """A decorator for a Triton kernel with state tiles BK x BV over its F and DV axes: autotuned
    over ``configs`` ((BK, BV, num_warps, num_stages[, registers per thread at most])) on a GPU,
    keyed by ``keys``, pruned to the tiles no wider than their axes; in Triton's interpreter the
    widest tiles up to ``interpreted`` (BK, BV)."""
    import triton

    if fused_decode.interpreting():
        bk, bv = interpreted
        return triton.heuristics({"BK": lambda a: min(a["F"], bk), "BV": lambda a: min(a["DV"], bv)})
    tuned = [triton.Config({"BK": c[0], "BV": c[1]}, num_warps=c[2], num_stages=c[3], maxnreg=c[4] if len(c) > 4 else None) for c in configs]

    def fitting(configs, named, **kwargs):  # no tile wider than its axis
        return [c for c in configs if c.kwargs["BK"] <= kwargs["F"] and c.kwargs["BV"] <= kwargs["DV"]]

    return fused_decode.autotune(tuned, key=keys, prune_configs_by={"early_config_prune": fitting})


_block_state: Any = None
"""``chunk_states``' step over one block: a Triton function made by ``_kernels`` (see there)."""


class _Kernels(NamedTuple):
    window_mix: Any
    chunk_states: Any
    hedgehog: Any


@functools.cache
def _kernels() -> _Kernels:
    import triton
    import triton.language as tl

    def tuned(keys: list[str], configs: list[tuple[int, int]]):
        """Autotuned over (num_warps, num_stages) on a GPU; as it is in Triton's interpreter."""
        if fused_decode.interpreting():
            return lambda fn: fn
        return fused_decode.autotune([triton.Config({}, num_warps=w, num_stages=s) for w, s in configs], key=keys)

    @tuned(["D", "DV", "F", "W"], [(4, 1), (4, 2), (4, 3), (8, 1), (8, 2)])
    @triton.jit
    def window_mix(
        q, wkeys, keys, wvalues, values, qf, kf, hs, num, zpre, empty, factor, out,
        T, n_rep, scale,
        s_qb, s_qh, s_qt, s_wb, s_wh, s_wt, s_kb, s_kh, s_kt, s_ub, s_uh, s_ut, s_vb, s_vh, s_vt,
        s_fb, s_ft, s_fh, s_gb, s_gt, s_gh, s_hb, s_hh, s_hn, s_nb, s_nt, s_nh, s_zb, s_zn, s_zh, s_ob, s_ot, s_oh,
        H: tl.constexpr, W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr, TILES: tl.constexpr, GATE: tl.constexpr, EPS: tl.constexpr,
        IEEE: tl.constexpr, STATES: tl.constexpr,
    ):  # fmt: skip
        blk = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)  # one (batch row, query head)
        b = r // H
        h = r % H
        hk = h // n_rep
        precision: tl.constexpr = "ieee" if IEEE else "tf32"
        i = blk * BM + tl.arange(0, BM)  # query slots; slot i is extended token W + i
        mi = i < T
        od, ov = tl.arange(0, D), tl.arange(0, DV)
        n_empty = tl.load(empty + b)  # the state's empty window slots (extended tokens 0 .. n_empty - 1)

        # The window: slot i sees extended tokens i + 1 .. i + W (the state's window slots below W,
        # the call's tokens from W), i.e. the key tiles from blk BM + 1.
        qb = tl.load(q + b * s_qb + h * s_qh + i[:, None] * s_qt + od[None, :], mask=mi[:, None], other=0.0)
        m = tl.full([BM], -1e30, tl.float32)
        den_w = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DV], tl.float32)
        for n in range(TILES):
            j = blk * BM + 1 + n * BN + tl.arange(0, BN)  # extended tokens
            mj = (j < T + W) & (j >= n_empty)
            old, new = mj & (j < W), mj & (j >= W)
            kt = tl.load(wkeys + b * s_wb + hk * s_wh + j[:, None] * s_wt + od[None, :], mask=old[:, None], other=0.0).to(qb.dtype)
            kt += tl.load(keys + b * s_kb + hk * s_kh + (j - W)[:, None] * s_kt + od[None, :], mask=new[:, None], other=0.0)
            s = tl.dot(qb, tl.trans(kt), input_precision=precision) * scale  # (BM, BN) float32
            dist = j[None, :] - i[:, None]
            s = tl.where((dist >= 1) & (dist <= W) & mj[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            den_w = den_w * alpha + tl.sum(p, axis=1)
            vt = tl.load(wvalues + b * s_ub + hk * s_uh + j[:, None] * s_ut + ov[None, :], mask=old[:, None], other=0.0).to(qb.dtype)
            vt += tl.load(values + b * s_vb + hk * s_vh + (j - W)[:, None] * s_vt + ov[None, :], mask=new[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=precision)
            m = m_new

        # The linear part: slot i reads phi(k) v^T of extended tokens 0 .. i, i.e. the state before
        # this block (with STATES: hs, else the numerator comes in ``num``; the denominator's zpre)
        # and this block's own tokens up to i (the features a slice at a time). The joint mix has
        # one numerator: the linear part is added to the window's, scaled by the window factor
        # (the gate mix normalises each part on its own: a numerator of its own for the linear part).
        f = tl.load(factor + h).to(tl.float32)
        if GATE:
            num_l = tl.zeros([BM, DV], tl.float32)
        else:
            num_l = acc * f
        den_l = tl.zeros([BM], tl.float32)
        a = tl.zeros([BM, BM], tl.float32)
        for f0 in range(0, F, BF):
            of = f0 + tl.arange(0, BF)
            qfc = tl.load(qf + b * s_fb + h * s_fh + i[:, None] * s_ft + of[None, :], mask=mi[:, None], other=0.0)
            z = tl.load(zpre + b * s_zb + blk * s_zn + h * s_zh + of)  # float32 (BF,)
            den_l += tl.sum(qfc.to(tl.float32) * z[None, :], axis=1)
            if STATES:
                hc = tl.load(hs + b * s_hb + h * s_hh + blk * s_hn + of[:, None] * DV + ov[None, :])  # (BF, DV)
                num_l += tl.dot(qfc, hc, input_precision=precision)
            kfc = tl.load(kf + b * s_gb + h * s_gh + i[:, None] * s_gt + of[None, :], mask=mi[:, None], other=0.0)
            a += tl.dot(qfc, tl.trans(kfc), input_precision=precision)  # queries x this block's linear keys
        a = tl.where(i[None, :] <= i[:, None], a, 0.0)
        den_l += tl.sum(a, axis=1)
        if STATES:
            old, new = mi & (i < W), mi & (i >= W)  # this block's tokens: the state's window slots, then the call's
            vl = tl.load(wvalues + b * s_ub + hk * s_uh + i[:, None] * s_ut + ov[None, :], mask=old[:, None], other=0.0).to(qb.dtype)
            vl += tl.load(values + b * s_vb + hk * s_vh + (i - W)[:, None] * s_vt + ov[None, :], mask=new[:, None], other=0.0)
            num_l += tl.dot(a.to(vl.dtype), vl, input_precision=precision)
        else:
            num_l += tl.load(num + b * s_nb + h * s_nh + i[:, None] * s_nt + ov[None, :], mask=mi[:, None], other=0.0).to(tl.float32)

        if GATE:  # g SWA + (1 - g) LA, each over its own denominator (0 where that is empty)
            ok_w, ok_l = den_w > EPS, den_l > EPS
            read_w = tl.where(ok_w[:, None], acc / tl.where(ok_w, den_w, 1.0)[:, None], 0.0)
            read_l = tl.where(ok_l[:, None], num_l / tl.where(ok_l, den_l, 1.0)[:, None], 0.0)
            o = read_l + f * (read_w - read_l)
        else:  # one denominator: the window's part scaled by the window factor, plus the linear one
            den = f * den_w + den_l
            ok = den > EPS
            o = tl.where(ok[:, None], num_l / tl.where(ok, den, 1.0)[:, None], 0.0)
        tl.store(out + b * s_ob + h * s_oh + i[:, None] * s_ot + ov[None, :], o.to(out.dtype.element_ty), mask=mi[:, None])

    @triton.jit
    def block_state(
        acc, n, kf, wvalues, values, hs, T, b, h, hk, ok, ov, tile,
        s_gb, s_gt, s_gh, s_ub, s_uh, s_ut, s_vb, s_vh, s_vt, s_hb, s_hh, s_hn,
        W: tl.constexpr, BM: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """Store S before block n, return S after it (the block's phi(k) v^T added)."""
        tl.store(hs + b * s_hb + h * s_hh + n * s_hn + tile, acc.to(hs.dtype.element_ty))
        e = n * BM + tl.arange(0, BM)  # extended tokens
        me = e < T
        kt = tl.load(kf + b * s_gb + h * s_gh + e[:, None] * s_gt + ok[None, :], mask=me[:, None], other=0.0)
        old, new = me & (e < W), me & (e >= W)
        vt = tl.load(wvalues + b * s_ub + hk * s_uh + e[:, None] * s_ut + ov[None, :], mask=old[:, None], other=0.0).to(kt.dtype)
        vt += tl.load(values + b * s_vb + hk * s_vh + (e - W)[:, None] * s_vt + ov[None, :], mask=new[:, None], other=0.0)
        return acc + tl.dot(tl.trans(kt), vt, input_precision="ieee" if IEEE else "tf32")

    # A module global, as Triton's interpreter resolves the names a kernel calls among its
    # function's globals only (the compiler also reads closures).
    globals()["_block_state"] = block_state

    @state_tiled(CHUNK_STATE_TILES, ["F", "DV"], interpreted=(64, 64))
    @triton.jit
    def chunk_states(
        kf, wvalues, values, h0, hs, final, T, n_rep, blocks,
        s_gb, s_gt, s_gh, s_ub, s_uh, s_ut, s_vb, s_vh, s_vt, s_hb, s_hh, s_hn,
        H: tl.constexpr, W: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
        BV: tl.constexpr, HAS_H0: tl.constexpr, IEEE: tl.constexpr, PIPELINED: tl.constexpr,
    ):  # fmt: skip
        ik, iv = tl.program_id(0), tl.program_id(1)
        r = tl.program_id(2).to(tl.int64)  # one (batch row, query head)
        b = r // H
        h = r % H
        hk = h // n_rep
        ok, ov = ik * BK + tl.arange(0, BK), iv * BV + tl.arange(0, BV)
        tile = ok[:, None] * DV + ov[None, :]
        if HAS_H0:
            acc = tl.load(h0 + r * F * DV + tile)
        else:
            acc = tl.zeros([BK, BV], tl.float32)
        if PIPELINED:  # a for loop, which Triton software-pipelines (the next block's loads under this one's dot)
            for n in range(0, blocks):
                acc = _block_state(acc, n, kf, wvalues, values, hs, T, b, h, hk, ok, ov, tile, s_gb, s_gt, s_gh, s_ub, s_uh, s_ut,
                                   s_vb, s_vh, s_vt, s_hb, s_hh, s_hn, W=W, BM=BM, IEEE=IEEE)
        else:  # Triton's interpreter takes no range() over a run-time bound with NumPy 2
            n = 0
            while n < blocks:
                acc = _block_state(acc, n, kf, wvalues, values, hs, T, b, h, hk, ok, ov, tile, s_gb, s_gt, s_gh, s_ub, s_uh, s_ut,
                                   s_vb, s_vh, s_vt, s_hb, s_hh, s_hn, W=W, BM=BM, IEEE=IEEE)
                n += 1
        tl.store(final + r * F * DV + tile, acc)

    @tuned(["D", "FH"], [(4, 1), (4, 2), (8, 2)])
    @triton.jit
    def hedgehog(
        x, weight, bias, out, T, n_rep, s_xb, s_xh, s_xt, s_ob, s_ot, s_oh,
        H: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, BT: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        blk = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)  # one (batch row, output head)
        b = r // H
        h = r % H
        t = blk * BT + tl.arange(0, BT)
        mt = t < T
        od, of = tl.arange(0, D), tl.arange(0, FH)
        xb = tl.load(x + b * s_xb + (h // n_rep) * s_xh + t[:, None] * s_xt + od[None, :], mask=mt[:, None], other=0.0)
        w = tl.load(weight + h * D * FH + od[:, None] * FH + of[None, :])
        p = tl.dot(xb, w.to(xb.dtype), input_precision="ieee" if IEEE else "tf32")
        p += tl.load(bias + h * FH + of).to(xb.dtype).to(tl.float32)[None, :]  # (BT, FH) float32
        if not IEEE:  # the module's map in bfloat16 / float16: its projection is a tensor of x's dtype
            p = p.to(xb.dtype).to(tl.float32)
        # Normalised by one reciprocal per row and a product per feature, not a division per feature.
        e = tl.exp(p - tl.max(p, axis=1)[:, None])
        pos = e * (1.0 / tl.sum(e, axis=1))[:, None]
        e = tl.exp(tl.min(p, axis=1)[:, None] - p)
        neg = e * (1.0 / tl.sum(e, axis=1))[:, None]
        base = out + b * s_ob + t[:, None] * s_ot + h * s_oh + of[None, :]
        tl.store(base, pos.to(out.dtype.element_ty), mask=mt[:, None])
        tl.store(base + FH, neg.to(out.dtype.element_ty), mask=mt[:, None])

    return _Kernels(window_mix=window_mix, chunk_states=chunk_states, hedgehog=hedgehog)


def hedgehog_token_major(x: Tensor, weight: Tensor, bias: Tensor, n_rep: int = 1, out: Tensor | None = None) -> Tensor:
    """Hedgehog features [softmax(x W + b), softmax(-(x W + b))] of ``x`` (B, Hkv, T, d) for the
    ``n_rep`` query heads of each of its heads (``weight`` (Hq, d, f), ``bias`` (Hq, f), Hq = Hkv
    n_rep), written token-major (B, T, Hq, 2f) in x's dtype, as fla reads them (into ``out`` when
    given, e.g. a slice of a larger buffer): one kernel, each head's keys read once (no repeated
    heads), the projection and both softmaxes in registers (float32; in bfloat16 or float16 the
    projection is rounded to x's dtype first, as the module's map makes it a tensor of that dtype).
    Equals ``feature_maps.hedgehog`` on the repeated heads, transposed (which it runs where d or f is
    not a power of two from 16)."""
    b, hkv, t, d = x.shape
    hq, _, fh = weight.shape
    if weight.shape != (hkv * n_rep, d, fh) or bias.shape != (hq, fh):
        raise ValueError(f"weight {tuple(weight.shape)} and bias {tuple(bias.shape)} do not fit x {tuple(x.shape)} with "
                         f"{n_rep} query heads per head: expected ({hkv * n_rep}, {d}, f) and ({hkv * n_rep}, f)")  # fmt: skip
    if out is None:
        out = torch.empty(b, t, hq, 2 * fh, device=x.device, dtype=x.dtype)
    elif out.shape != (b, t, hq, 2 * fh) or out.dtype != x.dtype:
        raise ValueError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected {(b, t, hq, 2 * fh)} and {x.dtype}")
    if t == 0:
        return out
    if not fused_decode.tile_sized(d, fh):  # the torch map on the repeated heads
        xr = x.repeat_interleave(n_rep, dim=1) if n_rep > 1 else x
        return out.copy_(hedgehog(xr, weight.to(x.dtype), bias.to(x.dtype)).transpose(1, 2))
    _kernels().hedgehog[(-(-t // BT_FEATURES), b * hq)](
        x, weight.contiguous(), bias.contiguous(), out, t, n_rep, *_strides(x, 3), *_strides(out, 3),
        H=hq, D=d, FH=fh, BT=BT_FEATURES, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out


def token_major_features(phi: FeatureFn, x: Tensor, n_rep: int, out: Tensor | None = None) -> Tensor:
    """phi of ``x`` (B, H, T, d) repeated to ``n_rep`` heads each, token-major (B, T, H n_rep, F)
    (into ``out`` when given): in one kernel where the map offers it (``token_major``, e.g.
    Hedgehog), else phi on the repeated heads, transposed."""
    token_major = getattr(phi, "token_major", None)
    if token_major is not None:
        return token_major(x, n_rep, out=out)
    f = phi(x.repeat_interleave(n_rep, dim=1) if n_rep > 1 else x).transpose(1, 2)
    return f.contiguous() if out is None else out.copy_(f)


def hybrid_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    phi_q: FeatureFn,
    phi_k: FeatureFn,
    window: int,
    mix: str = "joint",
    window_factor: Tensor | None = None,
    gate: Tensor | None = None,
    state: HybridState | None = None,
    scale: float | None = None,
    q_lin: Tensor | None = None,
    k_lin: Tensor | None = None,
    numerator: str = "kernel",
) -> tuple[Tensor, HybridState]:
    """``hybrid_attention`` (non-overlapping, both branches, every token real) for inference: the
    same arguments, outputs (B, Hq, T, Dv) in v's dtype (a view of a token-major tensor) and the
    same ``HybridState``. ``numerator`` (``NUMERATORS``): "kernel" computes the linear numerator in
    this module's kernels (``chunk_states`` and ``window_mix``; what ``hybrid_attention`` uses, the
    faster on an H200 at every length from 8K to 128K); "fla" takes it from fla's
    ``chunk_simple_gla`` on the values repeated to the query heads (CUDA with fla installed)."""
    if numerator not in NUMERATORS:
        raise ValueError(f"unknown numerator {numerator!r}; valid: {NUMERATORS}")
    from triton import cdiv

    if mix not in ("joint", "gate"):
        raise ValueError(f"unknown mix {mix!r}; valid: ('joint', 'gate')")
    n_rep = gqa_groups(q, k)
    b, hq, t, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    w = window
    scale = d**-0.5 if scale is None else scale
    separate = k_lin is not None
    if state is None:
        ws = WindowState.empty(b, hkv, w, d, dv, device=q.device, linear_keys=separate)
        lin = None
    else:
        ws, lin = state.window, state.linear
    if ws.keys.shape[2] != w:
        raise ValueError(f"state window has {ws.keys.shape[2]} slots, expected window={w}")

    head = min(w, t)  # how many of the state's window slots the call's tokens push out
    # The extended sequence: the state's window (right-aligned, empty slots first), then the
    # tokens. The kernels read the window's keys and values from the state and the rest from k and
    # v; the features are written token-major into one buffer (B, L, Hq, F), L = W + T.
    q_feat, k_feat = (q_lin, k_lin) if separate else (q, k)
    w_feat = ws.linear_keys if separate else ws.keys  # (B, Hkv, W, D) float32
    feats = num_features(phi_q, q_feat)
    qf = token_major_features(phi_q, q_feat, 1, q.new_empty(b, t, hq, feats))  # (B, T, Hq, F)
    kf = q.new_empty(b, w + t, hq, feats)  # (B, L, Hq, F)
    token_major_features(phi_k, k_feat, n_rep, kf[:, w:])
    fresh = state is None  # a first call: its window is known to be empty (no features, no masking, no sums)
    if fresh:
        kf[:, :w].zero_()
    else:
        token_major_features(phi_k, w_feat.to(k_feat.dtype), n_rep, kf[:, :w])
        kf[:, :w].mul_(ws.valid[:, :, None, None].to(kf.dtype))  # empty slots enter no sum

    # Denominator prefix per block of BM queries: z0 + the earlier blocks' phi(k), in float32.
    blocks, full = cdiv(t, BM), t // BM
    z0 = lin.k_sum.float() if lin is not None else kf.new_zeros(b, hq, feats, dtype=torch.float32)
    sums = kf[:, : full * BM].unflatten(1, (full, BM)).sum(dim=2, dtype=torch.float32)  # (B, full, Hq, F)
    scan = sums.view(b, full, hq * feats).transpose(1, 2).contiguous().cumsum(dim=-1)  # (B, Hq F, full): a scan along its last axis
    zpre = torch.empty(b, blocks, hq, feats, device=q.device, dtype=torch.float32)
    zpre[:, 0] = z0
    zpre[:, 1:] = z0[:, None] + scan[:, :, : blocks - 1].transpose(1, 2).view(b, blocks - 1, hq, feats)
    z_final = z0 + (scan[:, :, -1].view(b, hq, feats) if full else 0) + kf[:, full * BM : t].sum(dim=1, dtype=torch.float32)

    factor = window_factor if mix == "joint" else gate
    factor = torch.full((hq,), 1.0 if mix == "joint" else 0.5, device=q.device) if factor is None else factor
    if factor.shape != (hq,):
        raise ValueError(f"{'window_factor' if mix == 'joint' else 'gate'} has shape {tuple(factor.shape)}, expected ({hq},)")
    # The linear numerator over extended tokens 0 .. i for query slot i.
    if numerator == "kernel":  # the state before each block of BM queries (B, Hq, blocks, F, Dv), and after the last
        hs = q.new_empty(b, hq, blocks, feats, dv)
        new_kv = torch.empty(b, hq, feats, dv, device=q.device, dtype=torch.float32)
        h0 = lin.kv.float().contiguous() if lin is not None else new_kv
        _kernels().chunk_states[lambda meta: (feats // meta["BK"], dv // meta["BV"], b * hq)](
            kf, ws.values, v, h0, hs, new_kv, t, n_rep, blocks,
            *_strides(kf, 3), *_strides(ws.values, 3), *_strides(v, 3), *_strides(hs, 3),
            H=hq, W=w, F=feats, DV=dv, BM=BM, HAS_H0=lin is not None, IEEE=q.dtype == torch.float32,
            PIPELINED=not fused_decode.interpreting(),
        )  # fmt: skip
        num = q.new_empty(b, 1, hq, dv)  # unread
    else:  # fla, on the values repeated to the query heads (it takes no grouped heads)
        v_old = v.new_empty(b, t, hkv, n_rep, dv)  # (B, T, Hkv, n_rep, Dv) = (B, T, Hq, Dv)
        v_old[:, :head].copy_(ws.values[:, :, :head].transpose(1, 2)[:, :, :, None].expand(b, head, hkv, n_rep, dv))
        if t > w:
            v_old[:, w:].copy_(v[:, :, : t - w].transpose(1, 2)[:, :, :, None].expand(b, t - w, hkv, n_rep, dv))
        num, new_kv = _fla_numerator(qf, kf[:, :t], v_old.view(b, t, hq, dv), None if lin is None else lin.kv)  # (B, T, Hq, Dv)
        hs = q.new_empty(b, hq, 1, feats, dv)  # unread

    empty = torch.full((b,), w, device=q.device, dtype=torch.int32) if fresh else (w - ws.valid.sum(dim=1)).to(torch.int32)  # (B,)
    out = torch.empty(b, t, hq, dv, device=q.device, dtype=v.dtype)
    _kernels().window_mix[(blocks, b * hq)](
        q, ws.keys, k, ws.values, v, qf, kf, hs, num, zpre, empty, factor.float().contiguous(), out,
        t, n_rep, scale,
        *_strides(q, 3), *_strides(ws.keys, 3), *_strides(k, 3), *_strides(ws.values, 3), *_strides(v, 3),
        *_strides(qf, 3), *_strides(kf, 3), *_strides(hs, 3), *_strides(num, 3), *_strides(zpre, 3), *_strides(out, 3),
        H=hq, W=w, D=d, DV=dv, F=feats, BM=BM, BN=BN, BF=min(feats, 64), TILES=cdiv(BM + w - 1, BN), GATE=mix == "gate",
        EPS=EMPTY_DENOMINATOR, IEEE=q.dtype == torch.float32, STATES=numerator == "kernel",
    )  # fmt: skip

    seen = None if fresh else ws.positions.amax(dim=1, keepdim=True) + 1  # (B, 1) real tokens before this call
    if t >= w:  # the new window is the call's last W tokens: copies, no concatenation
        def last_tokens(new: Tensor) -> Tensor:
            return torch.empty(*new.shape[:2], w, new.shape[3], device=q.device, dtype=torch.float32).copy_(new[:, :, t - w :])

        positions = torch.arange(t - w, t, device=q.device)
        new_window = WindowState(
            keys=last_tokens(k),
            values=last_tokens(v),
            valid=torch.ones(b, w, device=q.device, dtype=torch.bool),
            positions=positions.expand(b, w).contiguous() if fresh else seen + positions,
            linear_keys=last_tokens(k_lin) if separate else None,
        )
    else:  # the state's last W - T slots, then the call's tokens
        new_pos = (0 if fresh else seen) + torch.arange(t, device=q.device)  # (B or 1, T)

        def last_window(old: Tensor, new: Tensor) -> Tensor:  # the last W of the extended tokens, float32
            return torch.cat([old[:, :, head:], new[:, :, t - head :].float()], dim=2)

        new_window = WindowState(
            keys=last_window(ws.keys, k),
            values=last_window(ws.values, v),
            valid=torch.cat([ws.valid[:, head:], ws.valid.new_ones(b, head)], dim=1),
            positions=torch.cat([ws.positions[:, head:], new_pos.expand(b, t)[:, t - head :]], dim=1),
            linear_keys=last_window(ws.linear_keys, k_lin) if separate else None,
        )
    return out.transpose(1, 2), HybridState(window=new_window, linear=LinearState(kv=new_kv, k_sum=z_final))


def _fla_numerator(qf: Tensor, kf: Tensor, v: Tensor, kv: Tensor | None) -> tuple[Tensor, Tensor]:
    """phi(q_t)^T S_t (B, T, H, Dv) in the inputs' dtype and the final S (B, H, F, Dv) float32, by
    fla's ``chunk_simple_gla`` on token-major qf, kf (B, T, H, F) and v (B, T, H, Dv)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as exc:
        raise RuntimeError(f"numerator 'fla' needs flash-linear-attention (fla-core==0.6.0) with CUDA; valid: {NUMERATORS}") from exc
    return chunk_simple_gla(q=qf, k=kf, v=v, scale=1.0, initial_state=None if kv is None else kv.float(), output_final_state=True)


def _strides(x: Tensor, n: int) -> tuple[int, ...]:
    """The first ``n`` strides of ``x``, whose last axis must be contiguous (the kernel's tiles)."""
    if x.stride(-1) != 1:
        raise ValueError(f"a tensor of shape {tuple(x.shape)} must be contiguous in its last axis, got strides {x.stride()}")
    return tuple(x.stride()[:n])
