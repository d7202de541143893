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
