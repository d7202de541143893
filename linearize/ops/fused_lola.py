"""LoLA's per-token decode step as two Triton kernels (selection, state pass, cache update, read),
and its chunked prefill from an empty memory as two more (``lola_prefill``, at the end of this module).

Each token, every query head of every row scores the lambda sparse-cache entries and the token
leaving the window by self-recall error against its linear state [S | z], writes the one not kept
into [S | z], moves the leaving token into the slot it takes, and reads window, cache and state. In
torch that is the Hedgehog features of all lambda + 1 candidates written out (B x Hq x lambda x F
floats), a matmul that reads them and the state, a second pass over the state, and a dozen kernels
for the read. ``lola_step`` does it in two kernels, after the new token has taken its window slot
in torch:

1. errors, one program per (row, query head, block of candidates; one more for the leaving
   token; a row's blocks neighbours in the launch order): the candidates' features in registers from their keys (the Hedgehog map
   [softmax(x W + b), softmax(-(x W + b))], rounded to bfloat16 where the model runs in it, as the
   torch map's output is), phi [S | z] tile by tile of the state, and each candidate's error
   || phi S / (phi z) - v || (the readout 0 where phi z is empty; sinks +inf, empty slots -inf);
2. commit, one program per (row, query head):
   - the least error, ties to the newest position and then the lowest slot, against the leaving
     token's (which loses every tie): the choice of ``ops.lola.lola_decode_step``;
   - one pass over [S | z]: the token not kept is written (S += phi [v, 1]^T) and the query's
     phi(q) [S | z] read from the updated tiles;
   - the leaving token into the chosen slot where it is kept, and ``held``;
   - the exact read of the window and the cache (one running max, the window factor) plus the
     linear term (with the length factor of ``weight_tokens``), one denominator.

Where the decode state keeps each cache slot's recall [phi S, phi z] (LoLA's ``keep_recalls`` with
``SCALAR_RECALLS`` False; the first step, or the first after a torch step, computes them as above and stores them), the errors kernel
scores the cache without the state: the commit leaves its write (phi_w, [v_w, 1]) pending, and the
next errors kernel adds it to every slot's recall as (phi . phi_w) [v_w, 1], O(f + Dv) per slot
instead of the O(f Dv) product, then takes the error from the recall; the slot the leaving token
takes gets the leaving token's recall, which its own program computed from the state. Such a state
also defers its writes into [S | z] (``DEFERRED_WRITES`` at most): the leaving token's program reads
the state once for the token's recall and for the query's read (``qphi``, into the read buffer),
each plus the deferred writes' terms; the commit adds its write to them and the query's read, and
writes [S | z] only when they are full, all at once.

By default the recalls are kept as three scalars per slot instead (``SCALAR_RECALLS``): a = v . phi S,
b = |phi S|^2 and d = phi z, from which the error is sqrt(|v|^2 - 2 a / d + b / d^2). A write
phi_w [v_w, 1]^T changes them by c = phi . phi_w times (v . v_w), 2 (phi . S v_w) + c |v_w|^2 and 1,
so the commit's pass over [S | z] also leaves u = S v_w (before the write) pending, and the next
errors kernel updates each slot from its features, its value and these: O(f + Dv) per slot, 4 floats
of memory instead of Dv + 1. The leaving token's scalars come from the commit before it, which reads
the next leaving token (the window ring's oldest) against the state after its write, in a second pass
over the updated tiles; so the errors kernel never reads [S | z] (but for rows whose scalars are not
current: a second launch computes them from the state), and the writes are not deferred. With
``KEPT_FEATURES`` the slots' features are kept as well and the errors kernel makes none. The error is then the
difference of terms of about |v|^2, so where a slot's value is recalled almost exactly its error
carries float32 rounding of |v|^2 (about 1e-7 relative): near-ties between such slots may go the
other way than in the torch step.

The errors kernel reads the state from memory about once per (row, query head) (its other blocks
find it in L2), the commit kernel reads it again and writes it once; the cache's keys and values,
kept in the model's dtype, are read for the errors and again for the read. From ``ONE_KERNEL_ROWS``
rows on, the two kernels run as one (``lola_step_kernel``: one program per (row, query head), its
blocks of errors one after another, then the commit), which reads the state and the cache from
memory once, with fewer programs in flight. With a bfloat16 model, phi [S | z] runs on
tensor cores as two bfloat16 products (phi is exact in bfloat16; S is split into its bfloat16 part
and the rest): about 16 bits of S's mantissa instead of float32's 24, so a near-tie between two
candidates may go the other way than in the torch step; a float32 model runs the products in
float32. Tests: tests/ops/test_fused_lola.py (the torch step and the chunked op, token by token).

The prefill splits what is sequential from what is not. Only the choice of what the cache keeps
depends on the chunks before; once each chunk's cache and the state its queries read are known, every
chunk's output can be computed at once. So:

1. the selection, one program per (row, query head) through the chunks, as ``ops.lola.lola_attention``
   does them one after another: the candidates' errors against [S | z] (the features of every query
   and key computed before, in torch), the lambda largest kept (the lambda-th largest error's bits
   found 4 at a time; ties to the earlier candidate, the stable sort's rule), the new cache as a list
   of positions per chunk, the cache entries not kept written into [S | z] and that state saved (the
   one the chunk's queries read), then the window's leavers not kept written;
2. the read, one program per (row, query head, chunk), in parallel: each query's window and the
   cache entries older than it exactly, the saved state and the leavers that have left its window
   linearly.

Where [S | z] is small (``PREFILL_RESIDENT_FLOATS``: up to 128 x 128, SmolLM2's 128 x 64 and the
Llama-3-8B shape's at LoLCATs' 128 features), the selection holds it in
registers through the chunks (loaded once, stored after the last; each chunk's saved state still
written) instead of reading it in tiles for every block of candidates and for the update.

A long prompt runs as segments of chunks (the saved states within ``PREFILL_SAVED_BYTES``); on CUDA
each segment's read runs on a second stream beside the next one's selection, which leaves most SMs
idle. The selection is latency-bound: one program per head, a few dependent phases per chunk
(docs/results/performance/prefill.md).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from linearize.ops import fused_decode
from linearize.ops.common import EMPTY_DENOMINATOR

BLOCK_ROWS = 128
"""Candidates per program of the errors kernel (each reads the state, from cache after the first)."""
BLOCK_VALUES = 64
"""Value columns per tile of [S | z]."""
WARPS = 8
"""Warps per program of the errors kernel where the map is 128 wide or more."""
SMALL_MAP_WARPS = 4
"""Warps per program of the errors kernel where the map is narrower (SmolLM2's 64)."""
SCALAR_PASS_WARPS: int | None = None
"""Warps per program of the scalar recalls' common pass (the rows whose recalls are current: no
state read, no pipelining); None: as the pass from the state (``WARPS`` or ``SMALL_MAP_WARPS``)."""
COMMIT_WARPS = 4
"""Warps per program of the commit kernel (the choice, the state pass, the read)."""
MAX_REGISTERS: int | None = None
"""A cap on the registers per thread of the errors kernel and of the one-kernel step (Triton's
``maxnreg``; None: the compiler's choice). At 128 and 8 warps two programs fit an SM's registers
(the 8B shape's errors kernel takes 198-201 uncapped: one program per SM), at the cost of spills."""
SPLIT_STATE = True
"""A bfloat16 model's decode step: the errors' products phi [S | z] take the float32 state as its
bfloat16 part plus the rest, two products on tensor cores (about 16 bits of S's mantissa). False:
its bfloat16 part alone, one product (8 bits): about 40% fewer FLOPs in the errors kernel at the
Llama-3-8B shape, and more near-ties between candidates decided otherwise than in the torch step."""
STAGES = 3
"""Software-pipelining stages of the errors kernel and of the one-kernel step (Triton's
``num_stages``): beyond 1, each stage buffers a float32 tile of [S | z] in shared memory (the
Llama-3-8B shape's errors kernel holds 172 KiB at 3, one program per SM)."""
SELECT_BLOCK = 1024
"""Errors the commit kernel scans at a time for the least."""
ONE_KERNEL_ROWS: int | None = None
"""Rows (batch rows x query heads) from which the step runs as one kernel, one program per (row,
query head) doing its errors and then its commit (``lola_step_kernel``): the state read from memory
once instead of twice and the slots' keys and values once, against fewer programs in flight (a
row's blocks of candidates one after another). None: always two kernels."""
ONE_KERNEL_WARPS = 8
"""Warps per program of the one-kernel step."""


@functools.cache
def _kernels():
    """The decode step's Triton kernels (errors, commit, the two as one), compiled on first use
    (Triton is imported only then)."""
    from linearize.ops._lola_kernel import lola_commit_kernel, lola_errors_kernel, lola_step_kernel

    return lola_errors_kernel, lola_commit_kernel, lola_step_kernel


STALE_PROGRAMS_PER_SM = 2
"""With scalar recalls, the errors kernel's pass over the rows whose recalls are stale (computed from
the state) runs about this many programs per SM, each over a group of rows (a power of two, at most
``STALE_MAX_GROUP``): compiled for the state's products, it holds one or two programs an SM, and on
every step but the first it finds every row current, so a program per (row, block) would occupy
the SMs for thousands of programs that only read a flag."""
STALE_MAX_GROUP = 64
"""The most rows one program of the stale pass checks (and, where they are stale, scores in turn)."""


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def stale_rows_per_program(rows: int, device: torch.device) -> int:
    """Rows per program of the errors kernel's stale pass: the largest power of two at most
    rows / (``STALE_PROGRAMS_PER_SM`` x SMs), between 1 and ``STALE_MAX_GROUP``."""
    per = rows // (STALE_PROGRAMS_PER_SM * _sm_count(device))
    return min(STALE_MAX_GROUP, 1 << (per.bit_length() - 1)) if per > 1 else 1


def one_kernel(rows: int) -> bool:
    """Whether a step of ``rows`` (batch rows x query heads) runs as one kernel (``ONE_KERNEL_ROWS``)."""
    return ONE_KERNEL_ROWS is not None and rows >= ONE_KERNEL_ROWS


def _pow2(n: int) -> int:
    """The block covering ``n``: a power of two, at least 16 (a product's least side)."""
    from triton import next_power_of_2

    return max(16, next_power_of_2(n))


DEFERRED_WRITES = 8
"""Writes into [S | z] a decode state with kept recalls defers (``LolaDecodeState.deferred``): the
state is written once every this many tokens."""


SCALAR_RECALLS = True
"""How a decode state with ``keep_recalls`` keeps its cache slots' recalls: True (the default), as
scalars (v . phi S, |phi S|^2, phi z: 4 floats per slot, the writes not deferred); False, as vectors
[phi S, phi z] (Dv + 1 floats per slot, with deferred writes: measured slower and larger at both
shapes, docs/results/performance/static.md). Read where a decode state is made."""
KEPT_FEATURES = False
"""With ``SCALAR_RECALLS``, the decode state also keeps each cache slot's Hedgehog features (2f per
slot in the model's dtype, as the map rounds them): the errors kernel reads them instead of making them
from the slot's key every token (a projection and 2f exponentials per slot), for f x 2 bytes more per
slot and query head. Read where a decode state is made."""
SCALAR_RECALL_WIDTH = 4
"""Floats per kept recall in the "scalars" form: a, b, d and one of padding (16-byte rows)."""


def pending_width(features: int, dv: int, scalars: bool) -> int:
    """Floats of a decode state's pending write (``LolaDecodeState.pending``) for ``features`` = 2f:
    phi_w and [v_w, 1]; with scalar recalls also u = S v_w (features), |v_w|^2 and the next leaving
    token's three recall scalars."""
    return features + dv + 1 + (features + 4 if scalars else 0)


STATE_ALIGN = 4
"""Floats a row of the decode state's [S | z] is padded to a multiple of (``state_width``): at 4,
every row starts on 16 bytes and the kernels move the state in 16-byte accesses (rows of Dv + 1
floats, as at 1, take 4-byte ones). Read where a decode state is made."""


def state_width(dv: int) -> int:
    """Floats per row of a decode state's [S | z]: Dv + 1, padded to a multiple of ``STATE_ALIGN``."""
    return -(-(dv + 1) // STATE_ALIGN) * STATE_ALIGN


def recall_width(dv: int) -> int:
    """Floats per kept recall: [phi S, phi z] (Dv + 1) padded to a multiple of 4, so that every
    row starts 16-byte aligned and is read in vector loads."""
    return (dv + 4) // 4 * 4


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernel runs a model of this dtype (bfloat16 on tensor cores, float32 exactly)."""
    return dtype in (torch.bfloat16, torch.float32)


@torch.library.custom_op(
    "linearize::lola_step",
    mutates_args=("linear", "held", "cache_keys", "cache_map_keys", "cache_values", "cache_valid", "cache_positions", "recall", "pending",
                  "recall_ok", "deferred", "deferred_count", "cache_features"),
)
def lola_step(
    linear: Tensor, held: Tensor, qphi: Tensor, q: Tensor,
    cache_keys: Tensor, cache_map_keys: Tensor | None, cache_values: Tensor, cache_valid: Tensor, cache_positions: Tensor,
    leave_keys: Tensor, leave_map_keys: Tensor | None, leave_values: Tensor, leave_valid: Tensor, leave_positions: Tensor,
    window_keys: Tensor, window_values: Tensor, window_valid: Tensor, window_map_keys: Tensor | None, window_index: Tensor,
    weight: Tensor, bias: Tensor, factor: Tensor,
    sinks: int, scale: float, weight_tokens: int, read_state: bool, read_sparse: bool,
    recall: Tensor | None, pending: Tensor | None, recall_ok: Tensor | None, deferred: Tensor | None, deferred_count: Tensor | None,
    cache_features: Tensor | None,
) -> Tensor:  # fmt: skip
    """One LoLA decode step after the new token took its window slot, in place on the memory:
    selection, the write into ``linear`` (B Hq, 2f, W) float32 [S | z] (W >= Dv + 1 floats per row,
    the columns past Dv + 1 left as they are) and ``held`` (B, Hq),
    the leaving token into the cache slot it takes, and the read. Returns the output (B Hq, Dv) in
    ``q``'s dtype.

    - ``q`` (B, Hq, D): the query as the exact read scores it; ``qphi`` (B Hq, 2f) float32 its
      features times the linear weight (zero when the state is not read);
    - the cache: ``cache_keys`` (B, Hq, lambda, D) as the exact read scores them,
      ``cache_map_keys`` the feature map's keys where they differ (None: the same), ``cache_values``
      (B, Hq, lambda, Dv), ``cache_valid`` bool and ``cache_positions`` long (B, Hq, lambda);
    - the token leaving the window (copied before the new token took its slot): ``leave_keys``,
      ``leave_map_keys`` (B, Hkv, D), ``leave_values`` (B, Hkv, Dv), ``leave_valid`` bool and
      ``leave_positions`` long (B,);
    - the window with the new token: ``window_keys`` (B, Hkv, eta, D), ``window_values`` (B, Hkv,
      eta, Dv), ``window_valid`` (B, eta) bool, ``window_map_keys`` the feature map's keys where they
      differ (None: the same), ``window_index`` () long the ring slot of its oldest token (the next
      step's leaving token);
    - the key map's Hedgehog ``weight`` (Hq, D, f) and ``bias`` (Hq, f) in the model's dtype
      (bfloat16 or float32), ``factor`` (Hq,) float32 the window factor;
    - ``sinks``, ``scale``, ``weight_tokens``, ``read_state``, ``read_sparse`` as in ``lola_attention``;
    - the kept recalls (all five, three with ``deferred`` and ``deferred_count`` None for the scalar
      form, or five Nones; no defaults: a dispatcher that drops trailing
      arguments equal to their defaults would leave the mutated ones out, and torch 2.11's version
      bump then indexes past the end): ``recall`` (B Hq, lambda, ``recall_width(Dv)``) float32
      each cache slot's [phi S, phi z] against the state before the last write (its first Dv + 1
      columns), ``pending`` (B Hq, 2f + Dv + 1) float32 that write (phi_w, [v_w, 1]), ``recall_ok``
      (B,) int32 whether the row's recalls are current (0: the step computes them from the state; a
      step elsewhere that changes the memory sets it to 0). With them the cache entries' errors cost
      O(f + Dv) each instead of O(f Dv);
    - with the kept recalls, the writes into [S | z] deferred: ``deferred`` (B Hq, K, 2f + Dv + 1)
      float32, ``deferred_count`` (B Hq) int32 of them in use (K a power of two): the true state is
      ``linear`` plus the first ``deferred_count`` writes phi [v, 1]^T; a step adds its write there
      and [S | z] takes them all when K are waiting, so most steps read the state once and write
      none of it;
    - scalar recalls (``deferred`` None): ``recall`` (B Hq, lambda, ``SCALAR_RECALL_WIDTH``) each
      slot's (v . phi S, |phi S|^2, phi z) against the state before the last write, ``pending`` (B Hq,
      ``pending_width(2f, Dv, True)``) that write, u = S v_w, |v_w|^2 and the next leaving token's
      scalars against the state after it; ``cache_features`` (B Hq, lambda, 2f) in ``weight``'s dtype
      or None: the slots' features kept too (current where the recalls are).
    """
    b, hq, lam, d = cache_keys.shape
    dv = cache_values.shape[-1]
    hkv, eta = window_keys.shape[1], window_keys.shape[2]
    fh = weight.shape[-1]
    fused_decode._check_buffer("linear", linear)
    if linear.dim() != 3 or linear.shape[:2] != (b * hq, 2 * fh) or linear.shape[2] < dv + 1:  # float32: _check_buffer
        raise ValueError(f"linear must have shape ({b * hq}, {2 * fh}, W >= {dv + 1}), got {tuple(linear.shape)}")
    fused_decode._check("held", held, (b, hq), torch.long)
    fused_decode._check("qphi", qphi, (b * hq, 2 * fh), torch.float32)
    fused_decode._check("q", q, (b, hq, d))
    fused_decode._check("cache_values", cache_values, (b, hq, lam, dv))
    fused_decode._check("cache_valid", cache_valid, (b, hq, lam), torch.bool)
    fused_decode._check("cache_positions", cache_positions, (b, hq, lam), torch.long)
    fused_decode._check("leave_keys", leave_keys, (b, hkv, d))
    fused_decode._check("leave_values", leave_values, (b, hkv, dv))
    fused_decode._check("leave_valid", leave_valid, (b,), torch.bool)
    fused_decode._check("leave_positions", leave_positions, (b,), torch.long)
    fused_decode._check("window_keys", window_keys, (b, hkv, eta, d))
    fused_decode._check("window_values", window_values, (b, hkv, eta, dv))
    fused_decode._check("window_valid", window_valid, (b, eta), torch.bool)
    fused_decode._check("weight", weight, (hq, d, fh))
    fused_decode._check("bias", bias, (hq, fh), weight.dtype)
    fused_decode._check("factor", factor, (hq,), torch.float32)
    if (cache_map_keys is None) != (leave_map_keys is None):
        raise ValueError("give cache_map_keys and leave_map_keys together (the feature map's own keys) or neither")
    if cache_map_keys is not None:
        fused_decode._check("cache_map_keys", cache_map_keys, (b, hq, lam, d))
        fused_decode._check("leave_map_keys", leave_map_keys, (b, hkv, d))
    keep = recall is not None
    scalars = keep and deferred is None and deferred_count is None
    if any(keep != (t is not None) for t in (pending, recall_ok)) or (
        not scalars and any(keep != (t is not None) for t in (deferred, deferred_count))
    ):
        raise ValueError("give recall, pending, recall_ok, deferred and deferred_count together (the kept recalls), the first three "
                         "alone (the kept recalls as scalars) or none of them")  # fmt: skip
    fused_decode._check("window_index", window_index, (), torch.long)
    if window_map_keys is not None:
        fused_decode._check("window_map_keys", window_map_keys, (b, hkv, eta, d))
    if keep:
        fused_decode._check_buffer("recall", recall)
        fused_decode._check("recall", recall, (b * hq, lam, SCALAR_RECALL_WIDTH if scalars else recall_width(dv)), torch.float32)
        fused_decode._check_buffer("pending", pending)
        fused_decode._check("pending", pending, (b * hq, pending_width(2 * fh, dv, scalars)), torch.float32)
        fused_decode._check("recall_ok", recall_ok, (b,), torch.int32)
        if not recall_ok.is_contiguous():
            raise ValueError("recall_ok must be contiguous (the kernels update it in place)")
    if keep and not scalars:
        k_deferred = deferred.shape[1] if deferred.dim() == 3 else 0
        if k_deferred < 2 or k_deferred & (k_deferred - 1):
            raise ValueError(f"deferred must be (B Hq, K, 2f + Dv + 1) with K a power of two >= 2, got {tuple(deferred.shape)}")
        fused_decode._check_buffer("deferred", deferred)
        fused_decode._check("deferred", deferred, (b * hq, k_deferred, 2 * fh + dv + 1), torch.float32)
        fused_decode._check("deferred_count", deferred_count, (b * hq,), torch.int32)
        if not deferred_count.is_contiguous():
            raise ValueError("deferred_count must be contiguous (the kernels update it in place)")
    if cache_features is not None:
        if not scalars:
            raise ValueError("cache_features are kept only with scalar recalls (recall, pending and recall_ok, no deferred writes)")
        fused_decode._check("cache_features", cache_features, (b * hq, lam, 2 * fh), weight.dtype)
        if not cache_features.is_contiguous():
            raise ValueError("cache_features must be contiguous (the kernels update it in place)")
    if not supports(weight.dtype):
        raise ValueError(f"weight must be bfloat16 or float32, got {weight.dtype}")
    if lam < 1 or hq % hkv:
        raise ValueError(f"needs a sparse cache (got lambda={lam}) and query heads ({hq}) a multiple of KV heads ({hkv})")
    updated = (held, cache_keys, cache_map_keys, cache_values, cache_valid, cache_positions)
    if any(t is not None and not t.is_contiguous() for t in updated):
        raise ValueError("held and the cache tensors must be contiguous (the kernel updates them in place)")
    separate = cache_map_keys is not None
    q, qphi, leave_keys, leave_values, leave_valid, leave_positions, window_keys, window_values, window_valid, weight, bias = (
        t.contiguous() for t in (q, qphi, leave_keys, leave_values, leave_valid, leave_positions, window_keys, window_values,
                                 window_valid, weight, bias)
    )  # fmt: skip
    leave_map_keys = leave_map_keys.contiguous() if separate else leave_keys
    window_map_keys = window_keys if window_map_keys is None else window_map_keys.contiguous()
    rows = b * hq
    out = torch.empty(rows, dv, device=linear.device, dtype=q.dtype)
    rbuf = torch.empty(rows, dv + 1, device=linear.device, dtype=torch.float32)
    errs = torch.empty(rows, lam + 1, device=linear.device, dtype=torch.float32)
    if scalars:  # unread
        lrec = deferred = errs
        deferred_count = held
        k_deferred = 2
    elif keep:
        lrec = torch.empty(rows, recall_width(dv), device=linear.device, dtype=torch.float32)
    else:  # unread
        recall = pending = lrec = deferred = errs
        recall_ok = deferred_count = held
        k_deferred = 2
    cfeat = errs if cache_features is None else cache_features  # unread without
    errors, commit, whole = _kernels()
    map_keys = cache_map_keys if separate else cache_keys
    block = min(BLOCK_ROWS, _pow2(lam))
    blocks = -(-lam // block)
    shape = dict(H=hq, L=lam, D=d, FH=fh, DV=dv, BL=block, BD=_pow2(d), BF=_pow2(fh),
                 BV=min(BLOCK_VALUES, _pow2(dv + 1)), LOWP=0 if weight.dtype != torch.bfloat16 else 1 if SPLIT_STATE else 2,
                 EPS=EMPTY_DENOMINATOR, KEEP=2 if scalars else int(keep),
                 RW=SCALAR_RECALL_WIDTH if scalars else recall_width(dv), K=k_deferred, WS=linear.shape[2])  # fmt: skip
    commit_args = (
        linear, errs, qphi, q, out, rbuf, held,
        cache_keys, map_keys, cache_values, cache_valid, cache_positions,
        leave_keys, leave_map_keys, leave_values, leave_valid, leave_positions, window_keys, window_values, window_valid,
        window_map_keys, window_index, weight, bias, factor, recall, pending, recall_ok, lrec, deferred, deferred_count, cfeat,
        sinks, hq // hkv, scale, weight_tokens,
    )  # fmt: skip
    commit_shape = dict(KF=cache_features is not None, ETA=eta, BS=min(SELECT_BLOCK, _pow2(lam)), BW=_pow2(eta), BDV=_pow2(dv), SEPARATE=separate,
                        READ_STATE=read_state, READ_SPARSE=read_sparse, **shape)  # fmt: skip
    if one_kernel(rows):
        whole[(rows,)](*commit_args, NB=blocks, num_warps=ONE_KERNEL_WARPS, num_stages=STAGES, maxnreg=MAX_REGISTERS, **commit_shape)
        if keep:
            recall_ok.fill_(1)  # every row's recalls are current (the kernel leaves this to its caller)
        return out
    group = stale_rows_per_program(rows, linear.device)
    warps = WARPS if fh >= 128 else SMALL_MAP_WARPS
    for from_state in (True, False) if scalars else (False,):  # scalar recalls: the rows whose recalls are not current, then the others
        common = scalars and not from_state  # the scalar recalls' common pass: no state read, no pipelining
        errors[(-(-rows // group),) if from_state else (rows * (blocks + 1),)](
            linear, errs, map_keys, cache_values, cache_valid, cache_positions, leave_map_keys, leave_values, leave_positions, weight, bias,
            recall, pending, recall_ok, lrec, deferred, deferred_count, qphi, rbuf, cfeat, sinks, hq // hkv, rows, NB=blocks,
            FROM_STATE=from_state, KF=cache_features is not None, RG=group if from_state else 1,
            **shape, num_warps=SCALAR_PASS_WARPS if common and SCALAR_PASS_WARPS is not None else warps,
            num_stages=1 if common else STAGES,
            maxnreg=MAX_REGISTERS,
        )  # fmt: skip
    commit[(rows,)](*commit_args, num_warps=COMMIT_WARPS, **commit_shape)
    return out


@lola_step.register_fake
def _(linear, held, qphi, q, cache_keys, cache_map_keys, cache_values, cache_valid, cache_positions, leave_keys, leave_map_keys,
      leave_values, leave_valid, leave_positions, window_keys, window_values, window_valid, window_map_keys, window_index, weight, bias,
      factor, sinks, scale, weight_tokens, read_state, read_sparse, recall, pending, recall_ok, deferred, deferred_count,
      cache_features):  # fmt: skip
    return q.new_empty(linear.shape[0], cache_values.shape[-1])


PREFILL_BLOCK_FEATURES = 128
"""Feature rows per tile of [S | z] in the selection kernel."""
PREFILL_BLOCK_VALUES = 128
"""Value columns per tile of [S | z] in the selection kernel."""
PREFILL_BLOCK_CACHE = 128
"""Cache entries per block of candidates (errors) and of keys (the exact read)."""
PREFILL_BLOCK_RECALL = 64
"""Candidates per block of the recall "memory" pass (its rows; its columns: the cache blocks and the leavers)."""
PREFILL_WARPS = 8
"""Warps per program of the selection kernel."""
PREFILL_RESIDENT_FLOATS = 128 * 128
"""The selection kernel holds [S | z] in registers through the chunks where its padded size is at
most this many floats, instead of reading it from memory in tiles for every block of candidates and
for the update: SmolLM2's 128 features x 64 values (32 per thread at 8 warps) and 128 x 128 (64 per
thread: the Llama-3-8B shape with 128 features, where the selection at 32K takes 13.7-14.2 ms
against 16.3-16.7 in tiles on an H100, the same caches, though it spills 158 registers against 88)."""
PREFILL_READ_WARPS = 8
"""Warps per program of the read kernel."""
PREFILL_READ_BLOCK_FEATURES = 64
"""Feature rows per tile of the saved state in the read kernel (all value columns at once)."""
PREFILL_READ_QUERIES = 32
"""Queries per program of the read kernel (a chunk's queries over several programs where fewer)."""
PREFILL_SAVED_BYTES = 256 * 2**20
"""Most bytes of saved states (one [S | z] per chunk, row and query head) between the two kernels:
a longer prompt runs as segments of chunks, each selected, then read."""
PREFILL_SEGMENT_CHUNKS = 32
"""Most chunks per segment on CUDA: the selection of a segment runs beside the read of the one
before, so the last segment's read is the only one not hidden."""


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the prefill's reads run on beside its selection, one per device."""
    return torch.cuda.Stream(device)


@functools.cache
def _prefill_kernels():
    from linearize.ops._lola_kernel import lola_read_kernel, lola_select_kernel

    return lola_select_kernel, lola_read_kernel


@torch.library.custom_op("linearize::lola_prefill", mutates_args=())
def lola_prefill(
    q: Tensor, k: Tensor, v: Tensor, qphi: Tensor, kphi: Tensor, n_real: Tensor, factor: Tensor, weights: Tensor,
    window: int, sparse: int, chunk: int, sinks: int, scale: float, weight_tokens: int, read_state: bool, read_sparse: bool,
    output: bool = True, recall_keys: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """LoLA's chunked prefill from an empty memory (``ops.lola.lola_attention``'s rule, chunk by
    chunk) as two Triton kernels per segment of chunks: the selection (one program per row and
    query head, the chunks in a loop: errors, choice, the state's writes, the state each chunk's
    queries read saved), then the read (one program per row, query head and chunk, in parallel).

    - ``q`` (B, Hq, T, D), ``k`` (B, Hkv, T, D), ``v`` (B, Hkv, T, Dv): each row's real tokens
      first (``n_real`` (B,) long of them), in the model's dtype (bfloat16 or float32);
    - ``qphi`` / ``kphi`` (B, Hq, T, F): the feature maps of the queries and of the keys (repeated
      to the query heads) in the model's dtype;
    - ``factor`` and ``weights`` (Hq,) float32: the window factor and the linear weight.

    Returns the output (B, Hq, T, Dv) in ``q``'s dtype (zero past ``n_real``), the linear state
    S (B, Hq, F, Dv) and z (B, Hq, F) float32, the sparse cache as positions (B, Hq, lambda) long in
    position order (-1 in empty slots, last), and the cache after each chunk's choice (B, Hq, chunks,
    lambda) int32 the same way (what the chunk's queries read).

    ``output`` False: the selection alone (the read kernel does not run and the output is empty,
    (B, Hq, 0, Dv)), in one launch over every chunk: for callers that read the chunks themselves
    from the caches returned (LoLA's training path).

    ``recall_keys`` (B, Hkv, T, D) in ``q``'s dtype, the keys the feature maps read (``k`` or
    ``k_lin``): the selection runs ``lola_attention``'s recall "memory" (each candidate's error the
    smaller of its self-recall error and the older candidates' recall error with these keys).
    """
    b, hq, t, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    feats = kphi.shape[-1]
    fused_decode._check("k", k, (b, hkv, t, d))
    fused_decode._check("v", v, (b, hkv, t, dv))
    fused_decode._check("kphi", kphi, (b, hq, t, feats), q.dtype)
    fused_decode._check("qphi", qphi, (b, hq, t, feats), q.dtype)
    fused_decode._check("n_real", n_real, (b,), torch.long)
    fused_decode._check("factor", factor, (hq,), torch.float32)
    fused_decode._check("weights", weights, (hq,), torch.float32)
    if recall_keys is not None:
        fused_decode._check("recall_keys", recall_keys, (b, hkv, t, d), q.dtype)
    if not supports(q.dtype) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, bfloat16 or float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if sparse < 1 or hq % hkv or not 1 <= chunk <= window:
        raise ValueError(f"needs a sparse cache (got sparse={sparse}), query heads ({hq}) a multiple of KV heads ({hkv}) "
                         f"and 1 <= chunk ({chunk}) <= window ({window})")  # fmt: skip
    q, k, v, qphi, kphi = (x.contiguous() for x in (q, k, v, qphi, kphi))
    memory = recall_keys is not None
    kx = recall_keys.contiguous() if memory else k  # read only with the memory rule
    rows, bc, n_chunks = b * hq, _pow2(chunk), -(-t // chunk)
    dev = q.device
    out = torch.zeros(b, hq, t if output else 0, dv, device=dev, dtype=q.dtype)
    kv = torch.zeros(b, hq, feats, dv, device=dev, dtype=torch.float32)
    k_sum = torch.zeros(b, hq, feats, device=dev, dtype=torch.float32)
    held = torch.zeros(rows, device=dev, dtype=torch.int32)
    hist = torch.full((rows, n_chunks + 1, sparse), -1, device=dev, dtype=torch.int32)  # the cache before and after each chunk
    lkept = torch.zeros(rows, n_chunks, bc, device=dev, dtype=torch.int8)
    nread = torch.empty(rows, n_chunks, device=dev, dtype=torch.int32)
    errs = torch.empty(rows, sparse + bc, device=dev, dtype=torch.float32)
    wlist = torch.empty(rows, bc, device=dev, dtype=torch.int32)
    # Segments of chunks: the saved states of one segment (two on CUDA, where the read of a segment
    # runs on a second stream beside the selection of the next: the selection's programs leave most
    # SMs idle) within PREFILL_SAVED_BYTES.
    interp = fused_decode.interpreting()
    overlap = output and q.is_cuda and not interp
    saved = read_state and output  # the state each chunk's queries read, kept for the read kernel
    per_chunk = rows * (feats * dv + feats) * 4
    n_seg = max(1, min(n_chunks, PREFILL_SEGMENT_CHUNKS if overlap else n_chunks, PREFILL_SAVED_BYTES // ((1 + overlap) * per_chunk)))
    n_seg = n_seg if saved else n_chunks
    n_buf = (1 + overlap) if saved else 1
    snap = torch.empty(n_buf, rows, n_seg if saved else 1, feats * dv, device=dev, dtype=torch.float32)
    snapz = torch.empty(n_buf, rows, n_seg if saved else 1, feats, device=dev, dtype=torch.float32)
    select, read = _prefill_kernels()
    resident = _pow2(feats) * _pow2(dv) <= PREFILL_RESIDENT_FLOATS  # [S | z] held in registers through the chunks
    block = min(PREFILL_BLOCK_CACHE, _pow2(sparse))
    bq = max(16, min(PREFILL_READ_QUERIES, bc))  # both powers of two
    common = dict(H=hq, F=feats, DV=dv, ETA=window, C=chunk, LAM=sparse, BC=bc, BL=block, LOWP=q.dtype == torch.bfloat16,
                  EPS=EMPTY_DENOMINATOR)  # fmt: skip
    main = torch.cuda.current_stream(dev) if overlap else None
    side = _side_stream(dev) if overlap else None
    read_done: list = [None] * n_buf  # the event after the last read of each buffer
    for i, c0 in enumerate(range(0, n_chunks, n_seg)):
        c1, buf = min(n_chunks, c0 + n_seg), i % n_buf
        if overlap and read_done[buf] is not None:
            main.wait_event(read_done[buf])  # the buffer's previous segment is read
        select[(rows,)](
            v, kphi, kx, n_real, kv, k_sum, held, hist, lkept, nread, errs, wlist, snap[buf], snapz[buf],
            t, n_chunks, c0, c1, n_seg, sinks, hq // hkv, scale, **common, BN=_pow2(sparse + bc),
            BF=_pow2(feats) if resident else min(PREFILL_BLOCK_FEATURES, _pow2(feats)),
            BV=_pow2(dv) if resident else min(PREFILL_BLOCK_VALUES, _pow2(dv)), SNAP=saved, RESIDENT=resident,
            CH0=c0 if interp else 0, CH1=c1 if interp else 0, MEMORY=memory, D=d, BD=_pow2(d), BDV=_pow2(dv),
            BM=min(PREFILL_BLOCK_RECALL, _pow2(sparse + bc)), num_warps=PREFILL_WARPS,
        )  # fmt: skip
        if not output:
            continue
        with torch.cuda.stream(side) if overlap else contextlib.nullcontext():
            if overlap:
                side.wait_stream(main)
            read[(rows * (c1 - c0) * (bc // bq),)](
                q, k, v, qphi, kphi, n_real, factor, weights, out, hist, lkept, nread, snap[buf], snapz[buf],
                t, n_chunks, c0, n_seg, c1 - c0, sinks, hq // hkv, scale, weight_tokens, **common,
                D=d, BW=_pow2(window + bq), BD=_pow2(d), BDV=_pow2(dv), BF=min(PREFILL_READ_BLOCK_FEATURES, _pow2(feats)), BQ=bq,
                READ_STATE=read_state, READ_SPARSE=read_sparse, num_warps=PREFILL_READ_WARPS,
            )  # fmt: skip
            if overlap:
                read_done[buf] = side.record_event()
    if overlap:
        main.wait_stream(side)
    positions = hist[:, n_chunks].long().view(b, hq, sparse)  # the cache after the last chunk
    return out, kv, k_sum, positions, hist[:, 1:].reshape(b, hq, n_chunks, sparse)


@lola_prefill.register_fake
def _(q, k, v, qphi, kphi, n_real, factor, weights, window, sparse, chunk, sinks, scale, weight_tokens, read_state, read_sparse,
      output=True, recall_keys=None):
    b, hq, t, _ = q.shape
    dv, feats = v.shape[-1], kphi.shape[-1]
    return (q.new_empty(b, hq, t if output else 0, dv), q.new_empty(b, hq, feats, dv, dtype=torch.float32), q.new_empty(b, hq, feats, dtype=torch.float32),
            q.new_empty(b, hq, sparse, dtype=torch.long), q.new_empty(b, hq, -(-t // chunk), sparse, dtype=torch.int32))  # fmt: skip
