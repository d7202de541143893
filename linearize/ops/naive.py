"""The specification of every attention kind: plain loops over rows and positions.

Each ``*_reference`` here is what the fast path of its kind is checked against (outputs, final
states and gradients; tests/ops). They are written to be read top to bottom, not to be fast, and
they share NO code with the fast paths: this module imports only torch, the state containers (to
return states in the same types), the ``FeatureFn`` type and the empty-normaliser threshold
``EMPTY_DENOMINATOR`` (a definition, not code). A bug in a fast path's helper (masking, mixing,
GQA repetition, chunking, division) therefore shows up as a disagreement instead of passing
silently on both sides. The feature maps ``phi_q`` / ``phi_k`` are passed in and tested on their
own (``hedgehog_reference``).

Conventions shared by every reference:

- Layout: q (B, Hq, T, D), k/v (B, Hkv, T, D|Dv); query head h reads KV head h // (Hq / Hkv).
- Arithmetic in float32, or float64 for float64 inputs (LoLA's: float32 always); outputs come
  back in the inputs' dtype.
- ``valid`` (B, T) bool marks real tokens (None: all real). Padding takes no position, no window
  slot and no state; outputs at padded queries are zero. Each row is compacted to its real tokens
  first, so "position p" below always counts real tokens.
- A normaliser at or below ``EMPTY_DENOMINATOR`` reads as "nothing to attend to": the output is 0.

The fast paths re-export their reference (``linearize.ops.hybrid.hybrid_attention_reference`` is
this module's), so either import works.
"""

from __future__ import annotations

import torch
from torch import Tensor

from linearize.ops.common import EMPTY_DENOMINATOR, FeatureFn
from linearize.ops.states import DslaState, HybridState, LinearState, LolaState, SparseCacheState, WindowState

__all__ = [
    "softmax_attention_reference",
    "sinks_attention_reference",
    "linear_attention_reference",
    "hybrid_attention_reference",
    "lola_attention_reference",
    "gla_reference",
    "dsla_attention_reference",
]

_MIXES = ("joint", "gate")  # the hybrid's choices, restated here so that nothing is imported
_BRANCHES = ("both", "window", "linear")


# ---------------------------------------------------------------- small local helpers


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32, float64 for float64."""
    return torch.promote_types(x.dtype, torch.float32)


def _kv_head_of(hq: int, hkv: int, device) -> Tensor:
    """(Hq,) long: the KV head each query head reads (GQA, HF order)."""
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return torch.arange(hq, device=device) // (hq // hkv)


def _valid_or_all(valid: Tensor | None, batch: int, t_len: int, device) -> Tensor:
    if valid is None:
        return torch.ones(batch, t_len, dtype=torch.bool, device=device)
    if tuple(valid.shape) != (batch, t_len):
        raise ValueError(f"valid mask has shape {tuple(valid.shape)}, expected {(batch, t_len)}")
    return valid.to(device=device, dtype=torch.bool)


def _real_tokens(valid_row: Tensor) -> Tensor:
    """(N,) long: the sequence indices of a row's real tokens, in order."""
    return valid_row.nonzero().flatten()


def _divide_or_zero(num: Tensor, den: Tensor) -> Tensor:
    """num (..., Dv) / den (...), 0 where den <= EMPTY_DENOMINATOR (finite gradients there too)."""
    empty = den <= EMPTY_DENOMINATOR  # (...)
    safe_den = torch.where(empty, torch.ones_like(den), den)
    return torch.where(empty[..., None], torch.zeros_like(num), num / safe_den[..., None])


def _scatter_rows(rows: list[Tensor], index: Tensor, t_len: int, heads: int, dv: int, like: Tensor) -> Tensor:
    """The outputs rows[p] (H, Dv) of a row's real tokens, at sequence indices ``index`` (N,)
    -> (H, T, Dv) with zeros at padding (and for a row without real tokens)."""
    out = torch.zeros(heads, t_len, dv, dtype=like.dtype, device=like.device)  # (H, T, Dv)
    return out.index_copy(1, index, torch.stack(rows, dim=1)) if rows else out


