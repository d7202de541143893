"""The pooled runner: every request's per-layer memory in one preallocated tensor per layer, row = its slot.

The reference runner (``runner.Runner``) keeps each request's states as separate tensors and merges
them into a batch for every layer (a copy of every row, left padding, a host sync per row) and runs
the reference softmax (float32 scores). The pooled runner gives the same results (tested against it)
with the work done once per layer and group of rows:

- softmax layers: keys and values (slots, kv_heads, capacity, head_dim) in the model's dtype. A
  request holding n tokens has them at positions 0..n-1 of its slot. A call writes its new tokens at
  n..n+T-1 with one indexed copy, then attends over the first max(n)+T positions of the slots from
  its lowest to its highest (a view, no copy; slots in that span that are not in the call attend to
  their position 0 and are dropped), or over a gathered copy of its rows when that span is more
  than three times the rows (a copy costs a write and a read); one ``scaled_dot_product_attention``
  call with the query heads of a KV head folded into the query axis, so grouped heads are never
  repeated, and one additive mask per call (its rows aligned for the memory-efficient kernel) that
  every layer reads as it is. A layer whose rows are split between softmax and a converted path
  runs one output projection for both groups. cuDNN's attention is left out of that call's backends: it builds a graph for every new
  key length, i.e. for every decode step (tens of ms each on an H200); flash, memory-efficient and
  math attention take any length. Free slots are handed out lowest first, which keeps the span of running requests short;
- converted layers: the kind's state with the slot on dim 0; a group's rows are gathered, advanced
  and written back with ``index_copy_``: decoding (one token per row) through the layer's per-token
  step (``decode_step``, where the kind has one), prefill chunks through its ``attend``. DSLA's two
  states live in one float32 tensor (2, slots, heads, features, columns), its rows padded as its
  decode step wants them (``ops.dsla.ROW_ALIGN`` on CUDA), and a decode step updates each row's states where
  they are (``DslaDecodeState.in_pool``): no gather, no write-back.

The arena grows (slots or capacity doubled, one copy) when a request needs more; freed slots are
reused without clearing (a slot's stale positions are masked; a first chunk starts from no state).
Every pool has one more row than the requests' slots, the scratch slot, which rows that pad a
static decode batch write (``graphs.StaticDecode``: with ``graphs``, decode steps run on static
buffers, captured as CUDA graphs on CUDA).
What a request holds is counted by the level formula (``LevelMemory``: the bytes its states would
hold alone); ``arena_bytes`` is what the pools have allocated.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from ..cache import StateCacheLayer
from ..layers.base import ConvertedAttention, project_qkv
from ..modeling import decoder_layers
from ..ops.dsla import DslaDecodeState, padded_columns
from ..ops.states import DslaState
from .graphs import PREFILL_ALIGN, StaticDecode, StaticPrefill
from .levels import LevelMemory
from .runner import SDPA_BACKENDS, additive_mask, check_rows, decoder_forward, next_positions, on_device, split_rows

MIN_SLOTS = 4
MIN_CAPACITY = 256


@dataclass(eq=False)
class PooledSequence:
    """One request's place in the pools: its slot, the tokens it holds and its conversion level."""

    slot: int
    levels: LevelMemory = field(repr=False)
    level: int = 0
    position: int = 0

    def nbytes_by_kind(self) -> tuple[int, int]:
        """(bytes of softmax keys and values, bytes of converted layers' states) this request holds."""
        return self.levels.bytes_by_kind(self.level, self.position)

    def nbytes(self) -> int:
        return sum(self.nbytes_by_kind())


