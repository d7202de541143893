"""LoLA: sliding window + sparse global cache + linear state, one shared softmax denominator.

Inference-only op on top of the joint-mode in-head hybrid (methods.md sections 1 and 2). Per head
the memory holds exactly ``window`` (eta) KV, ``sparse`` (lambda) KV and the linear state (H, s).

Chunked step, chunk C <= eta (C = 1 is the per-token decode step). Let n be the chunk's real
tokens and L the window tokens that leave during it (the window's n oldest slots; all of them are
tokens from before the chunk, because C <= eta):

  1. select: candidates = sparse cache G  U  L, in position order; score each by its self-recall
     error against the state BEFORE the chunk; a stable descending sort keeps the top lambda as the
     new cache G' (ties: the earlier position wins); the rest, R, go into (H, s) for good. The
     selection reads only tokens from before the chunk, so it is causal for every query of the chunk.
  2. attend: query t reads its TRUE sliding window W_t (the last eta real tokens up to and
     including t) exactly, and every older token where step 1 put it: exactly if it is in G', through
     the linear path if it is in R or in the state before the chunk. Concretely, with one softmax
     (window factor f on every explicit entry, one max m_t over the explicit entries) and one
     denominator,
         explicit_t = W_t  U  {j in G' : j older than W_t}
         linear_t   = (H, s) before the chunk  +  sum_{j in R, j older than W_t} phi(k_j) [v_j, 1]
     The tokens of L that are still in W_t are read in the window, whatever their selection; those
     that have left W_t but not yet been folded into the state are added to the linear term on the
     fly (phi(q_t)^T phi(k_j) v_j), so nothing is counted twice or lost.
  3. slide: the window becomes the last eta real tokens; (H, s) += R; G = G'.

Properties (tests check each): every token up to t is read exactly once; lambda = 0 gives the joint,
non-overlap hybrid (``hybrid_attention``) for ANY chunk length, outputs and final state; lambda >=
the number of tokens gives exact causal softmax for any C; C = 1 is the per-token decode rule
"evict before attend" (append, select, then attend window U G U state), so a prefill with C = 1
equals token-by-token decoding, and with lambda = 0 every C equals it. With lambda > 0 the
selection runs once per chunk (the C - 1 later leavers are scored against an older state than at
C = 1), so outputs and state may legitimately depend on C.

Relation to the LoLA authors' chunked prefill: they attend before evicting, with the window kept
over the previous and the current chunk (query t reads up to eta + C tokens exactly, plus G and the
state as they stood before the chunk), then score the tokens that fell out of the window together
with G against the state before the update. Our selection has the same candidates and the same
scoring state, so for the same chunk boundaries the memory after each chunk is the same; only the
read differs: each query sees its true window (as in training, so lambda = 0 is the trained hybrid
whatever C; the authors' read is not, and depends on C even at lambda = 0), and older tokens are
read from where this chunk's selection puts them. (Reading G and the state as they stood before the
chunk, with the tokens between W_t and the state always linear, would also give the hybrid at
lambda = 0, but not exact softmax at lambda >= T, and it would change the C = 1 decode step.)

Separate feature-map inputs (``q_lin`` / ``k_lin``, same shapes as q / k; e.g. q and k before RoPE,
as a hybrid trained with ``linear_rope: false`` sees them). Every exact softmax read (window and
sparse cache) scores the RoPE'd q / k; every use of a feature map sees the linear inputs: the state
read phi(q_lin_t), the write phi(k_lin_j) [v_j, 1] of a token into (H, s) (and its on-the-fly read),
and the self-recall error SRE(k_j, v_j | H, s) = || H^T phi(k_lin_j) / (phi(k_lin_j)^T s) - v_j ||,
which asks how well the STATE recalls token j. So the window and the sparse cache keep each token's
k_lin next to its k (``WindowState.linear_keys``, ``SparseCacheState.linear_keys``); a state made
with linear keys is continued only by calls that give q_lin / k_lin, and one made without only by
calls that do not. Without them (None) the feature maps see q / k. lambda = 0 is then the hybrid
with the same q_lin / k_lin, and lambda >= T is still exact softmax (the linear inputs play no role).

Two read-out options beyond the method as published (defaults keep it): ``sinks`` pins the first
``sinks`` tokens of a sequence in the sparse cache (their self-recall error counts as +inf, so they
are always selected and take ``sinks`` of the lambda slots), and ``linear_weight`` multiplies the
linear term (state and on-the-fly reads) in both numerator and denominator (1: the trained hybrid's
read; 0: the same read as ``read_state=False``), one number or one per query head. What is kept
does not depend on ``linear_weight``.

One selection option beyond the method (``recall``; the default, "state", is the method): with
"memory" a candidate's score is the smaller of its self-recall error against the state and its
recall error against the OLDER candidates, || sum_j softmax_j(k_lin_c . k_lin_j * scale) v_j - v_c ||
over the candidates j (cache entries and leaving tokens) at earlier positions (+inf where there is
none). The state recalls every token only through a blur of all of them, so a token that repeats
(a haystack sentence, a boilerplate line) keeps a high self-recall error at every occurrence and
LoLA spends one slot per copy; here a copy whose content an older entry already holds scores low
and goes to the state, and the oldest copy keeps its own score. The slots go to tokens nothing else
holds. The prefill kernels compute it too (the selection kernel, blocks of candidates against the
older ones); the decode step kernel does not, so decoding with it runs the torch step.

``lola_attention_reference`` is the specification (a plain float32 loop per row, head, chunk and
query over lists of token indices, in ``linearize.ops.naive``, re-exported here; it shares no code
with the fast path); ``lola_attention`` is the vectorised op (loop over chunks only) that continues
from a ``LolaState``. From an empty memory at inference where the fused kernels run, it hands the
whole prompt to ``fused_lola.lola_prefill`` (a Triton selection kernel, one program per row and
query head with the chunks in a loop inside it, then a parallel read kernel; the same numbers, tested
against the loop).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from linearize.ops import fused_decode, fused_lola
from linearize.ops.common import FeatureFn, default_valid, gather_tokens, gqa_groups, head_weights, on_device, repeat_kv, safe_divide
from linearize.ops.naive import lola_attention_reference  # noqa: F401 (the specification)
from linearize.ops.states import LinearState, LolaState, SparseCacheState, WindowState

logger = logging.getLogger(__name__)


def self_recall_error(k_phi: Tensor, v: Tensor, linear: LinearState) -> Tensor:
    """SRE(k, v | H, s) = || H^T phi(k) / (phi(k)^T s) - v ||_2 per candidate (L2, not squared).

    ``k_phi`` (..., N, F), ``v`` (..., N, Dv), ``linear.kv`` (..., F, Dv), ``linear.k_sum`` (..., F)
    -> (..., N). The readout is 0 where phi(k)^T s == 0, so an empty state gives ||v||.
    """
    num = k_phi @ linear.kv  # (..., N, Dv)
    den = (k_phi @ linear.k_sum.unsqueeze(-1)).squeeze(-1)  # (..., N)
    return _recall_distance(num, den, v)


def _recall_distance(num: Tensor, den: Tensor, v: Tensor) -> Tensor:
    """|| num / den - v ||_2 over the last axis, the readout 0 where den is empty: (..., N)."""
    return torch.linalg.vector_norm(safe_divide(num, den) - v, dim=-1)


RECALLS = ("state", "memory")
"""What a candidate's recall error is measured against: the linear state (LoLA's self-recall
error), or that and the older candidates (the smaller of the two; module docstring)."""


def older_recall_error(keys: Tensor, values: Tensor, positions: Tensor, valid: Tensor, scale: float) -> Tensor:
    """|| sum_j softmax_j(k_i . k_j * scale) v_j - v_i ||_2 over the valid candidates j at positions
    before i's, +inf where there is none: how well the older candidates recall candidate i.

    ``keys`` (..., N, D), ``values`` (..., N, Dv), ``positions`` / ``valid`` (..., N) -> (..., N) float32."""
    older = valid[..., None, :] & (positions[..., None, :] < positions[..., :, None])  # (..., N, N) i reads j
    scores = (keys.float() @ keys.float().transpose(-1, -2)) * scale  # (..., N, N)
    any_older = older.any(-1)  # (..., N)
    scores = torch.where(older, scores, -torch.inf).masked_fill(~any_older[..., None], 0)  # rows with none: finite, masked below
    err = torch.linalg.vector_norm(scores.softmax(-1) @ values.float() - values.float(), dim=-1)  # (..., N)
    return err.masked_fill(~any_older, torch.inf)


def lola_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    phi_q: FeatureFn,
    phi_k: FeatureFn,
    window: int,
    sparse: int,
    window_factor: Tensor,
    chunk: int = 16,
    valid: Tensor | None = None,
    state: LolaState | None = None,
    scale: float | None = None,
    read_state: bool = True,
    read_sparse: bool = True,
    q_lin: Tensor | None = None,
    k_lin: Tensor | None = None,
    sinks: int = 0,
    linear_weight: float | Sequence[float] | Tensor = 1.0,
    weight_tokens: int = 0,
    recall: str = "state",
) -> tuple[Tensor, LolaState]:
    """LoLA attention, vectorised over batch and heads, one loop step per chunk of ``chunk`` tokens.

    q (B, Hq, T, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv) with RoPE applied; ``valid`` (B, T), False
    for padding. Continues from ``state`` (prefill, then decode calls with T = 1). Returns the output
    (B, Hq, T, Dv) in q's dtype (zeros at padded positions) and the new float32 state.

    Chunks are cut over each row's real tokens (padding is moved out of the way first), so a row's
    result does not depend on how much padding the batch gave it. A chunk never exceeds the window
    (``chunk`` is capped at ``window``), so the tokens that leave the window during a chunk are
    always tokens that were in it before the chunk, and the chunk's selection reads no token of the
    chunk. Each query reads its true sliding window; see the module docstring for the exact rule.
    ``read_state`` / ``read_sparse`` hide the linear state / the sparse cache from the output
    (ablations); what is kept is unchanged. ``q_lin`` / ``k_lin`` (same shapes as q / k, e.g. before
    RoPE): what the feature maps see instead of q / k; the state then keeps them for the window and
    the sparse cache, and it cannot be continued by a call without them (nor the other way round).
    ``weight_tokens`` N > 0: a query that reads n > N tokens through the linear term (the state and
    the tokens it reads on the fly) reads it with ``linear_weight`` x N / n (the term is a sum over
    those tokens; this keeps its weight against the explicit entries from growing with the context);
    0: never. ``recall`` (``RECALLS``): what the selection's recall error is measured against (module
    docstring).
    Memory per chunk is O(C (window + sparse + C)); no T x T tensor is formed.
    """
    weights = _check_args(q, k, v, window=window, sparse=sparse, chunk=chunk, window_factor=window_factor, q_lin=q_lin,
                          k_lin=k_lin, sinks=sinks, linear_weight=linear_weight, weight_tokens=weight_tokens, recall=recall)  # (Hq,)
    n_rep = gqa_groups(q, k)
    batch, hq, t_len, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    scale = d**-0.5 if scale is None else scale
    if chunk > window:
        logger.debug("lola_attention: chunk %d capped at the window %d", chunk, window)
        chunk = window
    out_dtype = q.dtype  # the fused paths read mixed inputs (autocast) in one dtype; the output keeps q's
    low = _narrowest_dtype(q, k, v, q_lin, k_lin)
    fused = state is None and _fused_prefill_applies(q, sparse, low)
    if fused:
        q, k, v, q_lin, k_lin = (None if x is None else x.to(low) for x in (q, k, v, q_lin, k_lin))
    training = fused and _needs_grad(q, k, v, q_lin, k_lin, phi_q, phi_k)
    kw = dict(phi_q=phi_q, phi_k=phi_k, window=window, sparse=sparse, window_factor=window_factor, chunk=chunk, scale=scale,
              read_state=read_state, read_sparse=read_sparse, q_lin=q_lin, k_lin=k_lin, sinks=sinks, weights=weights,
              weight_tokens=weight_tokens, recall=recall)  # fmt: skip
    if training and window % chunk == 0 and (valid is None or bool(valid.all())):
        return _in_dtype(out_dtype, *_prefill_parallel(q, k, v, **kw))
    if fused and not training:
        return _in_dtype(out_dtype, *_prefill_fused(q, k, v, None if valid is None else default_valid(q, valid), **kw))
    valid = default_valid(q, valid)
    separate = k_lin is not None  # the feature maps see their own inputs (e.g. before RoPE)
    if state is None:
        feats = phi_k(k.new_zeros(batch, hq, 1, d)).shape[-1]
        state = lola_state_empty(batch, hq, hkv, window, sparse, d, dv, feats, q.device, linear_keys=separate)
    _check_state(state, batch, hq, hkv, window, sparse, d, dv, separate)

    # Pack each row's real tokens to the front (stable), so chunks are cut over real tokens.
    order = torch.argsort((~valid).int(), dim=1, stable=True)  # (B, T)
    n_real = valid.sum(1)  # (B,)
    ctx = _ChunkContext.on(q.device, phi_q, phi_k, window_factor, scale, n_rep, q.dtype, read_state, read_sparse, sinks, weights,
                           weight_tokens, recall)  # fmt: skip
    next_pos = state.window.positions[:, -1] + 1  # (B,) the newest token sits in the last slot
    outs = []
    for c0 in range(0, t_len, chunk):
        idx = order[:, c0 : c0 + chunk]  # (B, C)
        offs = torch.arange(idx.shape[1], device=q.device)  # (C,)
        cvalid = c0 + offs < n_real[:, None]  # (B, C) real tokens are a prefix of the chunk
        cpos = torch.where(cvalid, next_pos[:, None] + offs, -1)  # (B, C)
        mask = cvalid[:, None, :, None]  # (B, 1, C, 1)
        qc = torch.where(mask, gather_tokens(q, idx), 0).float()  # (B, Hq, C, D)
        kc = torch.where(mask, gather_tokens(k, idx), 0).float()  # (B, Hkv, C, D)
        vc = torch.where(mask, gather_tokens(v, idx), 0).float()  # (B, Hkv, C, Dv)
        lin = None
        if separate:
            lin = (
                torch.where(mask, gather_tokens(q_lin, idx), 0).float(),  # (B, Hq, C, D)
                torch.where(mask, gather_tokens(k_lin, idx), 0).float(),  # (B, Hkv, C, D)
            )
        out_c, state = _lola_chunk(state, qc, kc, vc, cvalid, cpos, ctx, lin)
        outs.append(out_c)
        next_pos = next_pos + cvalid.sum(1)
    packed = torch.cat(outs, dim=2) if outs else q.new_zeros(batch, hq, 0, dv, dtype=torch.float32)  # (B, Hq, T, Dv)
    return gather_tokens(packed, torch.argsort(order, dim=1)).to(q.dtype), state


def _narrowest_dtype(*xs: Tensor | None) -> torch.dtype:
    """The narrowest of the inputs' dtypes. Under autocast the projections come in bfloat16 and the
    RoPE'd q/k in float32 (RoPE's tables are float32); the kernels read one dtype, and autocast's
    softmax attention reads all three in bfloat16 too."""
    return min((x.dtype for x in xs if x is not None), key=lambda dt: torch.finfo(dt).bits)


def _in_dtype(dtype: torch.dtype, out: Tensor, state: LolaState) -> tuple[Tensor, LolaState]:
    return out.to(dtype), state


def _fused_prefill_applies(q: Tensor, sparse: int, dtype: torch.dtype) -> bool:
    """A prefill (from an empty memory) with a sparse cache, read in ``dtype`` (the narrowest of its
    inputs') where that is bfloat16 or float32, where the fused kernels run (``fused_decode.enabled``)."""
    return sparse > 0 and fused_decode.enabled(q) and fused_lola.supports(dtype)


def _prefill_fused(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, *, phi_q: FeatureFn, phi_k: FeatureFn, window: int, sparse: int,
                   window_factor: Tensor, chunk: int, scale: float, read_state: bool, read_sparse: bool, q_lin: Tensor | None,
                   k_lin: Tensor | None, sinks: int, weights: Tensor, weight_tokens: int, recall: str) -> tuple[Tensor, LolaState]:
    """``lola_attention`` from an empty memory through ``fused_lola.lola_prefill`` (the selection, one
    program per row and query head with the chunks in a loop inside it, then the read): each row's
    real tokens packed first, the kernels, the output unpacked; the memory they leave is gathered
    into a ``LolaState``. ``valid`` None: no padding (nothing packed); no value goes back to the
    host."""
    batch, hq, t_len, _ = q.shape
    packed = valid is not None
    order = torch.argsort((~valid).int(), dim=1, stable=True) if packed else None  # (B, T) real tokens first

    def pack(x: Tensor | None) -> Tensor | None:
        return x if x is None or order is None else gather_tokens(x, order)

    q, k, v, q_lin, k_lin = (pack(x) for x in (q, k, v, q_lin, k_lin))
    n_real = valid.sum(1) if packed else torch.full((batch,), t_len, device=q.device)  # (B,)
    out, kv, k_sum, positions, _ = _run_prefill_kernels(q, k, v, n_real, phi_q=phi_q, phi_k=phi_k, window=window, sparse=sparse,
                                                        window_factor=window_factor, chunk=chunk, scale=scale, read_state=read_state,
                                                        read_sparse=read_sparse, q_lin=q_lin, k_lin=k_lin, sinks=sinks,
                                                        weights=weights, weight_tokens=weight_tokens, recall=recall)  # fmt: skip
    if packed:
        out = gather_tokens(out, torch.argsort(order, dim=1))
    return out, _memory(k, v, k_lin, n_real, positions, LinearState(kv=kv, k_sum=k_sum), window, hq // k.shape[1])


def _run_prefill_kernels(q: Tensor, k: Tensor, v: Tensor, n_real: Tensor, *, phi_q: FeatureFn, phi_k: FeatureFn, window: int, sparse: int,
                         window_factor: Tensor, chunk: int, scale: float, read_state: bool, read_sparse: bool, q_lin: Tensor | None,
                         k_lin: Tensor | None, sinks: int, weights: Tensor, weight_tokens: int, recall: str = "state",
                         output: bool = True) -> tuple[Tensor, ...]:
    """``fused_lola.lola_prefill`` on each row's ``n_real`` real tokens (packed first), the features
    of every query and key computed first: (output, S, z, the last cache's positions, the cache each
    chunk's queries read (B, Hq, chunks, lambda) int32); ``output`` False: the selection alone (the
    output is empty). ``recall`` "memory": the selection reads the feature maps' keys as well."""
    n_rep = q.shape[1] // k.shape[1]
    kphi = _head_major_features(phi_k, k if k_lin is None else k_lin, n_rep, q.dtype)  # (B, Hq, T, F)
    qphi = _head_major_features(phi_q, q if q_lin is None else q_lin, 1, q.dtype) if read_state else kphi  # (unread without the state)
    factor = window_factor.to(q.device, torch.float32).contiguous()
    return fused_lola.lola_prefill(
        q, k, v, qphi, kphi, n_real, factor, on_device(weights, q.device), window, sparse, chunk, sinks, scale, weight_tokens,
        read_state, read_sparse, output, (k if k_lin is None else k_lin) if recall == "memory" else None,
    )  # fmt: skip


def _head_major_features(phi: FeatureFn, x: Tensor, n_rep: int, dtype: torch.dtype) -> Tensor:
    """phi of ``x`` (B, H, T, d) for ``n_rep`` query heads per head, (B, H n_rep, T, F) in ``dtype``:
    where the map has a kernel (``token_major``, Hedgehog's) one launch into a head-major buffer (no
    repeated heads, the projection and softmaxes in float32, as the fused decode step makes them),
    else phi on the repeated heads."""
    token_major = getattr(phi, "token_major", None)
    if token_major is None or x.dtype != dtype or not fused_decode.kernels_run_on(x) or torch.is_grad_enabled():
        return phi(repeat_kv(x, n_rep)).to(dtype)
    b, h, t, _ = x.shape
    feats = phi.num_features(x.shape[-1])
    out = x.new_empty(b, h * n_rep, t, feats)
    token_major(x, n_rep, out=out.transpose(1, 2))  # the kernel writes (B, T, H, F) through this view's strides
    return out


def _memory(k: Tensor, v: Tensor, k_lin: Tensor | None, n_real: Tensor, positions: Tensor, linear: LinearState, window: int,
            n_rep: int) -> LolaState:
    """The memory after a prefill of each row's ``n_real`` real tokens (packed first) whose last
    chunk left the sparse cache at ``positions`` (B, Hq, lambda) long (-1 empty): the window is each
    row's last ``window`` real tokens (right-aligned), the cache those positions' keys and values (a
    KV head's gathered for its query heads), ``linear`` the state."""
    batch, hkv = k.shape[:2]
    hq, sparse = positions.shape[1], positions.shape[2]
    pos = n_real[:, None] - window + torch.arange(window, device=k.device)  # (B, eta)
    w_valid = pos >= 0
    at = pos.clamp(min=0)

    def win(x: Tensor | None) -> Tensor | None:  # (B, Hkv, T, X) -> (B, Hkv, eta, X) float32, zero where empty
        return None if x is None else gather_tokens(x, at).float() * w_valid[:, None, :, None]

    c_valid = positions >= 0  # (B, Hq, L)
    slots = positions.clamp(min=0).view(batch, hkv, n_rep * sparse)  # a KV head's query heads, side by side

    def kept(x: Tensor | None) -> Tensor | None:  # (B, Hkv, T, X) -> (B, Hq, L, X) float32, zero where empty
        if x is None:
            return None
        got = x.gather(2, slots[..., None].expand(-1, -1, -1, x.shape[-1])).view(batch, hq, sparse, x.shape[-1])
        return got.float() * c_valid[..., None]

    return LolaState(
        window=WindowState(keys=win(k), values=win(v), valid=w_valid, positions=torch.where(w_valid, pos, -1), linear_keys=win(k_lin)),
        sparse=SparseCacheState(keys=kept(k), values=kept(v), valid=c_valid, positions=positions, linear_keys=kept(k_lin)),
        linear=linear,
    )


def _needs_grad(q: Tensor, k: Tensor, v: Tensor, q_lin: Tensor | None, k_lin: Tensor | None, phi_q: FeatureFn, phi_k: FeatureFn) -> bool:
    """Whether a gradient is asked of the output: grad mode on and an input or a feature map's
    parameters requiring one (the maps are probed on one token)."""
    if not torch.is_grad_enabled():
        return False
    if any(x is not None and x.requires_grad for x in (q, k, v, q_lin, k_lin)):
        return True
    probe_q = (q if q_lin is None else q_lin)[:1, :, :1]  # (1, Hq, 1, D)
    probe_k = repeat_kv((k if k_lin is None else k_lin)[:1, :, :1], q.shape[1] // k.shape[1])  # (1, Hq, 1, D)
    return phi_q(probe_q).requires_grad or phi_k(probe_k).requires_grad


def _prefill_parallel(q: Tensor, k: Tensor, v: Tensor, *, phi_q: FeatureFn, phi_k: FeatureFn, window: int, sparse: int,
                      window_factor: Tensor, chunk: int, scale: float, read_state: bool, read_sparse: bool, q_lin: Tensor | None,
                      k_lin: Tensor | None, sinks: int, weights: Tensor, weight_tokens: int, recall: str) -> tuple[Tensor, LolaState]:
    """``lola_attention`` from an empty memory with gradients where the fused kernels run, no padding,
    ``window`` a multiple of ``chunk``: the choice of each chunk's cache made by the kernels without
    gradients, then the output of every chunk at once given those caches (``lola_given_caches``) and
    the memory, both differentiable in q, k, v, the window factor and the feature maps, as the
    chunk loop's are."""
    batch, hq, t_len, _ = q.shape
    n_real = torch.full((batch,), t_len, device=q.device)
    with torch.no_grad():
        *_, positions, history = _run_prefill_kernels(q, k, v, n_real, phi_q=phi_q, phi_k=phi_k, window=window, sparse=sparse,
                                                      window_factor=window_factor, chunk=chunk, scale=scale, read_state=False,
                                                      read_sparse=False, q_lin=q_lin, k_lin=k_lin, sinks=sinks, weights=weights,
                                                      weight_tokens=weight_tokens, recall=recall, output=False)  # fmt: skip
    out = lola_given_caches(q, k, v, history.long(), phi_q=phi_q, phi_k=phi_k, window=window, window_factor=window_factor,
                            chunk=chunk, scale=scale, read_state=read_state, read_sparse=read_sparse, q_lin=q_lin, k_lin=k_lin,
                            weights=weights, weight_tokens=weight_tokens)  # fmt: skip
    # The memory, differentiable: the state holds every token that left the window, less the cache.
    n_rep = hq // k.shape[1]
    left = max(t_len - window, 0)
    no_state = LinearState(kv=q.new_zeros(0), k_sum=q.new_zeros(0))  # replaced below, from the cache gathered here
    mem = _memory(k, v, k_lin, n_real, positions, no_state, window, n_rep)
    cache = mem.sparse
    c_phi = phi_k((cache.keys if k_lin is None else cache.linear_keys).to(q.dtype)).float() * cache.valid[..., None]  # (B, Hq, L, F)
    kv, k_sum = -c_phi.transpose(-1, -2) @ cache.values, -c_phi.sum(-2)  # (B, Hq, F, Dv), (B, Hq, F)
    if left:
        k_phi = phi_k(repeat_kv((k if k_lin is None else k_lin)[:, :, :left], n_rep).to(q.dtype)).float()  # (B, Hq, left, F)
        kv, k_sum = kv + k_phi.transpose(-1, -2) @ repeat_kv(v[:, :, :left], n_rep).float(), k_sum + k_phi.sum(-2)
    return out, replace(mem, linear=LinearState(kv=kv, k_sum=k_sum))


def lola_given_caches(q: Tensor, k: Tensor, v: Tensor, caches: Tensor, *, phi_q: FeatureFn, phi_k: FeatureFn, window: int,
                      window_factor: Tensor, chunk: int, scale: float, read_state: bool = True, read_sparse: bool = True,
                      q_lin: Tensor | None = None, k_lin: Tensor | None = None, weights: Tensor, weight_tokens: int = 0) -> Tensor:
    """LoLA's output from an empty memory (no padding, ``window`` a multiple of ``chunk``) given the
    cache each chunk's queries read, ``caches`` (B, Hq, chunks, lambda) long positions (-1 empty;
    each chunk's a set, in any order): every chunk at once, differentiable in q, k, v and the feature
    maps (the choice itself has no gradient, as in the chunk loop).

    What a query reads linearly is every token older than its window that is not in its chunk's
    cache, so LoLA's read is the hybrid's (the window exactly, everything older linearly) with each
    cache entry older than the window moved from the linear term to the exact one:

        num_i = f (sum_window + sum_G_i) e^(s_ij - m_i) v_j + w_i (L_i - sum_G_i phi(q_i).phi(k_j) v_j)

    (den_i likewise with 1 for v_j), L_i the linear read of every token older than the window, m_i
    the max over the window and G_i, w_i the linear weight (times min(1, N / n_i) with
    ``weight_tokens`` N, n_i the tokens read linearly). Float32; returns (B, Hq, T, Dv) in q's
    dtype. Memory O(T (window + chunk + lambda)) per head, plus one F x Dv state per chunk."""
    batch, hq, t_len, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    n_rep, c, eta = hq // hkv, chunk, window
    n_chunks, lam = caches.shape[2], caches.shape[3]
    if eta % c or n_chunks != -(-t_len // c):
        raise ValueError(f"needs window ({eta}) a multiple of chunk ({c}) and one cache per chunk ({-(-t_len // c)}), got {n_chunks}")
    tp = n_chunks * c
    pad = tp - t_len

    def chunks(x: Tensor) -> Tensor:  # (B, H, T, X) -> (B, H, chunks, C, X) float32, zero past T
        return F.pad(x.float(), (0, 0, 0, pad)).view(x.shape[0], x.shape[1], n_chunks, c, x.shape[-1])

    def band(x: Tensor) -> Tensor:  # (B, H, T, X) -> (B, H, chunks, eta + C, X): positions p0 - eta .. p0 + C - 1
        xp = F.pad(x.float(), (0, 0, eta, pad))
        return xp.unfold(2, eta + c, c).transpose(-1, -2)

    dev = q.device
    kr, vr = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, Hq, T, D / Dv)
    qc = chunks(q)  # (B, Hq, n, C, D)
    pos = torch.arange(tp, device=dev).view(n_chunks, c)  # (n, C) each query's position
    first = pos - eta + 1  # (n, C) the oldest position of each query's window
    band_pos = pos[:, :1] - eta + torch.arange(eta + c, device=dev)  # (n, eta + C)
    w_ok = (band_pos[:, None, :] >= first[..., None]) & (band_pos[:, None, :] <= pos[..., None]) & (band_pos[:, None, :] >= 0)
    s_w = (qc @ band(kr).transpose(-1, -2)) * scale  # (B, Hq, n, C, eta + C)
    s_w = s_w.masked_fill(~w_ok, -torch.inf)

    valid = caches >= 0  # (B, Hq, n, L)
    idx = caches.clamp(min=0).view(batch, hq, n_chunks * lam)

    def gather(x: Tensor) -> Tensor:  # (B, Hq, T, X) -> (B, Hq, n, L, X): the cache entries, zero where empty
        got = x.float().gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1])).view(batch, hq, n_chunks, lam, x.shape[-1])
        return got * valid[..., None]

    older = valid[:, :, :, None, :] & (caches[:, :, :, None, :] < first[None, None, :, :, None])  # (B, Hq, n, C, L) G_i
    kc, vc = gather(kr), gather(vr)  # (B, Hq, n, L, D / Dv)
    s_c = (qc @ kc.transpose(-1, -2)) * scale  # (B, Hq, n, C, L)
    s_c = s_c.masked_fill(~(older & read_sparse), -torch.inf)
    m = torch.maximum(s_w.amax(-1), s_c.amax(-1))  # (B, Hq, n, C) the shared max
    m = torch.where(torch.isfinite(m), m, 0)[..., None]
    f = window_factor.to(dev, torch.float32).view(1, hq, 1, 1, 1)
    p_w, p_c = f * torch.exp(s_w - m), f * torch.exp(s_c - m)
    num = p_w @ band(vr) + p_c @ vc  # (B, Hq, n, C, Dv)
    den = p_w.sum(-1) + p_c.sum(-1)  # (B, Hq, n, C)
    if read_state:
        dtype = q.dtype
        q_phi = chunks(phi_q((q if q_lin is None else q_lin).to(dtype)))  # (B, Hq, n, C, F)
        k_phi = phi_k(repeat_kv(k if k_lin is None else k_lin, n_rep).to(dtype))  # (B, Hq, T, F)
        kb, vb = chunks(k_phi), chunks(vr)  # (B, Hq, n, C, F / Dv)
        lag = eta // c  # a query's leavers are the chunk `lag` chunks back
        states = kb.transpose(-1, -2) @ vb  # (B, Hq, n, F, Dv) each chunk's sum
        before = torch.cumsum(states, dim=2) - states  # (B, Hq, n, F, Dv) the chunks before each
        z = kb.sum(-2)  # (B, Hq, n, F)
        sums = torch.cumsum(z, dim=2) - z

        def back(x: Tensor) -> Tensor:  # chunk c - lag's x for chunk c (zero before the first)
            return F.pad(x, (0,) * (2 * (x.dim() - 3)) + (lag, 0))[:, :, :n_chunks]

        k_leave, v_leave = back(kb), back(vb)  # (B, Hq, n, C, F / Dv) the tokens leaving each query's window
        gone = torch.ones(c, c, dtype=torch.bool, device=dev).tril()  # leaver s has left query i's window for s <= i
        a_l = (q_phi @ k_leave.transpose(-1, -2)) * gone  # (B, Hq, n, C, C)
        lin_num = q_phi @ back(before) + a_l @ v_leave  # (B, Hq, n, C, Dv)
        lin_den = (q_phi @ back(sums)[..., None]).squeeze(-1) + a_l.sum(-1)  # (B, Hq, n, C)
        a_c = (q_phi @ gather(k_phi).transpose(-1, -2)) * older  # (B, Hq, n, C, L) read exactly, not linearly
        lin_num = lin_num - a_c @ vc
        lin_den = lin_den - a_c.sum(-1)
        weight = on_device(weights, dev).view(1, hq, 1, 1)
        if weight_tokens:
            n_read = first.clamp(min=0)[None, None] - older.sum(-1)  # (B, Hq, n, C)
            weight = weight * length_factor(n_read, weight_tokens)
        num = num + weight[..., None] * lin_num
        den = den + weight * lin_den
    out = safe_divide(num, den).reshape(batch, hq, tp, dv)[:, :, :t_len]
    return out.to(q.dtype)


