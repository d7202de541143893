"""Conversion levels of a nested family and the bytes a request holds at each.

A nested family (``dsla-chained``) has its converted layers in an ``order`` (least sensitive first).
A request at level k runs the first k layers of the order converted (a fixed-size state each) and
every other layer with the teacher's softmax attention (keys and values that grow with every token).
``LevelMemory`` counts those bytes exactly, from each layer's memory formula
(``linearize.memory.layer_memory``: the same numbers the caches' ``nbytes()`` report).
"""

from __future__ import annotations

from dataclasses import dataclass
from ..memory import LayerMemory, layer_memory


@dataclass(frozen=True)
class LevelMemory:
    """Per-layer memory of one request: ``softmax[i]`` when layer i runs softmax, ``converted[i]``
    when it runs converted; ``order`` the layers in conversion order (level k converts order[:k])."""

    order: tuple[int, ...]
    softmax: tuple[LayerMemory, ...]
    converted: dict[int, LayerMemory]

    @classmethod
    def from_spec(cls, spec, config, dtype_bytes: int = 2) -> "LevelMemory":
        """From a nested family's ConversionSpec (its ``order``) and the model config."""
        if spec is None or spec.order is None:
            raise ValueError("run-time conversion needs a nested family (a spec with an 'order', e.g. smollm2-135m-dsla-chained)")
        n = config.num_hidden_layers
        order = tuple(i % n for i in spec.order)
        softmax = tuple(layer_memory(None, config, dtype_bytes) for _ in range(n))
        converted = {i: layer_memory(spec.layer_spec(i, n), config, dtype_bytes) for i in order}
        return cls(order, softmax, converted)

    @property
    def max_level(self) -> int:
        return len(self.order)

    def check_level(self, level: int) -> int:
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= self.max_level:
            raise ValueError(f"level must be an integer in 0..{self.max_level} (layers in the conversion order), got {level!r}")
        return level

    def converted_layers(self, level: int) -> frozenset[int]:
        """The layers a request at ``level`` runs converted."""
        return frozenset(self.order[: self.check_level(level)])

    def bytes(self, level: int, tokens: int) -> int:
        """Bytes a request at ``level`` holds with ``tokens`` tokens of context."""
        converted = self.converted_layers(level)
        return sum((self.converted[i] if i in converted else m).at(tokens) for i, m in enumerate(self.softmax))

    def bytes_by_kind(self, level: int, tokens: int) -> tuple[int, int]:
        """(bytes of softmax keys and values, bytes of converted layers' states) of a request at ``level``
        with ``tokens`` of context."""
        converted = self.converted_layers(level)
        kv = sum(m.at(tokens) for i, m in enumerate(self.softmax) if i not in converted)
        return kv, sum(self.converted[i].at(tokens) for i in converted)

    def saving(self, level: int, tokens: int) -> int:
        """Bytes freed by raising a request at ``tokens`` of context from ``level`` to ``level + 1``
        (negative when its context is shorter than the converted layer's state)."""
        if level >= self.max_level:
            return 0
        layer = self.order[level]
        return self.softmax[layer].at(tokens) - self.converted[layer].at(tokens)

    def level_for(self, fraction: float) -> int:
        """The level converting ``fraction`` of the model's layers (rounded half up), capped at ``max_level``."""
        return min(self.max_level, int(fraction * len(self.softmax) + 0.5))

