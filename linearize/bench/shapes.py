"""Named attention-layer shapes for the layer benchmark (no heavy imports: the CLI lists them)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The attention shape of one decoder layer."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = {
    "smollm2-135m": LayerShape(hidden=576, heads=9, kv_heads=3, head_dim=64),
    "llama3-8b": LayerShape(hidden=4096, heads=32, kv_heads=8, head_dim=128),
}
"""Named layer shapes (``linearize bench --layer NAME``): SmolLM2-135M's and Llama-3-8B's."""


STACKS = {
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False),
}
"""Whole models of random weights (``linearize bench --capacity N --stack NAME``): LlamaConfig fields of
Llama-3-8B's shape (its layer is ``SHAPES['llama3-8b']``)."""