@dataclass(frozen=True)
class _ChunkContext:
    """The per-call constants of one chunk step."""

    phi_q: FeatureFn
    phi_k: FeatureFn
    factor: Tensor  # (1, Hq, 1, 1) window factor f
    scale: float
    n_rep: int
    dtype: torch.dtype  # the inputs' dtype, in which the feature maps run
    read_state: bool
    read_sparse: bool
    sinks: int  # the first ``sinks`` positions of a sequence are never evicted from the sparse cache
    linear_weight: Tensor  # (1, Hq, 1, 1) weight of the linear term in the shared denominator (1 = LoLCATs)
    weight_tokens: int  # > 0: the weight falls as weight_tokens / n for a query reading n > weight_tokens tokens linearly
    recall: str = "state"  # RECALLS: what the selection's recall error is measured against

    @classmethod
    def on(cls, device, phi_q, phi_k, window_factor: Tensor, scale: float, n_rep: int, dtype, read_state: bool, read_sparse: bool,
           sinks: int, weights: Tensor, weight_tokens: int, recall: str = "state") -> "_ChunkContext":
        """The context with the per-head window factor and linear weights (Hq,) as (1, Hq, 1, 1)
        float32 tensors on ``device``."""
        hq = window_factor.shape[0]
        factor = window_factor.to(device, torch.float32).view(1, hq, 1, 1)
        return cls(phi_q, phi_k, factor, scale, n_rep, dtype, read_state, read_sparse, sinks, on_device(weights, device).view(1, hq, 1, 1),
                   weight_tokens, recall)  # fmt: skip

    def phi(self, fn: FeatureFn, x: Tensor) -> Tensor:
        """Feature map in the model's dtype (float32 state keys round-trip exactly), result float32."""
        return fn(x.to(self.dtype)).float()


