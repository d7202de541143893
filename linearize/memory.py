"""What a request holds per layer: KV bytes per token (softmax) vs fixed state bytes (converted).

``formula`` numbers count the tensors that matter (keys/values, window, sparse cache, linear states)
at the dtypes the implementation keeps (KV in the model dtype; recurrent states in float32); each
kind's formula is its ``AttentionKind.memory``. Measured numbers come from the cache itself
(``linearize.cache.cache_nbytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layers.base import STATE_BYTES  # noqa: F401  (re-exported: the bytes of a state element)
from .layers.registry import KINDS
from .spec import LayerSpec


@dataclass
class LayerMemory:
    kind: str
    per_token: int  # bytes that grow with every token
    fixed: int  # bytes independent of context length

    def at(self, tokens: int) -> int:
        return self.per_token * tokens + self.fixed


def layer_memory(spec: LayerSpec | None, config, dtype_bytes: int = 2) -> LayerMemory:
    """Memory of one layer for one request. ``spec`` None = the teacher's softmax attention."""
    if spec is None:
        per_token, fixed = KINDS["softmax"].memory(None, config, dtype_bytes)
        return LayerMemory("teacher", per_token, fixed)
    per_token, fixed = spec.kind.memory(spec.options, config, dtype_bytes)
    return LayerMemory(spec.attention, per_token, fixed)


def request_memory(spec, model, tokens: int, dtype_bytes: int = 2) -> int:
    """Formula bytes one request holds over all layers at ``tokens`` of context.

    ``spec`` None = the teacher (every layer softmax); else a ConversionSpec applied to ``model``'s layers.
    A nested family's layers beyond ``active`` run the teacher's attention and hold its KV cache.
    """
    n = model.config.num_hidden_layers
    inactive = set(spec.inactive_layers(n)) if spec is not None else set()
    total = 0
    for i in range(n):
        layer_spec = spec.layer_spec(i, n) if spec is not None and i not in inactive else None
        total += layer_memory(layer_spec, model.config, dtype_bytes).at(tokens)
    return total
