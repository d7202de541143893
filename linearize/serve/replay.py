"""Trace replay: request traces, DSLA-Serve's session augmentation, an open-loop replay against the
engine in this process (or against a running server over HTTP: ``linearize.serve.client``), and the
serving metrics of ``vllm bench serve`` plus the paper's normalised latency; one report for both.

- Traces: the Azure LLM inference trace 2023 CSVs (TIMESTAMP, ContextTokens, GeneratedTokens; shipped,
  ``linearize.data.TRACES``) and Mooncake's JSONL (timestamp in ms, input_length, output_length).
- Augmentation (seeded): consecutive requests form sessions of Poisson(3) turns (at least 1); a
  turn's prompt is the session's history (every earlier turn's message and answer) followed by a new
  message of the trace's ContextTokens tokens; its output is forced to GeneratedTokens (ignore_eos).
  Prompts longer than ``max_prompt`` keep their most recent tokens. Arrival times stay the trace's.
- Prompt text: token ids cut from a real corpus stream, so prompts have exactly the counts asked
  (a random family's: seeded random ids).
- Warm-up: before anything is timed, prefill and decode at level 0, at the highest level the policy
  can give and at one in between (a level's first converted step compiles kernels on a GPU).
- Replay: open loop on the wall clock, arrival times divided by ``rate_scale``; every request either
  completes or keeps the status it ended with (rejected, http NNN, timeout, ...), and each is counted.
- Metrics (``vllm bench serve``'s definitions): TTFT; TPOT = (E2E - TTFT) / (output tokens - 1);
  ITL between consecutive tokens; E2E; the paper's normalised latency E2E / output tokens; mean,
  p50, p90, p99; throughput; goodput under SLOs.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from .engine import Engine
from .levels import LevelMemory
from .policy import MemoryView, Policy
from .sampling import SamplingParams
from .settings import DEFAULT_POLICIES, TRACE_NAMES, ReplaySettings, parse_slo  # noqa: F401 (re-exported; settings need no torch)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives (seconds from the trace's start) and its lengths."""

    arrival: float
    input_tokens: int
    output_tokens: int


def load_trace(path: str | Path) -> list[TraceRequest]:
    """An Azure 2023 CSV or a Mooncake JSONL trace, in arrival order (ValueError naming a bad row)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    rows: list[TraceRequest] = []
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
            if not need <= set(reader.fieldnames or ()):
                raise ValueError(f"trace {path.name}: expected the columns {sorted(need)}, found {reader.fieldnames}")
            start = None
            for i, row in enumerate(reader, 2):
                try:
                    t = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
                    start = t if start is None else start
                    rows.append(TraceRequest(t - start, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
                except (ValueError, TypeError) as err:
                    raise ValueError(f"trace {path.name}, line {i}: {err}") from None
    elif path.suffix in (".jsonl", ".json"):
        with path.open() as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    rows.append(TraceRequest(float(row["timestamp"]) / 1000, int(row["input_length"]), int(row["output_length"])))
                except (ValueError, KeyError, TypeError) as err:
                    raise ValueError(f"trace {path.name}, line {i}: expected timestamp (ms), input_length, output_length: {err}") from None
        if rows:
            first = rows[0].arrival
            rows = [TraceRequest(r.arrival - first, r.input_tokens, r.output_tokens) for r in rows]
    else:
        raise ValueError(f"trace {path.name}: unknown format {path.suffix!r}; expected .csv (Azure 2023) or .jsonl (Mooncake)")
    bad = next((r for r in rows if r.input_tokens < 1 or r.output_tokens < 1), None)
    if bad is not None:
        raise ValueError(f"trace {path.name}: a request with {bad.input_tokens} input / {bad.output_tokens} output tokens; both must be >= 1")
    return sorted(rows, key=lambda r: r.arrival)


@dataclass
class ReplayRequest:
    """A request to replay: its arrival, prompt token ids and forced output length."""

    arrival: float
    prompt: list[int]
    output_tokens: int
    session: int
    turn: int

    @property
    def final_tokens(self) -> int:
        """Its context once every output token is in: prompt + output."""
        return len(self.prompt) + self.output_tokens


def prompt_cap(trace: Sequence[TraceRequest], max_prompt: int, max_positions: int) -> int:
    """The prompt cap a replay augments ``trace`` with: ``max_prompt``, less where the model's
    ``max_positions`` must also hold the longest output."""
    return min(max_prompt, max_positions - max(r.output_tokens for r in trace))


def augment(trace: Sequence[TraceRequest], tokens: torch.Tensor, *, turns_mean: float = 3.0, max_prompt: int = 8192,
            seed: int = 0) -> list[ReplayRequest]:
    """Sessions of Poisson(``turns_mean``) turns (>= 1) over consecutive trace requests; each turn's
    prompt = the session's history + a new message of the trace's input length, cut from ``tokens``
    (a corpus stream, reused cyclically); answers are stand-in tokens of the trace's output length."""
    if tokens.numel() < 2:
        raise ValueError("the corpus stream for prompts is empty")
    rng = random.Random(seed)
    stream = tokens.tolist()
    cursor = 0

    def take(n: int) -> list[int]:
        nonlocal cursor
        out = []
        while len(out) < n:
            piece = stream[cursor : cursor + n - len(out)]
            out.extend(piece)
            cursor = (cursor + len(piece)) % len(stream)
        return out

    out: list[ReplayRequest] = []
    i, session = 0, 0
    while i < len(trace):
        turns = max(1, _poisson(rng, turns_mean))
        history: list[int] = []
        for turn, r in enumerate(trace[i : i + turns]):
            prompt = (history + take(r.input_tokens))[-max_prompt:]
            out.append(ReplayRequest(r.arrival, prompt, r.output_tokens, session, turn))
            history = prompt + take(r.output_tokens)
        i += turns
        session += 1
    return out


