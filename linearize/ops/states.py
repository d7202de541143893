"""Typed recurrent-state containers shared by the attention ops.

Every tensor field of a state has the batch on dim 0, so one generic implementation gives every
state the batch operations a server needs: ``select`` rows, ``split`` into requests, ``merge``
requests back into one batch, and ``nbytes`` (what the state holds in memory).

States are pure tensor containers: they know nothing of models or caches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch
from torch import Tensor

S = TypeVar("S", bound="BatchState")


@dataclass
class BatchState:
    """Base class: a dataclass whose fields are tensors (batch on dim 0) or nested BatchStates."""

    def _map(self: S, fn) -> S:
        values = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, BatchState):
                values[f.name] = v._map(fn)
            elif isinstance(v, Tensor):
                values[f.name] = fn(v)
            else:
                values[f.name] = v
        return type(self)(**values)

    def tensors(self) -> list[Tensor]:
        out: list[Tensor] = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, BatchState):
                out.extend(v.tensors())
            elif isinstance(v, Tensor):
                out.append(v)
        return out

    @property
    def batch_size(self) -> int:
        return self.tensors()[0].shape[0]

    def nbytes(self) -> int:
        """Bytes held by all tensors of this state."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def select(self: S, index: Tensor | Sequence[int]) -> S:
        """Rows ``index`` of the batch (a new state; tensors are gathered copies)."""
        if not isinstance(index, Tensor):
            index = torch.as_tensor(list(index), dtype=torch.long)
        return self._map(lambda t: t.index_select(0, index.to(t.device)))

    def split(self: S, sizes: Sequence[int]) -> list[S]:
        """Split the batch into consecutive groups of the given sizes."""
        if sum(sizes) != self.batch_size:
            raise ValueError(f"split sizes {list(sizes)} do not add up to the batch size {self.batch_size}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.select(torch.arange(s, s + n)) for s, n in zip(starts, sizes)]

    @classmethod
    def merge(cls: type[S], states: Sequence[S]) -> S:
        """Concatenate states along the batch (inverse of ``split``)."""
        if not states:
            raise ValueError("merge needs at least one state")
        kinds = {type(s).__name__ for s in states}
        if len(kinds) != 1:
            raise TypeError(f"cannot merge states of different kinds: {sorted(kinds)}")
        return _merge(list(states))

    def to(self: S, device=None, dtype=None) -> S:
        """Move to a device; ``dtype`` converts floating tensors only."""

        def move(t: Tensor) -> Tensor:
            if dtype is not None and t.is_floating_point():
                return t.to(device=device, dtype=dtype)
            return t.to(device=device)

        return self._map(move)

    def clone(self: S) -> S:
        return self._map(lambda t: t.clone())


def _merge(states: list[S]) -> S:
    first = states[0]
    values = {}
    for f in dataclasses.fields(first):
        vs = [getattr(s, f.name) for s in states]
        if isinstance(vs[0], BatchState):
            values[f.name] = _merge(vs)
        elif isinstance(vs[0], Tensor):
            values[f.name] = torch.cat(vs, dim=0)
        elif vs[0] is None or any(v is None for v in vs):
            if any(v is not None for v in vs):
                raise ValueError(f"cannot merge states whose field {f.name!r} is set in some and None in others")
            values[f.name] = None
        else:
            if any(v != vs[0] for v in vs):
                raise ValueError(f"cannot merge states whose field {f.name!r} differs: {vs}")
            values[f.name] = vs[0]
    return type(first)(**values)


@dataclass
class LinearState(BatchState):
    """Normalised linear-attention state: S = sum phi(k) v^T and z = sum phi(k)."""

    kv: Tensor  # (B, H, F, Dv)
    k_sum: Tensor  # (B, H, F)

    @classmethod
    def zeros(cls, batch: int, heads: int, features: int, dv: int, *, device=None, dtype=torch.float32):
        return cls(
            kv=torch.zeros(batch, heads, features, dv, device=device, dtype=dtype),
            k_sum=torch.zeros(batch, heads, features, device=device, dtype=dtype),
        )


@dataclass
class WindowState(BatchState):
    """The last ``W`` keys/values, oldest first, right-aligned: slot W-1 is the newest token.

    Slots not (yet) holding a real token have ``valid`` False. ``positions`` is each slot's index in
    its row's sequence of real tokens (-1 for invalid slots). ``linear_keys`` (None unless the
    linear part featurises other keys than the softmax, e.g. keys before RoPE) holds the keys the
    feature map will see when each token leaves the window.
    """

    keys: Tensor  # (B, Hkv, W, D)
    values: Tensor  # (B, Hkv, W, Dv)
    valid: Tensor  # (B, W) bool
    positions: Tensor  # (B, W) long
    linear_keys: Tensor | None = None  # (B, Hkv, W, D) or None

    @classmethod
    def empty(cls, batch: int, kv_heads: int, window: int, dk: int, dv: int, *, device=None, dtype=torch.float32,
              linear_keys: bool = False):
        return cls(
            keys=torch.zeros(batch, kv_heads, window, dk, device=device, dtype=dtype),
            values=torch.zeros(batch, kv_heads, window, dv, device=device, dtype=dtype),
            valid=torch.zeros(batch, window, device=device, dtype=torch.bool),
            positions=torch.full((batch, window), -1, device=device, dtype=torch.long),
            linear_keys=torch.zeros(batch, kv_heads, window, dk, device=device, dtype=dtype) if linear_keys else None,
        )


@dataclass
class HybridState(BatchState):
    """Sliding window + linear state over the tokens older than the window (in-head hybrid)."""

    window: WindowState
    linear: LinearState


@dataclass
class SparseCacheState(BatchState):
    """LoLA's sparse global cache: ``L`` slots per query head, kept by self-recall error.

    ``linear_keys`` (None unless the linear part featurises other keys than the softmax, e.g. keys
    before RoPE, as ``WindowState.linear_keys``) holds the keys the feature map sees for each entry:
    its self-recall error, and its write into the linear state when it is evicted.
    """

    keys: Tensor  # (B, H, L, D)
    values: Tensor  # (B, H, L, Dv)
    valid: Tensor  # (B, H, L) bool
    positions: Tensor  # (B, H, L) long, -1 where invalid
    linear_keys: Tensor | None = None  # (B, H, L, D) or None

    @classmethod
    def empty(cls, batch: int, heads: int, slots: int, dk: int, dv: int, *, device=None, dtype=torch.float32,
              linear_keys: bool = False):
        return cls(
            keys=torch.zeros(batch, heads, slots, dk, device=device, dtype=dtype),
            values=torch.zeros(batch, heads, slots, dv, device=device, dtype=dtype),
            valid=torch.zeros(batch, heads, slots, device=device, dtype=torch.bool),
            positions=torch.full((batch, heads, slots), -1, device=device, dtype=torch.long),
            linear_keys=torch.zeros(batch, heads, slots, dk, device=device, dtype=dtype) if linear_keys else None,
        )


@dataclass
class LolaState(BatchState):
    """LoLA's three memories: window, sparse cache, linear state."""

    window: WindowState
    sparse: SparseCacheState
    linear: LinearState


@dataclass
class DslaState(BatchState):
    """DSLA's two gated states (history: slow forgetting; recent: fast forgetting)."""

    history: Tensor  # (B, H, Dk, Dv)
    recent: Tensor  # (B, H, Dk, Dv)


@dataclass
class KVState(BatchState):
    """Plain key/value cache of a variable number of tokens (softmax and sinks-only kinds).

    ``valid`` marks real tokens (False for padding). Merging requests of different lengths
    left-pads the shorter ones with invalid slots.
    """

    keys: Tensor  # (B, Hkv, T, D)
    values: Tensor  # (B, Hkv, T, Dv)
    valid: Tensor  # (B, T) bool

    @classmethod
    def merge(cls, states):  # type: ignore[override]
        if not states:
            raise ValueError("merge needs at least one state")
        length = max(s.keys.shape[2] for s in states)
        return _merge([s.left_pad_to(length) for s in states])

    def left_pad_to(self, length: int) -> "KVState":
        pad = length - self.keys.shape[2]
        if pad <= 0:
            return self
        b, h, _, d = self.keys.shape
        dv = self.values.shape[-1]
        zk = self.keys.new_zeros(b, h, pad, d)
        zv = self.values.new_zeros(b, h, pad, dv)
        zvalid = self.valid.new_zeros(b, pad)
        return KVState(
            keys=torch.cat([zk, self.keys], dim=2),
            values=torch.cat([zv, self.values], dim=2),
            valid=torch.cat([zvalid, self.valid], dim=1),
        )


class DecodeClock:
    """A token counter on the device that every static decode state of one decoder reads: the
    decoder ``advance``s it once per step, after all layers, instead of each layer counting its own
    tokens (one kernel per step instead of one or two per layer). ``constant(n)`` gives a 0-dim
    device tensor holding n, the same tensor for the same n, so states that start alike read the
    same inputs and a compiled step computes what they derive from the clock once."""

    def __init__(self, device=None) -> None:
        self.count = torch.zeros((), dtype=torch.long, device=device)
        self._constants: dict[int, Tensor] = {}

    def constant(self, value: int) -> Tensor:
        if value not in self._constants:
            self._constants[value] = torch.tensor(value, dtype=torch.long, device=self.count.device)
        return self._constants[value]

    def now(self) -> int:
        """The count, read on the host."""
        return int(self.count)

    def advance(self) -> None:
        self.count.add_(1)

    def reset(self) -> None:
        self.count.zero_()
