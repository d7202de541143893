"""Sampling parameters (OpenAI's fields), per-request samplers and stop strings.

Every request samples with its own ``torch.Generator`` (seeded by its ``seed``, or at random), so
its tokens do not depend on which other requests share its batch: a batched run and the same request
run alone give the same tokens, greedy or sampled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_STOPS = 4
"""OpenAI's limit on stop strings per request."""
GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (dividing logits by less would overflow float32)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes (OpenAI completion fields; ``ignore_eos`` for benchmarks, as in vLLM)."""

    max_tokens: int = 16
    """Tokens to generate at most (finish_reason 'length' when reached)."""
    temperature: float = 1.0
    """0 (or below 1e-5): greedy; else logits / temperature before sampling (0..2)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the fewest tokens whose probability sums to top_p (0 < top_p <= 1)."""
    top_k: int = -1
    """Keep the k most likely tokens (-1 or 0: all)."""
    seed: int | None = None
    """Seed of this request's generator (None: random)."""
    stop: tuple[str, ...] = ()
    """Strings that end the output (not included in it; finish_reason 'stop'), at most 4."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks force output lengths this way)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _number(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be a number in [0, 2], got {self.temperature!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all), 0 (all) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """This request's generator: seeded by ``params.seed``, or from the global RNG."""
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """(V,) float32 logits / temperature with everything outside top-k and top-p set to -inf."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, index = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the tokens before it already reach top_p (the first one always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False  # the most likely token stays whatever top_p (a top_p below float32's range would drop it)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, index, drop), -math.inf)
    return logits


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token of one request from its (V,) logits."""
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(filter_logits(logits, params), -1)
    return int(torch.multinomial(probs, 1, generator=generator))


class StopChecker:
    """Incremental stop-string detection for streamed text.

    ``feed(text)`` takes the text decoded since the last call and returns (text safe to emit, stopped).
    Text that could still be the start of a stop string is held back until it cannot; when a stop
    string appears, the output ends right before it."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        buffer = self.pending + text
        if not self.stops:
            self.pending = ""
            return buffer, False
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buffer[: min(hits)], True
        hold = max((k for s in self.stops for k in range(1, len(s)) if buffer.endswith(s[:k])), default=0)
        self.pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """Held-back text at the end of a request that did not stop on a string."""
        out, self.pending = self.pending, ""
        return out