# ---------------------------------------------------------------- softmax and sinks-only softmax


def softmax_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, valid: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """Causal softmax attention, query by query: o_t = sum_{j<=t} softmax_j(scale q_t.k_j) v_j.

    q (B, Hq, T, D), k/v (B, Hkv, T, D|Dv) -> (B, Hq, T, Dv) in v's dtype, zeros at padded queries.
    """
    return _softmax_over_first(q, k, v, valid=valid, scale=scale, n_first=None)


def sinks_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, n_sinks: int = 8, valid: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """Softmax over the first ``n_sinks`` real tokens only (causal: position p sees sinks j <= p)."""
    if n_sinks < 1:
        raise ValueError(f"n_sinks must be >= 1, got {n_sinks}")
    return _softmax_over_first(q, k, v, valid=valid, scale=scale, n_first=n_sinks)


def _softmax_over_first(q, k, v, *, valid, scale, n_first: int | None) -> Tensor:
    """Query at real position p attends to real positions 0 .. p (at most the first ``n_first``)."""
    batch, hq, t_len, d = q.shape
    kv_head = _kv_head_of(hq, k.shape[1], q.device)
    valid = _valid_or_all(valid, batch, t_len, q.device)
    dt = _compute_dtype(v)
    scale = d**-0.5 if scale is None else scale
    out = []
    for b in range(batch):
        idx = _real_tokens(valid[b])  # (N,)
        qb = q[b][:, idx].to(dt)  # (Hq, N, D)
        kb = k[b][kv_head][:, idx].to(dt)  # (Hq, N, D)
        vb = v[b][kv_head][:, idx].to(dt)  # (Hq, N, Dv)
        rows = []
        for p in range(idx.numel()):
            last = p + 1 if n_first is None else min(p + 1, n_first)  # keys 0 .. last-1
            scores = (qb[:, p, None, :] * kb[:, :last]).sum(-1) * scale  # (Hq, last)
            weights = torch.softmax(scores, dim=-1)  # (Hq, last)
            rows.append((weights[..., None] * vb[:, :last]).sum(1))  # (Hq, Dv)
        out.append(_scatter_rows(rows, idx, t_len, hq, vb.shape[-1], vb))  # (Hq, T, Dv)
    return torch.stack(out).to(v.dtype)  # (B, Hq, T, Dv)


# ---------------------------------------------------------------- normalised linear attention


def linear_attention_reference(
    q_phi: Tensor, k_phi: Tensor, v: Tensor, state: LinearState | None = None
) -> tuple[Tensor, LinearState]:
    """Token-by-token normalised causal linear attention on featurised inputs.

        S_t = S_0 + sum_{i<=t} phi(k_i) v_i^T,  z_t = z_0 + sum_{i<=t} phi(k_i),
        o_t = phi(q_t)^T S_t / phi(q_t)^T z_t  (0 where the denominator is empty)

    q_phi/k_phi (B, H, T, F), v (B, H, T, Dv), state (S (B, H, F, Dv), z (B, H, F)) or None (zeros).
    Returns (out (B, H, T, Dv) in v's dtype, final state in float32 / float64).
    """
    dt = _compute_dtype(v)
    b, h, t_len, f = q_phi.shape
    dv = v.shape[-1]
    if state is None:
        s = torch.zeros(b, h, f, dv, dtype=dt, device=v.device)  # (B, H, F, Dv)
        z = torch.zeros(b, h, f, dtype=dt, device=v.device)  # (B, H, F)
    else:
        s, z = state.kv.to(dt), state.k_sum.to(dt)
    outs = []
    for t in range(t_len):
        qt, kt, vt = q_phi[:, :, t].to(dt), k_phi[:, :, t].to(dt), v[:, :, t].to(dt)  # (B, H, F|Dv)
        s = s + kt[..., :, None] * vt[..., None, :]  # (B, H, F, Dv)
        z = z + kt  # (B, H, F)
        num = (qt[..., :, None] * s).sum(-2)  # (B, H, Dv)
        den = (qt * z).sum(-1)  # (B, H)
        outs.append(_divide_or_zero(num, den))
    out = torch.stack(outs, dim=2) if outs else torch.zeros(b, h, 0, dv, dtype=dt, device=v.device)
    return out.to(v.dtype), LinearState(kv=s, k_sum=z)


