"""Per-layer recurrent state inside a transformers Cache.

Converted layers do not append keys/values: they keep a typed state (``linearize.ops.states``). A
``StateCacheLayer`` takes the place of the layer's entry in any transformers ``Cache`` (the
DynamicCache that ``generate()`` makes, or one the caller passes), so unconverted layers keep their
plain KV while converted ones keep window + linear state, LoLA memories or DSLA states.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from transformers import LlamaModel
from transformers.cache_utils import Cache, CacheLayerMixin

from .ops.states import BatchState


_reference_decoding = False


@contextlib.contextmanager
def reference_decoding():
    """Inside the block, converted layers decode every token through the reference ops (the general
    prefill code, which the per-token decode path is tested against) instead of the decode path."""
    global _reference_decoding
    before, _reference_decoding = _reference_decoding, True
    try:
        yield
    finally:
        _reference_decoding = before


def fast_decoding() -> bool:
    """Whether converted layers may take their per-token decode path (outside ``reference_decoding``)."""
    return not _reference_decoding


class StateCacheLayer(CacheLayerMixin):
    """One converted layer's state plus the number of positions it has seen (padding included)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__()
        self._state: BatchState | None = None
        self.decode_state: Any = None
        """A layer's working form of its state while it decodes token by token (updated in place;
        anything with ``canonical()`` -> BatchState), or None. Reading ``state`` turns it back."""
        self.seen = 0

    @property
    def state(self) -> BatchState | None:
        """The layer's state (its decode form, if any, turned back into it first)."""
        if self.decode_state is not None:
            self._state, self.decode_state = self.decode_state.canonical(), None
        return self._state

    @state.setter
    def state(self, value: BatchState | None) -> None:
        self._state, self.decode_state = value, None

    def __repr__(self) -> str:
        state = self.decode_state if self.decode_state is not None else self._state
        kind = type(state).__name__ if state is not None else "empty"
        return f"StateCacheLayer({kind}, seen={self.seen})"

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("a converted layer keeps a recurrent state; it does not take key/value updates")

    def store(self, state: BatchState | None, new_positions: int) -> None:
        self.state = state
        self.seen += new_positions
        self.is_initialized = True

    def advance(self, decode_state: Any, new_positions: int) -> None:
        """Keep ``decode_state`` (already updated in place) after ``new_positions`` more positions."""
        self.decode_state = decode_state
        self.seen += new_positions
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes()

    def _select(self, index: torch.Tensor) -> None:
        if self.state is not None:
            self.state = self.state.select(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self._select(torch.arange(self.state.batch_size).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a recurrent state cannot be cropped (tokens already folded into it)")

    def offload(self) -> None:
        if self.state is not None:
            self._device = self.state.tensors()[0].device
            self.state = self.state.to("cpu")

    def prefetch(self) -> None:
        device = getattr(self, "_device", None)
        if self.state is not None and device is not None:
            self.state = self.state.to(device)


def state_layer(cache: Cache, layer_idx: int) -> StateCacheLayer:
    """The StateCacheLayer of ``layer_idx`` in ``cache``, put in place on first use."""
    layers = cache.layers
    while len(layers) <= layer_idx:
        if cache.layer_class_to_replicate is None:
            raise ValueError(f"cache has {len(layers)} layers; layer {layer_idx} is out of range")
        layers.append(cache.layer_class_to_replicate())
    layer = layers[layer_idx]
    if not isinstance(layer, StateCacheLayer):
        if layer.get_seq_length() > 0:
            raise ValueError(
                f"cache layer {layer_idx} already holds keys/values of the unconverted attention; "
                "start a new cache after converting or switching modes"
            )
        layer = StateCacheLayer()
        layers[layer_idx] = layer
    return layer


def cache_nbytes(cache: Cache) -> dict[int, int]:
    """Bytes held per layer: KV tensors of unconverted layers, states of converted ones."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, StateCacheLayer):
            out[i] = layer.nbytes()
        else:
            out[i] = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))
    return out


# transformers renamed the cache argument and output field ``past_key_values`` to ``cache`` within 5.x
# (the old name warns, and goes in 5.40); this is the name the installed version takes.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kwargs(cache: Cache | None) -> dict[str, Any]:
    """``model(..., **cache_kwargs(cache))``: the cache under the argument name of the installed transformers."""
    return {CACHE_ARG: cache}


def output_cache(outputs) -> Cache | None:
    """The cache of a forward or ``generate(return_dict_in_generate=True)`` output."""
    return getattr(outputs, CACHE_ARG)


def cache_argument(kwargs: dict[str, Any]) -> Cache | None:
    """The cache among the keyword arguments an attention module receives, under either name."""
    cache = kwargs.get(CACHE_ARG)
    return cache if cache is not None else kwargs.get("past_key_values" if CACHE_ARG == "cache" else "cache")