def _poisson(rng: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


# ----------------------------------------------------------------------------- replay


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    status: str = "ok"
    """ok | rejected (by the engine's memory) | http NNN (the server's answer) | timeout | unfinished | error."""
    token_times: list[float] = field(default_factory=list)
    """When tokens arrived: one per token in process, one per streamed chunk over HTTP."""
    finish: float | None = None
    level: int = 0
    preemptions: int = 0
    generated: int | None = None
    """Output tokens received (over HTTP: the final chunk's usage); None: one per token time."""
    detail: str = ""
    """The server's error message, if any."""

    @property
    def n_out(self) -> int:
        return len(self.token_times) if self.generated is None else self.generated

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.finish - self.arrival if self.finish is not None else None

    @property
    def tpot(self) -> float | None:
        n = self.n_out
        return (self.e2e - self.ttft) / (n - 1) if n > 1 and self.e2e is not None and self.ttft is not None else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def normalized(self) -> float | None:
        return self.e2e / self.n_out if self.n_out and self.e2e is not None else None


WARM_UP_LENGTHS = (64, 700, 2000)
"""Prompt lengths of the warm-up requests."""


def warm_up_levels_of(cap: int) -> list[int]:
    """The levels a warm-up runs for a policy whose highest level is ``cap``: 0, the middle, ``cap``."""
    return sorted({0, cap // 2, cap})


def warm_up(engine: Engine, tokens: Sequence[int], lengths: Sequence[int] = WARM_UP_LENGTHS) -> list[int]:
    """Prefill and decode through ``engine`` at level 0, at the highest level its policy can give and
    at one in between, before anything is timed (kernel compilation and autotuning, e.g. fla's Triton
    kernels on a fresh GPU, happen on a level's first converted step); then clear its records and
    counters. At each level, requests of ``lengths`` prompt tokens (cut from ``tokens``, repeated as
    needed) run together: chunked prefill, then batched decode. Returns the levels run."""
    from .policy import StaticPolicy

    policy = engine.policy
    levels = warm_up_levels_of(policy.level_cap(engine.levels))
    for level in levels:
        engine.policy = StaticPolicy(level)
        for n in lengths:
            prompt = list(tokens[:n]) if len(tokens) >= n else (list(tokens) * (n // max(len(tokens), 1) + 1))[:n]
            engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        engine.run()
    engine.policy = policy
    engine.finished.clear()
    engine.counters.clear()
    engine.peak_bytes = 0
    return levels


def admitted_levels(engine: Engine, requests: Sequence["ReplayRequest"]) -> list[int]:
    """The levels the engine's policy admits the requests at on an empty engine (length-caps: its
    caps; memory: mostly 0)."""
    empty = MemoryView(engine.config.kv_budget, 0, engine.levels)
    return sorted({engine.policy.admission_level(len(r.prompt), r.final_tokens, empty) for r in requests})


def graph_levels(engine: Engine, requests: Sequence["ReplayRequest"]) -> list[int]:
    """The levels whose static steps a replay warms up: ``admitted_levels`` and the warm-up's levels."""
    return sorted(set(admitted_levels(engine, requests)) | set(warm_up_levels_of(engine.policy.level_cap(engine.levels))))


class _AdmitAt(Policy):
    """A policy for warm-ups: admits requests at the given levels, in turn (the last one after)."""

    name = "warm-up"

    def __init__(self, levels: Sequence[int]):
        self.levels = list(levels)
        self.next = 0

    def admission_level(self, prompt_tokens, final_tokens, memory) -> int:
        level = self.levels[min(self.next, len(self.levels) - 1)]
        self.next += 1
        return level

    def level_cap(self, levels) -> int:
        return max(self.levels)


def most_running(engine: Engine, requests: Sequence["ReplayRequest"]) -> int:
    """The most of ``requests`` that can ever run at once on ``engine``: its smallest prompts, each at
    its fewest bytes at any level the policy may give, added until the next would pass the budget
    (at least 1, at most ``max_running``): the largest decode batch a replay of them takes."""
    cap, levels, budget = engine.policy.level_cap(engine.levels), engine.levels, engine.config.kv_budget
    need = sorted(min(levels.bytes(k, len(r.prompt)) for k in range(cap + 1)) for r in requests)
    used = count = 0
    for b in need:
        if used + b > budget:
            break
        used, count = used + b, count + 1
    return max(1, min(count, engine.config.max_running))


def warm_up_graphs(engine: Engine, tokens: Sequence[int], levels: Sequence[int], lows: Sequence[int] = (),
                   max_rows: int | None = None) -> int:  # fmt: skip
    """Run every static step shape the engine's steps will take at ``levels`` twice before anything
    is timed, so that their CUDA graphs are captured now rather than by timed steps (a capture stops
    the device and costs several eager steps): decode steps at every padded batch size up to
    ``max_running``, or ``max_rows`` where given (e.g. ``most_running``) (batches of one-chunk prompts that decode together at least twice; at each level
    one batch with every row at it and, for each lower level of ``lows`` and the lowest of
    ``levels``, one with a row at that level beside the others: a decode graph is keyed by the
    batch's lowest and highest levels) and prefill chunks of every
    multiple of the runner's alignment up to ``max_step_tokens``, first chunks and continuations
    (prompts of two such chunks and one token, the step's budget set to the chunk). Call it after
    ``Engine.reserve`` (a growth of the arena drops the graphs). Returns the requests run (0 where
    the runner has no static steps); the engine's records and counters are cleared after."""
    from .graphs import bucket_rows
    from .policy import StaticPolicy

    align = getattr(engine.runner, "prefill_align", 1)  # > 1 exactly where the runner has static steps
    if align <= 1:
        return 0
    policy, budget = engine.policy, engine.config.max_step_tokens
    most = engine.config.max_running if max_rows is None else max(1, min(max_rows, engine.config.max_running))
    sizes = [min(b, most) for b in sorted({bucket_rows(n) for n in range(1, most + 1)})]  # rows that fill each bucket
    stream = list(tokens) or [1]

    def prompt(n: int) -> list[int]:
        return (stream * (n // len(stream) + 1))[:n]

    ran = 0
    lows = sorted({min(levels, default=0), *lows})
    try:
        for level in sorted(set(levels)):
            # each bucket with every row at the level, then with one row at each lower level of lows:
            # a decode step's graph is keyed by the batch's lowest and highest levels
            mixes = [(level,)] + [(low, level) for low in lows if low < level]
            for mix in mixes:
                for rows in sizes:  # prompts of one aligned chunk: a few steps prefill them all, then the whole batch decodes twice
                    if rows < len(mix):
                        continue
                    engine.policy = _AdmitAt([mix[0]] + [mix[-1]] * (rows - 1))
                    steps = -(-rows * align // max(budget - rows, align))
                    for _ in range(rows):
                        engine.add_request(prompt(align), SamplingParams(max_tokens=2 * steps + 3, temperature=0.0, ignore_eos=True))
                    engine.run()
                    ran += rows
            engine.policy = StaticPolicy(level)
            for chunk in range(align, budget + 1, align):
                engine.config.max_step_tokens = chunk
                for _ in range(2):
                    engine.add_request(prompt(2 * chunk + 1), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                    engine.run()
                    ran += 1
                engine.config.max_step_tokens = budget
    finally:
        engine.policy, engine.config.max_step_tokens = policy, budget
        engine.finished.clear()
        engine.counters.clear()
        engine.peak_bytes = 0
    return ran


def warm_up_levels(model, levels, max_level: int | None = None, lengths: Sequence[int] = WARM_UP_LENGTHS) -> list[int]:
    """``warm_up`` on a throwaway engine over ``model`` (no memory limit) whose policy may reach
    ``max_level`` (default: every layer of the order): level 0, the middle and that top level."""
    from .engine import EngineConfig
    from .policy import StaticPolicy

    cap = levels.max_level if max_level is None else min(max_level, levels.max_level)
    vocab = model.config.vocab_size
    engine = Engine(model, levels, EngineConfig(kv_budget=1 << 62, max_step_tokens=512), policy=StaticPolicy(cap))
    done = warm_up(engine, [3 + i % max(vocab - 3, 1) for i in range(max(lengths))], lengths)
    engine.close()
    logger.info("warmed up levels %s", done)
    return done


PROFILE_FROM_STEP = 20
"""The engine step a profile starts at by default (the first steps of a replay are prefills only)."""


def replay_engine(engine: Engine, requests: Sequence[ReplayRequest], *, rate_scale: float = 1.0, timeout: float | None = None,
                  progress: bool = True, profile_steps: int = 0, profile_from: int = PROFILE_FROM_STEP,
                  profile_out: Path | None = None) -> tuple[list[RequestRecord], list[dict[str, Any]]]:
    """Replay ``requests`` open loop against ``engine`` in this process; (records, timeline samples of
    memory and levels). Arrivals at ``arrival / rate_scale`` seconds after the start. With
    ``profile_steps``, steps ``profile_from``.. of the replay run under torch.profiler and its
    operator table goes to ``profile_out``; the replay's clock stops while the table is written (seconds
    of work that no request should wait for: arrivals, token times and the timeout all resume where
    they were)."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    records = [RequestRecord(r.arrival / rate_scale, len(r.prompt), r.output_tokens) for r in requests]
    ids: dict[str, int] = {}
    timeline: list[dict[str, Any]] = []
    start = time.monotonic()
    nxt = 0
    bar = tqdm(total=len(requests), desc=f"replay {engine.policy}", unit="req", disable=not progress)
    profiler, steps = None, 0
    while nxt < len(requests) or engine.has_work():
        now = time.monotonic() - start
        if timeout is not None and now > timeout:
            break
        while nxt < len(requests) and records[nxt].arrival <= now:
            r = requests[nxt]
            rid = engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True))
            ids[rid] = nxt
            nxt += 1
        if not engine.has_work():
            time.sleep(min(0.01, max(0.0, records[nxt].arrival - now)))
            continue
        if profile_steps and steps == profile_from:
            profiler = _start_profiler(engine.device)
        outputs = engine.step()
        steps += 1
        if profiler is not None and steps == profile_from + profile_steps:
            paused = time.monotonic()
            _write_profile(profiler, profile_out, steps=profile_steps)
            profiler = None
            start += time.monotonic() - paused  # the clock stood still while the profile was written
        stamp = time.monotonic() - start
        bar.update(stamp_outputs(engine, outputs, records, ids, stamp))
        timeline.append({**step_sample(engine, stamp), "decode_s": engine.last_step.decode_s, "prefill_s": engine.last_step.prefill_s})
    bar.close()
    if profiler is not None:  # the replay ended first: what was profiled
        _write_profile(profiler, profile_out, steps=steps - profile_from)
    for rec in records:
        if rec.finish is None:
            rec.status = "unfinished"
    return records, timeline


def stamp_outputs(engine: Engine, outputs, records: Sequence[RequestRecord], ids: dict[str, int], stamp: float) -> int:
    """Record one engine step's outputs at ``stamp`` (seconds since the replay's start) in the
    records of their requests (``ids``: request id -> record index); how many requests finished."""
    finished = 0
    for out in outputs:
        rec = records[ids[out.request_id]]
        rec.token_times.extend([stamp] * len(out.token_ids))
        if out.finish_reason is not None:
            rec.finish = stamp
            request = engine.get(out.request_id)
            rec.level, rec.preemptions, rec.generated = request.level, request.preemptions, len(request.output)
            if out.finish_reason not in ("stop", "length"):
                rec.status = out.finish_reason
            finished += 1
    return finished


def step_sample(engine: Engine, stamp: float) -> dict[str, Any]:
    """The timeline's sample of the engine after a step: memory held, requests running and waiting,
    their mean level, and the step's decoded rows and prefilled tokens."""
    running, work = engine.running, engine.last_step
    return {"t": stamp, "bytes": sum(engine.held_after_step), "running": len(running), "waiting": len(engine.waiting),
            "mean_level": statistics.fmean([r.level for r in running]) if running else 0.0,
            "decode_rows": work.decode_rows, "prefill_tokens": work.prefill_tokens}  # fmt: skip


def _start_profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.__enter__()
    return profiler


def _write_profile(profiler, out: Path | None, *, steps: int) -> None:
    """Operators of the profiled steps by self CPU time and (on CUDA) by self device time, to ``out``."""
    from ..io import atomic_write_text

    profiler.__exit__(None, None, None)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    events = profiler.key_averages()
    parts = [f"# {steps} engine steps under torch.profiler\n", "## by self CPU time\n",
             events.table(sort_by="self_cpu_time_total", row_limit=40)]  # fmt: skip
    if any(getattr(e, "self_device_time_total", 0) for e in events):
        parts += ["\n## by self device time\n", events.table(sort_by="self_device_time_total", row_limit=40)]
    atomic_write_text(out, "\n".join(parts))
    logger.info("profile of %d steps: %s", steps, out)


# ----------------------------------------------------------------------------- metrics


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)

    def pct(q: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]

    return {"mean": statistics.fmean(v), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def is_rejected(status: str) -> bool:
    """Whether a record's status says the server refused it (the engine's memory, or an HTTP error answer)."""
    return status == "rejected" or status.startswith("http ")


def summarize(records: Sequence[RequestRecord], *, slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Aggregate metrics of one replay: every request is in ``statuses``; ``rejected`` counts those the
    server refused, ``lost`` those that timed out, stayed unfinished or failed."""
    done = [r for r in records if r.status == "ok"]
    span = max((r.finish for r in done), default=0.0) - min((r.arrival for r in records), default=0.0)
    out_tokens = sum(r.n_out for r in done)
    slo = slo or {}

    def meets(r: RequestRecord) -> bool:
        checks = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2e": r.e2e}
        return all(checks[k] is not None and checks[k] <= v for k, v in slo.items())

    return {
        "requests": len(records),
        "completed": len(done),
        "rejected": sum(is_rejected(r.status) for r in records),
        "lost": sum(r.status != "ok" and not is_rejected(r.status) for r in records),
        "statuses": dict(sorted(Counter(r.status for r in records).items())),
        "duration_s": span,
        "request_throughput": len(done) / span if span > 0 else None,
        "output_throughput": out_tokens / span if span > 0 else None,
        "ttft_s": _stats([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": _stats([r.tpot for r in done if r.tpot is not None]),
        "itl_s": _stats([x for r in done for x in r.itls]),
        "e2e_s": _stats([r.e2e for r in done if r.e2e is not None]),
        "normalized_latency_s": _stats([r.normalized for r in done if r.normalized is not None]),
        "goodput": (sum(meets(r) for r in done) / span if span > 0 else None) if slo else None,
        "slo": slo,
        "preemptions": sum(r.preemptions for r in done),
        "mean_level": statistics.fmean([r.level for r in done]) if done else None,
    }


def _file_name(policy: str) -> str:
    """A policy's name as a file name part ('static:25%' -> 'static-25pct', 'memory:high=1.0' -> 'memory-high1.0')."""
    return policy.replace(":", "-").replace("%", "pct").replace("#", "-run").replace("=", "")


def step_stats(timeline: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Engine steps of an in-process replay (one timeline sample per step): how many, their durations
    (seconds between consecutive steps' ends: mean, p50, p90, p99), the mean number of running
    requests, and where the time went: ``decode_s`` (the decode forwards of the steps that decoded:
    mean, p50, ...; ``mean_decode_rows`` their rows), ``prefill_s_per_token`` (all prefill and
    recompute time over the tokens it fed) and ``prefill_share`` (prefill time over decode and
    prefill time together) and ``decode_fit`` (the decode forwards' seconds as a fixed cost plus a
    cost per row); None where the timeline does not say."""
    times = [p["t"] for p in timeline]
    decodes = [p for p in timeline if p.get("decode_rows")]
    prefill_s = sum(p.get("prefill_s", 0.0) for p in timeline)
    prefill_tokens = sum(p.get("prefill_tokens", 0) for p in timeline)
    work_s = prefill_s + sum(p["decode_s"] for p in decodes)
    return {"steps": len(times), "duration_s": _stats([b - a for a, b in zip(times, times[1:])]),
            "mean_running": statistics.fmean([p["running"] for p in timeline]) if timeline else None,
            "decode_s": _stats([p["decode_s"] for p in decodes]),
            "mean_decode_rows": statistics.fmean([p["decode_rows"] for p in decodes]) if decodes else None,
            "prefill_s_per_token": prefill_s / prefill_tokens if prefill_tokens else None,
            "prefill_share": prefill_s / work_s if work_s > 0 else None,
            "decode_fit": decode_fit([p["decode_rows"] for p in decodes], [p["decode_s"] for p in decodes])}  # fmt: skip


def decode_fit(rows: Sequence[int], seconds: Sequence[float]) -> dict[str, float] | None:
    """The least-squares line seconds = fixed_s + per_row_s * rows over decode forwards: what a
    forward costs whatever its batch (launches, host work, weight reads) and what each row adds
    (its KV or state reads). None with fewer than two distinct row counts."""
    if len(set(rows)) < 2:
        return None
    per_row, fixed = statistics.linear_regression([float(r) for r in rows], list(seconds))
    return {"fixed_s": fixed, "per_row_s": per_row}


Run = Callable[[], tuple[list[RequestRecord], list[dict[str, Any]], dict[str, Any]]]
"""One policy's replay: () -> (records, timeline, what the server counted: peak_bytes, budget_bytes,
conversions, and optionally preemptions and mean_level, which then replace the records' own)."""


def memory_bound(levels: LevelMemory, policy: Policy, requests: Sequence[ReplayRequest], budget: int) -> dict[str, float | None]:
    """What a policy's bytes allow where memory bounds the batch: each request at its final length
    (prompt + output) and at the level the policy gives it with the budget full (static and
    length-caps: their one level; memory: its level cap), against every request at level 0.
    {"bytes_vs_softmax": the policy's bytes / softmax's, "capacity_vs_softmax": its inverse, how many
    times softmax's concurrent requests the same memory holds}. On a server whose batch memory
    bounds, the capacity is about what the policy gains in tokens per step; mean latency follows it,
    except at loads between softmax's capacity and the policy's, where softmax's queue grows."""
    full = MemoryView(budget, budget, levels)
    softmax = ours = 0
    for request in requests:
        final = request.final_tokens
        softmax += levels.bytes(0, final)
        ours += levels.bytes(policy.admission_level(len(request.prompt), final, full), final)
    if not softmax or not ours:
        return {"bytes_vs_softmax": None, "capacity_vs_softmax": None}
    return {"bytes_vs_softmax": ours / softmax, "capacity_vs_softmax": softmax / ours}


def run_replay(engine_factory, requests: Sequence[ReplayRequest], policies: Sequence[str], *, rate_scale: float = 1.0,
               slo: dict[str, float] | None = None, timeout: float | None = None, out_dir: str | Path | None = None,
               settings: dict[str, Any] | None = None, profile_steps: int = 0, profile_from: int = PROFILE_FROM_STEP) -> dict[str, Any]:
    """Replay the same requests once per policy (``engine_factory(policy) -> Engine``) in this process;
    the report (JSON-able; with ``out_dir``: report.json, report.md and plots, written atomically).
    A policy named again runs again as a control, reported as 'NAME#2', 'NAME#3', ... (e.g.
    softmax,length-caps,memory,softmax: whether the order of the runs moved the numbers); where a
    policy ran more than once the report adds its runs together (``across_runs``)."""

    def run(policy: str, name: str) -> Run:
        def replay() -> tuple[list[RequestRecord], list[dict[str, Any]], dict[str, Any]]:
            engine = engine_factory(policy)
            device = engine.device
            try:
                tokens = requests[0].prompt if requests else [1]
                warm_up(engine, tokens)
                engine.reserve(max((r.final_tokens for r in requests), default=1))  # no growth while timed
                warm_up_graphs(engine, tokens, graph_levels(engine, requests), lows=admitted_levels(engine, requests),
                               max_rows=most_running(engine, requests))  # fmt: skip
                retries = _alloc_retries(device)
                profile_out = Path(out_dir) / f"profile_{_file_name(name)}.txt" if profile_steps and out_dir is not None else None
                records, timeline = replay_engine(engine, requests, rate_scale=rate_scale, timeout=timeout, profile_steps=profile_steps,
                                                  profile_from=profile_from, profile_out=profile_out)  # fmt: skip
                arena = getattr(engine.runner, "arena_bytes", None)
                return records, timeline, {"peak_bytes": engine.peak_bytes, "budget_bytes": engine.config.kv_budget,
                                           "conversions": engine.counters["conversions"],
                                           "arena_bytes": arena() if arena is not None else None,
                                           "alloc_retries": None if retries is None else _alloc_retries(device) - retries,
                                           "engine_steps": step_stats(timeline),
                                           "memory_bound": memory_bound(engine.levels, engine.policy, requests, engine.config.kv_budget)}  # fmt: skip
            finally:
                engine.close()
                del engine
                _release_memory(device)
        return replay

    return report_runs({name: run(policy, name) for name, policy in zip(run_names(policies), policies)}, n_requests=len(requests),
                       rate_scale=rate_scale, slo=slo, out_dir=out_dir, settings=settings)  # fmt: skip


def _alloc_retries(device: torch.device) -> int | None:
    """CUDA: how often the caching allocator has run out of free memory and retried after releasing its
    cache (each time a device synchronisation); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def _release_memory(device: torch.device) -> None:
    """After a policy: its engine's pools go back to the device before the next policy builds its own, so
    every policy starts from the same free memory instead of the blocks the earlier ones left cached
    (whether the allocator ran short during a policy is in its report: allocator retries)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_names(policies: Sequence[str]) -> list[str]:
    """Report names of policies run in turn: a repeated policy's later runs get '#2', '#3', ..."""
    seen: Counter = Counter()
    names = []
    for policy in policies:
        seen[policy] += 1
        names.append(policy if seen[policy] == 1 else f"{policy}#{seen[policy]}")
    return names


def report_runs(runs: dict[str, Run], *, n_requests: int, rate_scale: float, slo: dict[str, float] | None = None,
                out_dir: str | Path | None = None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run each policy's replay in turn and report them (in process or over HTTP): metrics, speed-up
    against softmax when it ran, report.json / report.md after every policy and the plots at the end."""
    result: dict[str, Any] = {"settings": {**(settings or {}), "rate_scale": rate_scale, "requests": n_requests}, "policies": {}}
    raw: dict[str, Any] = {}
    for policy, run in runs.items():
        records, timeline, counted = run()
        summary = summarize(records, slo=slo)
        summary.update(counted)
        result["policies"][policy] = summary
        raw[policy] = {"records": [asdict(r) for r in records], "timeline": timeline}
        logger.info("%s: mean normalised latency %s", policy, summary["normalized_latency_s"]["mean"])
        if out_dir is not None:  # after every policy: a run cut short keeps the policies it finished
            _write(result, raw, Path(out_dir), plots=False)
    base = result["policies"].get("softmax")
    if base and base["normalized_latency_s"]["mean"]:
        for summary in result["policies"].values():
            mean = summary["normalized_latency_s"]["mean"]
            summary["speedup_vs_softmax"] = base["normalized_latency_s"]["mean"] / mean if mean else None
    across = across_runs(result["policies"])
    if across:
        result["across_runs"] = across
    if out_dir is not None:
        _write(result, raw, Path(out_dir), plots=True)
    return result


def base_policy(name: str) -> str:
    """The policy a report name stands for: 'softmax#2' -> 'softmax' (``run_names``' suffix removed)."""
    head, sep, tail = name.rpartition("#")
    return head if sep and tail.isdigit() else name


def across_runs(policies: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each policy's runs together, where some policy ran more than once: the mean over its runs of
    each run's mean normalised latency, their lowest and highest, the mean p99 and TTFT, requests
    lost in all runs, and against softmax's runs: the ratio of the means and whether the two ranges
    are apart (every run of one policy faster than every run of the other: ``apart_from_softmax``,
    None unless both ran at least twice). {} when every policy ran once."""
    if len({base_policy(name) for name in policies}) == len(policies):
        return {}
    return runs_together(policies)


def runs_together(policies: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``across_runs``' entries for every policy, also where each ran once (its range is its mean)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for name, summary in policies.items():
        groups.setdefault(base_policy(name), []).append(summary)

    def of(runs: list[dict[str, Any]], metric: str, stat: str) -> list[float]:
        return [m[metric][stat] for m in runs if m[metric][stat] is not None]

    out: dict[str, dict[str, Any]] = {}
    for policy, runs in groups.items():
        means = of(runs, "normalized_latency_s", "mean")
        out[policy] = {"runs": len(runs), "normalized_latency_mean_s": _stats(means)["mean"], "normalized_latency_min_s": min(means, default=None),
                       "normalized_latency_max_s": max(means, default=None), "p99_mean_s": _stats(of(runs, "normalized_latency_s", "p99"))["mean"],
                       "ttft_mean_s": _stats(of(runs, "ttft_s", "mean"))["mean"], "lost": sum(m["lost"] for m in runs)}  # fmt: skip
    base = out.get("softmax")
    for policy, entry in out.items():
        ours = entry["normalized_latency_mean_s"]
        ok = base is not None and ours and base["normalized_latency_mean_s"]
        entry["speedup_vs_softmax"] = base["normalized_latency_mean_s"] / ours if ok else None
        both = ok and policy != "softmax" and entry["runs"] > 1 and base["runs"] > 1
        entry["apart_from_softmax"] = (entry["normalized_latency_max_s"] < base["normalized_latency_min_s"]
                                       or entry["normalized_latency_min_s"] > base["normalized_latency_max_s"]) if both else None  # fmt: skip
    return out


def sweep_report(results: dict[float, dict[str, Any]]) -> dict[str, Any]:
    """Replays of the same requests at several rate scales (rate scale -> its report) as each
    policy's numbers against the rate: {"settings", "rate_scales", "policies": {policy: [one entry
    per rate it ran at: "rate_scale" and the report's ``across_runs`` entry, or ``runs_together``'s
    where each policy ran once]}}."""
    if not results:
        raise ValueError("a sweep needs at least one replay")
    first = next(iter(results.values()))
    policies: dict[str, list[dict[str, Any]]] = {}
    for rate, result in results.items():
        for policy, entry in (result.get("across_runs") or runs_together(result["policies"])).items():
            policies.setdefault(policy, []).append({"rate_scale": rate, **entry})
    bounds = {base_policy(name): (m.get("memory_bound") or {}).get("capacity_vs_softmax") for name, m in first["policies"].items()}
    return {"settings": {k: v for k, v in first["settings"].items() if k != "rate_scale"}, "rate_scales": list(results),
            "policies": policies, "memory_bound": {p: b for p, b in bounds.items() if b is not None}}  # fmt: skip


def sweep_markdown(sweep: dict[str, Any]) -> str:
    s = sweep["settings"]
    policies = list(sweep["policies"])
    by_rate = {p: {e["rate_scale"]: e for e in entries} for p, entries in sweep["policies"].items()}
    others = [p for p in policies if p != "softmax"] if "softmax" in policies else []

    def f(x, scale=1.0, digits=1):
        return "" if x is None else f"{x * scale:.{digits}f}"

    lines = [f"# Trace replay at several rates\n\n{s['requests']} requests at each rate scale (arrival times / the rate scale); "
             + ", ".join(f"{k} {v}" for k, v in s.items() if k != "requests") + "\n",
             "Mean normalised latency (ms per output token; with repeats: the mean of the runs' means), each converting "
             "policy's ratio to softmax (above 1: faster), p99 (mean of runs) and requests lost in all runs.\n",
             "| rate scale | " + " | ".join(f"{p}" for p in policies) + "".join(f" | {p} vs softmax" for p in others)
             + " | " + " | ".join(f"p99 {p}" for p in policies) + " | lost |",
             "|---:|" + "---:|" * (2 * len(policies) + len(others) + 1)]  # fmt: skip
    for rate in sweep["rate_scales"]:
        cells = [by_rate[p].get(rate) for p in policies]
        ratios = [by_rate[p].get(rate, {}).get("speedup_vs_softmax") for p in others]
        lost = sum(c["lost"] for c in cells if c is not None)
        lines.append(f"| {rate:g} | " + " | ".join(f(c and c["normalized_latency_mean_s"], 1e3) for c in cells)
                     + "".join(f" | {f(r, 1, 2)}x" if r is not None else " | " for r in ratios)
                     + " | " + " | ".join(f(c and c["p99_mean_s"], 1e3, 0) for c in cells) + f" | {lost} |")  # fmt: skip
    bounds = sweep.get("memory_bound") or {}
    if any(p in bounds for p in others):
        lines += ["", "Memory bound (the same at every rate: how many times softmax's concurrent requests each policy's bytes let "
                      "the budget hold, every request at its final length and at the level the policy gives it with memory full): "
                  + ", ".join(f"{p} {bounds[p]:.2f}x" for p in others if p in bounds) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_sweep(sweep: dict[str, Any], out: str | Path) -> None:
    """sweep.json, sweep.md and latency_vs_rate.png in ``out``, each written atomically."""
    from ..io import write_results

    out = Path(out)
    write_results(out, "sweep", sweep, sweep_markdown(sweep), indent=1)
    plot_sweep(sweep, out)


def plot_sweep(sweep: dict[str, Any], out: Path) -> None:
    """latency_vs_rate.png: each policy's mean normalised latency against the rate scale (bars: the
    fastest and slowest run) and, beside it, each converting policy's ratio to softmax, with its memory
    bound dashed where the reports give one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..io import save_png

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, entries in sweep["policies"].items():
        done = [e for e in entries if e["normalized_latency_mean_s"] is not None]
        rates = [e["rate_scale"] for e in done]
        mean = [e["normalized_latency_mean_s"] * 1e3 for e in done]
        spread = [[m - e["normalized_latency_min_s"] * 1e3 for m, e in zip(mean, done)],
                  [e["normalized_latency_max_s"] * 1e3 - m for m, e in zip(mean, done)]]  # fmt: skip
        left.errorbar(rates, mean, yerr=spread, marker="o", capsize=3, label=policy)
        if policy != "softmax":
            ratio = [(e["rate_scale"], e["speedup_vs_softmax"]) for e in done if e.get("speedup_vs_softmax") is not None]
            if ratio:
                (line,) = right.plot(*zip(*ratio), marker="o", label=policy)
                bound = (sweep.get("memory_bound") or {}).get(policy)
                if bound is not None:
                    right.axhline(bound, color=line.get_color(), ls="--", lw=1, label=f"{policy}: memory bound")
    left.set(xlabel="rate scale (x the trace's arrival rate)", ylabel="mean normalised latency (ms per output token)", yscale="log")
    right.axhline(1.0, color="grey", lw=1)
    right.set(xlabel="rate scale (x the trace's arrival rate)", ylabel="softmax's latency / the policy's (above 1: faster)")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, out / "latency_vs_rate.png")


def _write(result: dict[str, Any], raw: dict[str, Any], out: Path, *, plots: bool) -> None:
    from ..io import write_results

    write_results(out, "report", {**result, "raw": raw}, replay_markdown(result), indent=1)
    if plots:
        plot_replay(raw, out)


def replay_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"# Trace replay\n\n{s['requests']} requests, arrival times / {s['rate_scale']}; "
             + ", ".join(f"{k} {v}" for k, v in s.items() if k not in ("requests", "rate_scale")) + "\n",
             "Memory bound: how many times softmax's concurrent requests the policy's bytes let the budget hold (every request at "
             "its final length, at the level the policy gives it with memory full): about what it gains in tokens per step where "
             "memory bounds the batch.\n",
             "| policy | completed | rejected | lost | mean normalised latency (ms/token) | p99 | vs softmax | memory bound | TTFT mean (s) "
             "| TTFT p99 | TPOT mean (ms) | E2E mean (s) | out tok/s | goodput (req/s) | preemptions | conversions | mean level | peak / budget |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, scale=1.0, digits=2):
        return "" if x is None else f"{x * scale:.{digits}f}"

    def peak(m) -> str:
        """Peak held over budget; over HTTP the sampled peak and the bound the server's histogram gives."""
        text = f"{f(m['peak_bytes'] / m['budget_bytes'], 100, 0)}%" if m.get("peak_bytes") is not None and m.get("budget_bytes") else ""
        bounds = m.get("peak_budget_fraction_bounds")
        if bounds:
            text += f" (<= {f(bounds[1], 100, 0)}%)" if bounds[1] is not None else f" (> {f(bounds[0], 100, 0)}%)"
        return text

    def bound(m) -> str:
        capacity = (m.get("memory_bound") or {}).get("capacity_vs_softmax")
        return "" if capacity is None else f"{capacity:.2f}x"

    for policy, m in result["policies"].items():
        lines.append(
            f"| {policy} | {m['completed']} | {m['rejected']} | {m['lost']} | {f(m['normalized_latency_s']['mean'], 1e3)} "
            f"| {f(m['normalized_latency_s']['p99'], 1e3)} | {f(m.get('speedup_vs_softmax'))}x | {bound(m)} | {f(m['ttft_s']['mean'])} "
            f"| {f(m['ttft_s']['p99'])} "
            f"| {f(m['tpot_s']['mean'], 1e3)} | {f(m['e2e_s']['mean'])} | {f(m['output_throughput'], 1, 1)} | {f(m['goodput'])} "
            f"| {m['preemptions']} | {m['conversions']} | {f(m['mean_level'], 1, 1)} "
            f"| {peak(m)} |"
        )
    across = result.get("across_runs")
    if across:
        lines += ["", "Across runs: each policy's runs together (mean of the runs' mean normalised latencies; range: the fastest and the "
                      "slowest run). 'apart' means every run of the policy was faster (or every one slower) than every softmax run; "
                      "'within the spread' that the ranges overlap, so this replay does not rank the two.", "",
                  "| policy | runs | mean normalised latency (ms/token) | range | vs softmax | p99 (mean of runs) | TTFT mean (s) | lost | "
                  "against softmax |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for policy, a in across.items():
            apart = {True: "apart", False: "within the spread", None: ""}[a["apart_from_softmax"]]
            lines.append(f"| {policy} | {a['runs']} | {f(a['normalized_latency_mean_s'], 1e3)} | {f(a['normalized_latency_min_s'], 1e3)}"
                         f"-{f(a['normalized_latency_max_s'], 1e3)} | {f(a['speedup_vs_softmax'])}x | {f(a['p99_mean_s'], 1e3)} "
                         f"| {f(a['ttft_mean_s'])} | {a['lost']} | {apart} |")
    stepped = {p: m for p, m in result["policies"].items() if m.get("engine_steps")}
    if stepped:
        lines += ["", "Engine steps (in process): time between consecutive steps' ends, with the requests running; "
                  "where it went: the decode forward of the steps that decoded (its median and mean rows), prefill and "
                  "recompute chunks per 1,000 tokens they fed, and prefill's share of the two; the decode forward "
                  "fitted as a fixed cost plus a cost per row (least squares over its steps).", "",
                  "| policy | steps | mean (ms) | p50 | p90 | p99 | mean running | decode forward p50 (ms) | rows | "
                  "decode fixed (ms) | per row (ms) | prefill ms / 1K tokens | prefill share | pools allocated (GiB) | allocator retries |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for policy, m in stepped.items():
            st, d = m["engine_steps"], m["engine_steps"]["duration_s"]
            dec = st.get("decode_s") or {}
            arena, retries = m.get("arena_bytes"), m.get("alloc_retries")
            share, fit = st.get("prefill_share"), st.get("decode_fit") or {}
            lines.append(f"| {policy} | {st['steps']} | {f(d['mean'], 1e3, 1)} | {f(d['p50'], 1e3, 1)} | {f(d['p90'], 1e3, 1)} "
                         f"| {f(d['p99'], 1e3, 1)} | {f(st['mean_running'], 1, 1)} | {f(dec.get('p50'), 1e3, 1)} "
                         f"| {f(st.get('mean_decode_rows'), 1, 1)} | {f(fit.get('fixed_s'), 1e3, 1)} | {f(fit.get('per_row_s'), 1e3, 2)} "
                         f"| {f(st.get('prefill_s_per_token'), 1e6, 1)} "
                         f"| {'' if share is None else f'{share:.0%}'} | {f(arena / 2**30 if arena else None, 1, 2)} "
                         f"| {'' if retries is None else retries} |")
    return "\n".join(lines) + "\n"


def _n_out(record: dict[str, Any]) -> int:
    return len(record["token_times"]) if record.get("generated") is None else record["generated"]


def plot_replay(raw: dict[str, Any], out: Path) -> None:
    """latency_cdf.png (normalised latency per policy), latency_vs_length.png, memory_levels.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..io import save_png

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, data in raw.items():
        norm = sorted(((r["finish"] - r["arrival"]) / max(_n_out(r), 1)) * 1e3
                      for r in data["records"] if r["status"] == "ok" and r["finish"] is not None)  # fmt: skip
        if norm:
            ax.plot(norm, [(i + 1) / len(norm) for i in range(len(norm))], label=policy)
    ax.set(xlabel="normalised latency (ms per output token)", ylabel="fraction of requests", xscale="log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, out / "latency_cdf.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, data in raw.items():
        done = [r for r in data["records"] if r["status"] == "ok" and r["finish"] is not None]
        ax.scatter([r["prompt_tokens"] for r in done], [(r["finish"] - r["arrival"]) / max(_n_out(r), 1) * 1e3 for r in done],
                   s=6, alpha=0.6, label=policy)  # fmt: skip
    ax.set(xlabel="prompt tokens", ylabel="normalised latency (ms per output token)", yscale="log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, out / "latency_vs_length.png")

    fig, axes = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for policy, data in raw.items():
        t = [p["t"] for p in data["timeline"]]
        axes[0].plot(t, [p["bytes"] / 2**20 for p in data["timeline"]], label=policy)
        axes[1].plot(t, [p["mean_level"] for p in data["timeline"]], label=policy)
    axes[0].set(ylabel="memory held (MiB)")
    axes[1].set(ylabel="mean level of running", xlabel="seconds")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_png(fig, out / "memory_levels.png")