def state_tokens(st: LolaState) -> Tensor:
    """(B, Hq) tokens written into each head's linear state: the real tokens seen (the window's
    newest position + 1) less those still held in the window and the sparse cache."""
    seen = st.window.positions[:, -1] + 1  # (B,) -1 + 1 = 0 for an empty window
    return seen[:, None] - st.window.valid.sum(1)[:, None] - st.sparse.valid.sum(-1)


def length_factor(tokens: Tensor, weight_tokens: int) -> Tensor:
    """min(1, weight_tokens / tokens), 1 where the state is empty, float32."""
    return (weight_tokens / tokens.float().clamp_min(1)).clamp(max=1.0)


def _lola_chunk(
    st: LolaState, q: Tensor, k: Tensor, v: Tensor, cvalid: Tensor, cpos: Tensor, ctx: _ChunkContext,
    lin: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, LolaState]:
    """One chunk: select the sparse cache, attend (true window per query), then write and slide.

    Kept as one function on purpose: the three steps share a dozen per-chunk tensors (candidates,
    their features, the kept / written masks, the base state), and read top to bottom as the three
    steps of the module docstring.

    q (B, Hq, C, D), k (B, Hkv, C, D), v (B, Hkv, C, Dv) float32, zero at padding; cvalid (B, C)
    with the real tokens first; cpos (B, C) their positions (-1 for padding). ``lin``: the feature
    maps' inputs (q_lin (B, Hq, C, D), k_lin (B, Hkv, C, D), zero at padding), or None: q and k.
    """
    win, cache, linear = st.window, st.sparse, st.linear
    batch, hq, c, d = q.shape
    eta, lam = win.valid.shape[1], cache.valid.shape[2]
    held = state_tokens(st) if ctx.weight_tokens else None  # (B, Hq) tokens in the state before the chunk
    n = cvalid.sum(1)  # (B,) real tokens in the chunk
    slot = torch.arange(eta, device=q.device)  # (eta,)
    # The window is right-aligned, so appending n tokens pushes out exactly slots [0, n) (n <= C <= eta).
    leaving = win.valid & (slot < n[:, None])  # (B, eta)

    # 1. Select. Candidates in position order: G (all older than the window; invalid slots last)
    # then the window's first C slots, oldest first. Only tokens from before the chunk take part.
    cand_k = torch.cat([cache.keys, repeat_kv(win.keys[:, :, :c], ctx.n_rep)], dim=2)  # (B, Hq, L+C, D)
    cand_v = torch.cat([cache.values, repeat_kv(win.values[:, :, :c], ctx.n_rep)], dim=2)  # (B, Hq, L+C, Dv)
    cand_valid = torch.cat([cache.valid, leaving[:, None, :c].expand(batch, hq, c)], dim=2)  # (B, Hq, L+C)
    cand_pos = torch.cat([cache.positions, win.positions[:, None, :c].expand(batch, hq, c)], dim=2)  # (B, Hq, L+C)
    if lin is not None:  # the feature map's own keys: SRE and the write into the state use them
        cand_lk = torch.cat([cache.linear_keys, repeat_kv(win.linear_keys[:, :, :c], ctx.n_rep)], dim=2)  # (B, Hq, L+C, D)
    else:
        cand_lk = cand_k
    cand_phi = ctx.phi(ctx.phi_k, cand_lk)  # (B, Hq, L+C, F)
    err = self_recall_error(cand_phi, cand_v, linear)  # (B, Hq, L+C)
    if ctx.recall == "memory":  # or recalled by an older candidate, whichever recalls it better
        err = torch.minimum(err, older_recall_error(cand_lk, cand_v, cand_pos, cand_valid, ctx.scale))
    err = err.masked_fill(cand_pos < ctx.sinks, torch.inf).masked_fill(~cand_valid, -torch.inf)  # sinks stay
    top = torch.sort(err, dim=-1, descending=True, stable=True).indices[..., :lam]  # (B, Hq, L)
    kept = torch.zeros_like(cand_valid).scatter(-1, top, True) & cand_valid  # (B, Hq, L+C)
    written = cand_valid & ~kept  # (B, Hq, L+C) R: into the state after the chunk
    written_phi = cand_phi * written.unsqueeze(-1)  # (B, Hq, L+C, F)
    order = torch.sort(torch.where(kept, cand_pos, torch.iinfo(torch.long).max), dim=-1, stable=True).indices
    sel = order[..., :lam]  # (B, Hq, L) kept candidates by position, invalid slots last
    g_valid = kept.gather(-1, sel)  # (B, Hq, L)

    def keep(x: Tensor) -> Tensor:  # (B, Hq, L+C, X) -> (B, Hq, L, X): the kept candidates, zero in empty slots
        return x.gather(2, sel.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])) * g_valid.unsqueeze(-1)

    cache = SparseCacheState(
        keys=keep(cand_k),  # (B, Hq, L, D)
        values=keep(cand_v),  # (B, Hq, L, Dv)
        valid=g_valid,
        positions=cand_pos.gather(-1, sel).masked_fill(~g_valid, -1),  # (B, Hq, L)
        linear_keys=keep(cand_lk) if lin is not None else None,  # (B, Hq, L, D)
    )

    # 2. Attend. Query i's window W_t holds positions >= first[i]; everything older is read where
    # the selection put it: G' explicitly, R (and the state before the chunk) linearly.
    first = cpos - eta + 1  # (B, C) oldest position in each query's window
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # (C, C)
    keys = torch.cat([win.keys, k], dim=2)  # (B, Hkv, eta+C, D)
    values = torch.cat([win.values, v], dim=2)  # (B, Hkv, eta+C, Dv)
    in_window = win.valid[:, None, :] & (win.positions[:, None, :] >= first[:, :, None])  # (B, C, eta)
    local_ok = torch.cat([in_window, causal & cvalid[:, None, :]], dim=2)  # (B, C, eta+C)
    scores = q @ repeat_kv(keys, ctx.n_rep).transpose(-1, -2) * ctx.scale  # (B, Hq, C, eta+C)
    scores = scores.masked_fill(~local_ok[:, None], -torch.inf)
    g_ok = cache.valid[:, :, None, :] & (cache.positions[:, :, None, :] < first[:, None, :, None])  # (B, Hq, C, L)
    g_scores = q @ cache.keys.transpose(-1, -2) * ctx.scale  # (B, Hq, C, L)
    g_scores = g_scores.masked_fill(~(g_ok & ctx.read_sparse), -torch.inf)
    scores = torch.cat([scores, g_scores], dim=-1)  # (B, Hq, C, eta+C+L)
    m = scores.amax(-1, keepdim=True)  # (B, Hq, C, 1) shared max over the explicit entries
    m = torch.where(torch.isfinite(m), m, 0)  # rows with nothing to attend (padding)
    p = ctx.factor * torch.exp(scores - m)  # (B, Hq, C, eta+C+L)
    num = p @ torch.cat([repeat_kv(values, ctx.n_rep), cache.values], dim=2)  # (B, Hq, C, Dv)
    den = p.sum(-1)  # (B, Hq, C)
    # The state before the chunk plus the part of R that came from G (older than every window).
    base_phi, base_v = written_phi[:, :, :lam], cand_v[:, :, :lam]  # (B, Hq, L, F), (B, Hq, L, Dv)
    base = LinearState(
        kv=linear.kv + base_phi.transpose(-1, -2) @ base_v,  # (B, Hq, F, Dv)
        k_sum=linear.k_sum + base_phi.sum(-2),  # (B, Hq, F)
    )
    left_phi, left_v = cand_phi[:, :, lam:], cand_v[:, :, lam:]  # (B, Hq, C, F), (B, Hq, C, Dv) window slots [0, C)
    if ctx.read_state:
        # LoLCATs convention: the linear term is NOT rescaled by exp(-m_t); weighted by linear_weight.
        # Written window tokens that have left query i's window: on the fly.
        gone = written[:, :, None, lam:] & (cand_pos[:, :, None, lam:] < first[:, None, :, None])  # (B, Hq, C, C)
        weight = ctx.linear_weight  # (1, Hq, 1, 1)
        if ctx.weight_tokens:  # n: the tokens query i reads linearly (the base state and its on-the-fly ones)
            n_read = (held + written[:, :, :lam].sum(-1))[..., None] + gone.sum(-1)  # (B, Hq, C)
            weight = weight * length_factor(n_read, ctx.weight_tokens)[..., None]  # (B, Hq, C, 1)
        q_phi = ctx.phi(ctx.phi_q, q if lin is None else lin[0]) * weight  # (B, Hq, C, F)
        num = num + q_phi @ base.kv  # (B, Hq, C, Dv)
        den = den + (q_phi @ base.k_sum.unsqueeze(-1)).squeeze(-1)  # (B, Hq, C)
        a = (q_phi @ left_phi.transpose(-1, -2)) * gone  # (B, Hq, C, C) query i, leaving slot s
        num = num + a @ left_v  # (B, Hq, C, Dv)
        den = den + a.sum(-1)  # (B, Hq, C)
    out = torch.where(cvalid[:, None, :, None], safe_divide(num, den), 0)  # (B, Hq, C, Dv)

    # 3. Write R into the state, slide: the window becomes the last eta real tokens, contiguous in
    # [window, chunk].
    left_written = written_phi[:, :, lam:]  # (B, Hq, C, F)
    linear = LinearState(
        kv=base.kv + left_written.transpose(-1, -2) @ left_v,  # (B, Hq, F, Dv)
        k_sum=base.k_sum + left_written.sum(-2),  # (B, Hq, F)
    )
    take = n[:, None] + slot  # (B, eta)

    def slide(x: Tensor) -> Tensor:  # (B, Hkv, eta+C, X) -> (B, Hkv, eta, X)
        return x.gather(2, take[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))

    window = WindowState(
        keys=slide(keys),  # (B, Hkv, eta, D)
        values=slide(values),  # (B, Hkv, eta, Dv)
        valid=torch.cat([win.valid, cvalid], dim=1).gather(1, take),  # (B, eta)
        positions=torch.cat([win.positions, cpos], dim=1).gather(1, take),  # (B, eta)
        linear_keys=slide(torch.cat([win.linear_keys, lin[1]], dim=2)) if lin is not None else None,  # (B, Hkv, eta, D)
    )
    return out, LolaState(window=window, sparse=cache, linear=linear)


