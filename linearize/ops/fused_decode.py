"""Fused per-token decode kernels (Triton) for the linear states: one pass over a state per token.

A decode step of a linear-attention kind is bound by its float32 state (B x Hq x F x Dv floats),
which it must read once for the query and read and write once to take the new token in. The torch
form of each step (``hybrid_decode_step``, ``dsla_decode_step``) passes over the state three to five
times (an outer product written out, an in-place update, a matmul that reads the result). The kernels
here make it one read and one write: each program loads a tile of the state, updates it, stores it
back and reads it for the query from registers.

- ``hybrid_linear_step``: the hybrid's linear part, [S | z] += phi(k_out) [v_out, 1]^T for the token
  leaving the window, then phi(q) [S | z].
- ``hybrid_window_read``: the rest of the hybrid's step in one kernel, after the new token took its
  window slot: the window's scores, softmax weights and values, combined with the linear read by the
  joint or the gate mix (in the torch form: two matmuls and about eight elementwise kernels).
- ``dsla_state_step``: DSLA's two gated states together (their query, key and value loaded once),
  S = diag(alpha) S + phi(k) [v, (1)]^T, then phi(q) S for both.
- ``slot_attention_partials`` and ``slot_prefill_attention``: softmax attention over keys kept in
  the serving runner's slot pools (a decode step's rows, each its own slot and length; one row's
  prefill chunk, causal), reading each slot and length on the device (``ops.softmax`` wraps them).

The state kernels return the raw reads (numerator and, with a normaliser, the denominator column)
in float32; the ops combine them exactly as their torch forms do. The torch forms stay the
reference these are tested against (tests/ops/test_fused_decode.py, on CPU through Triton's
interpreter when there is no GPU). All three are registered as torch custom ops, so
``torch.compile`` treats them as opaque (the state kernels as in-place updates) and CUDA graphs
capture them like any kernel.

``enabled(tensor)`` says whether a step on that tensor takes the fused path: on CUDA with Triton
importable, unless turned off with ``use_fused(False)`` (the benchmarks time both forms that way);
``use_fused(True)`` with ``TRITON_INTERPRET=1`` runs them on the CPU (the tests).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Any, Iterator, NamedTuple

import torch
from torch import Tensor

from ..checks import check_int

_FORCED: list[bool] = []
_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether Triton is installed (looked up once, at import: a compiled step reads a constant)."""
    return _TRITON


