"""Softmax attention over a KV cache, sinks-only softmax and zero attention (diagnostics).

These give the reference behaviour of the teacher (``softmax_attention``) and the two component
diagnostics of the HedgeCATs paper: attention restricted to the first ``n_sinks`` real tokens, and
no attention at all (the output is zero; residual and MLP remain). Their specifications,
``softmax_attention_reference`` and ``sinks_attention_reference``, live in ``linearize.ops.naive``
(re-exported here) and share no code with these.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import fused_decode
from .common import default_valid, gqa_groups, repeat_kv
from .naive import sinks_attention_reference, softmax_attention_reference  # noqa: F401 (the specification)
from .states import KVState


DECODE_FLASH = True
"""``linearize.decoding.StaticDecoder``'s softmax layers (the teacher's) read their static key and
value buffers with the flash-decoding kernel (``slot_attention``: each row only its keys so far,
split over programs, in float32) where the fused kernels run and the prompt has no padding; False,
or elsewhere: the scores' GEMM and a float32 masked softmax over the whole buffer."""


def _append(state: KVState | None, k: Tensor, v: Tensor, valid: Tensor) -> KVState:
    if state is None:
        return KVState(keys=k, values=v, valid=valid)
    return KVState(
        keys=torch.cat([state.keys, k], dim=2),
        values=torch.cat([state.values, v], dim=2),
        valid=torch.cat([state.valid, valid], dim=1),
    )


def _masked_softmax_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """q (B,H,T,D), k/v (B,H,S,D), allowed (B,T,S) bool -> (B,H,T,Dv); rows with nothing allowed give 0."""
    scores = torch.einsum("bhtd,bhsd->bhts", q.float(), k.float()) * scale  # (B, H, T, S)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    any_allowed = allowed.any(-1)[:, None, :, None]  # (B, 1, T, 1)
    probs = torch.softmax(torch.where(any_allowed, scores, torch.zeros_like(scores)), dim=-1)
    probs = torch.where(any_allowed, probs, torch.zeros_like(probs))
    return torch.einsum("bhts,bhsd->bhtd", probs, v.float()).to(v.dtype)


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    valid: Tensor | None = None,
    state: KVState | None = None,
    scale: float | None = None,
) -> tuple[Tensor, KVState]:
    """Causal softmax attention continuing from a KV ``state``.

    q (B, Hq, T, D), k/v (B, Hkv, T, D), valid (B, T) bool (False = padding). Returns the output
    (B, Hq, T, Dv) (zeros at padded queries) and the KV state holding every token so far.
    """
    n_rep = gqa_groups(q, k)
    valid = default_valid(q, valid)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    new_state = _append(state, k, v, valid)
    t, s = q.shape[2], new_state.keys.shape[2]
    past = s - t
    causal = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=past)  # (T, S)
    allowed = causal[None] & new_state.valid[:, None, :] & valid[:, :, None]  # (B, T, S)
    out = _masked_softmax_attention(q, repeat_kv(new_state.keys, n_rep), repeat_kv(new_state.values, n_rep), allowed, scale)
    return out, new_state


