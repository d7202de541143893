"""DSLA: dual-state gated linear attention (methods.md section 3; arXiv 2506.09316).

Two GLA states share the write k v^T and differ only in their data-dependent forget gates:

    S1_t = diag(alpha1_t) S1_{t-1} + k_t v_t^T        (history: slow forgetting)
    S2_t = diag(alpha2_t) S2_{t-1} + k_t v_t^T        (recent: fast forgetting)
    o_t  = scale * q_t^T (gamma S1_t + (1 - gamma) S2_t)

alpha is per key dimension, broadcast over the value axis (GLA style). Callers pass log-gates
``log_alpha = logsigmoid(x W + b) / GATE_NORMALISER`` (``log_gate``) of shape (B, Hq, T, Dk),
exactly what fla's ``chunk_gla`` takes as ``g``. The output is linear in S, so
o = gamma * o1 + (1 - gamma) * o2 with o_i plain GLA under gate i: every backend runs single-state
GLA twice.

Padding (``valid`` False) is a no-op: q, k, v are zeroed there (no write, zero output) and the
log-gates set to 0 (no decay), so a left-padded row equals the row alone and garbage (even NaN) at
padded positions never reaches outputs or gradients.

Backends of ``dsla_attention`` (``BACKENDS``): "torch" (chunked, pure PyTorch, autograd, any device)
and "fla" (flash-linear-attention 0.6.0 Triton kernels, CUDA only). ``dsla_attention_reference`` and
``gla_reference`` (in ``linearize.ops.naive``, re-exported here) are the plain float32 loops that
specify both; they share no code with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused_decode
from .common import EMPTY_DENOMINATOR, accumulation_dtype, default_valid, gqa_groups, repeat_kv, safe_divide
from .naive import dsla_attention_reference, gla_reference  # noqa: F401 (the specification)
from .states import DslaState

GATE_NORMALISER = 16.0
"""log_alpha = logsigmoid(z) / GATE_NORMALISER: fla's GLA default, and this package's gate
parameterisation (it keeps a freshly initialised gate's values near 1: slow forgetting)."""

FACTORED_DECAY_LIMIT = 30.0
"""The torch kernel factors a chunk's pairwise decays exp(b_t - b_s) into exp(b_t) exp(-b_s) (one
matmul) when no chunk's total log decay is below -LIMIT (e^30 ~ 1e13: far from float32's range);
stronger gates take the pairwise form, exact for any gate strength."""

FLA_RECURRENT_MAX_LEN = 64
"""fla's GLA layer runs ``fused_recurrent_gla`` for sequences of at most 64 tokens, ``chunk_gla`` above."""

GlaFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None, float, int], tuple[Tensor, Tensor]]
"""(q, k, v, log_alpha, initial state | None, scale, chunk) -> (o, final state); all (B, H, T, D), GQA repeated."""


def init_gate_bias(alpha: float) -> float:
    """Pre-activation z with exp(logsigmoid(z) / GATE_NORMALISER) = alpha, i.e.
    z = logit(alpha ** GATE_NORMALISER).

    0.999 -> 4.13 (history gate), 0.9 -> -1.48 (recent gate).
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"gate value alpha must lie in (0, 1), got {alpha}")
    p = alpha**GATE_NORMALISER
    return math.log(p) - math.log1p(-p)


def log_gate(z: Tensor) -> Tensor:
    """Log-gate from the gate's pre-activation: logsigmoid(z) / GATE_NORMALISER, in float32 (or
    wider), <= 0; exp of it is the gate value alpha in (0, 1)."""
    return F.logsigmoid(z.to(torch.promote_types(z.dtype, torch.float32))) / GATE_NORMALISER


def gate_half_life(alpha: float) -> float:
    """Tokens until a constant gate alpha halves the state: log(1/2) / log(alpha) (0.999 -> 693, 0.9 -> 6.6)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"gate value alpha must lie in (0, 1), got {alpha}")
    return math.log(0.5) / math.log(alpha)