def interpreting() -> bool:
    """Triton runs its kernels on the CPU, in Python (``TRITON_INTERPRET=1``, set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_run_on(x: Tensor) -> bool:
    """Whether Triton's kernels can run on ``x``'s device: CUDA, or the CPU when Triton interprets.
    (``scripts/kernel_resources.py`` replaces it to compile the kernels for a GPU on a CPU.)"""
    return x.is_cuda or (interpreting() and x.device.type == "cpu")


def enabled(x: Tensor) -> bool:
    """Whether a decode step on ``x``'s device takes the fused kernels: by default on CUDA (with
    Triton importable); inside ``use_fused(True)`` also on the CPU when Triton interprets."""
    asked = forced()
    if asked is False or not triton_available():
        return False
    return kernels_run_on(x) and (x.is_cuda or asked is True)


def forced() -> bool | None:
    """What the innermost ``use_fused`` block asks for (None outside any)."""
    return _FORCED[-1] if _FORCED else None


@contextlib.contextmanager
def use_fused(on: bool) -> Iterator[None]:
    """Within the block, decode steps take the fused kernels if ``on`` (where they apply: CUDA, or
    the CPU under Triton's interpreter) and never if not."""
    _FORCED.append(bool(on))
    try:
        yield
    finally:
        _FORCED.pop()


_AUTOTUNERS: list[Any] = []
"""Every Triton autotuner this package made (``autotune``), in the order made."""


def autotune(configs: list[Any], **kwargs: Any):
    """``triton.autotune(configs, **kwargs)`` that also records the autotuner, so that what it chose
    can be reported (``autotuned_choices``)."""
    import triton

    decorate = triton.autotune(configs, **kwargs)

    def register(fn):
        tuner = decorate(fn)
        _AUTOTUNERS.append(tuner)
        return tuner

    return register


def autotuned_choices() -> list[dict[str, Any]]:
    """What Triton's autotuner chose so far for this package's kernels: per kernel and key (the
    values of the autotuner's key arguments, then the dtypes of its tensor arguments), the chosen
    config's meta-parameters, warps, stages and register cap (None: none)."""
    out = []
    for tuner in _AUTOTUNERS:
        fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
        name = getattr(fn, "__name__", None) or str(fn)
        names = list(tuner.keys)
        for key, config in tuner.cache.items():
            key = list(key)
            out.append({
                "kernel": name,
                "key": {n: key[i] for i, n in enumerate(names) if i < len(key)},
                "dtypes": [str(k) for k in key[len(names):]],
                "config": {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
                           "maxnreg": config.maxnreg},
            })  # fmt: skip
    return out


class _Kernels(NamedTuple):
    hybrid: Any
    dsla: Any
    window: Any
    slots: Any
    prefill: Any
    inputs: Any
    down: Any
    mix: Any


_hedgehog_rows: Any = None
"""Rows' Hedgehog features for one map, stored: a Triton function made by ``_kernels``."""
_rope_rows: Any = None
"""Rows of q or k rotated by RoPE: a Triton function made by ``_kernels``."""


@functools.cache
def _kernels() -> _Kernels:
    """The Triton kernels, compiled on first use (Triton is imported only then)."""
    import triton
    import triton.language as tl

    def tuned(keys: list[str], restore: str):
        """Autotuned over the state tiles of both layouts on a GPU (the layout is in the key, so
        each is tuned on its own; the state restored after each trial, as these kernels update it
        in place); the default tiles in Triton's interpreter."""
        if interpreting():
            return lambda fn: triton.heuristics({"BK": lambda _: BLOCK_K, "BV": lambda _: BLOCK_V})(fn)
        tiles = dict.fromkeys(STATE_TILES + COLUMN_TILES)
        configs = [triton.Config({"BK": bk, "BV": bv}, num_warps=w) for bk, bv, w in tiles]
        return autotune(configs, key=keys, restore_value=[restore], prune_configs_by={"early_config_prune": tiles_for_layout})

    @tuned(["F", "V", "SV", "tune_rows"], "linear")
    @triton.jit(do_not_specialize=["slot", "tune_rows"])
    def hybrid_kernel(
        linear, features, values, qf, out, index,
        slot, tune_rows, n_rep, s_fb, s_fw, s_vb, s_vw, s_q,
        F: tl.constexpr, V: tl.constexpr, SF: tl.constexpr, SV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        DEVICE_INDEX: tl.constexpr,
    ):  # fmt: skip
        # tune_rows (the rows B x Hq rounded up to a power of 2) only keys the tuning: the tile
        # that is best at batch 1 is not at batch 64. SF, SV: the state's strides between feature
        # rows and value columns (V, 1 row-major; 1, F column-major), constants, so the compiler
        # sees which axis is contiguous.
        r = tl.program_id(0).to(tl.int64)  # one (batch row, query head)
        iv = tl.program_id(1)
        kr = r // n_rep  # its (batch row, KV head): the window is kept per KV head
        j = r % n_rep
        if DEVICE_INDEX:
            w = tl.load(index).to(tl.int64)
        else:
            w = slot.to(tl.int64)
        ov = iv * BV + tl.arange(0, BV)
        mv = ov < V
        vv = tl.load(values + kr * s_vb + w * s_vw + ov, mask=mv, other=0.0).to(tl.float32)  # [v, 1] of the leaving token
        acc = tl.zeros([BV], dtype=tl.float32)
        base = linear + r * F * V
        for k0 in range(0, F, BK):
            ok = k0 + tl.arange(0, BK)
            mk = ok < F
            f = tl.load(features + kr * s_fb + w * s_fw + j * F + ok, mask=mk, other=0.0).to(tl.float32)
            q = tl.load(qf + r * s_q + ok, mask=mk, other=0.0).to(tl.float32)
            ptr = base + ok[:, None] * SF + ov[None, :] * SV
            m = mk[:, None] & mv[None, :]
            s = tl.load(ptr, mask=m, other=0.0)
            s += f[:, None] * vv[None, :]
            tl.store(ptr, s, mask=m)
            acc += tl.sum(q[:, None] * s, axis=0)
        tl.store(out + r * V + ov, acc, mask=mv)

    @tuned(["K", "V", "SV", "tune_rows", "KS", "BY_ROW"], "states")
    @triton.jit(do_not_specialize=["rows", "state_rows", "tune_rows"])
    def dsla_kernel(
        states, qf, kf, v, decay, out, index,
        rows, state_rows, tune_rows, n_rep, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_db, s_ds, s_dh,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DV: tl.constexpr, KS: tl.constexpr, PAIR: tl.constexpr,
        SF: tl.constexpr, SV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr, INDEXED: tl.constexpr,
        BY_ROW: tl.constexpr,
    ):  # fmt: skip
        # rows = B * H (the batch) and state_rows (the states' rows: B * H, or a pool's slots * H) are
        # run-time values, not constexprs: a new batch size compiles nothing; tune_rows (the batch
        # rounded up to a power of 2) only keys the tuning: the best tile at batch 1 is not at 40.
        # PAIR: one program takes both states (their query, key and value loaded once; a large
        # batch); else each state and each block of KS feature rows is a program of its own (a small
        # batch), and the reads it writes are partial sums over its rows. BY_ROW: the grid's first
        # axis runs over (row, block of value columns) with a row's blocks adjacent, so they run
        # together and read its query, key and decay once from DRAM (else a row's blocks run a
        # whole pass over the rows apart, and at a large batch its inputs have left L2 by then).
        if BY_ROW:
            blocks = tl.cdiv(V, BV)
            r = tl.program_id(0).to(tl.int64) // blocks  # one (batch row, query head)
            iv = tl.program_id(0) % blocks
        else:
            r = tl.program_id(0).to(tl.int64)
            iv = tl.program_id(1)
        z = tl.program_id(2)  # PAIR: 0; else split * 2 + state (history 0, recent 1)
        st = z % 2
        sp = z // 2
        b = r // H
        h = r % H
        if INDEXED:  # batch row b keeps its states in row index[b] of a pool
            sr = tl.load(index + b).to(tl.int64) * H + h
        else:
            sr = r
        ov = iv * BV + tl.arange(0, BV)
        mv = ov < V
        vv = tl.load(v + b * s_vb + (h // n_rep) * s_vh + ov, mask=ov < DV, other=0.0).to(tl.float32)
        if NORMALIZE:
            vv = tl.where(ov == DV, 1.0, vv)  # the normaliser's column
        acc0 = tl.zeros([BV], dtype=tl.float32)
        acc1 = tl.zeros([BV], dtype=tl.float32)
        if PAIR:
            base0 = states + sr * K * V  # history
            base1 = states + (state_rows + sr) * K * V  # recent
            d0 = decay + b * s_db + h * s_dh
        else:
            base0 = states + (st * state_rows + sr) * K * V
            base1 = base0
            d0 = decay + b * s_db + st * s_ds + h * s_dh
        for k0 in range(0, KS, BK):
            kk = k0 + tl.arange(0, BK)
            ok = sp * KS + kk
            mk = (kk < KS) & (ok < K)
            q = tl.load(qf + b * s_qb + h * s_qh + ok, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(kf + b * s_kb + h * s_kh + ok, mask=mk, other=0.0).to(tl.float32)
            m = mk[:, None] & mv[None, :]
            kv = k[:, None] * vv[None, :]
            offs = ok[:, None] * SF + ov[None, :] * SV  # (SF, SV: as in hybrid_kernel)
            a0 = tl.load(d0 + ok, mask=mk, other=0.0).to(tl.float32)
            s0 = tl.load(base0 + offs, mask=m, other=0.0)
            s0 = a0[:, None] * s0 + kv
            tl.store(base0 + offs, s0, mask=m)
            acc0 += tl.sum(q[:, None] * s0, axis=0)
            if PAIR:
                a1 = tl.load(d0 + s_ds + ok, mask=mk, other=0.0).to(tl.float32)
                s1 = tl.load(base1 + offs, mask=m, other=0.0)
                s1 = a1[:, None] * s1 + kv
                tl.store(base1 + offs, s1, mask=m)
                acc1 += tl.sum(q[:, None] * s1, axis=0)
        tl.store(out + (z * rows + r) * V + ov, acc0, mask=mv)
        if PAIR:
            tl.store(out + (rows + r) * V + ov, acc1, mask=mv)

    @triton.jit
    def window_kernel(
        q, keys, values, valid, lin, factor, out,
        n_rep, s_qb, s_qh, scale,
        H: tl.constexpr, W: tl.constexpr, D: tl.constexpr, V: tl.constexpr,
        BW: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, EPS: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        # One program per (batch row, query head); with GROUP, per (batch row, KV head), its GROUP
        # query heads in turn on one load of the window.
        p = tl.program_id(0).to(tl.int64)
        if GROUP > 1:
            hkv = H // GROUP
            b = p // hkv
            kr = p
        else:
            b = p // H
            kr = b * (H // n_rep) + (p % H) // n_rep  # its (batch row, KV head)
        ow, od, ov = tl.arange(0, BW), tl.arange(0, BD), tl.arange(0, BV)
        mw, md, mv = ow < W, od < D, ov < V
        k = tl.load(keys + kr * W * D + ow[:, None] * D + od[None, :], mask=mw[:, None] & md[None, :], other=0.0)
        vt = tl.load(values + kr * W * V + ow[:, None] * V + ov[None, :], mask=mw[:, None] & mv[None, :], other=0.0)
        real = tl.load(valid + b * W + ow, mask=mw, other=0) != 0
        last = ov == V - 1
        for j in tl.static_range(GROUP):
            if GROUP > 1:
                h = (p % hkv) * GROUP + j
            else:
                h = p % H
            r = b * H + h
            qv = tl.load(q + b * s_qb + h * s_qh + od, mask=md, other=0.0).to(tl.float32)
            scores = tl.sum(k * qv[None, :], axis=1) * scale  # (BW,)
            scores = tl.where(real, scores, float("-inf"))
            e = tl.exp(scores - tl.max(scores, axis=0))  # the new token is in the window: the max is finite
            sw = tl.sum(e[:, None] * vt, axis=0)  # (BV,): [sum e v, sum e]
            la = tl.load(lin + r * V + ov, mask=mv, other=0.0)
            f = tl.load(factor + h).to(tl.float32)
            if GATE:  # g SWA + (1 - g) LA, each over its own denominator (0 where that is empty)
                den_w = tl.sum(tl.where(last, sw, 0.0), axis=0)
                den_l = tl.sum(tl.where(last, la, 0.0), axis=0)
                read_w = tl.where(den_w > EPS, sw / den_w, 0.0)
                read_l = tl.where(den_l > EPS, la / den_l, 0.0)
                o = read_l + f * (read_w - read_l)
            else:  # one denominator: the linear term plus the window's, scaled by the window factor
                x = la + f * sw
                den = tl.sum(tl.where(last, x, 0.0), axis=0)
                o = tl.where(den > EPS, x / den, 0.0)
            tl.store(out + r * (V - 1) + ov, o, mask=ov < V - 1)

    @triton.jit
    def slot_kernel(
        q, keys, values, slots, lengths, out_o, out_m, out_l,
        s_qb, s_qh, s_ks, s_kh, s_kt, s_vs, s_vh, s_vt, scale,
        SPLIT: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BD: tl.constexpr, BDV: tl.constexpr, NS: tl.constexpr, HKV: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)  # one (batch row, KV head, split of the keys)
        hk = tl.program_id(1).to(tl.int64)
        sp = tl.program_id(2)
        slot = tl.load(slots + b).to(tl.int64)
        n = tl.load(lengths + b).to(tl.int32)
        start = sp * SPLIT
        end = tl.minimum(start + SPLIT, n)
        om, od, ov = tl.arange(0, BM), tl.arange(0, BD), tl.arange(0, BDV)
        mm, md, mv = om < N_REP, od < D, ov < DV
        heads = hk * N_REP + om  # the KV head's query heads, one per row
        qv = tl.load(q + b * s_qb + heads[:, None] * s_qh + od[None, :], mask=mm[:, None] & md[None, :], other=0.0)
        kbase = keys + slot * s_ks + hk * s_kh
        vbase = values + slot * s_vs + hk * s_vh
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BDV], dtype=tl.float32)
        for t0 in range(0, SPLIT, BN):  # a constant trip count (Triton's interpreter takes no run-time bounds)
            if start + t0 < end:  # blocks past the row's length are skipped, not read
                ot = start + t0 + tl.arange(0, BN)
                mt = ot < end
                k = tl.load(kbase + ot[:, None] * s_kt + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
                s = tl.dot(qv, tl.trans(k), input_precision="ieee") * scale  # (BM, BN)
                s = tl.where(mt[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the block holds a key
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                v = tl.load(vbase + ot[:, None] * s_vt + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
        row = (b * HKV * N_REP + heads) * NS + sp  # (B, Hq, NS) partials
        tl.store(out_m + row, m_i, mask=mm)
        tl.store(out_l + row, l_i, mask=mm)
        tl.store(out_o + row[:, None] * DV + ov[None, :], acc, mask=mm[:, None] & mv[None, :])

    @triton.jit
    def slot_prefill_kernel(
        q, keys, values, meta, out,
        T, s_qh, s_qt, s_ks, s_kh, s_kt, s_vs, s_vh, s_vt, s_oh, s_ot, scale,
        CAP: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BD: tl.constexpr, BDV: tl.constexpr,
    ):  # fmt: skip
        qb = tl.program_id(0)  # one (block of the chunk's queries, query head)
        h = tl.program_id(1).to(tl.int64)
        hk = h // N_REP
        start = tl.load(meta).to(tl.int32)  # the chunk's first position
        slot = tl.load(meta + 1).to(tl.int64)
        oi, od, ov = qb * BM + tl.arange(0, BM), tl.arange(0, BD), tl.arange(0, BDV)
        mi, md, mv = oi < T, od < D, ov < DV
        pos = start + oi  # each query's position: it sees the slot's keys 0..pos
        last = start + tl.minimum(qb * BM + BM, T)  # keys the block reads: 0..last - 1
        qv = tl.load(q + h * s_qh + oi[:, None] * s_qt + od[None, :], mask=mi[:, None] & md[None, :], other=0.0)
        kbase = keys + slot * s_ks + hk * s_kh
        vbase = values + slot * s_vs + hk * s_vh
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BDV], dtype=tl.float32)
        for t0 in range(0, CAP, BN):  # a constant trip count (Triton's interpreter takes no run-time bounds)
            if t0 < last:  # blocks past the chunk's last position are skipped, not read
                ot = t0 + tl.arange(0, BN)
                mt = ot < last
                k = tl.load(kbase + ot[:, None] * s_kt + od[None, :], mask=mt[:, None] & md[None, :], other=0.0)
                s = tl.dot(qv, tl.trans(k), input_precision="ieee") * scale  # (BM, BN)
                s = tl.where(mt[None, :] & (ot[None, :] <= pos[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is in every query's first block
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                v = tl.load(vbase + ot[:, None] * s_vt + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + h * s_oh + oi[:, None] * s_ot + ov[None, :], o, mask=mi[:, None] & mv[None, :])

    @triton.jit
    def hedgehog_rows(x, hw, hb, m, dst, rows, mb, s_d, D: tl.constexpr, FH: tl.constexpr, IEEE: tl.constexpr):
        """[softmax(x W_m + b_m), softmax(-(x W_m + b_m))] of the rows ``x`` (BB, D) (batch rows ``rows``,
        valid where ``mb``), stored at ``dst`` + row * ``s_d`` (2 FH floats each), rounded through
        ``hw``'s dtype as the stored maps are."""
        od, of = tl.arange(0, D), tl.arange(0, FH)
        w = tl.load(hw + m * D * FH + od[:, None] * FH + of[None, :])
        p = tl.dot(x, w.to(x.dtype), input_precision="ieee" if IEEE else "tf32")  # (BB, FH) float32
        p += tl.load(hb + m * FH + of).to(tl.float32)[None, :]
        e = tl.exp(p - tl.max(p, axis=1)[:, None])
        ptr = dst + rows[:, None] * s_d + of[None, :]
        tl.store(ptr, (e / tl.sum(e, axis=1)[:, None]).to(hw.dtype.element_ty).to(dst.dtype.element_ty), mask=mb[:, None])
        e = tl.exp(tl.min(p, axis=1)[:, None] - p)
        tl.store(ptr + FH, (e / tl.sum(e, axis=1)[:, None]).to(hw.dtype.element_ty).to(dst.dtype.element_ty), mask=mb[:, None])

    globals()["_hedgehog_rows"] = hedgehog_rows  # a module global: what Triton's interpreter resolves

    @triton.jit
    def rope_rows(base, cos, sin, rows, mb, s_c, s_s, D: tl.constexpr):
        """The rows (BB, D) at ``base`` (a (BB, 1) block of row pointers) rotated by their batch rows'
        ``cos`` and ``sin`` (row stride ``s_c``, ``s_s``): x cos + rotate_half(x) sin in float32,
        rounded once to x's dtype, as ``ops.rope.rope`` computes it."""
        HALF: tl.constexpr = D // 2
        od = tl.arange(0, D)
        x = tl.load(base + od[None, :], mask=mb[:, None], other=0.0)
        xs = tl.load(base + ((od + HALF) % D)[None, :], mask=mb[:, None], other=0.0).to(tl.float32)  # (x2, x1)
        c = tl.load(cos + rows[:, None] * s_c + od[None, :], mask=mb[:, None], other=0.0).to(tl.float32)
        sn = tl.load(sin + rows[:, None] * s_s + od[None, :], mask=mb[:, None], other=0.0).to(tl.float32)
        sign = tl.where(od < HALF, -1.0, 1.0)[None, :]
        return (x.to(tl.float32) * c + (sign * xs) * sn).to(x.dtype)

    globals()["_rope_rows"] = rope_rows

    @triton.jit
    def dsla_inputs_kernel(
        q, k, x, down, xr_in, hw, hb, up, gb, qf, kf, decay, cos, sin,
        rows, n_rep, s_qb, s_qh, s_kb, s_kh, s_x, s_cb, s_sb,
        H: tl.constexpr, D: tl.constexpr, FH: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr, HID: tl.constexpr,
        BH: tl.constexpr, BB: tl.constexpr, NORM: tl.constexpr, IEEE: tl.constexpr, PARTS: tl.constexpr, DOWN: tl.constexpr,
        SPLIT: tl.constexpr, GH: tl.constexpr, XS: tl.constexpr, ROPE: tl.constexpr,
    ):  # fmt: skip
        # one program per (query head, block of BB rows, part): the head's weights loaded once for
        # its rows; PARTS 1: the query's map, the key's and both gates in one program; 4: one each,
        # a gate's program h computing its down projection once for the GH query heads from h GH
        # (programs past the last group do nothing); PARTS 1 takes GH 1
        h = tl.program_id(0)
        ob = tl.program_id(1) * BB + tl.arange(0, BB)
        part = tl.program_id(2)
        mb = ob < rows
        b = ob.to(tl.int64)
        F: tl.constexpr = 2 * FH
        od = tl.arange(0, D)
        if (PARTS == 1) | (part == 0):
            if ROPE:  # q and k before RoPE, rotated here by their rows' cos and sin (B, D)
                qv = _rope_rows(q + b[:, None] * s_qb + h * s_qh, cos, sin, b, mb, s_cb, s_sb, D=D)
            else:
                qv = tl.load(q + b[:, None] * s_qb + h * s_qh + od[None, :], mask=mb[:, None], other=0.0)
            _hedgehog_rows(qv, hw, hb, h, qf + h * F, b, mb, H * F, D=D, FH=FH, IEEE=IEEE)  # the query's map: h
        if (PARTS == 1) | (part == 1):
            if ROPE:
                kv = _rope_rows(k + b[:, None] * s_kb + (h // n_rep) * s_kh, cos, sin, b, mb, s_cb, s_sb, D=D)
            else:
                kv = tl.load(k + b[:, None] * s_kb + (h // n_rep) * s_kh + od[None, :], mask=mb[:, None], other=0.0)
            _hedgehog_rows(kv, hw, hb, H + h, kf + h * F, b, mb, H * F, D=D, FH=FH, IEEE=IEEE)  # the key's map for query head h: H + h
        oi, og = tl.arange(0, R), tl.arange(0, F)
        for s in tl.static_range(2):  # history, recent: alpha = exp(logsigmoid(x W_down W_up + b) / NORM)
            if ((PARTS == 1) | (part == 2 + s)) & (h * GH < H):
                if DOWN:  # xr = x W_down (BB, R): the gate's rank rows of ``down``, the rest of R zero; in
                    # float32, rounded through down's dtype as F.linear rounds it; SPLIT > 1: down
                    # is a float32 weight's SPLIT bfloat16 parts and x bfloat16, each part's
                    # products exact on the tensor cores, summed in float32
                    xr = tl.zeros([BB, R], dtype=tl.float32)
                    for h0 in range(0, HID, BH):
                        oh = h0 + tl.arange(0, BH)
                        mh = oh < HID
                        xv = tl.load(x + b[:, None] * s_x + oh[None, :], mask=mb[:, None] & mh[None, :], other=0.0)
                        md = (oi[:, None] < RANK) & mh[None, :]
                        if SPLIT > 1:
                            for p in tl.static_range(SPLIT):
                                dw = tl.load(down + (p * 2 * RANK + s * RANK + oi[:, None]) * HID + oh[None, :], mask=md, other=0.0)
                                xr = tl.dot(xv, tl.trans(dw), xr)
                        else:
                            dw = tl.load(down + (s * RANK + oi[:, None]) * HID + oh[None, :], mask=md, other=0.0)
                            xr += tl.dot(xv.to(dw.dtype).to(tl.float32), tl.trans(dw.to(tl.float32)), input_precision="ieee")
                    if SPLIT == 1:
                        xr = xr.to(down.dtype.element_ty).to(tl.float32)
                else:  # xr given: (XS, B, 2, R) float32, XS partial sums (of ``dsla_down_kernel``) added in order
                    xr = tl.load(xr_in + (b[:, None] * 2 + s) * R + oi[None, :], mask=mb[:, None], other=0.0)
                    for p in tl.static_range(1, XS):
                        xr += tl.load(xr_in + ((p * rows + b[:, None]) * 2 + s) * R + oi[None, :], mask=mb[:, None], other=0.0)
                for j in tl.static_range(GH):  # the group's heads, each its slice of the up projection
                    g = h * GH + j
                    if g < H:
                        u = tl.load(up + s * R * H * F + oi[:, None] * (H * F) + g * F + og[None, :])  # (R, F) float32
                        z = tl.dot(xr, u, input_precision="ieee") + tl.load(gb + s * H * F + g * F + og)[None, :]
                        ls = tl.minimum(z, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(z)))  # logsigmoid
                        tl.store(decay + (b[:, None] * 2 + s) * (H * F) + g * F + og[None, :], tl.exp(ls / NORM), mask=mb[:, None])

    @triton.jit
    def dsla_down_kernel(x, down, out, rows, s_x, R: tl.constexpr, RANK: tl.constexpr, HID: tl.constexpr, BH: tl.constexpr,
                         BB: tl.constexpr, SPLIT: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
        # one program per (block of BB rows, slice of STEPS x BH hidden units): both gates' partial
        # x W_down (BB, 2 R) over its slice, from the float32 weight's SPLIT bfloat16 parts (each
        # product exact on the tensor cores, summed in float32), stored at out[slice] (S, B, 2, R)
        ob = tl.program_id(0) * BB + tl.arange(0, BB)
        ks = tl.program_id(1)
        mb = ob < rows
        b = ob.to(tl.int64)
        oc = tl.arange(0, 2 * R)  # column c: gate c // R, rank row c % R (zero past RANK)
        wr = (oc // R) * RANK + oc % R
        mr = oc % R < RANK
        xr = tl.zeros([BB, 2 * R], dtype=tl.float32)
        for st in range(STEPS):
            oh = (ks * STEPS + st) * BH + tl.arange(0, BH)
            mh = oh < HID
            xv = tl.load(x + b[:, None] * s_x + oh[None, :], mask=mb[:, None] & mh[None, :], other=0.0)
            for p in tl.static_range(SPLIT):
                dw = tl.load(down + (p * 2 * RANK + wr[:, None]) * HID + oh[None, :], mask=mr[:, None] & mh[None, :], other=0.0)
                xr = tl.dot(xv, tl.trans(dw), xr)
        tl.store(out + (ks * rows + b[:, None]) * (2 * R) + oc[None, :], xr, mask=mb[:, None])

    @triton.jit
    def dsla_mix_kernel(o, w, out, rows, s_split, s_state, S: tl.constexpr, C: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr,
                        BR: tl.constexpr, NORMALIZE: tl.constexpr, EMPTY: tl.constexpr):  # fmt: skip
        # one program per BR (batch row, query head) rows: both states' reads summed over their S
        # partial sums (in order), each divided by its normaliser (column DV; 0 where empty) with
        # NORMALIZE, mixed by w (2,), the first DV columns stored in out's dtype
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        oc = tl.arange(0, BC)
        m = (r < rows)[:, None] & (oc < C)[None, :]
        base = o + r[:, None] * C + oc[None, :]
        h = tl.load(base, mask=m, other=0.0)
        n = tl.load(base + s_state, mask=m, other=0.0)
        for p in tl.static_range(1, S):
            h += tl.load(base + p * s_split, mask=m, other=0.0)
            n += tl.load(base + p * s_split + s_state, mask=m, other=0.0)
        w0 = tl.load(w)
        w1 = tl.load(w + 1)
        if NORMALIZE:
            dh = tl.sum(tl.where(oc[None, :] == DV, h, 0.0), axis=1)
            dn = tl.sum(tl.where(oc[None, :] == DV, n, 0.0), axis=1)
            gh = tl.where(dh > EMPTY, w0 / dh, 0.0)[:, None]
            gn = tl.where(dn > EMPTY, w1 / dn, 0.0)[:, None]
        else:
            gh = w0
            gn = w1
        tl.store(out + r[:, None] * DV + oc[None, :], (n * gn + h * gh).to(out.dtype.element_ty), mask=(r < rows)[:, None] & (oc < DV)[None, :])

    return _Kernels(hybrid=hybrid_kernel, dsla=dsla_kernel, window=window_kernel, slots=slot_kernel, prefill=slot_prefill_kernel,
                    inputs=dsla_inputs_kernel, down=dsla_down_kernel, mix=dsla_mix_kernel)  # fmt: skip


BLOCK_K = 32
BLOCK_V = 64
COLUMN_TILES = ((128, 8, 4), (128, 16, 4), (128, 32, 4), (128, 64, 8), (256, 16, 4), (256, 32, 8), (256, 8, 4), (64, 64, 4))
"""(feature rows, value columns, warps) per program the state kernels are tuned over on a GPU as
well, for column-major states: a program takes whole columns of F contiguous floats where F fits."""
COLUMN_STATES = True
"""Decode states made for the fused kernels keep [S | z] column-major: each value column's F
features contiguous (a (rows, F, C) tensor with strides (F C, 1, F)), so a program's loads are
whole aligned columns with no masked lanes (C = Dv + 1 columns otherwise start every row at a
4-byte offset or are padded) and its read sums along them. Whole SmolLM2 at batch 64 and 8K
decodes 5-9% faster so (both kinds). False: row-major, as the CPU kernels and the serving pools
take them (the kernels take either)."""
STATE_TILES = ((32, 64, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8), (8, 256, 4))
"""(feature rows, value columns, warps) per program the state kernels are tuned over on a GPU: the
widest tiles cover a whole [S | z] row block (Dv + 1 contiguous floats) in one coalesced load."""


def tiles_for_layout(configs: list[Any], nargs: dict[str, Any], **kwargs: Any) -> list[Any]:
    """The state kernels' autotuner configs worth timing for a launch's layout: ``STATE_TILES`` for
    a row-major state (stride ``SV`` 1 between value columns), ``COLUMN_TILES`` for a column-major
    one (an ``early_config_prune`` for ``triton.autotune``; all of them where none matches)."""
    tiles = set(STATE_TILES if kwargs.get("SV", 1) == 1 else COLUMN_TILES)
    kept = [c for c in configs if (c.kwargs["BK"], c.kwargs["BV"], c.num_warps) in tiles]
    return kept or configs


def _check_buffer(name: str, x: Tensor) -> None:
    """ValueError unless ``x`` is a contiguous float32 tensor (what a kernel indexes as one block)."""
    if not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"{name} must be a contiguous float32 tensor, got {x.dtype} with strides {x.stride()}")


def _column_major_empty(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised (..., R, C) tensor like ``like`` whose columns' R entries are contiguous
    (strides (..., 1, R))."""
    return like.new_empty(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)


def column_major(x: Tensor) -> Tensor:
    """``x`` (..., R, C) as a column-major copy: the same values and shape, each column's R entries
    contiguous (strides (..., 1, R))."""
    return _column_major_empty(x.shape, x).copy_(x)


def new_state(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised decode state of ``shape`` (..., R, C) with ``like``'s dtype and device, laid
    out for the fused kernels: column-major (as ``column_major`` makes) where ``column_states(like)``,
    else contiguous. The caller copies the state's parts in: no intermediate copy of the whole."""
    return _column_major_empty(shape, like) if column_states(like) else like.new_empty(shape)


def column_states(x: Tensor) -> bool:
    """Whether a new float32 decode state like ``x`` is made column-major: ``COLUMN_STATES`` is on
    and the fused kernels run on its device."""
    return COLUMN_STATES and x.dtype == torch.float32 and enabled(x)


def _state_strides(name: str, x: Tensor) -> dict[str, int]:
    """The state kernels' SF and SV for the float32 state ``x`` (..., R, C): its strides between
    feature rows and value columns (C, 1 contiguous; 1, R column-major, as ``column_major`` makes
    it); ValueError for any other layout or dtype."""
    if x.dtype == torch.float32 and (x.is_contiguous() or x.transpose(-1, -2).is_contiguous()):
        return {"SF": x.stride(-2), "SV": x.stride(-1)}
    raise ValueError(f"{name} must be a contiguous float32 tensor or its column-major form (last two axes transposed), got {x.dtype} "
                     f"with strides {x.stride()}")  # fmt: skip


def _check(name: str, x: Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {x.dtype}")


@torch.library.custom_op("linearize::hybrid_linear_step", mutates_args=("linear",))
def hybrid_linear_step(linear: Tensor, features: Tensor, values: Tensor, qf: Tensor, index: Tensor | None, slot: int) -> Tensor:
    """The hybrid decode step's linear part, in place: ``linear`` (B Hq, F, Dv + 1) float32 [S | z]
    (contiguous or column-major) takes the leaving token, window slot ``index`` (0-dim long tensor
    on the device; None: the host's ``slot``) of ``features`` (B Hkv, W, n_rep F) and ``values``
    (B Hkv, W, Dv + 1); returns phi(q) [S | z] (B Hq, Dv + 1) float32 for ``qf`` (B Hq, F)."""
    rows, f, width = linear.shape
    bk, w = values.shape[:2]
    n_rep = rows // bk
    strides = _state_strides("linear", linear)
    _check("features", features, (bk, w, n_rep * f))
    _check("values", values, (bk, w, width))
    _check("qf", qf, (rows, f))
    if features.stride(-1) != 1 or values.stride(-1) != 1 or qf.stride(-1) != 1:
        raise ValueError("features, values and qf must be contiguous in their last axis")
    out = torch.empty(rows, width, device=linear.device, dtype=torch.float32)
    kernel = _kernels().hybrid

    def grid(meta):
        return (rows, -(-width // meta["BV"]))

    kernel[grid](
        linear, features, values, qf, out, linear if index is None else index,
        slot, 1 << (rows - 1).bit_length(), n_rep, features.stride(0), features.stride(1), values.stride(0), values.stride(1),
        qf.stride(0), F=f, V=width, **strides, DEVICE_INDEX=index is not None,
    )  # fmt: skip
    return out


@hybrid_linear_step.register_fake
def _(linear, features, values, qf, index, slot):
    return linear.new_empty(linear.shape[0], linear.shape[2])


SPLIT_PROGRAMS = 256
"""At a small batch the DSLA state kernel runs each state, and each block of its feature rows, as a
program of its own, splitting the rows until a step runs about this many programs (B x Hq x 2
states x splits), with at least ``SPLIT_MIN_ROWS`` rows per split: at batch 1 one program per head
leaves most of the GPU idle and each program's pass over its rows waits on its loads one tile at a
time. A batch that fills the GPU without that (one split) keeps both states in one program, which
loads the query, key and value once for both."""
SPLIT_MIN_ROWS = 16


def dsla_splits(rows: int, features: int) -> int:
    """How many programs share each DSLA state's ``features`` rows in a step of ``rows`` = B x Hq
    (a power of 2; 1 once the batch alone fills the GPU, and then one program takes both states):
    their partial reads are summed after."""
    splits = 1
    while rows * 2 * splits * 2 <= SPLIT_PROGRAMS and features // (splits * 2) >= SPLIT_MIN_ROWS:
        splits *= 2
    return splits


def dsla_split_launch(splits: int, features: int) -> tuple[int, dict[str, Any]]:
    """The state kernel's launch for ``splits`` (``dsla_splits``) over ``features`` rows: the programs
    along its grid's third axis (one with both states in it, else one per state and split) and its
    constexprs KS (rows per split) and PAIR."""
    return (1 if splits == 1 else 2 * splits), {"KS": -(-features // splits), "PAIR": splits == 1}


@torch.library.custom_op("linearize::dsla_state_step", mutates_args=("states",))
def dsla_state_step(states: Tensor, qf: Tensor, kf: Tensor, v: Tensor, decay: Tensor, normalize: bool,
                    index: Tensor | None = None) -> Tensor:  # fmt: skip
    """DSLA's decode step on both states, in place: ``states`` (2, B, Hq, Dk, C) float32 (contiguous,
    or column-major: ``column_major``), history first, become diag(alpha) S + phi(k) [v, (1), 0 ...]^T
    for ``kf`` (B, Hq, Dk), ``v`` (B, Hkv, Dv) and ``decay`` (B, 2, Hq, Dk) = alpha; returns both reads phi(q) S as partial sums over
    ``dsla_splits(B Hq, Dk)`` blocks of feature rows, (splits, 2, B, Hq, C) float32 for ``qf``
    (B, Hq, Dk): their sum over the first axis is the read (``dsla_read`` adds them, where a
    compiled step fuses the sum into what follows). With ``normalize`` column Dv is the
    normaliser's (its value is 1 for every token); columns past it (C > Dv [+ 1]: rows padded for
    aligned loads) get zeros. With ``index`` (B,) int64, ``states`` is a pool (2, N, Hq, Dk, C) and
    batch row b updates its row index[b] in place (the other rows are left as they are; the
    indices must be distinct)."""
    _, n, hq, dk, width = states.shape
    b, hkv, dv = v.shape[0], v.shape[1], v.shape[-1]
    strides = _state_strides("states", states)
    if width < dv + int(normalize):
        raise ValueError(f"states have {width} columns; v's {dv} values" + (" and the normaliser" if normalize else "") + " need "
                         f"{dv + int(normalize)}")  # fmt: skip
    if index is None:
        if n != b:
            raise ValueError(f"states hold {n} rows for a batch of {b}: give the rows' index for a pool")
    else:
        _check("index", index, (b,), torch.int64)
    _check("qf", qf, (b, hq, dk))
    _check("kf", kf, (b, hq, dk))
    _check("v", v, (b, hkv, dv))
    _check("decay", decay, (b, 2, hq, dk))
    if any(x.stride(-1) != 1 for x in (qf, kf, v, decay)):
        raise ValueError("qf, kf, v and decay must be contiguous in their last axis")
    splits = dsla_splits(b * hq, dk)
    programs, split = dsla_split_launch(splits, dk)
    out = torch.empty(splits, 2, b, hq, width, device=states.device, dtype=torch.float32)
    kernel = _kernels().dsla

    by_row = DSLA_BLOCKS_BY_ROW

    def grid(meta):
        blocks = -(-width // meta["BV"])
        return (b * hq * blocks, 1, programs) if by_row else (b * hq, blocks, programs)

    kernel[grid](
        states, qf, kf, v, decay, out, index if index is not None else out,
        b * hq, n * hq, 1 << (b - 1).bit_length(), hq // hkv, qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), v.stride(0), v.stride(1),
        decay.stride(0), decay.stride(1), decay.stride(2),
        H=hq, K=dk, V=width, DV=dv, **strides, NORMALIZE=normalize, INDEXED=index is not None, **split, BY_ROW=by_row,
    )  # fmt: skip
    return out


@dsla_state_step.register_fake
def _(states, qf, kf, v, decay, normalize, index=None):
    return states.new_empty(dsla_splits(v.shape[0] * states.shape[2], states.shape[3]), 2, v.shape[0], states.shape[2], states.shape[4])


DSLA_MIX_KERNEL = True
"""``ops.dsla.dsla_decode_step`` mixes the two states' reads with ``dsla_mix`` (one kernel: the
partial sums added, each read divided by its normaliser, mixed, rounded to the output's dtype)
outside ``torch.compile``, where it would take six elementwise kernels (a compiled step fuses them
itself). False: the elementwise form everywhere. At the 8B shape, batch 224: 7.3 us a layer."""
DSLA_MIX_ROWS = 16
"""(Batch row, query head) rows per program of ``dsla_mix``."""


@torch.library.custom_op("linearize::dsla_mix", mutates_args=())
def dsla_mix(partials: Tensor, weights: Tensor, dv: int, normalize: bool, dtype: torch.dtype) -> Tensor:
    """DSLA's decode output from ``dsla_state_step``'s ``partials`` (S, 2, B, Hq, C) float32 in one
    kernel: each state's read summed over S, divided by its normaliser (column ``dv``, 0 where at or
    below ``common.EMPTY_DENOMINATOR``) with ``normalize``, then weights[0] history + weights[1]
    recent (``weights`` (2,) float32): (B, Hq, dv) in ``dtype``, the numbers of ``dsla_read`` and
    ``ops.dsla``'s elementwise mix."""
    from triton import next_power_of_2 as pow2

    from .common import EMPTY_DENOMINATOR

    splits, two, b, hq, width = partials.shape
    if two != 2 or partials.dtype != torch.float32 or not partials.is_contiguous():
        raise ValueError(f"partials must be a contiguous (splits, 2, B, Hq, C) float32 tensor, got {tuple(partials.shape)} {partials.dtype}")
    if width < dv + int(normalize):
        raise ValueError(f"partials have {width} columns; {dv} values" + (" and the normaliser" if normalize else "") + " need "
                         f"{dv + int(normalize)}")  # fmt: skip
    _check("weights", weights, (2,), torch.float32)
    out = torch.empty(b, hq, dv, device=partials.device, dtype=dtype)
    rows = b * hq
    _kernels().mix[(-(-rows // DSLA_MIX_ROWS),)](
        partials, weights, out, rows, partials.stride(0), partials.stride(1), S=splits, C=width, DV=dv, BC=pow2(dv + 1), BR=DSLA_MIX_ROWS,
        NORMALIZE=normalize, EMPTY=EMPTY_DENOMINATOR,
    )  # fmt: skip
    return out


@dsla_mix.register_fake
def _(partials, weights, dv, normalize, dtype):
    return partials.new_empty(partials.shape[2], partials.shape[3], dv, dtype=dtype)


def dsla_read(partials: Tensor) -> Tensor:
    """The two states' reads (2, B, Hq, C) from ``dsla_state_step``'s partial sums."""
    return partials[0] if partials.shape[0] == 1 else partials.sum(dim=0)


def tile_sized(*sizes: int) -> bool:
    """Every size a power of two from 16 (what the kernels' tiles and ``tl.dot`` take)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in sizes)


DSLA_BLOCKS_BY_ROW = True
"""DSLA's state kernel launches its programs with each row's blocks of value columns adjacent
(one grid axis over rows x blocks), so a row's query, key and decay are read from DRAM once and
then from L2. At 32K and the largest batch that fits, tokens/s rose 12% at SmolLM2's shape (4,048
rows) and 9% at the 8B shape (224), and batch 64 at 8K is no slower (H100). False: the blocks of
value columns on a grid axis of their own, each a pass over all the rows (at a large batch a row's
inputs have left L2 by its next block)."""


DSLA_FEATURES_IN_MAPS_DTYPE = True
"""``dsla_decode_inputs`` writes the query's and key's features in the feature maps' dtype
(bfloat16 in a bfloat16 model) instead of float32: the same numbers, as they are rounded through
that dtype either way, in half the bytes written and read again by the state kernel. SmolLM2 at 32K
and its largest batch (4,048): 56.92 ms a step against 57.27, the 8B shape (224): 51.75 against
51.80 (H100). False: float32 features."""


def _features_dtype(hedgehog_weight: Tensor) -> torch.dtype:
    """The dtype ``dsla_decode_inputs`` writes qf and kf in (``DSLA_FEATURES_IN_MAPS_DTYPE``)."""
    return hedgehog_weight.dtype if DSLA_FEATURES_IN_MAPS_DTYPE else torch.float32


DSLA_INPUT_ROWS = 16
"""Batch rows per program of ``dsla_decode_inputs`` (each program one query head's weights)."""
DSLA_INPUT_PARTS = 4
"""Programs per (query head, block of rows) of ``dsla_decode_inputs``: 4 makes the query's map,
the key's map and each gate a program of its own (a large batch at a few heads otherwise runs
fewer programs than the GPU has SMs, and each gate's program computes its down projection beside
the maps' programs); 1 does all four in one program. With the down projection in the kernel
(``DSLA_GATE_DOWN``), whole SmolLM2 at batch 64 and 8K decodes 11% faster with 4 than with the
float32 GEMM and 1 (H100); with the GEMM, 4 was no faster than 1."""


DSLA_GATE_DOWN = True
"""A bfloat16 model's DSLA layers (x bfloat16, the gates' weights float32) let
``dsla_decode_inputs`` compute the gates' down projection x W_down itself, from the weight's three
bfloat16 parts on the tensor cores (``bf16_parts``: each product exact, summed in float32, the
float32 projection up to the order of its sum), each gate's program for its rows: no GEMM and
split-K reduction of its own in the step. False, or any other dtypes: a float32 GEMM before the
kernel (``fused_dsla.gate_inputs``) gives it ``xr``. The kernel's other form, float32 dots for a
float32 x, is not used by the layers: with it whole SmolLM2 at batch 64 decoded 0.66 ms a step
slower (H100)."""


DSLA_GATE_HEADS = 1
"""Query heads per gate program of ``dsla_decode_inputs`` (with ``DSLA_INPUT_PARTS`` 4): the
program computes its rows' down projection x W_down once and each of its heads' gates from it, so
the projection (a pass over the hidden size) runs once per this many heads instead of once per head.
The heads are split into ceil(Hq / DSLA_GATE_HEADS) groups of equal size (the last may be smaller).
1 (a program per head) is the default: the kernel alone at the 8B shape, batch 224, took 105.8 us
with 1, 141.1 with 8 and 434.6 with 32, and at SmolLM2's shape, batch 64, 7.3 us with 1 and 8.9 with
3 (H100). Only SmolLM2's largest batch at 32K (4,048) gains: 75.9 us with 3 against 104.3. A gate
program is bound by the latency of its serial loop over the hidden size, not by how often the
projection is recomputed, so fewer, longer programs are slower. Every grouping gives the same numbers.
From ``DSLA_DOWN_SPLIT_ROWS`` rows the projection comes from a kernel of its own and a gate
program only adds its partial sums."""


DSLA_ROPE_IN_KERNEL = True
"""DSLA layers whose feature maps see q and k after RoPE hand ``dsla_decode_inputs`` the token's cos
and sin with q and k before it, so the kernel rotates them as it loads them: no RoPE kernel and no
pass over q and k of their own in the step. False: RoPE applied before the kernel (``ops.rope``).
At the 8B shape, batch 224: 31.1 us for the kernel rotating q and k against 47.3 for two RoPE
kernels and the kernel (H100)."""


DSLA_DOWN_SPLIT_ROWS: int | None = 128
"""From this many batch rows, ``dsla_decode_inputs`` computes the gates' down projection (from the
float32 weight's bfloat16 parts) in a kernel of its own before the inputs kernel, split over the
hidden size (``dsla_gate_down``: a program per block of rows and ``DSLA_DOWN_STEPS`` x 64 hidden
units), the gate programs adding its partial sums in a fixed order. Below it (or always, with
None), each gate program computes the projection for its rows in a serial loop over the whole hidden
size, once per query head: one launch fewer, which is what a small batch is bound by. At the 8B shape, batch
224, the projection and the inputs kernel take 28.7 us split in slices of 4 steps (30.2 with 2, 29.4
with 8) against 106.1 in the gate programs and 44.8 with a float32 GEMM before the kernel (H100)."""
DSLA_DOWN_STEPS = 4
"""Steps of 64 hidden units per program of ``dsla_gate_down``."""


def dsla_down_splits(rows: int, hidden: int) -> int:
    """The partial sums of the gates' down projection ``dsla_decode_inputs`` takes for ``rows`` batch
    rows and ``hidden`` units: 0 (the gate programs compute it) below ``DSLA_DOWN_SPLIT_ROWS``, else
    the slices of ``DSLA_DOWN_STEPS`` x 64 units covering ``hidden``."""
    check_int("fused_decode.DSLA_DOWN_SPLIT_ROWS", DSLA_DOWN_SPLIT_ROWS, 1, allow_none=True)
    check_int("fused_decode.DSLA_DOWN_STEPS", DSLA_DOWN_STEPS, 1)
    if DSLA_DOWN_SPLIT_ROWS is None or rows < DSLA_DOWN_SPLIT_ROWS:
        return 0
    return -(-hidden // (64 * DSLA_DOWN_STEPS))


def dsla_gate_down(x: Tensor, down: Tensor, r: int, splits: int) -> Tensor:
    """Both gates' down projection x W_down of ``x`` (B, hidden) bfloat16 from ``down`` (parts, 2
    rank, hidden), the float32 weight's bfloat16 parts (``bf16_parts``), as ``splits`` partial sums
    over consecutive slices of the hidden units: (splits, B, 2, r) float32, rank rows past the
    weight's zero. Their sum (in order) is the float32 projection up to the order of its sum."""
    parts, rows2, hidden = down.shape
    b = x.shape[0]
    steps = -(-hidden // (64 * splits))
    out = torch.empty(splits, b, 2, r, device=x.device, dtype=torch.float32)
    _kernels().down[(-(-b // DSLA_INPUT_ROWS), splits)](
        x, down, out, b, x.stride(0), R=r, RANK=rows2 // 2, HID=hidden, BH=64, BB=DSLA_INPUT_ROWS, SPLIT=parts, STEPS=steps,
    )  # fmt: skip
    return out


def dsla_gate_heads(heads: int) -> int:
    """The query heads each gate program of ``dsla_decode_inputs`` takes, of ``heads`` (``DSLA_GATE_HEADS``
    split evenly; 1 when the four parts run in one program)."""
    check_int("fused_decode.DSLA_GATE_HEADS", DSLA_GATE_HEADS, 1)
    if DSLA_INPUT_PARTS == 1:
        return 1
    groups = -(-heads // DSLA_GATE_HEADS)
    return -(-heads // groups)


def bf16_parts(w: Tensor, parts: int = 3) -> Tensor:
    """A float32 weight as ``parts`` bfloat16 tensors (parts, *w.shape) whose float32 sum is w: each
    part the rounding of what the ones before it left. Three hold all of float32's 24 significant
    bits (8 each), so x @ w for a bfloat16 x is three tensor-core products, each exact in float32,
    summed in float32 (``dsla_decode_inputs``'s gates' down projection); weights too small for
    bfloat16's exponent range (below about 1e-38) lose their last parts."""
    if w.dtype != torch.float32:
        raise ValueError(f"bf16_parts takes a float32 weight, got {w.dtype}")
    out, rest = [], w
    for _ in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        rest = rest - part.float()
    return torch.stack(out)


def dsla_inputs_apply(q: Tensor, hedgehog_weight: Tensor) -> bool:
    """Whether ``dsla_decode_inputs`` takes a step with query heads ``q`` (B, Hq, D) and Hedgehog
    maps ``hedgehog_weight`` (2 Hq, D, f): on a device the fused kernels are enabled for, D and f
    powers of two from 16."""
    d, f = hedgehog_weight.shape[-2:]
    return enabled(q) and tile_sized(d, f)


@torch.library.custom_op("linearize::dsla_decode_inputs", mutates_args=())
def dsla_decode_inputs(q: Tensor, k: Tensor, x: Tensor, down: Tensor, hedgehog_weight: Tensor, hedgehog_bias: Tensor, up: Tensor,
                       gate_bias: Tensor, xr: Tensor | None = None, cos: Tensor | None = None,
                       sin: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """What DSLA's decode step reads of one token, in one kernel: the Hedgehog features of q (B, Hq, D)
    and of k (B, Hkv, D) for every query head of its KV head (maps ``hedgehog_weight`` (2 Hq, D, f)
    and ``hedgehog_bias`` (2 Hq, 1, f), queries' first, as ``layers.base.token_features`` stacks them),
    rounded through the maps' dtype; and both gates alpha = exp(logsigmoid(xr W_up + b) / 16) from
    the token's hidden state ``x`` (B, hidden), both gates' down projections ``down`` (2 rank, hidden)
    (xr = x W_down in down's dtype, as ``fused_dsla.gate_inputs`` computes it: in the kernel, unless
    the caller's GEMM gave ``xr`` (B, 2, R) float32; ``DSLA_GATE_DOWN`` says which the layers do) and ``up`` (2, R, Hq F), ``gate_bias`` (2, Hq F) float32
    (``fused_dsla.gate_weights``; R the rank padded, ``fused_dsla.padded_rank``). Returns qf, kf
    (B, Hq, 2f), float32 (or the maps' dtype: ``DSLA_FEATURES_IN_MAPS_DTYPE``), and decay
    (B, 2, Hq, 2f), float32: the numbers of ``token_features`` and
    ``DslaAttention.decode_gates`` (tests/ops/test_fused_decode.py). One program per query head and
    block of ``DSLA_INPUT_ROWS`` rows, so each head's weights are read once per block; a gate's
    program takes ``dsla_gate_heads`` heads, its rows' down projection computed once for them (from
    ``DSLA_DOWN_SPLIT_ROWS`` rows, by ``dsla_gate_down`` before the kernel). With ``cos`` and ``sin``
    ((B or 1, D) in q's dtype, the token's rotary embedding), q and k come before RoPE and the
    kernel rotates them as ``ops.rope.rope`` does (no launch and no pass over q and k of their own)."""
    from .dsla import GATE_NORMALISER  # (ops.dsla imports this module)

    b, hq, d = q.shape
    hkv = k.shape[1]
    f = hedgehog_weight.shape[-1]
    nf = 2 * f
    r = up.shape[1]
    split = down.shape[0] if down.dim() == 3 else 1
    rank, hidden = down.shape[-2] // 2, down.shape[-1]
    _check("k", k, (b, hkv, d), q.dtype)
    _check("x", x, (b, hidden))
    if split > 1:  # bfloat16 parts of a float32 weight (``bf16_parts``), for a bfloat16 x
        _check("down", down, (split, 2 * rank, hidden), torch.bfloat16)
        if x.dtype != torch.bfloat16 or xr is not None:
            raise ValueError(f"down as bfloat16 parts takes a bfloat16 x and no xr, got x {x.dtype}" + (" and xr" if xr is not None else ""))
    else:
        _check("down", down, (2 * rank, hidden))
    if rank > r or down.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"down must be float32, bfloat16 or float16 with at most {r} rows per gate (up's rank axis), got "
                         f"{down.dtype} with {rank}")  # fmt: skip
    _check("hedgehog_weight", hedgehog_weight, (2 * hq, d, f))
    _check("hedgehog_bias", hedgehog_bias, (2 * hq, 1, f))
    _check("up", up, (2, r, hq * nf), torch.float32)
    _check("gate_bias", gate_bias, (2, hq * nf), torch.float32)
    if hq % hkv or r < 16 or r & (r - 1):
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv}), and the rank axis ({r}) a power of two from 16")
    if any(t.stride(-1) != 1 for t in (q, k, x)) or not all(t.is_contiguous() for t in (down, hedgehog_weight, hedgehog_bias, up, gate_bias)):
        raise ValueError("q, k and x must be contiguous in their last axis, the weights contiguous")
    qf = torch.empty(b, hq, nf, device=q.device, dtype=_features_dtype(hedgehog_weight))
    kf = torch.empty_like(qf)
    decay = torch.empty(b, 2, hq, nf, device=q.device, dtype=torch.float32)
    if DSLA_INPUT_PARTS not in (1, 4):
        raise ValueError(f"fused_decode.DSLA_INPUT_PARTS must be 1 or 4, got {DSLA_INPUT_PARTS!r}")
    if xr is not None:
        _check("xr", xr, (b, 2, r), torch.float32)
        if not xr.is_contiguous():
            raise ValueError("xr must be contiguous")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin come together (RoPE in the kernel) or not at all")
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 2 or t.shape[0] not in (1, b) or t.shape[1] != d or t.dtype != q.dtype or t.stride(-1) != 1:
                raise ValueError(f"{name} must be ({b} or 1, {d}) {q.dtype} with its last axis contiguous, got {tuple(t.shape)} {t.dtype}")
    splits = dsla_down_splits(b, hidden) if split > 1 else 0
    if splits:  # the projection's partial sums from a kernel of their own
        xr = dsla_gate_down(x, down, r, splits)
    _kernels().inputs[(hq, -(-b // DSLA_INPUT_ROWS), DSLA_INPUT_PARTS)](
        q, k, x, down, qf if xr is None else xr, hedgehog_weight, hedgehog_bias, up, gate_bias, qf, kf, decay,
        q if cos is None else cos, q if sin is None else sin,
        b, hq // hkv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), x.stride(0),
        0 if cos is None or cos.shape[0] == 1 else cos.stride(0), 0 if sin is None or sin.shape[0] == 1 else sin.stride(0),
        H=hq, D=d, FH=f, R=r, RANK=rank, HID=hidden, BH=64, BB=DSLA_INPUT_ROWS, NORM=GATE_NORMALISER, IEEE=q.dtype == torch.float32,
        PARTS=DSLA_INPUT_PARTS, DOWN=xr is None, SPLIT=split, GH=dsla_gate_heads(hq), XS=max(splits, 1), ROPE=cos is not None,
    )  # fmt: skip
    return qf, kf, decay


@dsla_decode_inputs.register_fake
def _(q, k, x, down, hedgehog_weight, hedgehog_bias, up, gate_bias, xr=None, cos=None, sin=None):
    b, hq = q.shape[:2]
    nf = 2 * hedgehog_weight.shape[-1]
    dtype = _features_dtype(hedgehog_weight)
    return q.new_empty(b, hq, nf, dtype=dtype), q.new_empty(b, hq, nf, dtype=dtype), q.new_empty(b, 2, hq, nf, dtype=torch.float32)


WINDOW_GROUPED = False
"""``hybrid_window_read`` runs a program per (batch row, KV head) that reads the window once for its
query heads in turn (False: a program per query head, each loading its KV head's window). Whole
SmolLM2 at batch 64 decoded no faster with it (H100)."""
WINDOW_WARPS = 8
"""Warps per program of ``hybrid_window_read``."""


@torch.library.custom_op("linearize::hybrid_window_read", mutates_args=())
def hybrid_window_read(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, lin: Tensor, factor: Tensor, scale: float,
                       gate: bool) -> Tensor:
    """The hybrid decode step's read, after the new token took its window slot: softmax scores of
    ``q`` (B, Hq, D) against the window ``keys`` (B Hkv, W, D) float32 (slots where ``valid`` (B, W)
    is False masked), their weights on ``values`` (B Hkv, W, Dv + 1) = [v, 1], combined with the
    linear read ``lin`` (B Hq, Dv + 1) = [phi(q) S, phi(q) z]: the joint mix (one denominator, the
    window's part times ``factor`` (Hq,)) or, with ``gate``, g SWA + (1 - g) LA with g = ``factor``.
    Returns (B Hq, Dv) float32, 0 where a denominator is empty."""
    from triton import next_power_of_2 as pow2

    from .common import EMPTY_DENOMINATOR

    b, hq, d = q.shape
    bk, w, width = values.shape
    for name, x in (("keys", keys), ("values", values), ("lin", lin)):
        _check_buffer(name, x)
    _check("keys", keys, (bk, w, d))
    _check("valid", valid, (b, w), torch.bool)
    _check("lin", lin, (b * hq, width))
    _check("factor", factor, (hq,))
    if q.stride(-1) != 1 or not valid.is_contiguous() or not factor.is_contiguous():
        raise ValueError("q must be contiguous in its last axis, valid and factor contiguous")
    out = torch.empty(b * hq, width - 1, device=q.device, dtype=torch.float32)
    kernel = _kernels().window
    n_rep = hq // (bk // b)
    group = n_rep if WINDOW_GROUPED else 1
    kernel[(b * hq // group,)](
        q, keys, values, valid.view(torch.uint8), lin, factor, out,  # the mask as bytes (same storage); factor in its own dtype
        n_rep, q.stride(0), q.stride(1), scale,
        H=hq, W=w, D=d, V=width, BW=pow2(w), BD=pow2(d), BV=pow2(width), GATE=gate, EPS=EMPTY_DENOMINATOR, GROUP=group,
        num_warps=WINDOW_WARPS,
    )  # fmt: skip
    return out


@hybrid_window_read.register_fake
def _(q, keys, values, valid, lin, factor, scale, gate):
    return lin.new_empty(lin.shape[0], lin.shape[1] - 1)


SLOT_BLOCK = 64
"""Keys per block of the slot attention kernel's loop."""


def slot_splits(batch: int, kv_heads: int, capacity: int) -> int:
    """How many programs share one (row, KV head)'s keys in ``slot_attention``: enough programs to
    fill the GPU at small batches (about 1,024 in all), and no program with more than 2,048 keys; a
    function of the shapes only, so a captured graph keeps its grid."""
    blocks = max(1, -(-capacity // SLOT_BLOCK))
    return max(1, min(blocks, max(-(-capacity // 2048), -(-1024 // (batch * kv_heads)))))


@torch.library.custom_op("linearize::slot_attention", mutates_args=())
def slot_attention_partials(q: Tensor, keys: Tensor, values: Tensor, slots: Tensor, lengths: Tensor,
                            scale: float) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Flash-decoding partials of one query token per row over keys held in slot pools: row b reads
    the first lengths[b] positions of slot slots[b] of ``keys`` (S, Hkv, C, D) and ``values`` (S, Hkv,
    C, Dv), for ``q`` (B, Hq, D) (Hq a multiple of Hkv: the query heads of a KV head read its keys
    once). The keys are cut into ``slot_splits`` parts; returns each part's (output numerator (B, Hq,
    NS, Dv), row max (B, Hq, NS), sum of weights (B, Hq, NS)), float32 (an empty part: -inf, 0, 0).
    ``slot_attention`` combines them."""
    from triton import next_power_of_2 as pow2

    b, hq, d = q.shape
    _, hkv, cap, dv = values.shape
    if keys.shape[:3] != values.shape[:3] or keys.shape[-1] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit "
                         "(S, Hkv, C, D) pools with Hq a multiple of Hkv")  # fmt: skip
    _check("slots", slots, (b,), torch.int64)
    _check("lengths", lengths, (b,), torch.int64)
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("q, keys and values must be contiguous in their last axis")
    n_rep = hq // hkv
    ns = slot_splits(b, hkv, cap)
    per_split = -(-cap // ns)
    split = -(-per_split // SLOT_BLOCK) * SLOT_BLOCK  # keys per program, whole blocks
    out_o = torch.empty(b, hq, ns, dv, device=q.device, dtype=torch.float32)
    out_m = torch.empty(b, hq, ns, device=q.device, dtype=torch.float32)
    out_l = torch.empty(b, hq, ns, device=q.device, dtype=torch.float32)
    _kernels().slots[(b, hkv, ns)](
        q, keys, values, slots, lengths, out_o, out_m, out_l,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), scale,
        SPLIT=split, N_REP=n_rep, D=d, DV=dv, BM=max(16, pow2(n_rep)), BN=SLOT_BLOCK, BD=max(16, pow2(d)), BDV=max(16, pow2(dv)), NS=ns, HKV=hkv,
    )  # fmt: skip
    return out_o, out_m, out_l


@slot_attention_partials.register_fake
def _(q, keys, values, slots, lengths, scale):
    b, hq, _ = q.shape
    ns = slot_splits(b, values.shape[1], values.shape[2])
    return q.new_empty(b, hq, ns, values.shape[-1], dtype=torch.float32), q.new_empty(b, hq, ns, dtype=torch.float32), \
        q.new_empty(b, hq, ns, dtype=torch.float32)  # fmt: skip


SLOT_PREFILL_BLOCK = 64
"""Queries and keys per block of the slot prefill kernel."""


@torch.library.custom_op("linearize::slot_prefill_attention", mutates_args=())
def slot_prefill_attention(q: Tensor, keys: Tensor, values: Tensor, meta: Tensor, scale: float) -> Tensor:
    """Causal flash attention of one row's prefill chunk over its keys held in a slot pool: query t
    of ``q`` (Hq, T, D) sits at position meta[0] + t and reads positions 0..meta[0] + t of slot meta[1]
    of ``keys`` (S, Hkv, C, D) and ``values`` (S, Hkv, C, Dv) (the chunk's own keys already written
    there); Hq a multiple of Hkv. Returns (Hq, T, Dv) in q's dtype. The chunk's start and slot are
    read on the device and key blocks past the chunk's last position are skipped, so the launch
    depends only on the shapes (a CUDA graph replays it for any start and slot)."""
    from triton import next_power_of_2 as pow2

    hq, t, d = q.shape
    _, hkv, cap, dv = values.shape
    if keys.shape[:3] != values.shape[:3] or keys.shape[-1] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit "
                         "(S, Hkv, C, D) pools with Hq a multiple of Hkv")  # fmt: skip
    _check("meta", meta, (2,), torch.int64)
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("q, keys and values must be contiguous in their last axis")
    out = torch.empty(hq, t, dv, device=q.device, dtype=q.dtype)
    block = SLOT_PREFILL_BLOCK
    _kernels().prefill[(-(-t // block), hq)](
        q, keys, values, meta, out,
        t, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), scale,
        CAP=cap, N_REP=hq // hkv, D=d, DV=dv, BM=block, BN=block, BD=max(16, pow2(d)), BDV=max(16, pow2(dv)),
    )  # fmt: skip
    return out


@slot_prefill_attention.register_fake
def _(q, keys, values, meta, scale):
    return q.new_empty(q.shape[0], q.shape[1], values.shape[-1])
