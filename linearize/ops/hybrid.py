"""In-head hybrid: sliding-window softmax + linear attention (LoLCATs / HedgeCATs).

For query t, W_t = the last ``window`` real tokens up to and including t (padding does not take
window slots); "older" = the real tokens before W_t. With s_j = scale * q_t.k_j and m_t = max_{j in W_t} s_j:

- mix "joint" (LoLCATs): one shared denominator,
      o_t = (f sum_{W_t} e^{s_j - m_t} v_j + phi(q_t)^T S) / (f sum_{W_t} e^{s_j - m_t} + phi(q_t)^T z)
  with f = window_factor per head and (S, z) the linear sums over the older tokens ("overlap":
  over all tokens up to t).
- mix "gate" (HedgeCATs Eq. 3): o_t = g SWA_t + (1 - g) LA_t, each branch normalised on its own;
  an empty LA branch (nothing older than the window yet, without overlap) reads as 0.

``branches`` ablates components: "window" = SWA only (normalised window softmax; LA zeroed),
"linear" = LA only over all tokens up to t (window removed), normalised; "both" = the hybrid.

Layout: q (B, Hq, T, D), k/v (B, Hkv, T, D) after RoPE; keys/values are repeated for GQA here,
then featurised by ``phi_k`` (queries by ``phi_q``). ``q_lin`` / ``k_lin`` (same shapes as q / k),
when given, are what the feature maps see instead of q / k: e.g. q and k before RoPE, so that the
linear term depends on no absolute position while the window softmax keeps RoPE. ``valid`` (B, T) marks real tokens: padding
keys contribute nothing and never enter a state; outputs at padded queries are zero.

State (``HybridState``, float32, or float64 for float64 inputs): the window holds the last
``window`` real tokens (pre-feature-map keys, Hkv heads), compacted and right-aligned (empty slots
only on the left); the linear state sums phi(k) v^T and phi(k) over the real tokens OLDER than the
window, whatever the mode, so modes can be switched at run time (overlap / "linear" add the window
tokens' linear part on the fly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused_decode, fused_prefill
from .common import EMPTY_DENOMINATOR, FeatureFn, accumulation_dtype, default_valid, gather_tokens, gqa_groups, repeat_kv, safe_divide
from .linear_attn import linear_attention_numden
from .naive import hybrid_attention_reference  # noqa: F401 (the specification)
from .states import DecodeClock, HybridState, LinearState, WindowState

MIXES = ("joint", "gate")
BRANCHES = ("both", "window", "linear")


def hybrid_state_empty(
    batch: int,
    kv_heads: int,
    heads: int,
    window: int,
    dk: int,
    dv: int,
    features: int,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    linear_keys: bool = False,
) -> HybridState:
    """The state before any token: an empty window and zero linear sums (``linear_keys``: the
    window also keeps the feature maps' own keys, for calls with ``k_lin``)."""
    return HybridState(
        window=WindowState.empty(batch, kv_heads, window, dk, dv, device=device, dtype=dtype, linear_keys=linear_keys),
        linear=LinearState.zeros(batch, heads, features, dv, device=device, dtype=dtype),
    )


def _per_head(x: Tensor, heads: int, name: str, default: float, like: Tensor) -> Tensor:
    """A (Hq,) per-head parameter as ``like``'s dtype; ``default`` everywhere when None."""
    if x is None:
        return torch.full((heads,), default, dtype=like.dtype, device=like.device)
    if x.shape != (heads,):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({heads},) (one value per query head)")
    return x.to(like.dtype)


def _check_args(q: Tensor, k: Tensor, window: int, mix: str, branches: str,
                q_lin: Tensor | None = None, k_lin: Tensor | None = None) -> int:
    if (q_lin is None) != (k_lin is None):
        raise ValueError("q_lin and k_lin go together: give both (the feature maps' inputs) or neither")
    if q_lin is not None and (q_lin.shape != q.shape or k_lin.shape != k.shape):
        raise ValueError(f"q_lin/k_lin have shapes {tuple(q_lin.shape)}/{tuple(k_lin.shape)}; expected those of "
                         f"q/k {tuple(q.shape)}/{tuple(k.shape)}")
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; valid: {MIXES}")
    if branches not in BRANCHES:
        raise ValueError(f"unknown branches {branches!r}; valid: {BRANCHES}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    return gqa_groups(q, k)


def _heads_view(x: Tensor, ndim: int) -> Tensor:
    """(H,) -> (1, H, 1, ...) broadcasting against an ndim tensor with heads on dim 1."""
    return x.view(1, -1, *([1] * (ndim - 2)))


def _mix(
    scores: Tensor | None,
    in_window: Tensor,
    values: Tensor,
    lin_num: Tensor,
    lin_den: Tensor,
    *,
    mix: str,
    branches: str,
    window_factor: Tensor,
    gate: Tensor,
) -> Tensor:
    """Combine the window softmax with the linear term.

    scores (B, H, ..., Q, S) scaled q.k, in_window (B, 1, ..., Q, S) bool, values (B, H, ..., S, Dv),
    lin_num (B, H, ..., Q, Dv) and lin_den (B, H, ..., Q): the linear term already summed over the
    keys the LA branch covers. Returns (B, H, ..., Q, Dv).
    """
    if branches == "linear":
        return safe_divide(lin_num, lin_den)
    s = scores.masked_fill(~in_window, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (..., Q, 1); not detached, as in the LoLCATs code
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty window (padded query)
    e = torch.exp(s - m)  # (..., Q, S), 0 outside the window
    sw_num = e @ values  # (..., Q, Dv)
    sw_den = e.sum(dim=-1)  # (..., Q)
    if branches == "window":
        return safe_divide(sw_num, sw_den)
    if mix == "joint":
        # The linear term is NOT rescaled by exp(-m_t): the published LoLCATs convention (the
        # window terms carry exp(-m_t) and f, the linear term neither).
        f_num, f_den = _heads_view(window_factor, sw_num.dim()), _heads_view(window_factor, sw_den.dim())
        return safe_divide(f_num * sw_num + lin_num, f_den * sw_den + lin_den)
    g = _heads_view(gate, sw_num.dim())
    return g * safe_divide(sw_num, sw_den) + (1 - g) * safe_divide(lin_num, lin_den)


def _hybrid_quadratic(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    phi_q: FeatureFn,
    phi_k: FeatureFn,
    window: int,
    mix: str = "joint",
    overlap: bool = False,
    window_factor: Tensor | None = None,
    gate: Tensor | None = None,
    branches: str = "both",
    valid: Tensor | None = None,
    scale: float | None = None,
    q_lin: Tensor | None = None,
    k_lin: Tensor | None = None,
) -> Tensor:
    """The hybrid's output (B, Hq, T, Dv) in v's dtype as one quadratic form over the full sequence
    (T x T scores and masks): what ``hybrid_attention_weights`` differentiates through."""
    n_rep = _check_args(q, k, window, mix, branches, q_lin, k_lin)
    valid = default_valid(q, valid)
    b, hq, t, d = q.shape
    dt = accumulation_dtype(v.dtype)
    scale = d**-0.5 if scale is None else scale
    kr, vr = repeat_kv(k, n_rep), repeat_kv(v, n_rep).to(dt)  # (B, Hq, T, D|Dv)
    q_feat = q if q_lin is None else q_lin
    k_feat = kr if k_lin is None else repeat_kv(k_lin, n_rep)
    qf, kf = phi_q(q_feat).to(dt), phi_k(k_feat).to(dt)  # (B, Hq, T, F)
    pos = valid.long().cumsum(dim=1) - 1  # (B, T) real-token index
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # (T, T)
    seen = causal & valid[:, None, :] & valid[:, :, None]  # (B, T, T) real keys up to the real query
    dist = pos[:, :, None] - pos[:, None, :]  # (B, T, T) real tokens between query and key
    in_window = seen & (dist < window)  # (B, T, T)
    linear_keys = seen if (overlap or branches == "linear") else seen & (dist >= window)  # (B, T, T)
    lin = torch.einsum("bhtf,bhsf->bhts", qf, kf) * linear_keys[:, None]  # (B, Hq, T, T)
    scores = torch.einsum("bhtd,bhsd->bhts", q.to(dt), kr.to(dt)) * scale  # (B, Hq, T, T)
    out = _mix(
        scores,
        in_window[:, None],
        vr,
        lin @ vr,
        lin.sum(dim=-1),
        mix=mix,
        branches=branches,
        window_factor=_per_head(window_factor, hq, "window_factor", 1.0, vr),
        gate=_per_head(gate, hq, "gate", 0.5, vr),
    )
    out = torch.where(valid[:, None, :, None], out, torch.zeros_like(out))  # (B, Hq, T, Dv)
    return out.to(v.dtype)


def hybrid_attention_weights(q: Tensor, k: Tensor, **kwargs) -> Tensor:
    """(B, Hq, T, T): the weight each query gives each key under the hybrid (any mix, branches).

    The output is linear in v, so the quadratic form with identity values yields the weight matrix;
    ``kwargs`` are those of ``hybrid_attention_reference``. Quadratic: for attention transfer at ~1K.
    """
    b, hkv, t, _ = k.shape
    eye = torch.eye(t, dtype=accumulation_dtype(q.dtype), device=q.device).expand(b, hkv, t, t)  # (B, Hkv, T, T)
    return _hybrid_quadratic(q, k, eye, **kwargs)


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    phi_q: FeatureFn,
    phi_k: FeatureFn,
    window: int,
    mix: str = "joint",
    overlap: bool = False,
    window_factor: Tensor | None = None,
    gate: Tensor | None = None,
    branches: str = "both",
    valid: Tensor | None = None,
    state: HybridState | None = None,
    scale: float | None = None,
    backend: str = "torch",
    chunk: int = 64,
    q_lin: Tensor | None = None,
    k_lin: Tensor | None = None,
) -> tuple[Tensor, HybridState]:
    """The exact hybrid in O(T (chunk + window)) memory, continuing from ``state``.

    Splitting a sequence into calls (prefill pieces, token-by-token decode) gives the same outputs
    and state as one call, and one call gives those of ``hybrid_attention_reference`` (the
    specification: a loop over queries, in ``linearize.ops.naive``). ``backend`` ("torch" or "fla")
    runs the linear part over the older tokens; ``chunk`` is the query-chunk length. Differentiable
    on the torch backend. As in the reference, window_factor None means f = 1 and gate None means
    g = 0.5. At inference on CUDA (``fused_prefill.applies``: no gradient, no padding, the
    non-overlapping two-branch hybrid) the call goes to ``fused_prefill.hybrid_prefill``: the same
    outputs and state in the inputs' dtype.
    Returns (out (B, Hq, T, Dv) in v's dtype, the new HybridState).
    """
    n_rep = _check_args(q, k, window, mix, branches, q_lin, k_lin)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if fused_prefill.applies(q, k, v, valid=valid, branches=branches, overlap=overlap, phi_q=phi_q):
        return fused_prefill.hybrid_prefill(q, k, v, phi_q=phi_q, phi_k=phi_k, window=window, mix=mix, window_factor=window_factor,
                                            gate=gate, state=state, scale=scale, q_lin=q_lin, k_lin=k_lin)  # fmt: skip
    b, hq, t, d = q.shape
    dt = accumulation_dtype(v.dtype)
    scale = d**-0.5 if scale is None else scale
    separate = k_lin is not None  # the feature maps see their own keys (e.g. before RoPE)
    if state is None:
        ws = WindowState.empty(b, k.shape[1], window, d, v.shape[-1], device=q.device, dtype=dt, linear_keys=separate)
        lin_state = None
    else:
        ws, lin_state = state.window, state.linear
    if ws.keys.shape[2] != window:
        raise ValueError(f"state window has {ws.keys.shape[2]} slots, expected window={window}")
    if (ws.linear_keys is not None) != separate:
        raise ValueError("the state's window " + ("keeps" if ws.linear_keys is not None else "does not keep")
                         + " separate feature-map keys but this call " + ("gives" if separate else "does not give")
                         + " q_lin/k_lin: a sequence cannot switch between them")

    ext = _extend(ws, q, k, v, valid, window, q_lin, k_lin)  # the state's window, then the new tokens
    kr, vr = repeat_kv(ext.keys, n_rep), repeat_kv(ext.values, n_rep).to(dt)  # (B, Hq, L, D|Dv)
    k_feat = repeat_kv(ext.lin_keys, n_rep) if separate else kr
    kf = phi_k(k_feat).to(dt) * ext.valid[:, None, :, None]  # (B, Hq, L, F); padding/empty slots -> 0
    qf = phi_q(ext.lin_queries if separate else ext.queries).to(dt)  # (B, Hq, T, F)

    # Older than the window: query slot i (extended index window + i) has older keys 0..i, i.e.
    # causal LA over the extended keys shifted right by `window`, continuing the lagged state.
    # Its final state covers extended tokens 0..T-1 = everything before the new window.
    old_num, old_den, new_linear = linear_attention_numden(
        qf, kf[:, :, :t], vr[:, :, :t], lin_state, backend=backend, chunk=chunk
    )

    out = _window_and_mix(
        ext.queries, kr, vr, qf, kf, old_num, old_den, ext.valid, window=window, chunk=chunk, scale=scale, dt=dt,
        overlap=overlap, branches=branches, mix=mix,
        window_factor=_per_head(window_factor, hq, "window_factor", 1.0, vr), gate=_per_head(gate, hq, "gate", 0.5, vr),
    )  # (B, Hq, T, Dv), by query slot
    if valid is not None:  # back from query slots to the new tokens' order
        slot = (ext.order.argsort(dim=1)[:, window:] - window).clamp(min=0)  # (B, T)
        out = gather_tokens(out, slot)
    out = torch.where(ext.new_valid[:, None, :, None], out, torch.zeros_like(out))

    new_window = WindowState(
        keys=ext.keys[:, :, t:].to(dt),  # (B, Hkv, window, D)
        values=ext.values[:, :, t:].to(dt),  # (B, Hkv, window, Dv)
        valid=ext.valid[:, t:],
        positions=ext.positions[:, t:],
        linear_keys=ext.lin_keys[:, :, t:].to(dt) if separate else None,  # (B, Hkv, window, D)
    )
    return out.to(v.dtype), HybridState(window=new_window, linear=new_linear)


@dataclass(frozen=True)
class _Extended:
    """The state's window slots followed by the call's tokens (L = window + T), padding moved left."""

    valid: Tensor  # (B, L)
    positions: Tensor  # (B, L)
    keys: Tensor  # (B, Hkv, L, D), zero at padding
    values: Tensor  # (B, Hkv, L, Dv), zero at padding
    lin_keys: Tensor | None  # (B, Hkv, L, D): the feature maps' keys, or None
    queries: Tensor  # (B, Hq, T, D): query slot i holds extended token window + i
    lin_queries: Tensor | None  # (B, Hq, T, D) or None
    order: Tensor | None  # (B, L) the stable sort that moved padding left; None without a mask
    new_valid: Tensor  # (B, T) the call's real tokens


def _extend(ws: WindowState, q, k, v, valid, window: int, q_lin, k_lin) -> _Extended:
    """The extended sequence a call works on: the state's window, then the new tokens."""
    separate = k_lin is not None
    order = None
    new_valid = default_valid(q, valid)  # (B, T)
    seen = ws.positions.amax(dim=1) + 1  # (B,) real tokens before this call
    new_pos = (seen[:, None] + new_valid.long().cumsum(dim=1) - 1).masked_fill(~new_valid, -1)  # (B, T)
    ext_valid = torch.cat([ws.valid, new_valid], dim=1)  # (B, L)
    ext_pos = torch.cat([ws.positions, new_pos], dim=1)  # (B, L)
    keys = torch.cat([ws.keys.to(k.dtype), k], dim=2)  # (B, Hkv, L, D)
    values = torch.cat([ws.values.to(v.dtype), v], dim=2)  # (B, Hkv, L, Dv)
    lin_keys = torch.cat([ws.linear_keys.to(k_lin.dtype), k_lin], dim=2) if separate else None  # (B, Hkv, L, D)
    queries = q  # query slot i holds extended token window + i
    lin_queries = q_lin if separate else None
    if valid is not None:
        # Move padding to the left of each row (stable). Real tokens then sit at consecutive
        # indices, so the window is the last `window` indices. (The state's window is already
        # compacted, so without a mask nothing moves.) Query slots that now hold an old window
        # token or padding get a zero query; their outputs are dropped.
        order = torch.sort(ext_valid.to(torch.int8), dim=1, stable=True).indices  # (B, L)
        ext_valid, ext_pos = ext_valid.gather(1, order), ext_pos.gather(1, order)
        keys, values = gather_tokens(keys, order), gather_tokens(values, order)
        queries = gather_tokens(F.pad(q, (0, 0, window, 0)), order[:, window:])  # (B, Hq, T, D)
        if separate:
            lin_keys = gather_tokens(lin_keys, order)
            lin_queries = gather_tokens(F.pad(q_lin, (0, 0, window, 0)), order[:, window:])  # (B, Hq, T, D)
    keys = torch.where(ext_valid[:, None, :, None], keys, torch.zeros_like(keys))
    values = torch.where(ext_valid[:, None, :, None], values, torch.zeros_like(values))
    if separate:
        lin_keys = torch.where(ext_valid[:, None, :, None], lin_keys, torch.zeros_like(lin_keys))
    return _Extended(ext_valid, ext_pos, keys, values, lin_keys, queries, lin_queries, order, new_valid)


def _window_and_mix(queries, kr, vr, qf, kf, old_num, old_den, ext_valid, *, window: int, chunk: int, scale: float, dt,
                    overlap: bool, branches: str, mix: str, window_factor: Tensor, gate: Tensor) -> Tensor:
    """The window softmax of every query slot, mixed with the linear part: (B, Hq, T, Dv) by slot.

    queries (B, Hq, T, D); kr / vr (B, Hq, L, D|Dv) the extended keys and values; qf (B, Hq, T, F) and
    kf (B, Hq, L, F) their feature maps; old_num / old_den the linear part over the older tokens.
    """
    b, hq, t, _ = queries.shape
    # Window: query slot i sees extended keys i+1 .. i+window. Chunks of c queries take blocks of
    # c + window - 1 keys; key u of the block is in query s's window iff 0 <= u - s < window.
    c = max(1, min(chunk, t))
    n = -(-t // c)
    pad = n * c - t
    span = c + window - 1

    def key_blocks(x: Tensor) -> Tensor:  # (B, H, L, X) -> (B, H, N, span, X)
        return F.pad(x[:, :, 1:], (0, 0, 0, pad)).unfold(2, span, c).transpose(-1, -2)

    def query_blocks(x: Tensor) -> Tensor:  # (B, H, T, X) -> (B, H, N, c, X)
        return F.pad(x, (0, 0, 0, pad)).view(*x.shape[:2], n, c, x.shape[-1])

    offset = torch.arange(span, device=queries.device)[None, :] - torch.arange(c, device=queries.device)[:, None]  # (c, span)
    key_ok = F.pad(ext_valid[:, 1:], (0, pad)).unfold(1, span, c)  # (B, N, span)
    in_window = ((offset >= 0) & (offset < window)) & key_ok[:, None, :, None, :]  # (B, 1, N, c, span)
    vb = key_blocks(vr)  # (B, Hq, N, span, Dv)
    lin_num, lin_den = query_blocks(old_num), query_blocks(old_den[..., None])[..., 0]  # (B, Hq, N, c, Dv|)
    if overlap or branches == "linear":  # the window tokens' linear part, on the fly
        a = torch.einsum("bhncf,bhnsf->bhncs", query_blocks(qf), key_blocks(kf)) * in_window  # (B, Hq, N, c, span)
        lin_num, lin_den = lin_num + a @ vb, lin_den + a.sum(dim=-1)
    scores = None
    if branches != "linear":
        scores = (
            torch.einsum("bhncd,bhnsd->bhncs", query_blocks(queries.to(dt)), key_blocks(kr.to(dt))) * scale
        )  # (B, Hq, N, c, span)
    out = _mix(
        scores,
        in_window,
        vb,
        lin_num,
        lin_den,
        mix=mix,
        branches=branches,
        window_factor=window_factor,
        gate=gate,
    )
    return out.reshape(b, hq, n * c, -1)[:, :, :t]


# ----------------------------------------------------------------------------- per-token decoding


def _linear_state(kv: Tensor, k_sum: Tensor) -> Tensor:
    """[S | z] (B Hq, F, Dv + 1) of ``kv`` (B, Hq, F, Dv) and ``k_sum`` (B, Hq, F), laid out as
    ``fused_decode.new_state`` makes a decode state: each part copied in once."""
    b, h, f, dv = kv.shape
    linear = fused_decode.new_state((b * h, f, dv + 1), kv)
    linear[..., :dv].copy_(kv.reshape(b * h, f, dv))
    linear[..., dv].copy_(k_sum.reshape(b * h, f))
    return linear


@dataclass
class HybridDecodeState:
    """A ``HybridState`` in the form per-token decoding updates in place, laid out for few, batched
    operations per token (heads folded into the batch: ``bk`` = B * Hkv rows).

    The window is a ring buffer: ring index ``(head + j) % window`` holds the canonical slot j
    (oldest first), so a new token overwrites one slot instead of shifting the window. Values carry a
    last column of ones at real tokens (0 at empty slots) and the linear state is kept as [S | z], so
    one matmul reads a numerator and its denominator together. ``features`` keeps phi_k of every
    slot's key for all query heads of its KV head (zero at empty slots), computed once when the token
    arrives and folded into the linear state when it leaves. Slot positions are not written per
    token: the ``steps`` tokens since ring index ``start`` carry positions ``last + 1``, ``last + 2``, ...
    ``canonical()`` gives the equivalent HybridState."""

    keys: Tensor  # (bk, W, D), ring order
    linear_keys: Tensor | None  # (bk, W, D) or None
    values: Tensor  # (bk, W, Dv + 1): [v, 1], zero at empty slots
    features: Tensor  # (bk, W, n_rep * F)
    linear: Tensor  # (B * Hq, F, Dv + 1): [S | z]; column-major where the fused kernels take it (``fused_decode.new_state``)
    valid: Tensor  # (B, W)
    positions: Tensor  # (B, W): as in the state this was made from
    last: Tensor  # (B,) position of each row's last token before ``start``
    heads: int  # Hq
    full: bool = False  # every slot of every row holds a token (no masking needed)
    start: int = 0
    steps: int = 0
    index: Tensor | None = None
    """Static form (``make_static``): the ring index of the oldest slot as a 0-dim device tensor,
    advanced on the device, so that a step reads nothing on the host and can be captured in a CUDA
    graph; None: the host's ``head``."""
    count: Tensor | None = None
    """Static form: the tokens decoded since ``make_static`` (0-dim, on the device; the host's
    ``steps`` stops there). None with a ``clock``."""
    clock: DecodeClock | None = None
    """Static form with a shared clock (``make_static(clock)``): ``index`` stays the ring index at
    ``make_static`` and ``clock_start`` the clock's count then; the step derives the ring index from
    the clock and writes no counter of its own (the clock's owner advances it once per step)."""
    clock_start: Tensor | None = None
    kernel_args: Any = field(default=None, repr=False)
    """What the CPU kernel (``cpu_kernels.hybrid_step``) keeps between tokens: its argument block,
    scratch buffer and the weights the block points at."""
    kernel_scratch: Any = field(default=None, repr=False)
    kernel_weights: Any = field(default=None, repr=False)

    @property
    def head(self) -> int:
        """Ring index of the oldest slot (the next one written)."""
        return (self.start + self.steps) % self.keys.shape[1]

    @classmethod
    def from_state(cls, state: HybridState, phi_k: FeatureFn, heads: int) -> "HybridDecodeState":
        """The decode form of ``state`` (copies: the canonical state is left untouched)."""
        ws, lin = state.window, state.linear
        b, hkv, w, d = ws.keys.shape
        n_rep, dt = heads // hkv, ws.keys.dtype
        f = lin.kv.shape[2]
        real = ws.valid[:, None, :, None].expand(b, hkv, w, 1).to(dt)  # (B, Hkv, W, 1)
        keys = ws.keys if ws.linear_keys is None else ws.linear_keys
        features = phi_k(repeat_kv(keys, n_rep)).to(dt) * ws.valid[:, None, :, None]  # (B, Hq, W, F)
        features = features.view(b, hkv, n_rep, w, f).permute(0, 1, 3, 2, 4).reshape(b * hkv, w, n_rep * f)
        return cls(
            keys=ws.keys.reshape(b * hkv, w, d).clone(),
            linear_keys=None if ws.linear_keys is None else ws.linear_keys.reshape(b * hkv, w, d).clone(),
            values=torch.cat([ws.values, real], dim=-1).reshape(b * hkv, w, -1),
            features=features,
            linear=_linear_state(lin.kv, lin.k_sum),
            valid=ws.valid.clone(), positions=ws.positions.clone(), last=ws.positions.amax(dim=1), heads=heads,
            full=bool(ws.valid.all()),
        )  # fmt: skip

    def make_static(self, clock: DecodeClock | None = None) -> "HybridDecodeState":
        """Switch to the static form: the ring index and the token count live on the device and every
        step masks the empty slots (no host read of ``valid``), so a step replayed from a CUDA graph
        misses nothing; ``canonical`` reads the count back. With ``clock`` (on this state's device)
        the count is the clock's since now: the steps read it and write no counter."""
        if self.index is None:
            if clock is None:
                self.index = torch.tensor(self.head, dtype=torch.long, device=self.keys.device)
                self.count = torch.zeros((), dtype=torch.long, device=self.keys.device)
            else:
                if clock.count.device != self.keys.device:
                    raise ValueError(f"the clock is on {clock.count.device}; the state on {self.keys.device}")
                self.index, self.clock, self.clock_start = clock.constant(self.head), clock, clock.constant(clock.now())
            self.full = False
        return self

    def ring_index(self) -> Tensor | None:
        """Static form: the ring index of the oldest slot (the one the next token takes), (1,) on
        the device; None in the host form (``head``)."""
        if self.index is None:
            return None
        if self.clock is None:
            return self.index.view(1)
        return (self.index + self.clock.count - self.clock_start).remainder(self.keys.shape[1]).view(1)

    def decoded(self) -> int:
        """Tokens decoded in the static form (read on the host); 0 in the host form."""
        if self.clock is not None:
            return self.clock.now() - int(self.clock_start)
        return 0 if self.count is None else int(self.count)

    def canonical(self) -> HybridState:
        """The HybridState this stands for (window oldest first, right-aligned)."""
        bk, w, d = self.keys.shape
        b = self.valid.shape[0]
        hkv, dv = bk // b, self.values.shape[-1] - 1
        steps = self.steps + self.decoded()  # static form: the device counts
        head = (self.start + steps) % w
        valid, positions = self.valid.clone(), self.positions.clone()
        if steps:
            new = torch.arange(max(0, steps - w), steps, device=valid.device)  # tokens still in the window
            slots = (self.start + new) % w
            valid[:, slots] = True
            positions[:, slots] = self.last[:, None] + 1 + new

        def order(x: Tensor | None) -> Tensor | None:  # ring (bk, W, X) -> canonical (B, Hkv, W, X)
            return None if x is None else x.roll(-head, dims=1).view(b, hkv, w, -1)

        window = WindowState(
            keys=order(self.keys), values=order(self.values)[..., :dv].contiguous(), valid=valid.roll(-head, dims=1),
            positions=positions.roll(-head, dims=1), linear_keys=order(self.linear_keys),
        )  # fmt: skip
        f = self.linear.shape[1]
        kv = self.linear.view(b, self.heads, f, dv + 1)
        return HybridState(window=window, linear=LinearState(kv=kv[..., :dv].contiguous(), k_sum=kv[..., dv].contiguous()))


def _take(state: HybridDecodeState, features: Tensor, values: Tensor) -> None:
    """[S | z] += phi(k) [v, 1]^T in place for the token leaving the window: its ``features``
    (bk, [1,] n_rep F) and ``values`` (bk, [1,] Dv + 1) (zero for an empty slot), in either layout
    of ``state.linear``."""
    bk, width = values.shape[0], values.shape[-1]
    n_rep = state.linear.shape[0] // bk
    state.linear.view(bk, n_rep, -1, width).addcmul_(features.reshape(bk, n_rep, -1, 1), values.reshape(bk, 1, 1, width))


def _read(x: Tensor) -> Tensor:
    """[numerator, denominator] in the last axis -> their ratio, 0 where the denominator is at most
    EMPTY_DENOMINATOR (``safe_divide``'s values; decoding takes no gradients)."""
    den = x[..., -1:]
    return torch.where(den > EMPTY_DENOMINATOR, x[..., :-1] / den, 0.0)


def hybrid_decode_step(
    state: HybridDecodeState,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qf: Tensor,
    kf: Tensor,
    *,
    mix: str = "joint",
    overlap: bool = False,
    window_factor: Tensor | None = None,
    gate: Tensor | None = None,
    branches: str = "both",
    scale: float | None = None,
    k_lin: Tensor | None = None,
) -> Tensor:
    """One new real token per row (q (B, Hq, 1, D), k/v (B, Hkv, 1, D), no padding): the output
    (B, Hq, 1, Dv) in v's dtype, ``state`` updated in place. ``qf`` (B, Hq, F) is phi_q of the query
    (of q_lin, when the feature maps see other inputs), ``kf`` (B, Hq, F) phi_k of the key (k_lin)
    for every query head of its KV head; ``k_lin`` (B, Hkv, 1, D) is kept for the window's
    ``linear_keys`` when the state has them. ``window_factor`` (joint mix) and ``gate`` (gate mix) are
    (Hq,) in the state's dtype (None: 1 and 0.5). The same numbers as ``hybrid_attention`` on that
    token (its per-token specialisation: no concatenation, no repeated KV heads, each key's
    features computed once, when it arrives); tested against it."""
    b, hq, _, d = q.shape
    bk, w, _ = state.keys.shape
    n_rep, dt, dv = hq // (bk // b), state.keys.dtype, v.shape[-1]
    scale = d**-0.5 if scale is None else scale
    qf = qf.reshape(b * hq, -1)  # (B Hq, F)
    if qf.dtype != dt:
        qf = qf.to(dt)
    lin = None
    fused = fused_decode.enabled(state.linear) and state.linear.dtype == torch.float32
    ring = state.ring_index()  # (1,) on the device in the static form
    if fused:
        # The leaving token joins [S | z] and the query reads it, in one pass over the state.
        lin = fused_decode.hybrid_linear_step(state.linear, state.features, state.values, qf, ring,
                                              state.head if ring is None else 0).view(b, hq, dv + 1)  # fmt: skip
    if ring is None:
        i = state.head
        # The oldest slot leaves the window: its features (zero for an empty slot) join [S | z].
        if lin is None:
            _take(state, state.features[:, i], state.values[:, i])
        # The new token takes its slot.
        state.keys[:, i] = k.reshape(bk, d)
        if state.linear_keys is not None:
            state.linear_keys[:, i] = (k if k_lin is None else k_lin).reshape(bk, d)
        state.values[:, i, :dv] = v.reshape(bk, dv)
        if not state.full:
            state.values[:, i, dv] = 1.0
            state.valid[:, i] = True
            state.full = bool(state.valid.all())  # (a host read until the window fills; then no masking)
        state.features[:, i] = kf.reshape(bk, -1)
        state.steps += 1
    else:  # the same with the ring index on the device (static form)
        i = ring
        if lin is None:
            _take(state, state.features.index_select(1, i), state.values.index_select(1, i))
        state.keys.index_copy_(1, i, k.reshape(bk, 1, d).to(dt))
        if state.linear_keys is not None:
            state.linear_keys.index_copy_(1, i, (k if k_lin is None else k_lin).reshape(bk, 1, d).to(dt))
        v1 = v.reshape(bk, 1, dv).to(dt)
        state.values.index_copy_(1, i, torch.cat([v1, torch.ones_like(v1[..., :1])], dim=-1))  # [v, 1]
        # Slot i holds a token from now on; a whole-tensor update (index_fill_ on this bool tensor fails torch.compile at batch 1).
        state.valid.copy_(state.valid | (torch.arange(w, device=i.device) == i))
        state.features.index_copy_(1, i, kf.reshape(bk, 1, -1).to(dt))
        if state.clock is None:  # (with a clock, its owner counts)
            state.index.add_(1).remainder_(w)
            state.count.add_(1)  # the host's ``steps`` stays

    if fused and branches == "both" and not overlap:  # the window's read and the mix, one kernel
        if mix == "joint":
            factor = torch.ones(hq, dtype=dt, device=q.device) if window_factor is None else window_factor
        else:
            factor = torch.full((hq,), 0.5, dtype=dt, device=q.device) if gate is None else gate
        out = fused_decode.hybrid_window_read(q.view(b, hq, d), state.keys, state.values, state.valid, lin.view(b * hq, dv + 1),
                                              factor, scale, mix == "gate")  # fmt: skip
        return out.view(b, hq, 1, dv).to(v.dtype)
    qf = qf.view(b * hq, 1, -1)  # (B Hq, 1, F)
    if lin is None:
        lin = torch.bmm(qf, state.linear).view(b, hq, dv + 1)  # [phi(q) S, phi(q) z]
    if overlap or branches == "linear":  # the window tokens' linear part
        a = torch.einsum("brf,bwrf->brw", qf.view(bk, n_rep, -1), state.features.view(bk, w, n_rep, -1))  # (bk, n_rep, W)
        lin = lin + torch.bmm(a, state.values).view(b, hq, dv + 1)
    if branches == "linear":
        return _read(lin).view(b, hq, 1, dv).to(v.dtype)
    qs = q.reshape(bk, n_rep, d)
    scores = torch.bmm(qs if qs.dtype == dt else qs.to(dt), state.keys.transpose(1, 2)).mul_(scale)  # (bk, n_rep, W)
    if not state.full:
        scores.masked_fill_(~state.valid[:, None, None, :].expand(b, bk // b, 1, w).reshape(bk, 1, w), float("-inf"))
    e = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()  # the new token is in the window: the max is finite
    sw = torch.bmm(e, state.values).view(b, hq, dv + 1)  # [sum e v, sum e]
    if branches == "window":
        out = _read(sw)
    elif mix == "joint":  # the linear term is not rescaled by exp(-m_t), as in hybrid_attention
        out = _read(lin + sw if window_factor is None else torch.addcmul(lin, window_factor.view(hq, 1), sw))
    else:
        g = torch.full((hq, 1), 0.5, dtype=dt, device=sw.device) if gate is None else gate.view(hq, 1)
        out = torch.lerp(_read(lin), _read(sw), g)  # g SWA + (1 - g) LA
    return out.view(b, hq, 1, dv).to(v.dtype)
