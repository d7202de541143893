"""A replay on a model of the engine's steps: the engine's own scheduling, admission, preemption and
conversion policies over a trace window, with each step's time taken from a cost model instead of
a forward on a GPU.

What a replay on the GPU measures (``serve.replay``) depends on two things: how much each step
costs, and which requests the memory budget lets run together. The second is the engine's own code
and needs no GPU: ``CostRunner`` stands in for the model runner (its sequences count their tokens,
and hold exactly the bytes ``LevelMemory`` gives their level, as the real runners' caches report),
and ``simulate_replay`` steps the real ``Engine`` on a virtual clock, each step advancing it by
``StepCosts.step_s``. The costs come from a replay measured on the GPU (``StepCosts.fit``: least
squares over its engine steps' timeline), so the model answers "what would this replay give at
another rate, on another window, under another budget", for choosing what to measure, not in place
of measuring it.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from .engine import Engine, EngineConfig
from .levels import LevelMemory
from .policy import Policy
from .replay import ReplayRequest, RequestRecord, stamp_outputs, step_sample, summarize
from .sampling import SamplingParams


@dataclass(frozen=True)
class StepCosts:
    """Seconds one engine step takes: ``step_s`` (fixed when it decodes, per decoded row, fixed when
    it prefills, per prefilled token)."""

    decode_fixed_s: float
    decode_row_s: float
    prefill_fixed_s: float
    prefill_token_s: float

    def step_s(self, decode_rows: int, prefill_tokens: int) -> float:
        s = 0.0
        if decode_rows:
            s += self.decode_fixed_s + self.decode_row_s * decode_rows
        if prefill_tokens:
            s += self.prefill_fixed_s + self.prefill_token_s * prefill_tokens
        return s

    @classmethod
    def fit(cls, timeline: Sequence[dict[str, Any]]) -> "StepCosts":
        """Least squares of each step's wall time (from the previous step's end to its own: the
        engine's work and the replay loop's) on [decodes, decoded rows, prefills, prefilled tokens],
        over a replay's timeline (``replay_engine``'s samples); coefficients kept >= 0. The first
        step of the timeline and steps after an idle gap (no request running before them) are left out."""
        if timeline and not {"decode_rows", "prefill_tokens"} <= timeline[-1].keys():
            raise ValueError("this timeline has no per-step work (decode rows, prefill tokens) to fit step costs on")
        rows, times = [], []
        for prev, cur in zip(timeline, timeline[1:]):
            if prev["running"] == 0:
                continue
            d, p = cur["decode_rows"], cur["prefill_tokens"]
            rows.append([1.0 if d else 0.0, float(d), 1.0 if p else 0.0, float(p)])
            times.append(cur["t"] - prev["t"])
        if len(rows) < 4:
            raise ValueError(f"a timeline of {len(timeline)} steps is too short to fit step costs from")
        x, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(times, dtype=torch.float64)
        coef = _nonnegative_lstsq(x, y)
        return cls(*(float(c) for c in coef))

    @classmethod
    def from_report(cls, path: str | Path, policy: str) -> "StepCosts":
        """Fitted on ``policy``'s replay in a report (``report.json`` or ``report.json.gz`` of
        ``linearize replay --engine``, which keeps each policy's timeline)."""
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            report = json.load(f)
        raw = report.get("raw", {})
        if policy not in raw or "timeline" not in raw[policy]:
            raise ValueError(f"{path} has no timeline for policy {policy!r}; it has {sorted(raw)}")
        return cls.fit(raw[policy]["timeline"])