# ---------------------------------------------------------------- in-head hybrid (LoLCATs / HedgeCATs)


def _right_aligned(x: Tensor, kept: Tensor, slots: int) -> Tensor:
    """Tokens ``kept`` (n,) of x (H, T, X), oldest first, in the last n of ``slots`` -> (H, slots, X)."""
    return torch.cat([x.new_zeros(x.shape[0], slots - kept.numel(), x.shape[2]), x[:, kept]], dim=1)


def _check_hybrid(q, k, window, mix, branches, window_factor, gate, q_lin, k_lin) -> None:
    if mix not in _MIXES:
        raise ValueError(f"unknown mix {mix!r}; valid: {_MIXES}")
    if branches not in _BRANCHES:
        raise ValueError(f"unknown branches {branches!r}; valid: {_BRANCHES}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    hq = q.shape[1]
    for name, x in (("window_factor", window_factor), ("gate", gate)):
        if x is not None and tuple(x.shape) != (hq,):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({hq},) (one value per query head)")
    _check_linear_inputs(q, k, q_lin, k_lin)


def _check_linear_inputs(q: Tensor, k: Tensor, q_lin: Tensor | None, k_lin: Tensor | None) -> None:
    if (q_lin is None) != (k_lin is None):
        raise ValueError("q_lin and k_lin go together: give both (the feature maps' inputs) or neither")
    if q_lin is not None and (q_lin.shape != q.shape or k_lin.shape != k.shape):
        raise ValueError(f"q_lin/k_lin have shapes {tuple(q_lin.shape)}/{tuple(k_lin.shape)}; expected those of "
                         f"q/k {tuple(q.shape)}/{tuple(k.shape)}")


def hybrid_attention_reference(
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
) -> tuple[Tensor, HybridState]:
    """Sliding-window softmax + linear attention, one query at a time (methods.md section 1).

    For the query at real position p: W = positions p - window + 1 .. p (the true sliding window),
    "older" = positions before W; the linear branch covers "older", or every position up to p with
    ``overlap`` or branches="linear". With s_j = scale q.k_j, m = max_{j in W} s_j, e_j = e^{s_j - m}
    and a_j = phi_q(q_p).phi_k(k_j):

        joint:  (f sum_W e_j v_j + sum_LA a_j v_j) / (f sum_W e_j + sum_LA a_j)
                (the linear term is NOT rescaled by e^{-m}: the published LoLCATs convention)
        gate:   g (sum_W e_j v_j / sum_W e_j) + (1 - g) (sum_LA a_j v_j / sum_LA a_j)
        branches "window": the window softmax alone; "linear": the linear branch alone.

    f = window_factor (default 1), g = gate (default 0.5), per query head. The feature maps see
    ``q_lin`` / ``k_lin`` when given (e.g. q, k before RoPE), q / k otherwise (keys after GQA
    repetition). Returns (out (B, Hq, T, Dv) in v's dtype, the HybridState after the sequence:
    window = the last ``window`` real tokens right-aligned, linear = phi(k) v^T and phi(k) summed
    over the real tokens before them).
    """
    _check_hybrid(q, k, window, mix, branches, window_factor, gate, q_lin, k_lin)
    batch, hq, t_len, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    kv_head = _kv_head_of(hq, hkv, q.device)  # (Hq,)
    valid = _valid_or_all(valid, batch, t_len, q.device)
    dt = _compute_dtype(v)
    scale = d**-0.5 if scale is None else scale
    f = torch.ones(hq, dtype=dt, device=q.device) if window_factor is None else window_factor.to(dt)  # (Hq,)
    g = torch.full((hq,), 0.5, dtype=dt, device=q.device) if gate is None else gate.to(dt)  # (Hq,)
    linear_covers_window = overlap or branches == "linear"

    # Feature maps once over the whole sequence (padding featurised too, then never read).
    q_phi = phi_q(q if q_lin is None else q_lin).to(dt)  # (B, Hq, T, F)
    k_phi = phi_k((k if k_lin is None else k_lin)[:, kv_head]).to(dt)  # (B, Hq, T, F)

    outs, states = [], []
    for b in range(batch):
        idx = _real_tokens(valid[b])  # (N,) the row's real tokens
        n_real = idx.numel()
        qb = q[b][:, idx].to(dt)  # (Hq, N, D)
        kb = k[b][kv_head][:, idx].to(dt)  # (Hq, N, D)
        vb = v[b][kv_head][:, idx].to(dt)  # (Hq, N, Dv)
        qpb, kpb = q_phi[b][:, idx], k_phi[b][:, idx]  # (Hq, N, F)
        rows = []
        for p in range(n_real):
            first = max(0, p - window + 1)  # W = positions first .. p
            la_end = p + 1 if linear_covers_window else first  # linear branch: positions 0 .. la_end-1

            scores = (qb[:, p, None, :] * kb[:, first : p + 1]).sum(-1) * scale  # (Hq, |W|)
            e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # (Hq, |W|)
            sw_num = (e[..., None] * vb[:, first : p + 1]).sum(1)  # (Hq, Dv)
            sw_den = e.sum(-1)  # (Hq,)

            a = (qpb[:, p, None, :] * kpb[:, :la_end]).sum(-1)  # (Hq, |LA|)
            la_num = (a[..., None] * vb[:, :la_end]).sum(1)  # (Hq, Dv)
            la_den = a.sum(-1)  # (Hq,)

            if branches == "window":
                o = _divide_or_zero(sw_num, sw_den)
            elif branches == "linear":
                o = _divide_or_zero(la_num, la_den)
            elif mix == "joint":
                o = _divide_or_zero(f[:, None] * sw_num + la_num, f * sw_den + la_den)
            else:  # gate
                o = g[:, None] * _divide_or_zero(sw_num, sw_den) + (1 - g[:, None]) * _divide_or_zero(la_num, la_den)
            rows.append(o)  # (Hq, Dv)
        outs.append(_scatter_rows(rows, idx, t_len, hq, dv, vb))  # (Hq, T, Dv)

        # Final state of this row.
        n_kept = min(window, n_real)
        n_older = n_real - n_kept
        kv = (kpb[:, :n_older, :, None] * vb[:, :n_older, None, :]).sum(1)  # (Hq, F, Dv)
        k_sum = kpb[:, :n_older].sum(1)  # (Hq, F)
        kept = idx[n_older:]  # (n_kept,) sequence indices of the window tokens, oldest first
        states.append(dict(
            kv=kv, k_sum=k_sum,
            keys=_right_aligned(k[b].to(dt), kept, window),  # (Hkv, window, D)
            values=_right_aligned(v[b].to(dt), kept, window),  # (Hkv, window, Dv)
            linear_keys=_right_aligned(k_lin[b].to(dt), kept, window) if k_lin is not None else None,
            valid=torch.arange(window, device=q.device) >= window - n_kept,
            positions=torch.cat([torch.full((window - n_kept,), -1, device=q.device),
                                 torch.arange(n_older, n_real, device=q.device)]).long(),
        ))

    def stacked(name: str) -> Tensor | None:
        return None if states[0][name] is None else torch.stack([s[name] for s in states])

    state = HybridState(
        window=WindowState(keys=stacked("keys"), values=stacked("values"), valid=stacked("valid"),
                           positions=stacked("positions"), linear_keys=stacked("linear_keys")),
        linear=LinearState(kv=stacked("kv"), k_sum=stacked("k_sum")),  # (B, Hq, F, Dv), (B, Hq, F)
    )
    return torch.stack(outs).to(v.dtype), state  # (B, Hq, T, Dv)


# ---------------------------------------------------------------- LoLA (sliding window + sparse cache + state)


def lola_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    phi_q: FeatureFn,
    phi_k: FeatureFn,
    window: int,
    sparse: int,
    window_factor: Tensor,
    chunk: int = 1,
    valid: Tensor | None = None,
    scale: float | None = None,
    read_state: bool = True,
    read_sparse: bool = True,
    q_lin: Tensor | None = None,
    k_lin: Tensor | None = None,
    sinks: int = 0,
    linear_weight=1.0,
    weight_tokens: int = 0,
    recall: str = "state",
) -> tuple[Tensor, LolaState]:
    """The specification of LoLA: a plain loop over rows, query heads, chunks and queries, in float32.

    q (B, Hq, T, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv) -> output (B, Hq, T, Dv) and the final state,
    from an empty state. Chunks of ``chunk`` real tokens (capped at ``window``), as ``lola_attention``
    cuts them in one call. Memories are lists of sequence indices; positions in the state count real
    tokens. The self-recall error is written out here. ``q_lin`` / ``k_lin``: what the feature maps
    see instead of q / k (see ``linearize.ops.lola``'s module docstring for the rule). ``sinks``: the
    first ``sinks`` real tokens never leave the sparse cache; ``linear_weight``: the weight of the
    linear term (state and on-the-fly reads) in the numerator and the denominator, one number or one
    per query head; ``weight_tokens`` N > 0: a query that reads n > N tokens linearly (the state's
    and those read on the fly) has that weight multiplied by N / n. ``recall`` "memory": a candidate's
    error is the smaller of its self-recall error and the error of a softmax read, its feature-map key
    as the query (times ``scale``), over the candidates at earlier positions (+inf where there is none).
    """
    if window < 1 or sparse < 0 or chunk < 1:
        raise ValueError(f"need window >= 1, sparse >= 0, chunk >= 1; got window={window}, sparse={sparse}, chunk={chunk}")
    if not 0 <= sinks <= sparse:
        raise ValueError(f"sinks must lie in [0, sparse={sparse}] (they occupy sparse-cache slots), got {sinks}")
    weights = [float(w) for w in torch.as_tensor(linear_weight, dtype=torch.float32).reshape(-1).tolist()]  # one per query head
    weights = weights * q.shape[1] if len(weights) == 1 else weights
    if len(weights) != q.shape[1] or not all(0 <= w < float("inf") for w in weights):  # NaN fails 0 <= w
        raise ValueError(f"linear_weight must be one number or {q.shape[1]} (one per query head), each finite and >= 0; "
                         f"got {linear_weight!r}")
    if tuple(window_factor.shape) != (q.shape[1],):
        raise ValueError(f"window_factor must have shape ({q.shape[1]},), got {tuple(window_factor.shape)}")
    if isinstance(weight_tokens, bool) or not isinstance(weight_tokens, int) or weight_tokens < 0:
        raise ValueError(f"weight_tokens must be an integer >= 0 (0: off), got {weight_tokens!r}")
    if recall not in ("state", "memory"):
        raise ValueError(f"recall must be one of ('state', 'memory'), got {recall!r}")
    _check_linear_inputs(q, k, q_lin, k_lin)
    batch, hq, t_len, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    kv_head = _kv_head_of(hq, hkv, q.device).tolist()
    chunk = min(chunk, window)
    scale = d**-0.5 if scale is None else scale
    valid = _valid_or_all(valid, batch, t_len, q.device)
    dtype = q.dtype
    separate = k_lin is not None
    q, k, v = q.float(), k.float(), v.float()
    q_feat = q_lin.float() if separate else q  # (B, Hq, T, D) what phi_q sees
    k_feat = k_lin.float() if separate else k  # (B, Hkv, T, D) what phi_k sees
    f = window_factor.to(q.device, torch.float32)  # (Hq,)
    q_phi = phi_q(q_feat).float()  # (B, Hq, T, F)
    k_phi = phi_k(k_feat[:, kv_head]).float()  # (B, Hq, T, F)
    feats = k_phi.shape[-1]

    out = torch.zeros(batch, hq, t_len, dv, device=q.device)  # (B, Hq, T, Dv)
    final = LolaState(
        window=WindowState.empty(batch, hkv, window, d, dv, device=q.device, linear_keys=separate),
        sparse=SparseCacheState.empty(batch, hq, sparse, d, dv, device=q.device, linear_keys=separate),
        linear=LinearState.zeros(batch, hq, feats, dv, device=q.device),
    )
    for b in range(batch):
        real = valid[b].nonzero().flatten().tolist()  # sequence index of each real token
        position = {t: i for i, t in enumerate(real)}
        for h in range(hq):
            g = kv_head[h]
            win: list[int] = []  # sequence indices, oldest first
            cache: list[int] = []  # sequence indices, ascending (all older than the window)
            kv = torch.zeros(feats, dv, device=q.device)  # (F, Dv) H
            k_sum = torch.zeros(feats, device=q.device)  # (F,) s
            folded = 0  # tokens written into (H, s)
            for c0 in range(0, len(real), chunk):
                tokens = real[c0 : c0 + chunk]

                # 1. Select among G and the window tokens leaving during this chunk, against (H, s).
                leaving = win[: max(0, len(win) + len(tokens) - window)]
                cands = cache + leaving  # position ascending
                errs = []
                for j in cands:
                    phi_j = k_phi[b, h, j]  # (F,) phi of the feature map's key: how the STATE recalls j
                    den = phi_j @ k_sum
                    readout = phi_j @ kv / den if den > EMPTY_DENOMINATOR else torch.zeros(dv, device=q.device)
                    err = torch.linalg.vector_norm(readout - v[b, g, j]).item()
                    older = [i for i in cands if i < j]  # sequence order is position order
                    if recall == "memory" and older:  # or recalled by the older candidates, if better
                        s = torch.stack([k_feat[b, g, j] @ k_feat[b, g, i] * scale for i in older])  # (N,)
                        w = torch.softmax(s, dim=0)
                        recalled = sum(w[n] * v[b, g, i] for n, i in enumerate(older))  # (Dv,)
                        err = min(err, torch.linalg.vector_norm(recalled - v[b, g, j]).item())
                    errs.append(err)
                errs = [float("inf") if position[j] < sinks else e for j, e in zip(cands, errs)]  # sinks stay
                ranked = sorted(range(len(cands)), key=lambda i: (-errs[i], i))  # ties: earlier first
                new_cache = sorted(cands[i] for i in ranked[:sparse])
                written = [cands[i] for i in ranked[sparse:]]

                # 2. Attend: the true window W_t exactly; older tokens where the selection put them.
                seen = win + tokens
                for i, t in enumerate(tokens):
                    w_t = seen[: len(win) + i + 1][-window:]
                    explicit = w_t + ([j for j in new_cache if j not in w_t] if read_sparse else [])
                    scores = torch.stack([q[b, h, t] @ k[b, g, j] * scale for j in explicit])  # (N,)
                    p = f[h] * torch.exp(scores - scores.max())  # (N,)
                    num = sum(p[n] * v[b, g, j] for n, j in enumerate(explicit))  # (Dv,)
                    den = p.sum()
                    if read_state:
                        # LoLCATs convention: the linear term is NOT rescaled by exp(-m_t); it is
                        # weighted by linear_weight (1 = LoLCATs).
                        lin_num = q_phi[b, h, t] @ kv  # (Dv,)
                        lin_den = q_phi[b, h, t] @ k_sum
                        n_read = folded  # tokens this query reads linearly
                        for j in written:
                            if j not in w_t:  # left the window, not yet in the state: on the fly
                                a = q_phi[b, h, t] @ k_phi[b, h, j]
                                lin_num, lin_den = lin_num + a * v[b, g, j], lin_den + a
                                n_read += 1
                        weight = weights[h]
                        if weight_tokens and n_read > weight_tokens:
                            weight = weight * weight_tokens / n_read
                        num, den = num + weight * lin_num, den + weight * lin_den
                    out[b, h, t] = num / den

                # 3. Fold the written tokens into the state, keep G', slide the window.
                for j in written:
                    kv = kv + torch.outer(k_phi[b, h, j], v[b, g, j])
                    k_sum = k_sum + k_phi[b, h, j]
                folded += len(written)
                cache = new_cache
                win = seen[-window:]

            # The window of KV head g is the same for all its query heads: rewriting it is harmless.
            slots = slice(window - len(win), window)  # right-aligned, oldest first
            final.window.keys[b, g, slots] = k[b, g, win]
            if separate:
                final.window.linear_keys[b, g, slots] = k_feat[b, g, win]
            final.window.values[b, g, slots] = v[b, g, win]
            final.window.valid[b, slots] = True
            final.window.positions[b, slots] = torch.tensor([position[t] for t in win], dtype=torch.long)
            n_cache = len(cache)
            final.sparse.keys[b, h, :n_cache] = k[b, g, cache]
            if separate:
                final.sparse.linear_keys[b, h, :n_cache] = k_feat[b, g, cache]
            final.sparse.values[b, h, :n_cache] = v[b, g, cache]
            final.sparse.valid[b, h, :n_cache] = True
            final.sparse.positions[b, h, :n_cache] = torch.tensor([position[t] for t in cache], dtype=torch.long)
            final.linear.kv[b, h] = kv
            final.linear.k_sum[b, h] = k_sum
    return out.to(dtype), final