@dataclass
class PooledRunner:
    """Runs a nested family (its ``order`` in ``levels``) row by row at each row's level, on slot pools."""

    model: torch.nn.Module
    levels: LevelMemory
    max_slots: int | None = None
    """Requests the pools may hold at once (None: no limit); the arena never grows past it."""
    graphs: bool = False
    """Decode steps (one token per row, every row holding tokens, converted layers DSLA in their hybrid
    mode) and one-row prefill chunks of multiples of ``PREFILL_ALIGN`` tokens on static buffers
    (``graphs.StaticDecode``, ``graphs.StaticPrefill``): captured as CUDA graphs on CUDA; elsewhere the
    same static steps run eagerly."""
    generation: int = field(init=False, default=0)
    """Counts pool creations and growths (what captured graphs hold the addresses of)."""
    _layers: list = field(init=False, repr=False)
    _keys: list = field(init=False, repr=False)
    _values: list = field(init=False, repr=False)
    _states: dict = field(init=False, repr=False)
    _dsla: dict = field(init=False, repr=False)
    """Layer -> the (2, slots, Hq, F, C) tensor its DslaState's history and recent are views of."""
    _free: list = field(init=False, repr=False)
    _slots: int = field(init=False, default=0)
    _capacity: int = field(init=False, default=0)
    _static: StaticDecode | None = field(init=False, default=None, repr=False)
    _static_prefill: StaticPrefill | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self._layers = list(decoder_layers(self.model))
        for i in self.levels.order:
            if not isinstance(self._layers[i].self_attn, ConvertedAttention):
                raise ValueError(f"layer {i} is in the conversion order but is not converted")
        self._keys = [None] * len(self._layers)
        self._values = [None] * len(self._layers)
        self._states = {}
        self._dsla = {}
        self._free = []
        if self.graphs:
            cuda = next(self.model.parameters()).is_cuda
            self._static, self._static_prefill = StaticDecode(self, capture=cuda), StaticPrefill(self, capture=cuda)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def scratch_slot(self) -> int:
        """The pools' row past the requests' slots: where rows that pad a static batch write."""
        return self._slots

    @property
    def prefill_align(self) -> int:
        """Prefill chunks of a multiple of this many tokens take the static path (1: no such path);
        the engine cuts a prompt's chunks to it, all but the last."""
        return PREFILL_ALIGN if self._static_prefill is not None else 1

    # --- slots ---------------------------------------------------------------------------------
    def new_sequence(self, level: int = 0) -> PooledSequence:
        level = self.levels.check_level(level)
        if not self._free:
            if self.max_slots is not None and self._slots >= self.max_slots:
                raise RuntimeError(f"all {self.max_slots} slots are taken: release a sequence first")
            grown = max(MIN_SLOTS, 2 * self._slots)
            self._grow(slots=grown if self.max_slots is None else min(grown, self.max_slots))
        return PooledSequence(heapq.heappop(self._free), self.levels, level, 0)

    def release(self, seq: PooledSequence | None) -> None:
        """Give a request's slot back (its memory is free for the next request)."""
        if seq is not None and seq.slot >= 0:
            heapq.heappush(self._free, seq.slot)
            seq.slot = -1

    def close(self) -> None:
        """Free every pool and captured graph now (not when the last reference goes); the runner cannot
        run after."""
        for static in (self._static, self._static_prefill):
            if static is not None:
                static.close()
        self._static = self._static_prefill = None
        self._keys = [None] * len(self._layers)
        self._values = [None] * len(self._layers)
        self._states, self._dsla, self._free = {}, {}, []
        self._slots, self._capacity, self.max_slots = 0, 0, 0
        self.generation += 1

    def reserve(self, slots: int, capacity: int) -> None:
        """Grow the arena now to ``slots`` requests (at most ``max_slots``) of ``capacity`` tokens each,
        so that serving up to that needs no growth: every growth copies the arena and drops every
        captured graph (a replay's first minutes would otherwise grow it several times, each followed
        by new captures). Pools of layers not yet run are created at that size when first needed."""
        if slots < 1 or capacity < 1:
            raise ValueError(f"reserve needs slots >= 1 and capacity >= 1, got {slots} and {capacity}")
        self._grow(slots=slots if self.max_slots is None else min(slots, self.max_slots), capacity=capacity)

    def arena_bytes(self) -> int:
        """Bytes the pools have allocated (every slot at full capacity)."""
        tensors = [t for t in self._keys + self._values if t is not None] + list(self._dsla.values())
        tensors += [t for i, s in self._states.items() if i not in self._dsla for t in s.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _grow(self, slots: int | None = None, capacity: int | None = None) -> None:
        """Enlarge the arena to ``slots`` rows and ``capacity`` tokens per row (copies what is held)."""
        new_slots = max(self._slots, slots or 0)
        new_capacity = max(self._capacity, capacity or 0, MIN_CAPACITY)
        if new_slots == self._slots and new_capacity == self._capacity:
            return
        for pool in (self._keys, self._values):
            for i, t in enumerate(pool):
                if t is not None:
                    grown = t.new_zeros(new_slots + 1, t.shape[1], new_capacity, t.shape[3])  # + the scratch slot
                    grown[: self._slots, :, : t.shape[2]] = t[: self._slots]
                    pool[i] = grown
        for i, state in self._states.items():
            if i in self._dsla:
                self._states[i] = self._dsla_pool(i, new_slots)
            else:
                self._states[i] = state._map(lambda t: torch.cat([t, t.new_zeros(new_slots + 1 - t.shape[0], *t.shape[1:])]))
        for slot in range(self._slots, new_slots):
            heapq.heappush(self._free, slot)
        self._slots, self._capacity = new_slots, new_capacity
        self.generation += 1

    # --- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list[PooledSequence], ids: Tensor) -> Tensor:
        """Feed ``ids`` (B, T) to the B sequences (row b continues ``seqs[b]``); returns the logits of
        each row's last position (B, vocab), float32. Every sequence's position advances by T."""
        check_rows(seqs, ids)
        if any(s.slot < 0 for s in seqs):
            raise ValueError("a released sequence cannot run again: take a new one")
        b, t = ids.shape
        device = ids.device
        need = max(s.position for s in seqs) + t
        if need > self._capacity:
            limit = getattr(self.model.config, "max_position_embeddings", None) or need
            self._grow(capacity=max(need, min(2 * self._capacity, limit)))
        if t == 1 and self._static is not None:
            hi = max(s.level for s in seqs)
            if self._static.supports(seqs, hi):
                return self._static.forward(seqs, ids, hi)
        if b == 1 and t > 1 and self._static_prefill is not None and self._static_prefill.supports(seqs[0], t):
            return self._static_prefill.forward(seqs[0], ids)
        positions = next_positions(seqs, ids)  # (B, T)
        converted_rows = [self.levels.converted_layers(s.level) for s in seqs]
        groups: dict[tuple[int, ...], _Group] = {}

        def group_of(rows: tuple[int, ...]) -> _Group:
            return groups.get(rows) or groups.setdefault(rows, _Group.make(rows, seqs, positions, t, device))

        def attention(i: int, attn, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            split = split_rows(converted_rows, i)
            if not split[0] or not split[1]:  # one group: no gather of the hidden states
                return attn.o_proj(self._attention(attn, h, (cos, sin), group_of(tuple(range(b))), i, converted=bool(split[0])))
            out = None
            for converted, part in zip((True, False), split):
                group = group_of(tuple(part))
                o = self._attention(attn, h[group.rows], (cos[group.rows], sin[group.rows]), group, i, converted)
                out = (o.new_empty(b, *o.shape[1:]) if out is None else out).index_copy_(0, group.rows, o)
            return attn.o_proj(out)  # one output projection for both groups

        return decoder_forward(self.model, self._layers, seqs, ids, positions, attention)

    def _attention(self, attn, h: Tensor, pe: tuple[Tensor, Tensor], group: "_Group", i: int, converted: bool) -> Tensor:
        """The group's attention output before the output projection, (G, T, Hq * Dv) in h's dtype."""
        b, t, _ = h.shape
        if converted:
            o = self._converted(attn, h, pe, group, i)
        else:
            o = self._softmax(attn, h, pe, group, i)
        return o.transpose(1, 2).reshape(b, t, -1).to(h.dtype)

    def _converted(self, attn, h: Tensor, pe: tuple[Tensor, Tensor], group: "_Group", i: int) -> Tensor:
        pool = self._states.get(i)
        decoding = pool is not None and not group.all_fresh and group.fresh is None and h.shape[1] == 1 and attn.mode == "hybrid"
        if decoding and i in self._dsla:  # the rows' states advanced where they are in the pool
            rows, width = StateCacheLayer(), pool.history.shape[-1]
            key = (attn.num_kv_heads, self._dsla[i].shape[-1], width, attn.normalize)
            rows.decode_state = DslaDecodeState.in_pool(self._dsla[i], group.slots, attn.num_kv_heads, width, attn.normalize,
                                                        values=group.scratch.get(key))  # fmt: skip
            group.scratch[key] = rows.decode_state.values  # the call's converted layers write their values there in turn
            o = attn.decode_step(h, pe, rows)
            if o is not None:
                return o
        if group.all_fresh or pool is None:
            state = None
        else:
            state = pool.select(group.slots)
            if group.fresh is not None:  # rows starting now begin from an empty (zero) state
                state = state._map(lambda x: x.index_fill_(0, group.fresh, 0))
        o = None
        if decoding:  # the per-token step on the gathered rows
            rows = StateCacheLayer()  # the protocol decode_step advances: state in, decode state back
            rows.state = state
            o = attn.decode_step(h, pe, rows)
            new = rows.state
        if o is None:
            p = attn.project(h, pe)
            o, new = attn.attend(p, h, None, state, mode="hybrid")
        if pool is None:
            if isinstance(new, DslaState):
                pool = self._states[i] = self._dsla_pool(i, self._slots, new)
            else:
                pool = self._states[i] = new._map(lambda x: x.new_zeros(self._slots + 1, *x.shape[1:]))  # + the scratch slot
            self.generation += 1
        for dst, src in zip(pool.tensors(), new.tensors()):
            dst.index_copy_(0, group.slots, src.to(dst.dtype))
        return o

    def _dsla_pool(self, i: int, slots: int, like: DslaState | None = None) -> DslaState:
        """Layer i's DSLA pool for ``slots`` rows and the scratch slot: one zeroed (2, slots + 1, Hq, F, C) tensor, its rows
        padded as the decode step wants them (``padded_columns``), shaped like the state ``like`` for a
        new pool, holding the layer's earlier pool otherwise; returns the DslaState of views into it
        that the generic code reads and writes."""
        old = self._dsla.get(i)
        if old is None:
            width = like.history.shape[-1]
            storage = like.history.new_zeros(2, slots + 1, *like.history.shape[1:-1], padded_columns(width, like.history))
        else:  # + the scratch slot
            width = self._states[i].history.shape[-1]
            storage = old.new_zeros(2, slots + 1, *old.shape[2:])
            storage[:, : old.shape[1] - 1] = old[:, :-1]
        self._dsla[i] = storage
        return DslaState(history=storage[0, ..., :width], recent=storage[1, ..., :width])

    def _softmax(self, attn, h: Tensor, pe: tuple[Tensor, Tensor], group: "_Group", i: int) -> Tensor:
        q, k, v, _, _ = project_qkv(attn, h, pe)  # q (B, Hq, T, D), k/v (B, Hkv, T, D)
        if self._keys[i] is None:  # the requests' slots and the scratch slot
            self._keys[i] = k.new_zeros(self._slots + 1, k.shape[1], self._capacity, k.shape[3])
            self._values[i] = v.new_zeros(self._slots + 1, v.shape[1], self._capacity, v.shape[3])
            self.generation += 1
        keys, values = self._keys[i], self._values[i]
        b, hkv, t, d = k.shape
        # write the new tokens at their positions: keys[slot_b, :, start_b + j] = k[b, :, j]
        keys[group.write_slots, :, group.write_positions] = k.transpose(1, 2).reshape(b * t, hkv, d)
        values[group.write_slots, :, group.write_positions] = v.transpose(1, 2).reshape(b * t, hkv, v.shape[3])
        n, n_rep = group.length, q.shape[1] // hkv
        qf = q.reshape(b, hkv, n_rep * t, d)  # query heads of one KV head folded into the query axis
        if group.gather:
            keys, values = keys[group.slots, :, :n], values[group.slots, :, :n]  # (B, Hkv, n, D) copies
        else:
            keys, values = keys[group.lo : group.lo + group.span, :, :n], values[group.lo : group.lo + group.span, :, :n]  # views
            if group.span_index is not None:  # rows placed in the span; the span's other slots idle
                qf = qf.new_zeros(group.span, *qf.shape[1:]).index_copy_(0, group.span_index, qf)
        with sdpa_kernel(SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=group.mask(n_rep, qf.dtype), scale=attn.scaling)
        if group.span_index is not None and not group.gather:
            o = o.index_select(0, group.span_index)
        return o.reshape(b, hkv * n_rep, t, values.shape[3])


@dataclass
class _Group:
    """Index tensors of one group of rows for one forward call (shared by every layer it meets)."""

    rows: Tensor  # (G,) rows of the call
    slots: Tensor  # (G,) their slots
    lo: int  # lowest slot
    span: int  # highest - lowest + 1
    gather: bool  # attend over gathered copies of the rows (else over the span's view)
    span_index: Tensor | None  # (G,) each row's place in the span, unless the rows are the span in order
    write_slots: Tensor  # (G * T,)
    write_positions: Tensor  # (G * T,)
    length: int  # positions attended: max(start) + T
    allowed: Tensor  # (G or span, T, length) bool: key j visible to query t of row g (span rows: the span's)
    fresh: Tensor | None  # rows (within the group) that hold nothing yet, when some do
    all_fresh: bool
    scratch: dict = field(default_factory=dict)  # the DSLA decode step's value rows, shared by the call's converted layers
    _masks: dict = field(default_factory=dict)

    @classmethod
    def make(cls, rows: tuple[int, ...], seqs, positions: Tensor, t: int, device) -> "_Group":
        starts = [seqs[r].position for r in rows]
        slots = [seqs[r].slot for r in rows]
        length = max(starts) + t
        idx = on_device(rows, device)
        pos = positions.index_select(0, idx)  # (G, T)
        allowed = torch.arange(length, device=device)[None, None, :] <= pos[:, :, None]  # (G, T, length)
        fresh = [g for g, n in enumerate(starts) if n == 0]
        slot_t = on_device(slots, device)
        lo, span = min(slots), max(slots) - min(slots) + 1
        gather = span > 3 * len(rows)
        in_order = slots == list(range(lo, lo + len(rows)))
        span_index = None if in_order or gather else slot_t - lo
        if span_index is not None:  # idle slots of the span see their position 0 only (no empty rows)
            idle = torch.zeros(span, t, length, dtype=torch.bool, device=device)
            idle[:, :, 0] = True
            allowed = idle.index_copy_(0, span_index, allowed)
        return cls(
            rows=idx, slots=slot_t, lo=lo, span=span, gather=gather, span_index=span_index,
            write_slots=slot_t.repeat_interleave(t), write_positions=pos.reshape(-1),
            length=length, allowed=allowed,
            fresh=on_device(fresh, device) if fresh and len(fresh) < len(rows) else None,
            all_fresh=len(fresh) == len(rows),
        )  # fmt: skip

    def mask(self, n_rep: int, dtype: torch.dtype) -> Tensor:
        """(G or span, 1, n_rep * T, length): the additive mask (0 where ``allowed``, -inf elsewhere) in
        the queries' ``dtype`` for queries folded as (head in group, token), built once per call and
        shared by its layers. Its rows are padded in memory to a multiple of MASK_ALIGN, so SDPA's
        memory-efficient kernel takes it as it is: a boolean mask, or an unaligned one, is converted and
        padded again by every layer's call."""
        m = self._masks.get((n_rep, dtype))
        if m is None:
            m = self._masks[(n_rep, dtype)] = additive_mask(self.allowed.repeat(1, n_rep, 1)[:, None], dtype)  # (G or span, 1, n_rep * T, length)
        return m