def dsla_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha_history: Tensor,
    log_alpha_recent: Tensor,
    gamma: Tensor,
    *,
    valid: Tensor | None = None,
    state: DslaState | None = None,
    scale: float | None = None,
    backend: str = "torch",
    chunk: int = 32,
    normalize: bool = False,
) -> tuple[Tensor, DslaState]:
    """Dual-state gated linear attention continuing from ``state``.

    q (B, Hq, T, Dk) with RoPE applied, k (B, Hkv, T, Dk), v (B, Hkv, T, Dv); log-gates (B, Hq, T, Dk),
    <= 0 and finite; gamma a 0-dim or (Hq,) tensor in [0, 1] (weight of the history state); valid
    (B, T) bool (False = padding); state holds history/recent (B, Hq, Dk, Dv), zeros when None;
    scale defaults to Dk ** -0.5 (multiplies q, as in fla). ``chunk`` is the block length of the
    "torch" backend (fla picks its own). Returns o (B, Hq, T, Dv) in q's dtype (zeros at padding) and
    the state after the last token (float32; float64 for float64 inputs on "torch").
    Calling again with the returned state continues the sequence exactly (prefill in pieces, decode).

    ``normalize``: each state also accumulates the normaliser z = sum of decayed k (v gets a column
    of ones, so states are (B, Hq, Dk, Dv + 1)) and its read is divided by q z before the mix, as in
    normalised linear attention; q and k must then be non-negative (a feature map's output).
    """
    gla = BACKENDS.get(backend)
    if gla is None:
        raise ValueError(f"unknown DSLA backend {backend!r}; expected one of {tuple(BACKENDS)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n_rep = gqa_groups(q, k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g1, g2 = _mask_padding(q, k, v, log_alpha_history, log_alpha_recent, valid)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, Hq, T, Dk), (B, Hq, T, Dv)
    v = _with_ones(v) if normalize else v  # (B, Hq, T, Dv [+ 1])
    o1, s1 = gla(q, k, v, g1, None if state is None else state.history, scale, chunk)
    o2, s2 = gla(q, k, v, g2, None if state is None else state.recent, scale, chunk)
    return _mix(o1, o2, gamma, q, normalize), DslaState(history=s1, recent=s2)


def dsla_prefill(
    qf: Tensor,
    kf: Tensor,
    v: Tensor,
    log_alphas: Tensor,
    gamma: Tensor,
    *,
    state: DslaState | None = None,
    scale: float | None = None,
    backend: str = "fla",
    chunk: int = 32,
    normalize: bool = False,
) -> tuple[Tensor, DslaState]:
    """``dsla_attention`` for a prefill without padding, on token-major inputs, both states in one
    GLA call: qf and kf (B, T, Hq, Dk) (kf for every query head: the keys as the states see them),
    v (B, T, Hkv, Dv), ``log_alphas`` (B, T, 2, Hq, Dk) the two log-gates, history first (as one
    projection of both gates gives them). The same output (B, Hq, T, Dv) in qf's dtype (a view of a
    token-major tensor) and the same state as ``dsla_attention`` on the (B, H, T, D) views.

    The two states are 2 Hq heads of one GLA: q and k written twice side by side, the values
    repeated to those heads with the normaliser's column of ones in one copy, the initial states
    concatenated. One kernel sequence runs both states (on "fla" one ``chunk_gla`` call, whose host
    work, not its kernels, bounds a short prefill), and the mix reads the output in place."""
    gla = BACKENDS.get(backend)
    if gla is None:
        raise ValueError(f"unknown DSLA backend {backend!r}; expected one of {tuple(BACKENDS)}")
    b, t, hq, dk, hkv, dv = token_major_sizes(qf, kf, v)
    if log_alphas.shape != (b, t, 2, hq, dk):
        raise ValueError(f"log_alphas has shape {tuple(log_alphas.shape)}, expected (B, T, 2, Hq, Dk) = {(b, t, 2, hq, dk)}")
    scale = dk**-0.5 if scale is None else scale
    width = dv + int(normalize)
    q2, k2 = (x[:, :, None].expand(b, t, 2, hq, dk).reshape(b, t, 2 * hq, dk) for x in (qf, kf))  # (B, T, 2 Hq, Dk)
    values = v.new_empty(b, t, 2, hkv, hq // hkv, width)  # (B, T, 2, Hkv, n_rep, Dv [+ 1])
    values[..., :dv] = v[:, :, None, :, None]
    if normalize:
        values[..., dv] = 1.0
    values = values.view(b, t, 2 * hq, width)
    h0 = None if state is None else torch.cat((state.history, state.recent), dim=1)  # (B, 2 Hq, Dk, Dv [+ 1])
    o, s = gla(q2.transpose(1, 2), k2.transpose(1, 2), values.transpose(1, 2), log_alphas.reshape(b, t, 2 * hq, dk).transpose(1, 2),
               h0, scale, chunk)  # fmt: skip
    o = o.transpose(1, 2).view(b, t, 2, hq, width)  # token-major on "fla" (a view); a copy on "torch"
    s = s.view(b, 2, hq, dk, width)
    return _mix_stacked(o, gamma, dv, normalize, qf.dtype), DslaState(history=s[:, 0].contiguous(), recent=s[:, 1].contiguous())


def token_major_sizes(qf: Tensor, kf: Tensor, v: Tensor) -> tuple[int, int, int, int, int, int]:
    """(B, T, Hq, Dk, Hkv, Dv) of a token-major prefill's features qf, kf (B, T, Hq, Dk) and values
    v (B, T, Hkv, Dv), checked: qf and kf alike, Hkv dividing Hq."""
    b, t, hq, dk = qf.shape
    hkv, dv = v.shape[2], v.shape[3]
    if kf.shape != qf.shape or v.shape[:2] != (b, t) or hq % hkv:
        raise ValueError(f"qf {tuple(qf.shape)} and kf {tuple(kf.shape)} must match, and v {tuple(v.shape)} must be (B, T, Hkv, Dv) "
                         "with Hkv dividing Hq")  # fmt: skip
    return b, t, hq, dk, hkv, dv


def _mix_stacked(o: Tensor, gamma: Tensor, dv: int, normalize: bool, dtype: torch.dtype) -> Tensor:
    """gamma * o_history + (1 - gamma) * o_recent of a stacked GLA output ``o`` (B, T, 2, Hq, Dv [+ 1]),
    each read over its normaliser first with ``normalize`` (0 where that is empty, as
    ``safe_divide``), in float32 (or wider): (B, Hq, T, Dv) in ``dtype``, a view of a token-major tensor."""
    hq = o.shape[3]
    gamma = torch.as_tensor(gamma, device=o.device)
    if gamma.numel() not in (1, hq):
        raise ValueError(f"gamma must be a scalar or have one value per query head ({hq}), got {tuple(gamma.shape)}")
    acc = torch.promote_types(torch.promote_types(o.dtype, gamma.dtype), torch.float32)
    gamma = gamma.to(acc).reshape(-1, 1)  # (Hq or 1, 1)
    weights = torch.stack((gamma, 1 - gamma))[:, None, None]  # (2, 1, 1, Hq or 1, 1)
    out = _mix_reads(o.movedim(2, 0), weights, dv, normalize)  # (B, T, Hq, Dv) in acc
    return out.to(dtype).transpose(1, 2)


ROW_ALIGN = 4
"""On CUDA a decode state's rows are padded to a multiple of this many float32 columns (16 bytes),
so the fused state kernel reads and writes them in aligned vector loads (Dv + 1 = 129 columns
otherwise start every row at a 4-byte offset)."""


@dataclass
class DslaDecodeState:
    """A DslaState as per-token decoding updates it in place: both states stacked in one tensor
    (2, B, Hq, Dk, C), history first, so one operation decays and writes both, and a (B, Hkv, C)
    buffer that takes each token's values beside the normaliser's column of ones. The first
    ``width`` = Dv [+ 1] columns are the state's; on CUDA C pads the rows to ``ROW_ALIGN`` with
    columns that stay zero (their values are zero). It starts as a copy (a state handed out earlier
    is never changed); ``canonical()`` gives the DslaState."""

    states: Tensor
    values: Tensor
    width: int = -1
    """The state's columns, Dv [+ 1] (-1: all of ``states``' columns)."""
    index: Tensor | None = None
    """(B,) int64: ``states`` is a pool (2, N, Hq, Dk, C) and batch row b keeps its states in row
    index[b], updated there in place (``in_pool``); None: row b is batch row b."""
    kernel_args: Any = field(default=None, repr=False)
    """What the CPU kernel (``cpu_kernels.dsla_step``) keeps between tokens: its argument block,
    scratch buffer and the weights the block points at."""
    kernel_scratch: Any = field(default=None, repr=False)
    kernel_weights: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.width < 0:
            self.width = self.states.shape[-1]

    @classmethod
    def from_state(cls, state: DslaState, kv_heads: int, normalize: bool, align: int | None = None) -> "DslaDecodeState":
        """The decode form of ``state``: column-major where the fused kernels take it
        (``fused_decode.column_states``; no padding, each column's Dk floats contiguous) unless
        ``align`` is given; else its rows padded to a multiple of ``align`` columns (default:
        ``ROW_ALIGN`` on CUDA, none elsewhere: the CPU kernel takes unpadded rows)."""
        width = state.history.shape[-1]
        if align is None and fused_decode.column_states(state.history):
            states = fused_decode.new_state((2, *state.history.shape), state.history)  # (2, B, Hq, Dk, Dv [+ 1]), no padding
        else:
            states = state.history.new_zeros(2, *state.history.shape[:-1], padded_columns(width, state.history, align))  # (2, B, Hq, Dk, C)
        states[0, ..., :width] = state.history
        states[1, ..., :width] = state.recent
        return cls(states, _value_rows(states, states.shape[1], kv_heads, width, normalize), width)

    @classmethod
    def in_pool(cls, pool: Tensor, index: Tensor, kv_heads: int, width: int, normalize: bool, values: Tensor | None = None) -> "DslaDecodeState":
        """Batch row b's states are row index[b] of ``pool`` (2, N, Hq, Dk, C), float32, whose first
        ``width`` = Dv [+ 1] columns are the state's and the rest zero: decoding updates them there,
        nothing is copied. ``values``: the value-row buffer of an earlier state of these rows with the
        same kv heads, columns, width and normaliser (each step rewrites its value columns), reused."""
        if values is None:
            values = _value_rows(pool, index.shape[0], kv_heads, width, normalize)
        elif tuple(values.shape) != (index.shape[0], kv_heads, pool.shape[-1]) or values.dtype != pool.dtype:
            raise ValueError(f"values {tuple(values.shape)} {values.dtype} do not fit {index.shape[0]} rows of {kv_heads} kv heads "
                             f"and {pool.shape[-1]} {pool.dtype} columns")  # fmt: skip
        return cls(pool, values, width, index)

    def canonical(self) -> DslaState:
        states = self.states if self.index is None else self.states.index_select(1, self.index)
        if self.width == states.shape[-1] and states.is_contiguous():
            return DslaState(history=states[0], recent=states[1])
        return DslaState(history=states[0, ..., : self.width].contiguous(), recent=states[1, ..., : self.width].contiguous())


def padded_columns(width: int, like: Tensor, align: int | None = None) -> int:
    """``width`` state columns rounded up to a multiple of ``align`` (default: ``ROW_ALIGN`` for a
    CUDA ``like``, 1 elsewhere): the row length of a decode state's tensor."""
    align = (ROW_ALIGN if like.is_cuda else 1) if align is None else align
    if align < 1:
        raise ValueError(f"align must be a positive number of columns, got {align}")
    return -(-width // align) * align


def _value_rows(states: Tensor, batch: int, kv_heads: int, width: int, normalize: bool) -> Tensor:
    """The (B, Hkv, C) buffer a decode step writes each token's values into, the normaliser's column
    (``width`` - 1, with ``normalize``) set to 1 once."""
    values = states.new_zeros(batch, kv_heads, states.shape[-1])
    if normalize:
        values[..., width - 1] = 1.0
    return values


def dsla_decode_step(
    state: DslaDecodeState,
    qf: Tensor,
    kf: Tensor,
    v: Tensor,
    decay: Tensor,
    weights: Tensor,
    *,
    normalize: bool = False,
) -> Tensor:
    """One new real token per row (T = 1, no padding): the output (B, Hq, 1, Dv) in v's dtype, both
    states decayed and written in place. ``qf`` (B, Hq, Dk) and ``kf`` (B, Hq, Dk) are the query
    and the key as the states see them (feature-mapped when ``normalize``; the key for every query
    head of its KV head), v (B, Hkv, 1, Dv); ``decay`` (B, 2, Hq, Dk) the gates alpha = exp(log
    alpha), history first; ``weights`` (2,) the mix (gamma, 1 - gamma), times the scale without
    ``normalize``. The same numbers as ``dsla_attention`` on that token (its recurrent form, every
    operation once for both states: no concatenation, no repeated KV heads; tested against it)."""
    s = state.states  # (2, B, Hq, Dk, C): Dv [+ 1] columns, then zero padding (a pool: (2, N, ...) with index)
    _, _, hq, dk, width = s.shape
    b, hkv, dv = v.shape[0], state.values.shape[1], v.shape[-1]
    if fused_decode.enabled(s) and s.dtype == torch.float32:  # one pass over both states
        o = fused_decode.dsla_state_step(s, qf.reshape(b, hq, dk), kf.reshape(b, hq, dk), v.reshape(b, hkv, dv), decay, normalize,
                                         state.index)  # fmt: skip
        if fused_decode.DSLA_MIX_KERNEL and weights.dtype == torch.float32 and not torch.compiler.is_compiling():
            return fused_decode.dsla_mix(o, weights.reshape(2), dv, normalize, v.dtype).view(b, hq, 1, dv)  # the mix in one kernel
        o = fused_decode.dsla_read(o).view(2, b, hq, 1, width)
    else:
        rows = s if state.index is None else s.index_select(1, state.index)  # a pool's rows: gathered, written back below
        state.values[..., :dv] = v.view(b, hkv, dv)
        write = kf.reshape(b, hkv, hq // hkv, dk, 1) * state.values.view(b, hkv, 1, 1, width)  # (B, Hkv, n_rep, Dk, Dv [+ 1]): k v^T
        torch.addcmul(write.view(b, hq, dk, width), decay.transpose(0, 1)[..., None], rows, out=rows)  # S = diag(alpha) S + k v^T, both
        o = torch.matmul(qf.reshape(1, b, hq, 1, dk), rows)  # (2, B, Hq, 1, Dv [+ 1]): both states' reads
        if state.index is not None:
            s.index_copy_(1, state.index, rows)
    out = _mix_reads(o, weights.view(2, 1, 1, 1, 1), dv, normalize)  # (B, Hq, 1, Dv)
    return out if out.dtype == v.dtype else out.to(v.dtype)


def _mix_reads(o: Tensor, weights: Tensor, dv: int, normalize: bool) -> Tensor:
    """weights[0] * o[0] + weights[1] * o[1] over the value columns of the two states' reads ``o``
    (2, ..., Dv [+ 1]), history first; with ``normalize`` each read is divided by its last column
    first, 0 where that is empty (as ``safe_divide``). ``weights`` (2, ...) broadcasts against o's
    reads; the result is in the wider of their dtypes. For inference: an empty normaliser's
    quotient is masked, not kept out of the graph as ``safe_divide`` keeps it for gradients."""
    if normalize:
        den = o[..., dv : dv + 1]
        weights = torch.where(den > EMPTY_DENOMINATOR, weights / den, 0.0)
    o = o[..., :dv]
    return torch.addcmul(o[1] * weights[1], o[0], weights[0])


def _with_ones(v: Tensor) -> Tensor:
    """v with a column of ones appended. Padding needs no special case: its k is zero, so it writes
    nothing to either column."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _mask_padding(
    q: Tensor, k: Tensor, v: Tensor, g1: Tensor, g2: Tensor, valid: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Check shapes; make padded positions no-ops: q, k, v zero (no write, zero output), gates 0 (no decay)."""
    if k.shape != (q.shape[0], k.shape[1], *q.shape[2:]) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"inconsistent q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, g in (("log_alpha_history", g1), ("log_alpha_recent", g2)):
        if g.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(g.shape)}, expected q's shape {tuple(q.shape)}")
    if valid is None:
        return q, k, v, g1, g2
    pad = ~default_valid(q, valid)[:, None, :, None]  # (B, 1, T, 1)
    return tuple(x.masked_fill(pad, 0.0) for x in (q, k, v, g1, g2))  # type: ignore[return-value]


def _mix(o1: Tensor, o2: Tensor, gamma: Tensor, q: Tensor, normalize: bool = False) -> Tensor:
    """gamma * o1 + (1 - gamma) * o2 in float32 (or wider), gamma 0-dim or per query head; q's dtype out.
    With ``normalize`` each o's last column is its normaliser: o[..., :-1] / o[..., -1] first."""
    gamma = torch.as_tensor(gamma, device=q.device)
    if gamma.numel() not in (1, q.shape[1]):
        raise ValueError(f"gamma must be a scalar or have one value per query head ({q.shape[1]}), got {tuple(gamma.shape)}")
    dtype = torch.promote_types(torch.promote_types(o1.dtype, gamma.dtype), torch.float32)
    if normalize:
        o1, o2 = (safe_divide(o[..., :-1].to(dtype), o[..., -1].to(dtype)) for o in (o1, o2))
    gamma = gamma.to(dtype).reshape(-1, 1, 1)  # (Hq or 1, 1, 1): broadcasts over (B, Hq, T, Dv)
    return (gamma * o1.to(dtype) + (1 - gamma) * o2.to(dtype)).to(q.dtype)  # (B, Hq, T, Dv)


def _gla_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Tensor | None, scale: float, chunk: int
) -> tuple[Tensor, Tensor]:
    """Chunked GLA in PyTorch, stable for any gate strength: every exponent taken is <= 0.

    Within a chunk the log decay from s to t, sum_{s<j<=t} g_j, is summed pairwise for s <= t as a
    segment sum (as Mamba2's ``segsum``): never q * exp(b), k * exp(-b), which overflows, nor the
    difference of two cumulative sums, which cancels badly after a strong gate; except where every
    chunk's decay stays within FACTORED_DECAY_LIMIT, where those factors are safe and much cheaper. Across chunks the
    state carries everything: q_t reads it decayed from the chunk start, k_s writes into it decayed
    to the chunk end. Memory: the pairwise decays hold B H T chunk Dk values.
    """
    dtype = accumulation_dtype(q.dtype)
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    n = -(-t // chunk)
    pad = n * chunk - t  # padded tail: k = 0 (no write), g = 0 (no decay); its outputs are dropped
    q, k, g = (F.pad(x.to(dtype), (0, 0, 0, pad)).reshape(b, h, n, chunk, dk) for x in (q, k, g))  # (B, H, N, C, Dk)
    v = F.pad(v.to(dtype), (0, 0, 0, pad)).reshape(b, h, n, chunk, dv)  # (B, H, N, C, Dv)

    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    from_start = g.cumsum(dim=3)  # (B, H, N, C, Dk): log decay from the chunk start through t
    q_read = q * from_start.exp()  # (B, H, N, C, Dk)
    factored = from_start.numel() == 0 or bool(from_start[:, :, :, -1].amin() >= -FACTORED_DECAY_LIMIT)
    if factored:
        # No chunk decays by more than e^-LIMIT: the pairwise decay exp(b_t - b_s) factors into
        # exp(b_t) exp(-b_s) with both factors within e^+-LIMIT (no overflow, no cancellation), so
        # the intra-chunk part is one (C x C) matmul, without the (C x C x Dk) pairwise decays.
        scores = (q_read @ (k * (-from_start).exp()).transpose(-1, -2)).masked_fill(~ones.tril(), 0.0)  # (B, H, N, C_t, C_s)
        to_end = from_start[:, :, :, -1:] - from_start  # (B, H, N, C, Dk): log decay after s through the chunk end
    else:
        after_s = ones.tril(-1)[:, :, None]  # (C_j, C_s, 1): j > s
        causal = ones.tril()[:, :, None]  # (C_t, C_s, 1): s <= t
        g_js = g[:, :, :, :, None].expand(b, h, n, chunk, chunk, dk)  # (B, H, N, C_j, C_s, Dk): g_j
        pair = g_js.masked_fill(~after_s, 0.0).cumsum(dim=3)  # (B, H, N, C_t, C_s, Dk): sum_{s<j<=t} g_j
        decay = pair.masked_fill(~causal, float("-inf")).exp()  # (B, H, N, C_t, C_s, Dk), <= 1, 0 above the diagonal
        scores = torch.einsum("bhntk,bhntsk->bhnts", q, k[:, :, :, None] * decay)  # (B, H, N, C_t, C_s)
        to_end = pair[:, :, :, -1]  # (B, H, N, C, Dk): log decay after s through the chunk end
    o_intra = scores @ v  # (B, H, N, C, Dv)
    writes = (k * to_end.exp()).transpose(-1, -2) @ v  # (B, H, N, Dk, Dv): the chunk's write, decayed to its end
    chunk_decay = from_start[:, :, :, -1, :, None].exp()  # (B, H, N, Dk, 1)
    s = q.new_zeros(b, h, dk, dv) if h0 is None else h0.to(dtype)  # (B, H, Dk, Dv)
    o_inter = []
    for i in range(n):
        o_inter.append(q_read[:, :, i] @ s)  # (B, H, C, Dv)
        s = chunk_decay[:, :, i] * s + writes[:, :, i]  # (B, H, Dk, Dv)
    o = scale * (o_intra + torch.stack(o_inter, dim=2))  # (B, H, N, C, Dv)
    return o.reshape(b, h, n * chunk, dv)[:, :, :t], s


def _import_fla():
    try:
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
    except ImportError as e:
        raise RuntimeError(
            "DSLA backend 'fla' needs flash-linear-attention (pip install fla-core==0.6.0) and a CUDA GPU; "
            "use backend='torch' otherwise"
        ) from e
    return chunk_gla, fused_recurrent_gla


def _gla_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Tensor | None, scale: float, chunk: int) -> tuple[Tensor, Tensor]:
    """fla 0.6.0 GLA kernels; ``chunk`` is unused (fla picks its own).

    fla takes (B, T, H, D) tensors, gates of q's shape, a float32 initial state (B, H, Dk, Dv), and
    multiplies q by ``scale``. Gates go in float32 whatever q's dtype (their cumulative sums need it).
    Like fla's GLA layer: fused_recurrent_gla up to FLA_RECURRENT_MAX_LEN tokens, chunk_gla above.
    """
    chunk_gla, fused_recurrent_gla = _import_fla()
    dtype = q.dtype if q.dtype == k.dtype == v.dtype else torch.float32  # mixed under autocast: widen
    qt, kt, vt = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # (B, T, H, D)
    gt = g.float().transpose(1, 2)  # (B, T, H, Dk)
    h0 = None if h0 is None else h0.float()  # (B, H, Dk, Dv)
    if q.shape[2] <= FLA_RECURRENT_MAX_LEN:
        o, s = fused_recurrent_gla(qt, kt, vt, gk=gt, scale=scale, initial_state=h0, output_final_state=True)
    else:
        o, s = chunk_gla(qt, kt, vt, g=gt, scale=scale, initial_state=h0, output_final_state=True)
    return o.transpose(1, 2), s  # (B, H, T, Dv), (B, H, Dk, Dv)


BACKENDS: dict[str, GlaFn] = {"torch": _gla_chunked, "fla": _gla_fla}
"""Name -> single-state GLA implementation used by ``dsla_attention``."""