# ---------------------------------------------------------------- GLA and DSLA (dual-state gated linear attention)


def gla_reference(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, state: Tensor | None = None, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Single-state gated linear attention, token by token (float32, float64 for float64 inputs).

        S_t = diag(exp(log_alpha_t)) S_{t-1} + k_t v_t^T,   o_t = scale q_t^T S_t

    q/log_alpha (B, Hq, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv), state (B, Hq, Dk, Dv) or None
    (zeros). Returns o (B, Hq, T, Dv) in q's dtype and the final state (B, Hq, Dk, Dv) in the
    compute dtype.
    """
    dt = _compute_dtype(q)
    batch, hq, t_len, dk = q.shape
    kv_head = _kv_head_of(hq, k.shape[1], q.device)
    scale = dk**-0.5 if scale is None else scale
    qf, gf = q.to(dt), log_alpha.to(dt)  # (B, Hq, T, Dk)
    kf, vf = k.to(dt)[:, kv_head], v.to(dt)[:, kv_head]  # (B, Hq, T, Dk|Dv)
    s = torch.zeros(batch, hq, dk, v.shape[-1], dtype=dt, device=q.device) if state is None else state.to(dt)
    outs = []
    for t in range(t_len):
        decay = gf[:, :, t].exp()[..., None]  # (B, Hq, Dk, 1): per key dimension, over the value axis
        s = decay * s + kf[:, :, t, :, None] * vf[:, :, t, None, :]  # (B, Hq, Dk, Dv)
        outs.append(scale * (qf[:, :, t, :, None] * s).sum(-2))  # (B, Hq, Dv)
    o = torch.stack(outs, dim=2) if outs else qf.new_zeros(batch, hq, 0, v.shape[-1])
    return o.to(q.dtype), s  # (B, Hq, T, Dv), (B, Hq, Dk, Dv)


def dsla_attention_reference(
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
    normalize: bool = False,
) -> tuple[Tensor, DslaState]:
    """DSLA, row by row and real token by real token (methods.md section 3).

        S1_t = diag(alpha1_t) S1_{t-1} + k_t v_t^T,   S2_t = diag(alpha2_t) S2_{t-1} + k_t v_t^T
        o_t  = gamma (scale q_t^T S1_t) + (1 - gamma) (scale q_t^T S2_t)

    alpha_t = exp(log_alpha_t) per key dimension. Padded tokens are skipped (no write, no decay,
    output 0). ``normalize``: each state also carries z_t = diag(alpha_t) z_{t-1} + k_t as its last
    value column (states (B, Hq, Dk, Dv + 1)) and each read is divided by its own normaliser,
    (q^T S) / (q^T z) (0 where that is empty), before the gamma mix. Same arguments and results as
    ``dsla_attention``: o (B, Hq, T, Dv) in q's dtype, final states in float32 / float64.
    """
    batch, hq, t_len, dk = q.shape
    kv_head = _kv_head_of(hq, k.shape[1], q.device)
    for name, x in (("log_alpha_history", log_alpha_history), ("log_alpha_recent", log_alpha_recent)):
        if x.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected q's shape {tuple(q.shape)}")
    gamma = torch.as_tensor(gamma, device=q.device)
    if gamma.numel() not in (1, hq):
        raise ValueError(f"gamma must be a scalar or have one value per query head ({hq}), got {tuple(gamma.shape)}")
    if k.shape != (batch, k.shape[1], t_len, dk) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"inconsistent q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    valid = _valid_or_all(valid, batch, t_len, q.device)
    dt = _compute_dtype(q)  # the states' dtype
    mix_dt = torch.promote_types(dt, gamma.dtype)  # the mix's dtype
    scale = dk**-0.5 if scale is None else scale
    dv = v.shape[-1]
    width = dv + 1 if normalize else dv  # state columns
    gamma = gamma.to(mix_dt).reshape(-1, 1)  # (Hq or 1, 1)

    outs, histories, recents = [], [], []
    for b in range(batch):
        if state is None:
            s1 = torch.zeros(hq, dk, width, dtype=dt, device=q.device)  # (Hq, Dk, Dv[+1])
            s2 = torch.zeros(hq, dk, width, dtype=dt, device=q.device)
        else:
            s1, s2 = state.history[b].to(dt), state.recent[b].to(dt)
        rows = [torch.zeros(hq, dv, dtype=mix_dt, device=q.device) for _ in range(t_len)]  # padding stays 0
        for t in _real_tokens(valid[b]).tolist():
            qt = q[b, :, t].to(dt)  # (Hq, Dk)
            kt = k[b, kv_head, t].to(dt)  # (Hq, Dk)
            vt = v[b, kv_head, t].to(dt)  # (Hq, Dv)
            write = kt[:, :, None] * vt[:, None, :]  # (Hq, Dk, Dv)
            if normalize:
                write = torch.cat([write, kt[:, :, None]], dim=-1)  # (Hq, Dk, Dv + 1): z gains k_t
            s1 = log_alpha_history[b, :, t].to(dt).exp()[:, :, None] * s1 + write
            s2 = log_alpha_recent[b, :, t].to(dt).exp()[:, :, None] * s2 + write
            r1 = scale * (qt[:, :, None] * s1).sum(1)  # (Hq, Dv[+1])
            r2 = scale * (qt[:, :, None] * s2).sum(1)
            if normalize:
                r1 = _divide_or_zero(r1[:, :dv], r1[:, dv])  # (Hq, Dv)
                r2 = _divide_or_zero(r2[:, :dv], r2[:, dv])
            rows[t] = gamma * r1 + (1 - gamma) * r2  # (Hq, Dv)
        outs.append(torch.stack(rows, dim=1) if rows else torch.zeros(hq, 0, dv, dtype=mix_dt, device=q.device))
        histories.append(s1)
        recents.append(s2)
    out = torch.stack(outs).to(q.dtype)  # (B, Hq, T, Dv)
    return out, DslaState(history=torch.stack(histories), recent=torch.stack(recents))
