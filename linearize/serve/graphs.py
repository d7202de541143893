"""The pooled runner's decode forward and prefill chunks on static buffers, captured as CUDA graphs
(the gpt-fast pattern for a continuous batch). ``StaticDecode`` below; ``StaticPrefill``: one-row
prefill chunks padded to a multiple of ``PREFILL_ALIGN`` tokens, graphs keyed by (padded length,
level, first chunk or not), each layer's memory read and written at the row's slot as described there.

An engine step that decodes runs every layer for one token per running request. Launched op by op,
that forward costs the same tens of milliseconds of host time whatever its batch (a Llama-2-7B
shape: about 40 ms against the 3 ms its weights take to read on an H200), which is what bounds the
step. Here the forward reads and writes only tensors that live between steps:

- per batch bucket (rows padded to 1, 2, 4, 8, then multiples of 8): the rows' tokens, positions,
  slots and levels, copied in before each step, and the logits the step writes;
- the runner's pools: keys and values per softmax layer, one DSLA state pool per converted layer,
  with one scratch slot past the requests' slots where padding rows write.

So every index is a device tensor and the kernels are the same at every step: softmax layers write
the new key and value at each row's slot and position and attend through ``slot_attention`` (each
row reads its own length); converted layers advance each row's DSLA states where they are in the
pool. Rows of different levels share the call: a layer every row runs converted (below the
batch's lowest level) runs its converted path alone; at a layer that only some rows run converted,
both paths run on every row (a converted row attends over 0 keys; a softmax row's state update
lands in its slot's unused state row) and each row keeps its own. Graphs are keyed by (bucket,
lowest level in the batch, highest; padding rows take the highest); the first step of a key runs
eagerly (kernels pick their configurations, caches fill), the second captures it; the graphs share one memory pool, and all of them (with their pool) are
dropped when a runner's pool is created or grows (their addresses change).

Decoding through graphs gives the same logits as the eager pooled runner (tested on the CPU, where
the static step runs eagerly, and on CUDA)."""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..cache import StateCacheLayer
from ..layers.base import project_qkv
from ..layers.dsla import DslaAttention
from ..ops.dsla import DslaDecodeState
from ..ops.softmax import slot_attention, slot_prefill_attention
from .runner import decoder_forward, on_device

PREFILL_ALIGN = 64
"""Prefill chunks run on static buffers of a multiple of this many tokens (``StaticPrefill``, a
chunk padded up to the next); the engine cuts a prompt's chunks to it, all but the last."""

logger = logging.getLogger(__name__)


