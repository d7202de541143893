"""What a request holds per layer: KV bytes per token (softmax) vs fixed state bytes (converted).

``formula`` numbers count the tensors that matter (keys/values, window, sparse cache, linear states)
at the dtypes the implementation keeps (KV in the model dtype; recurrent states in float32); each
kind's formula is its ``AttentionKind.memory``. Measured numbers come from the cache itself
(``linearize.cache.cache_nbytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layers.base import STATE_BYTES  # noqa: F401  (re-exported: the bytes of a state element)
from .convert import running_layers
from .layers.registry import KINDS
from .modeling import decoder_layers
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
    specs = [spec.layer_spec(i, n) if spec is not None and i not in inactive else None for i in range(n)]
    return sum(layer_memory(s, model.config, dtype_bytes).at(tokens) for s in specs)


def running_memory(model, dtype_bytes: int | None = None) -> list[LayerMemory]:
    """Per layer, the memory of the attention it runs now (layers in 'teacher' mode or unconverted:
    the teacher's KV cache). ``dtype_bytes`` None = the model's parameter size."""
    running = running_layers(model)
    dtype_bytes = dtype_bytes or next(model.parameters()).element_size()
    return [layer_memory(running[i].spec if i in running else None, model.config, dtype_bytes)
            for i in range(len(decoder_layers(model)))]


def running_request_memory(model, tokens: int) -> int:
    """Formula bytes one request holds at ``tokens`` of context, from each layer's current attention."""
    return sum(m.at(tokens) for m in running_memory(model))
