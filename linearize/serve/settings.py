"""Server settings: one dataclass feeds the ``linearize serve`` flags, the app builder and Ray Serve;
``ReplaySettings`` feeds ``linearize replay``. No torch here: the command line builds its parser from them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SERVE_MODEL = "smollm2-135m-dsla-chained"
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass
class ServeSettings:
    """What ``linearize serve`` runs (each field is the flag of the same name, dashes for underscores)."""

    model: str = DEFAULT_SERVE_MODEL
    """A nested family (shipped name or directory): its conversion order gives the levels; or random:llama2-7b, random:tiny
    (random weights, for timing)."""
    served_model_name: str | None = None
    """The name clients use (default: model)."""
    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface)."""
    port: int = 8000
    """TCP port."""
    policy: str = "memory"
    """softmax | static:K | static:P% | length-caps | memory: how many layers each request runs converted."""
    kv_budget: str = "1GiB"
    """Bytes all requests' KV and states may hold: 8GiB, 512MiB, ... or a fraction of free GPU memory (0.5, 50%)."""
    max_level: int | None = None
    """Memory policy: convert at most this many layers per request (a quality cap)."""
    high_water: float = 0.9
    """Memory policy: raise levels of the longest requests above this fraction of the budget."""
    low_water: float = 0.6
    """Memory policy: new requests start unconverted while memory stays below this fraction."""
    max_step_tokens: int = 512
    """Tokens per engine step: decodes first, then prefill chunks."""
    max_running: int = 64
    """Requests decoding together at most."""
    runner: str = "pooled"
    """pooled: requests' memory in per-layer slot pools; reference: per-request states merged every layer (slow, plain)."""
    graphs: bool = True
    """Pooled runner on CUDA: decode steps replayed as CUDA graphs, one per padded batch size and highest level, and
    prefill chunks of multiples of 64 tokens, one per length, level and first chunk or not (--no-graphs: launched op by op)."""
    max_prompt_tokens: int = 8192
    """Longer prompts get 400."""
    max_waiting: int = 256
    """Queued requests beyond this get 503."""
    api_key: str | None = field(default_factory=lambda: os.environ.get("LINEARIZE_API_KEY"))
    """Require 'Authorization: Bearer KEY' on /v1 routes (default: $LINEARIZE_API_KEY, else none)."""
    device: str | None = None
    """cpu | cuda (default: cuda when available)."""
    replicas: int = 1
    """Engines behind one endpoint: more than 1 runs them as Ray Serve replicas (one GPU each on CUDA)."""

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")
        for name in ("max_step_tokens", "max_running", "max_prompt_tokens", "max_waiting", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        check_runner(self.runner)
        parse_bytes(self.kv_budget)
        if str(self.model).startswith("random:"):
            from .random_family import random_shape

            random_shape(self.model)


RUNNERS = ("pooled", "reference")
"""The engine's runners: slot pools (default) or per-request states merged every layer (the reference)."""


def check_runner(runner: str) -> str:
    """``runner`` if it names one of RUNNERS; ValueError naming it and the choices otherwise."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    return runner


def parse_bytes(text: str) -> int | float:
    """'8GiB', '512MiB', '1.5GB', '123456' -> bytes (int); '0.5' or '50%' -> a fraction (float) of the
    device memory free at start. ValueError naming the value and the forms."""
    t = str(text).strip().lower()
    if t.endswith("%"):
        try:
            fraction = float(t[:-1]) / 100
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            raise ValueError(f"kv-budget {text!r}: a percentage must lie in (0%, 100%]")
        return fraction
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]i?b|b)?", t)
    if m is None:
        raise ValueError(f"kv-budget {text!r}: expected bytes ('8GiB', '512MiB', '2GB', '1000000') or a fraction of free GPU memory ('0.5', '50%')")
    value, unit = float(m.group(1)), m.group(2) or ""
    if unit == "" and "." in m.group(1) and value <= 1:
        if value <= 0:
            raise ValueError(f"kv-budget {text!r}: a fraction must lie in (0, 1]")
        return value
    n = int(value * UNITS[unit])
    if n < 1:
        raise ValueError(f"kv-budget {text!r} is not a positive number of bytes")
    return n


DEFAULT_POLICIES = "softmax,static:25%,length-caps,memory"
"""The policies an in-process replay compares by default."""
TRACE_NAMES = {"azure-conv": "azure_llm_2023_conv.csv", "azure-code": "azure_llm_2023_code.csv"}
"""Shipped traces by name."""


@dataclass
class ReplaySettings:
    """What ``linearize replay`` replays (each field is the flag of the same name, dashes for underscores)."""

    trace: str = "azure-conv"
    """A shipped trace (azure-conv, azure-code) or a path (.csv Azure 2023, .jsonl Mooncake)."""
    policies: str | None = None
    """Comma-separated policies, each replayed on the same requests in one run (default: softmax,static:25%,length-caps,memory;
    with --url: the server's one policy, named by its /metrics)."""
    url: str | None = None
    """Replay against a running server (http://HOST:PORT) through /v1/completions instead of an engine in this process."""
    repeats: int = 1
    """In process: replay the policy list this many times in turn (softmax,memory with 2: softmax, memory, softmax#2,
    memory#2). The report adds each policy's mean over its runs and their range, and says which policies stand apart
    from softmax by more than the run-to-run spread (one open-loop replay that queues requests can move by 30% between
    runs of the same policy)."""
    rate_scale: float = 1.0
    """Arrival times are divided by this (2 = twice the trace's rate)."""
    rate_scales: str | None = None
    """A sweep instead of one rate: comma-separated rate scales (e.g. 2,3,4,6), each replayed in turn into OUT/rate-X/,
    then sweep.md, sweep.json and latency_vs_rate.png in OUT: each policy's latency against the rate (replaces --rate-scale)."""
    start: int = 0
    """First trace request to replay."""
    requests: int = 200
    """Trace requests to replay (a window of the trace, so the run ends by itself)."""
    turns_mean: float = 3.0
    """Mean turns per session (Poisson; at least 1)."""
    max_prompt: int = 8192
    """Prompts longer than this keep their most recent tokens (the model's position limit)."""
    seed: int = 0
    """Seed of the session augmentation."""
    corpus: str = "wiki"
    """Text source of the prompts (a data source of linearize.data)."""
    slo: str | None = None
    """Service-level objectives for goodput, e.g. ttft=2s,tpot=100ms."""
    profile_steps: int = 0
    """In process: profile this many engine steps of each policy (from step profile-from) with torch.profiler
    and write profile_POLICY.txt (operators by self CPU and device time) beside the report. The replay's
    clock stops while a profile is written, so writing it delays no request; but the policies replayed
    after a profile may run slower (on an H200 the repeated softmax ran 0.61x its first run): time the
    policies in a replay without profiles."""
    profile_from: int = 20
    """The engine step (counted from 0) each policy's profile starts at: early steps are prefills and first
    kernel compilations, later ones the steady state."""
    timeout: float | None = None
    """Stop a policy's replay after this many seconds (its unfinished requests count as lost)."""
    out: str | None = None
    """Directory for report.json, report.md and the plots."""

    def __post_init__(self) -> None:
        if not self.rate_scale > 0:
            raise ValueError(f"rate-scale must be > 0, got {self.rate_scale}")
        if self.rate_scales is not None:
            if self.rate_scale != 1.0:
                raise ValueError(f"rate-scale {self.rate_scale} and rate-scales {self.rate_scales!r}: give one (a sweep replaces the single rate)")
            self.rate_list()
        for name in ("requests", "max_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")
        if not isinstance(self.profile_steps, int) or self.profile_steps < 0:
            raise ValueError(f"profile-steps must be an integer >= 0, got {self.profile_steps!r}")
        if not isinstance(self.profile_from, int) or self.profile_from < 0:
            raise ValueError(f"profile-from must be an integer >= 0, got {self.profile_from!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {self.repeats!r}")
        if self.repeats > 1 and self.url is not None:
            raise ValueError(f"repeats {self.repeats}: repeated runs are in process only (no --url); replay the server again instead")
        if self.profile_steps and (self.url is not None or self.out is None):
            raise ValueError("profile-steps needs an in-process replay (no --url) and --out for the profiles")
        if not self.turns_mean > 0:
            raise ValueError(f"turns-mean must be > 0, got {self.turns_mean}")
        parse_slo(self.slo)
        if self.url is not None and not re.fullmatch(r"https?://[^/\s]+/?", self.url):
            raise ValueError(f"url {self.url!r}: expected http://HOST:PORT (the server's root, without /v1)")
        if self.policies is not None and not self.policy_list():
            raise ValueError(f"policies {self.policies!r}: expected comma-separated policies, e.g. softmax,memory")
        if self.url is not None and self.policies is not None and len(self.policy_list()) != 1:
            raise ValueError(f"policies {self.policies!r}: a server runs one policy; with --url give at most one (its name in the report)")

    def policy_list(self) -> list[str]:
        """The policies to replay (in process: the default four unless given)."""
        return [p.strip() for p in (self.policies or DEFAULT_POLICIES).split(",") if p.strip()]

    def rate_list(self) -> list[float]:
        """The rate scales to replay at, in order: the sweep's, else the one rate scale."""
        if self.rate_scales is None:
            return [self.rate_scale]
        rates = []
        for part in self.rate_scales.split(","):
            try:
                rate = float(part)
            except ValueError:
                rate = 0.0
            if not rate > 0 or rate in rates:
                raise ValueError(f"rate-scales {self.rate_scales!r}: {part.strip()!r} is not a new number > 0 (expected distinct "
                                 "rate scales, e.g. 2,3,4,6)")  # fmt: skip
            rates.append(rate)
        return rates

    def run_list(self) -> list[str]:
        """The policies in the order they run: the list, ``repeats`` times."""
        return self.policy_list() * self.repeats

    def trace_path(self) -> Path:
        from ..data import TRACES

        return TRACES / TRACE_NAMES[self.trace] if self.trace in TRACE_NAMES else Path(self.trace)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=2s,tpot=100ms' -> {'ttft': 2.0, 'tpot': 0.1} (seconds); ValueError naming bad parts."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if key not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"SLO {part!r}: the keys are ttft, tpot and e2e")
        try:
            seconds = float(value[:-2]) / 1000 if value.endswith("ms") else float(value.removesuffix("s"))
        except ValueError:
            raise ValueError(f"SLO {part!r}: expected a time like 2s or 100ms") from None
        slo[key] = seconds
    return slo