def _nonnegative_lstsq(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """min ||x c - y|| with c >= 0: least squares, dropping the most negative coefficient until none is."""
    active = list(range(x.shape[1]))
    while True:
        c = torch.linalg.lstsq(x[:, active], y[:, None]).solution[:, 0]
        if (c >= 0).all():
            out = torch.zeros(x.shape[1], dtype=x.dtype)
            out[active] = c
            return out
        active.pop(int(torch.argmin(c)))


class CostSequence:
    """A request's memory as the cost runner keeps it: its tokens and level, and the bytes
    ``LevelMemory`` gives them (what the real runners' caches hold)."""

    def __init__(self, levels: LevelMemory, level: int) -> None:
        self.levels, self.level, self.position = levels, level, 0

    def nbytes_by_kind(self) -> tuple[int, int]:
        return self.levels.bytes_by_kind(self.level, self.position)

    def nbytes(self) -> int:
        return sum(self.nbytes_by_kind())


class CostRunner:
    """Stands in for the engine's model runner: no forward runs, each sequence counts the tokens fed
    to it, and the logits are one column of zeros (every row's next token is 0). ``prefill_align``:
    the pooled runner's on CUDA (prefill chunks in multiples of 64, as its static buffers take them)."""

    device = "cpu"

    def __init__(self, levels: LevelMemory, config, prefill_align: int = 64) -> None:
        self.levels, self.prefill_align = levels, prefill_align
        self.model = SimpleNamespace(config=config)

    def new_sequence(self, level: int) -> CostSequence:
        return CostSequence(self.levels, self.levels.check_level(level))

    def forward(self, seqs: Sequence[CostSequence], ids: torch.Tensor) -> torch.Tensor:
        for seq in seqs:
            seq.position += ids.shape[1]
        return torch.zeros(len(seqs), 1)

    def release(self, seq: CostSequence) -> None:
        seq.position = 0

    def close(self) -> None:
        pass


def simulate_replay(levels: LevelMemory, config, engine_config: EngineConfig, policy: Policy, requests: Sequence[ReplayRequest],
                    costs: StepCosts, *, rate_scale: float = 1.0, prefill_align: int = 64,
                    horizon_s: float | None = None) -> tuple[list[RequestRecord], list[dict[str, Any]]]:  # fmt: skip
    """``replay_engine``'s open-loop replay of ``requests`` on a virtual clock: arrivals at
    ``arrival / rate_scale``, the real ``Engine`` (its budget, limits and ``policy``) stepping a
    ``CostRunner``, each step advancing the clock by ``costs``. (records, timeline) as
    ``replay_engine`` returns them; ``horizon_s`` stops the clock there (the unfinished requests
    counted as such)."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    engine = Engine(None, levels, engine_config, policy=policy, eos_token_ids=(),
                    runner=CostRunner(levels, config, prefill_align))  # fmt: skip
    records = [RequestRecord(r.arrival / rate_scale, len(r.prompt), r.output_tokens) for r in requests]
    ids: dict[str, int] = {}
    timeline: list[dict[str, Any]] = []
    now, nxt = 0.0, 0
    while nxt < len(requests) or engine.has_work():
        if horizon_s is not None and now > horizon_s:
            break
        while nxt < len(requests) and records[nxt].arrival <= now:
            r = requests[nxt]
            ids[engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True))] = nxt
            nxt += 1
        if not engine.has_work():
            now = records[nxt].arrival
            continue
        outputs = engine.step()
        now += costs.step_s(engine.last_step.decode_rows, engine.last_step.prefill_tokens)
        stamp_outputs(engine, outputs, records, ids, now)
        timeline.append(step_sample(engine, now))
    for rec in records:
        if rec.finish is None:
            rec.status = "unfinished"
    return records, timeline


def simulated_summary(records: Sequence[RequestRecord], timeline: Sequence[dict[str, Any]], costs: StepCosts) -> dict[str, Any]:
    """``replay.summarize``'s metrics of a simulated replay, with its steps, mean running requests,
    peak bytes and the costs it ran on."""
    out = summarize(records)
    out["steps"] = len(timeline)
    out["mean_running"] = sum(s["running"] for s in timeline) / len(timeline) if timeline else 0.0
    out["peak_bytes"] = max((s["bytes"] for s in timeline), default=0)
    out["costs"] = asdict(costs)
    return out


__all__ = ["CostRunner", "CostSequence", "StepCosts", "simulate_replay", "simulated_summary"]
