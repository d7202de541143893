"""What a request holds per layer: KV bytes per token (softmax) vs fixed state bytes (converted).

``formula`` numbers count the tensors that matter (keys/values, window, sparse cache, linear states)
at the dtypes the implementation keeps (KV in the model dtype; recurrent states in float32).
Measured numbers come from the cache itself (``linearize.cache.cache_nbytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import LayerSpec

STATE_BYTES = 4  # recurrent states are kept in float32


@dataclass
class LayerMemory:
    kind: str
    per_token: int  # bytes that grow with every token
    fixed: int  # bytes independent of context length

    def at(self, tokens: int) -> int:
        return self.per_token * tokens + self.fixed


def layer_memory(spec: LayerSpec | None, config, dtype_bytes: int = 2) -> LayerMemory:
    """Memory of one layer for one request. ``spec`` None = the teacher's softmax attention."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    kv_token = 2 * hkv * head_dim * dtype_bytes
    if spec is None or spec.attention == "softmax":
        return LayerMemory("softmax" if spec else "teacher", kv_token, 0)
    features = spec.features(head_dim)
    if spec.attention == "dsla":  # two (features x head_dim [+ 1 normaliser column]) states per head
        return LayerMemory("dsla", 0, 2 * h * features * (head_dim + spec.dsla_normalized) * STATE_BYTES)
    linear = h * features * (head_dim + 1) * STATE_BYTES
    window = spec.window * (2 + (not spec.linear_rope)) * hkv * head_dim * STATE_BYTES  # + keys before RoPE
    if spec.attention == "lola":  # the sparse cache keeps keys before RoPE too (its entries' SRE and write)
        sparse = spec.sparse_cache * (2 + (not spec.linear_rope)) * h * head_dim * STATE_BYTES
        return LayerMemory("lola", 0, window + sparse + linear)
    return LayerMemory("hybrid", 0, window + linear)


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