def bucket_rows(rows: int) -> int:
    """The batch a decode step of ``rows`` rows runs at: 1, 2, 4, 8, then the next multiple of 8."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8


@dataclass(eq=False)
class _Entry:
    """Static buffers of one shape, with the graphs captured on them and the keys run once eagerly."""

    graphs: dict = field(default_factory=dict, kw_only=True)
    warm: set = field(default_factory=set, kw_only=True)


class _StaticSteps:
    """What static decode steps and prefill chunks share: the runner (held weakly: the runner holds
    this, so no cycle keeps its pools and graphs alive), entries of static buffers by shape, and
    running a step on an entry under a key: replayed where its graph is captured, captured on the
    key's second step, eagerly otherwise (the first step of a key lets kernels pick their
    configurations and caches fill). Every graph shares one memory pool; when the runner's pools are
    created or grow, every graph and its pool are dropped and each key warms up again."""

    what = "step"

    def __init__(self, runner, capture: bool) -> None:
        self._runner = weakref.ref(runner)
        self.capture = capture
        self._entries: dict = {}
        self._generation = -1
        self._pool = None
        self.captured = 0
        """Graphs captured so far (a key's graph is captured again after the pools change)."""

    @property
    def runner(self):
        return self._runner()

    def close(self) -> None:
        """Drop every graph, its memory pool and the static buffers."""
        self._entries.clear()
        self._pool = None

    def _layers_ready(self, converted) -> bool:
        """Every layer's memory is in place: its softmax pool, or for a layer in ``converted`` a DSLA
        layer in its hybrid mode with its state pool."""
        runner = self.runner
        for i, layer in enumerate(runner._layers):
            if i in converted:
                if i not in runner._dsla or not isinstance(layer.self_attn, DslaAttention) or layer.self_attn.mode != "hybrid":
                    return False
            elif runner._keys[i] is None:
                return False
        return True

    def _entry(self, size: int, make):
        """The entry for ``size`` (``make()`` builds it the first time), after dropping stale graphs."""
        runner = self.runner
        if runner.generation != self._generation:  # pools created or grown: the graphs' addresses are stale
            for entry in self._entries.values():  # and each key warms up again (new shapes may compile kernels)
                entry.graphs.clear()
                entry.warm.clear()
            self._pool = None  # the allocator drops a pool with its last graph: new graphs take a new one
            self._generation = runner.generation
        entry = self._entries.get(size)
        if entry is None:
            entry = self._entries[size] = make()
        return entry

    def _run(self, entry: _Entry, key) -> None:
        graph = entry.graphs.get(key)
        if graph is not None:
            graph.replay()
        elif self.capture and key in entry.warm and (graph := self._record(entry, key)) is not None:
            entry.graphs[key] = graph
            graph.replay()
        else:
            self._step(entry, key)
            entry.warm.add(key)

    def _record(self, entry: _Entry, key) -> torch.cuda.CUDAGraph | None:
        """The step's graph; None (and no more captures: the steps run eagerly) where capture fails."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # a graph freed by the collector during a capture would invalidate it
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):  # records on a side stream; nothing runs
                self._step(entry, key)
        except RuntimeError as err:
            logger.warning("capturing a %s failed (%s, key %s): %s; they run without graphs", self.what, entry, key,
                           str(err).splitlines()[0][:300])  # fmt: skip
            self.capture = False
            return None
        finally:
            if collecting:
                gc.enable()
        self.captured += 1
        logger.info("%s captured as a CUDA graph (%s, key %s)", self.what, entry, key)
        return graph

    def _step(self, entry: _Entry, key) -> None:
        raise NotImplementedError


@dataclass(eq=False, repr=False)
class _Bucket(_Entry):
    """Static inputs and outputs of decode steps at one padded batch size."""

    rows: int
    ids: Tensor  # (B, 1) tokens
    meta: Tensor  # (3, B): positions, slots, levels
    logits: Tensor  # (B, vocab) float32
    values: dict = field(default_factory=dict)  # DSLA value-row buffers by (kv heads, columns, width, normaliser)

    def __repr__(self) -> str:
        return f"batch {self.rows}"

    @property
    def positions(self) -> Tensor:
        return self.meta[0]

    @property
    def slots(self) -> Tensor:
        return self.meta[1]

    @property
    def levels(self) -> Tensor:
        return self.meta[2]


class StaticDecode(_StaticSteps):
    """Decode steps of a ``PooledRunner`` on static buffers; on CUDA (``capture``) replayed as CUDA
    graphs keyed by (padded batch size, lowest level in the batch, highest)."""

    what = "decode step"

    def __init__(self, runner, capture: bool) -> None:
        super().__init__(runner, capture)
        self.rank = {layer: r for r, layer in enumerate(runner.levels.order)}

    def supports(self, seqs, hi: int) -> bool:
        """Whether a decode step of ``seqs`` (highest level ``hi``) can run here: every row holds tokens
        and every layer's memory is in place (``_layers_ready``, converted: the first ``hi`` of the order)."""
        return not any(s.position == 0 for s in seqs) and self._layers_ready(set(self.runner.levels.order[:hi]))

    @torch.inference_mode()
    def forward(self, seqs, ids: Tensor, hi: int) -> Tensor:
        """The logits (n, vocab) float32 of one decode step for the n ``seqs`` (``ids`` (n, 1)); every
        row's position advances by 1."""
        runner = self.runner
        n, rows, device = len(seqs), bucket_rows(len(seqs)), ids.device
        vocab = runner.model.config.vocab_size
        bucket = self._entry(rows, lambda: _Bucket(rows, torch.zeros(rows, 1, dtype=torch.long, device=device),
                                                   torch.zeros(3, rows, dtype=torch.long, device=device), torch.zeros(rows, vocab, device=device)))  # fmt: skip
        pad = rows - n  # padding rows: position 0 of the scratch slot, at the highest level
        meta = [[s.position for s in seqs] + [0] * pad, [s.slot for s in seqs] + [runner.scratch_slot] * pad,
                [s.level for s in seqs] + [hi] * pad]  # fmt: skip
        bucket.meta.copy_(on_device(meta, device))
        bucket.ids[:n].copy_(ids)
        if pad:
            bucket.ids[n:].zero_()
        self._run(bucket, (min(s.level for s in seqs), hi))
        for s in seqs:
            s.position += 1
        return bucket.logits[:n].clone()

    def _step(self, bucket: _Bucket, key: tuple[int, int]) -> None:
        """One decode step on the bucket's buffers under ``key`` (the rows' lowest and highest levels):
        its logits written in place."""
        runner = self.runner
        lo, hi = key
        lengths = bucket.positions + 1  # keys each softmax row reads, its new one included

        def attention(i: int, attn, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            return attn.o_proj(self._attention(i, attn, h, (cos, sin), bucket, lengths, lo, hi))

        logits = decoder_forward(runner.model, runner._layers, [], bucket.ids, bucket.positions.view(-1, 1), attention)
        bucket.logits.copy_(logits)

    def _attention(self, i: int, attn, h: Tensor, pe, bucket: _Bucket, lengths: Tensor, lo: int, hi: int) -> Tensor:
        """Layer i's attention output before its projection, (B, 1, Hq * Dv) in h's dtype (the rows'
        levels lie in ``lo..hi``)."""
        runner = self.runner
        rank = self.rank.get(i)
        converted = rank is not None and rank < hi  # some row runs layer i converted
        softmax = runner._keys[i] is not None and not (rank is not None and rank < lo)  # some row runs it as softmax
        b = bucket.rows
        out = None
        if converted:
            conv = bucket.levels > rank  # (B,) the rows that run layer i converted
            pool, width = runner._dsla[i], runner._states[i].history.shape[-1]
            key = (attn.num_kv_heads, pool.shape[-1], width, attn.normalize)
            rows = StateCacheLayer()
            rows.decode_state = DslaDecodeState.in_pool(pool, bucket.slots, attn.num_kv_heads, width, attn.normalize,
                                                        values=bucket.values.get(key))  # fmt: skip
            bucket.values[key] = rows.decode_state.values
            out = attn.decode_step(h, pe, rows)[:, :, 0]  # (B, Hq, Dv)
        if softmax or not converted:
            q, k, v, _, _ = project_qkv(attn, h, pe)  # (B, Hq, 1, D), (B, Hkv, 1, D)
            keys, values = runner._keys[i], runner._values[i]
            keys[bucket.slots, :, bucket.positions] = k[:, :, 0].to(keys.dtype)
            values[bucket.slots, :, bucket.positions] = v[:, :, 0].to(values.dtype)
            soft = slot_attention(q[:, :, 0], keys, values, bucket.slots, lengths.masked_fill(conv, 0) if converted else lengths,
                                  attn.scaling)  # fmt: skip
            out = soft if out is None else torch.where(conv[:, None, None], out.to(soft.dtype), soft)
        return out.reshape(b, 1, -1).to(h.dtype)


@dataclass(eq=False, repr=False)
class _Chunk(_Entry):
    """Static inputs and outputs of one-row prefill chunks of one length."""

    tokens: int
    ids: Tensor  # (1, T)
    meta: Tensor  # (3,): the row's first position, its slot, and the chunk's tokens (the rest is padding)
    offsets: Tensor  # (T,) 0..T-1
    logits: Tensor  # (1, vocab) float32

    def __repr__(self) -> str:
        return f"{self.tokens} tokens"


class StaticPrefill(_StaticSteps):
    """One-row prefill chunks of a ``PooledRunner`` on static buffers of ``PREFILL_ALIGN`` multiples
    (a chunk of another length padded up to the next, at its end); on CUDA (``capture``) replayed as
    CUDA graphs keyed by (padded length, level, first chunk or not).

    Softmax layers write the chunk's keys and values at the row's slot and positions and attend
    through ``slot_prefill_attention``, which reads the slot in place, only up to the chunk's last
    position (start and slot are device values: the launch is the same whatever the row holds);
    converted layers gather the row's DSLA states from the pool (none on a first chunk), run the
    layer's padded prefill (``DslaAttention.prefill_padded``: the padding leaves the states as they
    are) and write them back. Padding tokens write keys and values past the row's last token, which
    nothing reads (a softmax query reads only the positions before it; the row's next tokens
    overwrite them), and the logits are the last real token's: the same as an unpadded chunk's."""

    what = "prefill chunk"

    def supports(self, seq, tokens: int) -> bool:
        """Whether a chunk of ``tokens`` for ``seq`` can run here: padded to a multiple of
        PREFILL_ALIGN within the pools' capacity, and every layer's memory in place (``_layers_ready``)."""
        runner = self.runner
        if seq.position + padded_length(tokens) > runner._capacity:
            return False
        return self._layers_ready(runner.levels.converted_layers(seq.level))

    @torch.inference_mode()
    def forward(self, seq, ids: Tensor) -> Tensor:
        """The logits (1, vocab) float32 of the chunk's last token; the row's position advances."""
        t, device = ids.shape[1], ids.device
        n = padded_length(t)
        vocab = self.runner.model.config.vocab_size
        chunk = self._entry(n, lambda: _Chunk(n, torch.zeros(1, n, dtype=torch.long, device=device), torch.zeros(3, dtype=torch.long, device=device),
                                              torch.arange(n, device=device), torch.zeros(1, vocab, device=device)))  # fmt: skip
        chunk.meta.copy_(on_device([seq.position, seq.slot, t], device))
        chunk.ids[:, :t].copy_(ids)
        if t < n:
            chunk.ids[:, t:].zero_()
        self._run(chunk, (seq.level, seq.position == 0))
        seq.position += t
        return chunk.logits.clone()

    def _step(self, chunk: _Chunk, key: tuple[int, bool]) -> None:
        runner = self.runner
        level, fresh = key
        converted = runner.levels.converted_layers(level)
        start, slot, valid = chunk.meta[0], chunk.meta[1:2], chunk.meta[2:3]
        positions = (start + chunk.offsets)[None]  # (1, T)

        def attention(i: int, attn, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            t = h.shape[1]
            if i in converted:
                pool = runner._states[i]
                p = attn.project(h, (cos, sin))
                o, new = attn.prefill_padded(p, h, None if fresh else pool.select(slot), valid)
                for dst, src in zip(pool.tensors(), new.tensors()):
                    dst.index_copy_(0, slot, src.to(dst.dtype))
            else:
                q, k, v, _, _ = project_qkv(attn, h, (cos, sin))  # (1, Hq, T, D), (1, Hkv, T, D)
                keys, values = runner._keys[i], runner._values[i]
                keys[slot, :, positions[0]] = k[0].transpose(0, 1).to(keys.dtype)  # (T, Hkv, D) at the row's positions
                values[slot, :, positions[0]] = v[0].transpose(0, 1).to(values.dtype)
                o = slot_prefill_attention(q[0], keys, values, chunk.meta[:2], attn.scaling)[None]  # (1, Hq, T, Dv)
            return attn.o_proj(o.transpose(1, 2).reshape(1, t, -1).to(h.dtype))

        logits = decoder_forward(runner.model, runner._layers, [], chunk.ids, positions, attention, last=valid - 1)
        chunk.logits.copy_(logits)


def padded_length(tokens: int) -> int:
    """The static length a prefill chunk of ``tokens`` runs at: the next multiple of PREFILL_ALIGN."""
    return -(-tokens // PREFILL_ALIGN) * PREFILL_ALIGN