def slot_attention(q: Tensor, keys: Tensor, values: Tensor, slots: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """One query token per row over keys kept in slot pools (the serving runner's layout): row b
    attends to the first lengths[b] positions of slot slots[b] of ``keys`` (S, Hkv, C, D) and
    ``values`` (S, Hkv, C, Dv) (a row of length 0 gives 0). q (B, Hq, D), the query heads of a KV
    head consecutive; returns (B, Hq, Dv) in q's dtype. Every index is a device tensor and the work
    depends only on the shapes, so a CUDA graph can capture it: on CUDA it is a flash-decoding
    kernel (``fused_decode.slot_attention_partials``, each row reading its own length, the parts
    combined here), elsewhere ``slot_attention_reference`` (float32 over the whole capacity)."""
    if fused_decode.enabled(q):
        return combine_parts(*fused_decode.slot_attention_partials(q, keys, values, slots, lengths, scale)).to(q.dtype)
    return slot_attention_reference(q, keys, values, slots, lengths, scale)


def slot_prefill_attention(q: Tensor, keys: Tensor, values: Tensor, meta: Tensor, scale: float) -> Tensor:
    """One row's prefill chunk over its keys kept in a slot pool: query t of ``q`` (Hq, T, D) sits at
    position meta[0] + t and attends causally to positions 0..meta[0] + t of slot meta[1] of ``keys``
    (S, Hkv, C, D) and ``values`` (S, Hkv, C, Dv), the chunk's own keys written there first; the
    query heads of a KV head consecutive. Returns (Hq, T, Dv) in q's dtype. Start and slot are device
    values, so a CUDA graph can capture it: on CUDA a flash-attention kernel that reads the slot only
    up to the chunk's last position (``fused_decode.slot_prefill_attention``), elsewhere
    ``slot_prefill_attention_reference`` (float32 over the whole capacity)."""
    if fused_decode.enabled(q):
        return fused_decode.slot_prefill_attention(q, keys, values, meta, scale)
    return slot_prefill_attention_reference(q, keys, values, meta, scale)


def slot_prefill_attention_reference(q: Tensor, keys: Tensor, values: Tensor, meta: Tensor, scale: float) -> Tensor:
    """``slot_prefill_attention`` in float32 over the slot's whole capacity, later positions masked."""
    hq, t, d = q.shape
    k = keys.index_select(0, meta[1:]).squeeze(0).float()  # (Hkv, C, D)
    v = values.index_select(0, meta[1:]).squeeze(0).float()
    hkv, cap = k.shape[0], k.shape[1]
    scores = torch.matmul(q.float().reshape(hkv, hq // hkv * t, d), k.transpose(-1, -2)) * scale  # (Hkv, n_rep T, C)
    positions = (meta[0] + torch.arange(t, device=q.device)).repeat(hq // hkv)  # each folded query's position
    allowed = torch.arange(cap, device=q.device)[None, :] <= positions[:, None]  # (n_rep T, C)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.matmul(weights, v).reshape(hq, t, v.shape[-1]).to(q.dtype)


def combine_parts(o: Tensor, m: Tensor, l: Tensor) -> Tensor:
    """Softmax attention from its parts over disjoint key ranges: o (..., P, Dv) each part's sum of
    exp(score - m) v, m (..., P) its max score, l (..., P) its sum of exp(score - m) (an empty part:
    m = -inf, l = 0) -> (..., Dv) float32, 0 where every part is empty."""
    top = m.amax(dim=-1, keepdim=True)
    w = torch.where(l > 0, torch.exp(m - top), 0.0)  # each part rescaled to the common max
    den = (l * w).sum(dim=-1, keepdim=True)
    return torch.where(den > 0, (o * w[..., None]).sum(dim=-2) / den, 0.0)


def slot_attention_reference(q: Tensor, keys: Tensor, values: Tensor, slots: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """``slot_attention`` in float32 over each row's gathered slot, positions from lengths[b] on masked."""
    b, hq, d = q.shape
    k, v = keys[slots].float(), values[slots].float()  # (B, Hkv, C, D)
    hkv, cap = k.shape[1], k.shape[2]
    scores = torch.matmul(q.float().reshape(b, hkv, hq // hkv, d), k.transpose(-1, -2)) * scale  # (B, Hkv, n_rep, C)
    allowed = (torch.arange(cap, device=q.device) < lengths[:, None])[:, None, None]  # (B, 1, 1, C)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1).nan_to_num(0.0)  # empty rows: 0
    return torch.matmul(weights, v).reshape(b, hq, v.shape[-1]).to(q.dtype)


def sinks_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    n_sinks: int = 8,
    valid: Tensor | None = None,
    state: KVState | None = None,
    scale: float | None = None,
) -> tuple[Tensor, KVState]:
    """Softmax over the first ``n_sinks`` real tokens only (causal: query t sees sinks <= t).

    The state keeps exactly ``n_sinks`` slots (the sink tokens, in order; unfilled slots invalid).
    """
    if n_sinks < 1:
        raise ValueError(f"n_sinks must be >= 1, got {n_sinks}")
    n_rep = gqa_groups(q, k)
    valid = default_valid(q, valid)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, hkv, t, d = k.shape
    if state is None:
        state = KVState(
            keys=k.new_zeros(b, hkv, n_sinks, d),
            values=v.new_zeros(b, hkv, n_sinks, v.shape[-1]),
            valid=torch.zeros(b, n_sinks, dtype=torch.bool, device=k.device),
        )
    seen = state.valid.sum(dim=1, keepdim=True)  # (B, 1): sinks already held (= real tokens seen, capped)
    pos = seen + valid.long().cumsum(dim=1) - 1  # (B, T) real-token index of each new token
    is_sink = valid & (pos < n_sinks)  # (B, T)
    # Token with real position j fills sink slot j: a one-hot match (B, T, n_sinks).
    slot_ids = torch.arange(n_sinks, device=q.device)
    match = (is_sink[:, :, None] & (pos[:, :, None] == slot_ids)).to(k.dtype)  # (B, T, n)
    filled = match.sum(dim=1) > 0  # (B, n)
    keep = (~filled)[:, None, :, None].to(k.dtype)  # (B, 1, n, 1)
    new_state = KVState(
        keys=state.keys * keep + torch.einsum("btn,bhtd->bhnd", match, k),
        values=state.values * keep + torch.einsum("btn,bhtd->bhnd", match, v),
        valid=state.valid | filled,
    )
    # Query at real position p sees sink slots j <= p.
    allowed = new_state.valid[:, None, :] & (slot_ids[None, None, :] <= pos[:, :, None]) & valid[:, :, None]  # (B, T, n)
    out = _masked_softmax_attention(q, repeat_kv(new_state.keys, n_rep), repeat_kv(new_state.values, n_rep), allowed, scale)
    return out, new_state


def zero_attention(q: Tensor, v: Tensor) -> Tensor:
    """No attention: (B, Hq, T, Dv) zeros."""
    return q.new_zeros(*q.shape[:-1], v.shape[-1])
