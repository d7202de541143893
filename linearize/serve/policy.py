"""Conversion policies: at which level a request starts, and which live requests rise when memory binds.

A policy sees requests and memory only through ``RequestView`` and ``MemoryView`` and decides
levels; the engine applies them (levels of a live request only rise), logs and counts each decision.

- ``softmax``: every request at level 0 (nothing converted): the baseline.
- ``static:K``: every request at level K (an integer, or a percentage of the model's layers: ``static:25%``).
- ``length-caps``: the level by prompt length (DSLA-Serve): < 2K tokens 12.5% of the layers,
  2K-4K 25%, 4K-8K 37.5%, >= 8K 50%.
- ``memory``: a new request starts at level 0 while memory stays under the low-water mark with it,
  else at the lowest level that keeps memory under the high-water mark (never above ``max_level``);
  when memory in use passes the high-water mark, the longest live requests rise one layer at a time,
  the one that frees the most bytes first, until use falls to the middle of the two marks: converting
  before preempting. A rise rebuilds the request's memory from its tokens (a recompute), so marks
  matter: ``memory:high=1.0`` raises live requests only where their next tokens would not fit
  otherwise (and admits new ones at levels that keep under the whole budget). The marks and the
  level cap default to the server's ``--high-water``, ``--low-water`` and ``--max-level``; a policy
  string may set its own (``memory:high=1.0:low=0.5:max-level=8``), so one replay can compare them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .levels import LevelMemory

POLICIES = ("softmax", "static:K", "static:P%", "length-caps", "memory", "memory:high=H:low=L:max-level=K")
"""The ``--policy`` forms."""
LENGTH_CAPS = ((2048, 0.125), (4096, 0.25), (8192, 0.375), (math.inf, 0.5))
"""(prompt tokens below, fraction of layers converted): DSLA-Serve's caps."""


@dataclass(frozen=True)
class RequestView:
    """What a policy sees of a live request."""

    id: str
    tokens: int
    """Context tokens it holds now (prompt + generated)."""
    level: int


@dataclass(frozen=True)
class MemoryView:
    """What a policy sees of memory: the byte budget, the bytes in use, and the per-level formula."""

    budget: int
    used: int
    levels: LevelMemory


class Policy:
    """Base: level 0 for everyone, no raises."""

    name = "softmax"

    def admission_level(self, prompt_tokens: int, final_tokens: int, memory: MemoryView) -> int:
        """The level a new request starts at (``final_tokens``: its prompt plus the tokens it may generate)."""
        return 0

    def raises(self, running: Sequence[RequestView], memory: MemoryView) -> dict[str, int]:
        """New, higher levels for some live requests (request id -> level); empty: none."""
        return {}

    def level_cap(self, levels: LevelMemory) -> int:
        """The highest level this policy ever gives (a request that does not fit there is rejected)."""
        return 0

    def __repr__(self) -> str:
        return self.name


class SoftmaxPolicy(Policy):
    pass


class StaticPolicy(Policy):
    def __init__(self, level: int):
        self.level = level
        self.name = f"static:{level}"

    def admission_level(self, prompt_tokens, final_tokens, memory):
        return min(self.level, memory.levels.max_level)

    def level_cap(self, levels):
        return min(self.level, levels.max_level)


class LengthCapsPolicy(Policy):
    name = "length-caps"

    def __init__(self, caps: Sequence[tuple[float, float]] = LENGTH_CAPS):
        self.caps = tuple(caps)

    def admission_level(self, prompt_tokens, final_tokens, memory):
        fraction = next(f for below, f in self.caps if prompt_tokens < below)
        return memory.levels.level_for(fraction)

    def level_cap(self, levels):
        return levels.level_for(max(f for _, f in self.caps))


class MemoryPolicy(Policy):
    name = "memory"

    def __init__(self, *, high: float = 0.9, low: float = 0.6, max_level: int | None = None):
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"water marks must satisfy 0 < low <= high <= 1, got low={low}, high={high}")
        self.high, self.low, self.max_level = high, low, max_level

    def level_cap(self, levels):
        return levels.max_level if self.max_level is None else min(self.max_level, levels.max_level)

    def cap(self, memory: MemoryView) -> int:
        return self.level_cap(memory.levels)

    def admission_level(self, prompt_tokens, final_tokens, memory):
        levels = memory.levels
        if memory.used + levels.bytes(0, final_tokens) <= self.low * memory.budget:
            return 0
        for level in range(self.cap(memory) + 1):
            if memory.used + levels.bytes(level, final_tokens) <= self.high * memory.budget:
                return level
        return self.cap(memory)

    def raises(self, running, memory):
        if memory.used <= self.high * memory.budget:
            return {}
        levels, cap = memory.levels, self.cap(memory)
        target = (self.high + self.low) / 2 * memory.budget
        current = {r.id: r.level for r in running}
        tokens = {r.id: r.tokens for r in running}
        used = memory.used
        while used > target:
            candidates = [(levels.saving(current[i], tokens[i]), tokens[i], i) for i in current if current[i] < cap]
            candidates = [c for c in candidates if c[0] > 0]
            if not candidates:
                break
            saving, _, rid = max(candidates)
            current[rid] += 1
            used -= saving
        return {r.id: current[r.id] for r in running if current[r.id] != r.level}


def parse_policy(text: str, levels: LevelMemory, *, max_level: int | None = None, high: float = 0.9, low: float = 0.6) -> Policy:
    """A Policy from its ``--policy`` form (ValueError naming the value and the valid forms)."""
    if text == "softmax":
        return SoftmaxPolicy()
    if text == "length-caps":
        return LengthCapsPolicy()
    if text == "memory" or text.startswith("memory:"):
        options = {"high": high, "low": low, "max_level": max_level}
        for part in text.split(":")[1:]:
            key, _, value = part.partition("=")
            name = key.replace("-", "_")
            try:
                if name not in options or not value:
                    raise ValueError
                options[name] = int(value) if name == "max_level" else float(value)
                if name == "max_level" and not 0 <= options[name] <= levels.max_level:
                    raise ValueError
            except ValueError:
                raise ValueError(f"policy {text!r}: {part!r} is not one of high=H, low=L (fractions of the budget) or "
                                 f"max-level=K (0..{levels.max_level})") from None  # fmt: skip
        return MemoryPolicy(**options)
    if text.startswith("static:"):
        arg = text.removeprefix("static:")
        try:
            if arg.endswith("%"):
                percent = float(arg[:-1])
                if not 0 <= percent <= 100:
                    raise ValueError
                level = levels.level_for(percent / 100)
            else:
                level = int(arg)
                if not 0 <= level <= levels.max_level:
                    raise ValueError
        except ValueError:
            raise ValueError(f"policy {text!r}: static needs a level in 0..{levels.max_level} or a percentage 0%..100%") from None
        return StaticPolicy(level)
    raise ValueError(f"unknown policy {text!r}; valid: {', '.join(POLICIES)}")