# ----------------------------------------------------------------------------- per-token decoding


@dataclass
class LolaDecodeState:
    """A ``LolaState`` in the form per-token decoding updates in place, with no sort, no
    concatenation and no copy of the memory per token: each step writes one window slot, at most one
    sparse-cache slot and one rank-1 update of the linear state, so nothing is allocated from step to
    step and no host value changes (a step can be captured once as a CUDA graph).

    - The window is a ring: ring index ``index`` (a device tensor) holds its oldest slot, the one
      the next token takes.
    - The sparse cache is unordered: a token that leaves the window takes the slot of the candidate
      it displaces; ``cache_positions`` says where each entry came from (``canonical`` sorts).
    - The linear state is kept as [S | z] (``linear``), so one matmul reads a numerator and its
      denominator together; ``held`` counts the tokens written into it (for ``weight_tokens``).
      Its rows are padded with zeros to ``fused_lola.state_width(Dv)`` floats (a multiple of
      ``fused_lola.STATE_ALIGN``), so that each starts on 16 bytes and the kernels read and write
      them in 16-byte accesses; ``sz()`` is the view without the padding.

    ``context`` holds the per-call constants (window factor, linear weights) already on the
    device. ``canonical()`` gives the equivalent ``LolaState`` (the chunked op's layout).

    Where the fused step may run (and ``keep_recalls``, with ``fused_lola.SCALAR_RECALLS`` False), the
    state also keeps each cache slot's recall [phi(k) S, phi(k) z] (``recall``, lambda (Dv + 1) floats per query head, padded to a
    multiple of 4: about the bytes of the slots' keys and values in float32). A write into [S | z]
    changes every recall by a rank-one term, so the step adds that term (kept in ``pending`` until
    the next step's errors) instead of reading the whole state for every slot. They are derived
    data: ``recall_ok`` says which rows' are current, and the torch step, which does not keep them,
    clears it. Such a state also defers its writes into [S | z]: the first ``deferred_count`` rows of
    ``deferred`` are writes not yet in ``linear`` (``linear_state()`` is the true state), which takes
    them all once ``fused_lola.DEFERRED_WRITES`` are waiting, so most steps read [S | z] once and
    write none of it; the torch step adds them first. A row whose recalls are not current has no
    deferred writes (the fused step computes its recalls from ``linear`` alone): code that changes
    the memory outside the steps folds them (``fold_deferred``) before clearing ``recall_ok``.
    With ``fused_lola.SCALAR_RECALLS`` (the default; read here) a slot's recall is kept as three scalars instead
    (v . phi S, |phi S|^2, phi z; ``recall`` (B Hq, lambda, 4)), ``pending`` also holds S v_w and the
    next leaving token's scalars, and no writes are deferred (``deferred`` None); with
    ``fused_lola.KEPT_FEATURES`` as well, ``cache_features`` keeps each slot's features (current where
    the recalls are)."""

    keys: Tensor  # (B, Hkv, eta, D) ring order
    values: Tensor  # (B, Hkv, eta, Dv)
    linear_keys: Tensor | None  # (B, Hkv, eta, D) or None
    valid: Tensor  # (B, eta)
    positions: Tensor  # (B, eta), -1 at empty slots
    index: Tensor  # () ring index of the oldest window slot
    next_position: Tensor  # (B,) the position of the next token
    cache_keys: Tensor  # (B, Hq, lambda, D), unordered
    cache_values: Tensor  # (B, Hq, lambda, Dv)
    cache_linear_keys: Tensor | None  # (B, Hq, lambda, D) or None
    cache_valid: Tensor  # (B, Hq, lambda)
    cache_positions: Tensor  # (B, Hq, lambda), -1 at empty slots
    linear: Tensor  # (B Hq, F, state_width(Dv)): [S | z | 0]
    held: Tensor  # (B, Hq) tokens written into the linear state
    context: _ChunkContext
    key_map: tuple[Tensor, Tensor] | None = None  # phi_k as Hedgehog (weight (Hq, D, f), bias (Hq, f)), for the fused step
    recall: Tensor | None = None  # (B Hq, lambda, Dv + 1 padded) the fused step's kept recalls [phi S, phi z] of the cache slots
    pending: Tensor | None = None  # (B Hq, fused_lola.pending_width(F, Dv, scalars)) the last write (phi_w, [v_w, 1], ...), not yet in ``recall``
    recall_ok: Tensor | None = None  # (B,) int32: 1 where the row's kept recalls are current
    deferred: Tensor | None = None  # (B Hq, K, F + Dv + 1) writes (phi, [v, 1]) not yet in ``linear``
    deferred_count: Tensor | None = None  # (B Hq,) int32 how many of them
    cache_features: Tensor | None = None  # (B Hq, lambda, F) with scalar recalls and fused_lola.KEPT_FEATURES: the slots' features

    @classmethod
    def from_state(cls, state: LolaState, *, phi_q: FeatureFn, phi_k: FeatureFn, window_factor: Tensor, scale: float,
                   dtype: torch.dtype, read_state: bool = True, read_sparse: bool = True, sinks: int = 0,
                   linear_weight: float | Sequence[float] | Tensor = 1.0, weight_tokens: int = 0,
                   key_map: tuple[Tensor, Tensor] | None = None, recall: str = "state", keep_recalls: bool = True) -> "LolaDecodeState":
        """The decode form of ``state`` (copies: ``state`` is left untouched) for ``lola_attention``'s
        arguments of the same names (checked once here; ``dtype``: the inputs' dtype, in which the
        feature maps run). ``key_map``: when ``phi_k`` is the Hedgehog map with this weight (Hq, D, f)
        and bias (Hq, f), the step runs as ``ops.fused_lola``'s two kernels where the fused kernels
        apply (they compute the keys' features from it; with ``recall`` "memory" the torch step runs).
        ``keep_recalls``: where the fused step may run, keep each cache slot's recall (below)."""
        hq, hkv = state.sparse.keys.shape[1], state.window.keys.shape[1]
        weights = _check_options(heads=hq, window=state.window.keys.shape[2], sparse=state.sparse.keys.shape[2], chunk=1,
                                 window_factor=window_factor, sinks=sinks, linear_weight=linear_weight, weight_tokens=weight_tokens,
                                 recall=recall)  # fmt: skip
        context = _ChunkContext.on(state.linear.kv.device, phi_q, phi_k, window_factor, scale, hq // hkv, dtype, read_state, read_sparse,
                                   sinks, weights, weight_tokens, recall)  # fmt: skip
        win, cache = state.window.clone(), state.sparse.clone()
        # Keys and values come from the model's projections, so they are kept in its dtype where it
        # is narrower than float32 (exactly: the float32 copies hold those numbers), halving what a
        # step reads; every computation on them stays in float32.
        store = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32

        def kept(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(store)

        b, lam, dv = state.sparse.keys.shape[0], state.sparse.keys.shape[2], state.sparse.values.shape[-1]
        linear = state.linear.kv
        keep = (keep_recalls and _fused_step_fits(lam, key_map, recall, dtype, linear) and fused_decode.triton_available()
                and fused_decode.kernels_run_on(linear))  # where the fused step may run  # fmt: skip
        recalls = {}
        if keep and fused_lola.SCALAR_RECALLS:  # the first fused step computes them (recall_ok 0)
            recalls = dict(recall=linear.new_zeros(b * hq, lam, fused_lola.SCALAR_RECALL_WIDTH),
                           pending=linear.new_zeros(b * hq, fused_lola.pending_width(linear.shape[2], dv, True)),
                           recall_ok=torch.zeros(b, dtype=torch.int32, device=linear.device))  # fmt: skip
            if fused_lola.KEPT_FEATURES:  # in the map's dtype (bfloat16 or float32: the fused step's)
                recalls["cache_features"] = torch.zeros(b * hq, lam, linear.shape[2], dtype=dtype, device=linear.device)
        elif keep:  # the first fused step computes them (recall_ok 0)
            width = linear.shape[2] + dv + 1
            recalls = dict(recall=linear.new_zeros(b * hq, lam, fused_lola.recall_width(dv)), pending=linear.new_zeros(b * hq, width),
                           recall_ok=torch.zeros(b, dtype=torch.int32, device=linear.device),
                           deferred=linear.new_zeros(b * hq, fused_lola.DEFERRED_WRITES, width),
                           deferred_count=torch.zeros(b * hq, dtype=torch.int32, device=linear.device))  # fmt: skip
        return cls(
            keys=kept(win.keys), values=kept(win.values), linear_keys=kept(win.linear_keys), valid=win.valid, positions=win.positions,
            index=torch.zeros((), dtype=torch.long, device=win.keys.device),
            next_position=win.positions[:, -1] + 1,  # the newest token sits in the last slot (-1 + 1 = 0 when empty)
            cache_keys=kept(cache.keys), cache_values=kept(cache.values), cache_linear_keys=kept(cache.linear_keys), cache_valid=cache.valid,
            cache_positions=cache.positions,
            linear=_padded_state(state.linear, dv), held=state_tokens(state),
            context=context, key_map=None if key_map is None else _key_map(key_map, hq, state.sparse.keys.shape[-1], dtype),
            **recalls,
        )  # fmt: skip

    def canonical(self) -> LolaState:
        """The LolaState this stands for: the window oldest first, right-aligned; the sparse cache in
        position order with its empty slots last."""
        head = int(self.index)

        def ring(x: Tensor | None, dim: int) -> Tensor | None:
            if x is None:
                return None
            x = x.roll(-head, dims=dim)
            return x.float() if x.is_floating_point() else x  # keys and values as LolaState keeps them

        order = torch.sort(torch.where(self.cache_valid, self.cache_positions, torch.iinfo(torch.long).max), dim=-1, stable=True).indices

        def sort(x: Tensor | None) -> Tensor | None:  # (B, Hq, L, X) in position order
            return None if x is None else x.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])).float()

        dv = self.values.shape[-1]
        linear = self.linear_state()[..., : dv + 1].view(*self.cache_valid.shape[:2], -1, dv + 1)  # (B, Hq, F, Dv + 1)
        return LolaState(
            window=WindowState(keys=ring(self.keys, 2), values=ring(self.values, 2), valid=ring(self.valid, 1),
                               positions=ring(self.positions, 1), linear_keys=ring(self.linear_keys, 2)),
            sparse=SparseCacheState(keys=sort(self.cache_keys), values=sort(self.cache_values), valid=self.cache_valid.gather(-1, order),
                                    positions=self.cache_positions.gather(-1, order), linear_keys=sort(self.cache_linear_keys)),
            linear=LinearState(kv=linear[..., :dv].contiguous(), k_sum=linear[..., dv].contiguous()),
        )  # fmt: skip

    def _deferred_sum(self) -> Tensor:
        """The deferred writes summed: (B Hq, F, Dv + 1), sum over the first ``deferred_count`` of
        phi [v, 1]^T."""
        f = self.linear.shape[1]
        use = torch.arange(self.deferred.shape[1], device=self.linear.device) < self.deferred_count[:, None]  # (B Hq, K)
        ring = self.deferred * use[..., None]
        return ring[..., :f].transpose(1, 2) @ ring[..., f:]

    def sz(self) -> Tensor:
        """``linear`` without its padding: [S | z] (B Hq, F, Dv + 1), a view."""
        return self.linear[..., : self.values.shape[-1] + 1]

    def linear_state(self) -> Tensor:
        """[S | z | 0] (B Hq, F, state_width(Dv)) with every write in it: ``linear`` plus the deferred
        writes."""
        if self.deferred is None:
            return self.linear
        out = self.linear.clone()
        out[..., : self.values.shape[-1] + 1] += self._deferred_sum()
        return out

    def fold_deferred(self) -> None:
        """Add the deferred writes to ``linear`` in place (none left deferred)."""
        if self.deferred is not None:
            self.sz().add_(self._deferred_sum())
            self.deferred_count.zero_()


def _padded_state(linear: LinearState, dv: int) -> Tensor:
    """[S | z] of ``linear`` as the decode state keeps it: (B Hq, F, state_width(Dv)) float32, the
    padding's columns zero."""
    b, hq, f, _ = linear.kv.shape
    out = linear.kv.new_zeros(b * hq, f, fused_lola.state_width(dv))
    out[..., :dv] = linear.kv.flatten(0, 1)
    out[..., dv] = linear.k_sum.flatten(0, 1)
    return out


def _fused_step_fits(sparse: int, key_map, recall: str, dtype: torch.dtype, linear: Tensor) -> bool:
    """Whether ``fused_lola.lola_step`` can decode such a memory (where the fused kernels are
    enabled): a sparse cache, the Hedgehog key map, the self-recall rule, a dtype it supports and
    [S | z] in float32."""
    return bool(sparse) and key_map is not None and recall == "state" and fused_lola.supports(dtype) and linear.dtype == torch.float32


def _key_map(key_map: tuple[Tensor, Tensor], hq: int, d: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The Hedgehog key map's (weight, bias) as (Hq, D, f) and (Hq, f) in ``dtype``, contiguous."""
    weight, bias = key_map
    if weight.dim() != 3 or weight.shape[:2] != (hq, d) or bias.numel() != hq * weight.shape[-1]:
        raise ValueError(f"key_map must be a Hedgehog weight ({hq}, {d}, f) and bias ({hq}, f), got {tuple(weight.shape)} and {tuple(bias.shape)}")
    return weight.detach().to(dtype).contiguous(), bias.detach().reshape(hq, -1).to(dtype).contiguous()


def _recall_error(phi: Tensor, v: Tensor, linear: Tensor) -> Tensor:
    """``self_recall_error`` against a state kept as [S | z] (..., F, Dv + 1): phi (..., N, F), v
    (..., N, Dv) -> (..., N)."""
    r = phi @ linear  # (..., N, Dv + 1): [phi S, phi z]
    return _recall_distance(r[..., :-1], r[..., -1], v)


def lola_decode_step(ds: LolaDecodeState, q: Tensor, k: Tensor, v: Tensor, q_lin: Tensor | None = None,
                     k_lin: Tensor | None = None) -> Tensor:
    """One new real token per row (q (B, Hq, 1, D), k/v (B, Hkv, 1, D|Dv), no padding): the output
    (B, Hq, 1, Dv) in q's dtype; ``ds`` updated in place. The same numbers as ``lola_attention`` on
    that token (its one-token chunk; tested against it), computed as the per-token rule reads:

    1. the window's oldest token leaves it; with the sparse cache's lambda entries it makes lambda + 1
       candidates, scored by self-recall error against the state before this token. Exactly one
       is not kept: the lowest error (sinks +inf, empty slots -inf), ties to the newest position
       (the chunked op's stable sort), so the leaving token loses every tie. It is written into
       [S | z]; if it was a cache entry, the leaving token takes its slot.
    2. the new token takes the leaving token's window slot.
    3. the query reads the window and the cache exactly and the state linearly, one denominator."""
    ctx = ds.context
    separate = ds.linear_keys is not None
    if (k_lin is not None) != separate:
        raise ValueError("the decode state " + ("keeps" if k_lin is None else "does not keep") + " separate feature-map keys: "
                         "give q_lin/k_lin exactly when it does")  # fmt: skip
    b, hq, _, d = q.shape
    eta, lam, dv = ds.keys.shape[2], ds.cache_keys.shape[2], ds.values.shape[-1]
    n_rep = ctx.n_rep
    i = ds.index.view(1)

    if _fused_step_fits(lam, ds.key_map, ctx.recall, ctx.dtype, ds.linear) and fused_decode.enabled(ds.linear):
        return _step_fused(ds, q, k, v, q_lin, k_lin)
    if ds.recall_ok is not None:  # this step changes the memory without the kept recalls
        ds.recall_ok.zero_()
    ds.fold_deferred()

    # 1. Select: the leaving token against the cache entries.
    leave = {"keys": repeat_kv(ds.keys.index_select(2, i), n_rep), "values": repeat_kv(ds.values.index_select(2, i), n_rep)}  # (B, Hq, 1, X)
    if separate:
        leave["linear_keys"] = repeat_kv(ds.linear_keys.index_select(2, i), n_rep)
    leave_valid = ds.valid.index_select(1, i).expand(b, hq)  # (B, Hq)
    leave_pos = ds.positions.index_select(1, i).expand(b, hq)  # (B, Hq)
    pending = _select(ds, leave, leave_valid, leave_pos)

    # 2. The new token takes the leaving token's window slot.
    _write_window(ds, k, v, k_lin)

    # 3. Read: the window and the cache exactly (factor f, one max), the state linearly.
    qf = q.float()
    s_win = (qf.reshape(b, -1, n_rep, d) @ ds.keys.float().transpose(-1, -2)).view(b, hq, 1, eta) * ctx.scale  # (B, Hq, 1, eta)
    s_win = s_win.masked_fill(~ds.valid[:, None, None, :], -torch.inf)
    s_cache = (qf @ ds.cache_keys.float().transpose(-1, -2)) * ctx.scale  # (B, Hq, 1, L)
    s_cache = s_cache.masked_fill(~(ds.cache_valid[:, :, None, :] & ctx.read_sparse), -torch.inf)
    m = torch.maximum(s_win.amax(-1, keepdim=True), s_cache.amax(-1, keepdim=True)) if lam else s_win.amax(-1, keepdim=True)
    p_win = ctx.factor * torch.exp(s_win - m)  # (B, Hq, 1, eta): the new token is in the window, so m is finite
    p_cache = ctx.factor * torch.exp(s_cache - m)  # (B, Hq, 1, L)
    num = (p_win.view(b, -1, n_rep, eta) @ ds.values.float()).view(b, hq, 1, dv) + p_cache @ ds.cache_values.float()  # (B, Hq, 1, Dv)
    den = p_win.sum(-1) + p_cache.sum(-1)  # (B, Hq, 1)
    r = _update_and_read(ds, q, q_lin, *pending)
    if r is not None:  # LoLCATs convention: the linear term is not rescaled by exp(-m)
        num = num + r[..., :dv]
        den = den + r[..., dv]
    return safe_divide(num, den).to(q.dtype)


def _write_window(ds: LolaDecodeState, k: Tensor, v: Tensor, k_lin: Tensor | None) -> None:
    """Step 2: the new token takes the leaving token's window slot."""
    i = ds.index.view(1)
    eta = ds.keys.shape[2]
    ds.keys.index_copy_(2, i, k.to(ds.keys.dtype))
    ds.values.index_copy_(2, i, v.to(ds.values.dtype))
    if ds.linear_keys is not None:
        ds.linear_keys.index_copy_(2, i, k_lin.to(ds.linear_keys.dtype))
    ds.valid.copy_(ds.valid | (torch.arange(eta, device=i.device) == i))
    ds.positions.index_copy_(1, i, ds.next_position[:, None])
    ds.next_position.add_(1)
    ds.index.add_(1).remainder_(eta)


def _step_fused(ds: LolaDecodeState, q: Tensor, k: Tensor, v: Tensor, q_lin: Tensor | None, k_lin: Tensor | None) -> Tensor:
    """The whole step through ``fused_lola.lola_step`` (two kernels: the selection, the state's
    update and read, the cache slot taken and the exact read), after the window takes the new token
    in torch (the leaving token copied before)."""
    ctx = ds.context
    b, hq, _, _ = q.shape
    dv = ds.values.shape[-1]
    i = ds.index.view(1)
    leaving = [ds.keys.index_select(2, i)[:, :, 0], None if ds.linear_keys is None else ds.linear_keys.index_select(2, i)[:, :, 0],
               ds.values.index_select(2, i)[:, :, 0], ds.valid.index_select(1, i)[:, 0], ds.positions.index_select(1, i)[:, 0]]  # fmt: skip
    _write_window(ds, k, v, k_lin)
    if ctx.read_state:
        qphi = (ctx.phi(ctx.phi_q, (q if q_lin is None else q_lin).float()) * ctx.linear_weight).reshape(b * hq, -1)  # (B Hq, F)
    else:
        qphi = ds.linear.new_zeros(b * hq, ds.linear.shape[1])
    weight, bias = ds.key_map
    out = fused_lola.lola_step(
        ds.linear, ds.held, qphi, q[:, :, 0], ds.cache_keys, ds.cache_linear_keys, ds.cache_values, ds.cache_valid, ds.cache_positions,
        *leaving, ds.keys, ds.values, ds.valid, ds.linear_keys, ds.index, weight, bias, ctx.factor.view(hq), ctx.sinks, ctx.scale, ctx.weight_tokens,
        ctx.read_state, ctx.read_sparse, ds.recall, ds.pending, ds.recall_ok, ds.deferred, ds.deferred_count, ds.cache_features,
    )  # fmt: skip
    return out.view(b, hq, 1, dv)


def _take_slot(ds: LolaDecodeState, leave: dict[str, Tensor], take: Tensor, leave_pos: Tensor, j: Tensor, slot_valid: Tensor) -> None:
    """Cache slot ``j`` (B, Hq, 1) <- the leaving token where ``take`` (B, Hq)."""
    cache = {"keys": ds.cache_keys, "values": ds.cache_values}
    if ds.cache_linear_keys is not None:
        cache["linear_keys"] = ds.cache_linear_keys
    for name, buf in cache.items():
        at = j[..., None].expand(-1, -1, 1, buf.shape[-1])
        buf.scatter_(2, at, torch.where(take[..., None, None], leave[name], buf.gather(2, at)))
    ds.cache_positions.scatter_(2, j, torch.where(take, leave_pos, ds.cache_positions.gather(2, j)[..., 0])[..., None])
    ds.cache_valid.scatter_(2, j, (slot_valid | take)[..., None])


def _select(ds: LolaDecodeState, leave: dict[str, Tensor], leave_valid: Tensor, leave_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Step 1 in torch: the choice, the cache slot taken and ``held``; returns the token not kept
    as its features (B, Hq, 1, F) and [v, 1] (B, Hq, 1, Dv + 1), zero where none is written, for
    ``_update_and_read``."""
    ctx = ds.context
    separate = ds.linear_keys is not None
    b, hq = leave_valid.shape
    dv = ds.values.shape[-1]
    lam = ds.cache_keys.shape[2]
    state = ds.sz().view(b, hq, -1, dv + 1)
    phi_leave = ctx.phi(ctx.phi_k, leave["linear_keys" if separate else "keys"])  # (B, Hq, 1, F)
    err_leave = _recall_error(phi_leave, leave["values"], state)[..., 0]  # (B, Hq)
    if lam:
        phi_cache = ctx.phi(ctx.phi_k, ds.cache_linear_keys if separate else ds.cache_keys)  # (B, Hq, L, F)
        err = _recall_error(phi_cache, ds.cache_values, state)  # (B, Hq, L)
        if ctx.recall == "memory":  # the cache entries and the leaving token (the newest) as one candidate set
            name = "linear_keys" if separate else "keys"
            older = older_recall_error(torch.cat([ds.cache_linear_keys if separate else ds.cache_keys, leave[name].to(ds.cache_keys.dtype)], 2),
                                       torch.cat([ds.cache_values, leave["values"].to(ds.cache_values.dtype)], 2),
                                       torch.cat([ds.cache_positions, leave_pos[..., None]], 2),
                                       torch.cat([ds.cache_valid, leave_valid[..., None]], 2), ctx.scale)  # (B, Hq, L + 1)
            err, err_leave = torch.minimum(err, older[..., :lam]), torch.minimum(err_leave, older[..., lam])
        err = err.masked_fill(ds.cache_positions < ctx.sinks, torch.inf).masked_fill(~ds.cache_valid, -torch.inf)
        err_leave = err_leave.masked_fill(leave_pos < ctx.sinks, torch.inf)
        least = err.amin(-1)  # (B, Hq)
        j = torch.where(err == least[..., None], ds.cache_positions, -2).argmax(-1, keepdim=True)  # (B, Hq, 1) the newest of the least
        drop_leaving = err_leave <= least  # (B, Hq): the leaving token is newer than every cache entry
        take = leave_valid & ~drop_leaving  # (B, Hq): the leaving token takes slot j
        slot_valid = ds.cache_valid.gather(2, j)[..., 0]  # (B, Hq)
        phi_slot = phi_cache.gather(2, j[..., None].expand(-1, -1, 1, phi_cache.shape[-1]))  # (B, Hq, 1, F)
        v_slot = ds.cache_values.gather(2, j[..., None].expand(-1, -1, 1, dv))  # (B, Hq, 1, Dv)
        out_phi = torch.where(drop_leaving[..., None, None], phi_leave, phi_slot)  # (B, Hq, 1, F)
        out_v = torch.where(drop_leaving[..., None, None], leave["values"], v_slot)  # (B, Hq, 1, Dv)
        written = leave_valid & torch.where(drop_leaving, True, slot_valid)  # (B, Hq)
        _take_slot(ds, leave, take, leave_pos, j, slot_valid)
    else:  # lambda 0: the leaving token is written whatever its error
        out_phi, out_v, written = phi_leave, leave["values"], leave_valid
    ds.held.add_(written)
    out_v = out_v.float()
    row = torch.cat([out_v, torch.ones_like(out_v[..., :1])], dim=-1) * written[..., None, None]  # (B, Hq, 1, Dv + 1)
    return out_phi, row


def _update_and_read(ds: LolaDecodeState, q: Tensor, q_lin: Tensor | None, out_phi: Tensor, row: Tensor) -> Tensor | None:
    """The token not kept, ``out_phi`` (B, Hq, 1, F) and ``row`` [v, 1] (B, Hq, 1, Dv + 1) (zero
    where none is written), joins [S | z] for good; returns phi(q) [S | z] after it (B, Hq, 1, Dv + 1)
    with the linear weight where the state is read, else None. On CUDA one pass over the state
    (the hybrid's state kernel, one slot per query head)."""
    ctx = ds.context
    b, hq, _, f = out_phi.shape
    dv = row.shape[-1] - 1
    fused = ctx.read_state and fused_decode.enabled(ds.linear) and ds.linear.dtype == torch.float32
    width = ds.linear.shape[-1]
    if width > dv + 1:  # the padding's columns, written zero
        row = torch.nn.functional.pad(row, (0, width - dv - 1))
    if not fused:
        ds.linear.baddbmm_(out_phi.reshape(b * hq, 1, f).transpose(1, 2), row.view(b * hq, 1, width))
    if not ctx.read_state:
        return None
    weight = ctx.linear_weight  # (1, Hq, 1, 1)
    if ctx.weight_tokens:
        weight = weight * length_factor(ds.held, ctx.weight_tokens)[..., None, None]
    q_phi = ctx.phi(ctx.phi_q, q.float() if q_lin is None else q_lin.float()) * weight  # (B, Hq, 1, F)
    if fused:  # [S | z] += phi_w [v_w, 1]^T, then phi(q) [S | z]
        return fused_decode.hybrid_linear_step(ds.linear, out_phi.reshape(b * hq, 1, f), row.view(b * hq, 1, width),
                                               q_phi.reshape(b * hq, f), None, 0)[:, : dv + 1].reshape(b, hq, 1, dv + 1)  # fmt: skip
    return q_phi @ ds.sz().view(b, hq, -1, dv + 1)


def lola_state_empty(batch, hq, hkv, window, sparse, d, dv, feats, device, linear_keys: bool = False) -> LolaState:
    """The memory before any token: an empty window and sparse cache, zero linear sums (float32)."""
    return LolaState(
        window=WindowState.empty(batch, hkv, window, d, dv, device=device, linear_keys=linear_keys),
        sparse=SparseCacheState.empty(batch, hq, sparse, d, dv, device=device, linear_keys=linear_keys),
        linear=LinearState.zeros(batch, hq, feats, dv, device=device),
    )


def _check_args(q: Tensor, k: Tensor, v: Tensor, *, window: int, sparse: int, chunk: int, window_factor: Tensor,
                q_lin: Tensor | None = None, k_lin: Tensor | None = None, sinks: int = 0,
                linear_weight=1.0, weight_tokens: int = 0, recall: str = "state") -> Tensor:
    """ValueError naming a bad argument; the linear weights per query head (Hq,), checked."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be (B, H, T, D), got shape {tuple(x.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (B, Hkv, T)")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on B, T and D")
    if (q_lin is None) != (k_lin is None):
        raise ValueError("q_lin and k_lin go together: give both (the feature maps' inputs) or neither")
    if q_lin is not None and (q_lin.shape != q.shape or k_lin.shape != k.shape):
        raise ValueError(f"q_lin/k_lin have shapes {tuple(q_lin.shape)}/{tuple(k_lin.shape)}; expected those of "
                         f"q/k {tuple(q.shape)}/{tuple(k.shape)}")
    return _check_options(heads=q.shape[1], window=window, sparse=sparse, chunk=chunk, window_factor=window_factor, sinks=sinks,
                          linear_weight=linear_weight, weight_tokens=weight_tokens, recall=recall)  # fmt: skip


def _check_options(*, heads: int, window: int, sparse: int, chunk: int, window_factor: Tensor, sinks: int, linear_weight,
                   weight_tokens: int, recall: str = "state") -> Tensor:
    """ValueError naming a bad option (the calls' and the decode state's); the linear weights per
    query head (Hq,), checked."""
    if recall not in RECALLS:
        raise ValueError(f"recall must be one of {RECALLS}, got {recall!r}")
    if isinstance(weight_tokens, bool) or not isinstance(weight_tokens, int) or weight_tokens < 0:
        raise ValueError(f"weight_tokens must be an integer >= 0 (0: off), got {weight_tokens!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not 0 <= sinks <= sparse:
        raise ValueError(f"sinks must lie in [0, sparse={sparse}] (they occupy sparse-cache slots), got {sinks}")
    if sparse < 0:
        raise ValueError(f"sparse must be >= 0, got {sparse}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if window_factor.shape != (heads,):
        raise ValueError(f"window_factor must have shape ({heads},), got {tuple(window_factor.shape)}")
    return head_weights(linear_weight, heads)


def _check_state(st: LolaState, batch, hq, hkv, window, sparse, d, dv, separate: bool) -> None:
    for name, x in (("window", st.window.linear_keys), ("sparse cache", st.sparse.linear_keys)):
        if (x is not None) != separate:
            raise ValueError(f"the state's {name} " + ("keeps" if x is not None else "does not keep")
                             + " separate feature-map keys but this call " + ("gives" if separate else "does not give")
                             + " q_lin/k_lin: a sequence cannot switch between them")
    feats = st.linear.k_sum.shape[-1]
    expected = {
        "window.keys": (st.window.keys, (batch, hkv, window, d)),
        "window.values": (st.window.values, (batch, hkv, window, dv)),
        "sparse.keys": (st.sparse.keys, (batch, hq, sparse, d)),
        "sparse.values": (st.sparse.values, (batch, hq, sparse, dv)),
        "linear.kv": (st.linear.kv, (batch, hq, feats, dv)),
        "linear.k_sum": (st.linear.k_sum, (batch, hq, feats)),
    }
    if separate:
        expected["window.linear_keys"] = (st.window.linear_keys, (batch, hkv, window, d))
        expected["sparse.linear_keys"] = (st.sparse.linear_keys, (batch, hq, sparse, d))
    for name, (x, want) in expected.items():
        if tuple(x.shape) != want:
            raise ValueError(f"state.{name} has shape {tuple(x.shape)}, expected {want} for this call")
