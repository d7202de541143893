"""Trace replay against a running server over HTTP (``linearize replay --url``), as ``vllm bench serve``
measures one.

Each replayed request is one ``POST /v1/completions`` with its prompt as token ids, ``max_tokens``
= the trace's output length, ``ignore_eos``, ``stream`` and ``stream_options.include_usage``; they
are sent open loop (httpx's async client) at the trace's arrival times divided by ``rate_scale``.
Measured at the client from the server-sent events: TTFT to the first chunk with text, ITL between
such chunks, E2E to the end of the stream; the output token count is the final chunk's usage, so
TPOT = (E2E - TTFT) / (output tokens - 1) counts tokens, not chunks. A request the server refuses
(an HTTP error, or an error event in the stream), one that times out or one whose connection fails
keeps its status (``http 503``, ``rejected``, ``timeout``, ``error``): none is lost.

The server's own counters (``linearize:*`` in /metrics: preemptions, conversions, the memory budget,
its policy) are read before and after the timed requests, and its KV and state bytes are sampled
during them (the memory timeline and the peak). A few warm-up requests run first and are left out
of the report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Sequence

from .replay import WARM_UP_LENGTHS, ReplayRequest, RequestRecord

logger = logging.getLogger(__name__)

SAMPLE_EVERY_S = 0.25
"""How often /metrics is read during a replay (the memory timeline)."""


def scrape(text: str) -> dict[str, Any]:
    """The ``linearize:*`` samples of a /metrics page: {sample name: value summed over its label sets;
    a histogram bucket keeps its edge, as ``name{le=0.5}``}, plus ``"info"``: the labels of
    ``linearize:engine_info`` (model_name, policy) when present."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("linearize:"):
                continue
            name = f"{sample.name}{{le={float(sample.labels['le'])}}}" if sample.name.endswith("_bucket") else sample.name
            out[name] = out.get(name, 0.0) + sample.value
            if sample.name == "linearize:engine_info":
                out["info"] = dict(sample.labels)
    return out


class HTTPReplay:
    """Replays requests against the server at ``url``; ``run()`` gives what ``report_runs`` takes."""

    def __init__(self, url: str, requests: Sequence[ReplayRequest], *, model: str | None = None, api_key: str | None = None,
                 rate_scale: float = 1.0, timeout: float | None = None, warm_up: Sequence[int] = WARM_UP_LENGTHS,
                 progress: bool = True):  # fmt: skip
        if rate_scale <= 0:
            raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
        self.url, self.requests, self.model = url.rstrip("/"), list(requests), model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.rate_scale, self.timeout, self.warm_up_lengths, self.progress = rate_scale, timeout, tuple(warm_up), progress
        self.info: dict[str, str] = {}
        """What /metrics says of the server (model_name, policy), read by ``connect``."""

    # --- the server ---------------------------------------------------------------------------
    def connect(self) -> dict[str, str]:
        """Check that a server answers; learn its model name (unless given) and policy. ValueError
        naming the URL when none answers or it is not a linearize server."""
        return asyncio.run(self._connect())

    async def _connect(self) -> dict[str, str]:
        import httpx

        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=30) as client:
            try:
                models = await client.get("/v1/models")
                metrics = await client.get("/metrics")
            except httpx.TransportError as err:
                raise ValueError(f"url {self.url!r}: no server answers ({type(err).__name__}: {err}); start one with linearize serve") from None
        if models.status_code != 200:
            raise ValueError(f"url {self.url!r}: GET /v1/models answered {models.status_code}: {models.text[:200]}")
        names = [m["id"] for m in models.json().get("data", [])]
        if self.model is None:
            if not names:
                raise ValueError(f"url {self.url!r}: the server lists no model; give --served-model-name")
            self.model = names[0]
        elif self.model not in names:
            raise ValueError(f"served-model-name {self.model!r}: the server at {self.url} serves {names}")
        self.info = dict(scrape(metrics.text).get("info", {})) if metrics.status_code == 200 else {}
        return self.info

    # --- the replay ---------------------------------------------------------------------------
    def run(self) -> tuple[list[RequestRecord], list[dict[str, Any]], dict[str, Any]]:
        """(records, timeline, the server's counts during the timed requests)."""
        return asyncio.run(self._run())

    def _body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip

    async def _run(self):
        import httpx
        from tqdm.auto import tqdm

        if self.model is None:
            await self._connect()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, limits=limits,
                                     timeout=httpx.Timeout(None, connect=30.0)) as client:  # fmt: skip
            await self._warm_up(client)
            before = scrape((await client.get("/metrics")).text)
            records = [RequestRecord(r.arrival / self.rate_scale, len(r.prompt), r.output_tokens) for r in self.requests]
            bar = tqdm(total=len(records), desc=f"replay {self.url}", unit="req", disable=not self.progress)
            start = time.monotonic()
            tasks = [asyncio.create_task(self._send(client, r, rec, start, bar)) for r, rec in zip(self.requests, records)]
            timeline: list[dict[str, Any]] = []
            sampler = asyncio.create_task(self._sample(client, start, before, timeline))
            done, pending = await asyncio.wait(tasks, timeout=self.timeout) if tasks else (set(), set())
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            bar.close()
            after = scrape((await client.get("/metrics")).text)
        for task in done:
            if task.exception() is not None:  # a bug here, not the server: say so rather than lose the request
                logger.error("a replayed request failed in the client: %r", task.exception())
        for rec in records:
            if rec.finish is None and rec.status == "ok":
                rec.status = "timeout" if pending else "unfinished"
        return records, timeline, self._counted(before, after, timeline)

    async def _warm_up(self, client) -> None:
        """Requests of the warm-up lengths (3 output tokens each) together, before anything is timed;
        not reported. They reach the levels the server's policy gives them (a server on CUDA ran
        level 0, its middle and its top level when it loaded)."""
        if not self.warm_up_lengths or not self.requests:
            return
        tokens = [t for r in self.requests[:8] for t in r.prompt]
        longest = max(len(r.prompt) for r in self.requests)
        prompts = [(tokens * (n // len(tokens) + 1))[:n] for n in self.warm_up_lengths if n <= longest] or [tokens[:longest]]
        answers = await asyncio.gather(*(client.post("/v1/completions", json={**self._body(p, 3), "stream": False, "stream_options": None})
                                         for p in prompts), return_exceptions=True)  # fmt: skip
        for prompt, answer in zip(prompts, answers):
            status = getattr(answer, "status_code", answer)
            if status != 200:
                logger.warning("warm-up request of %d tokens: %s", len(prompt), getattr(answer, "text", answer))

    async def _send(self, client, request: ReplayRequest, rec: RequestRecord, start: float, bar) -> None:
        import httpx

        await asyncio.sleep(max(0.0, rec.arrival - (time.monotonic() - start)))
        try:
            async with client.stream("POST", "/v1/completions", json=self._body(request.prompt, request.output_tokens)) as response:
                if response.status_code != 200:
                    rec.status, rec.finish = f"http {response.status_code}", None
                    rec.detail = _error_message(await response.aread())
                    return
                finished = False
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    stamp = time.monotonic() - start
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = chunk["error"] or {}
                        rec.status = "rejected" if error.get("type") == "invalid_request_error" else "error"
                        rec.detail = str(error.get("message", ""))
                        return
                    for choice in chunk.get("choices") or ():
                        if choice.get("text"):
                            rec.token_times.append(stamp)
                        finished = finished or choice.get("finish_reason") is not None
                    if chunk.get("usage"):
                        rec.generated = int(chunk["usage"]["completion_tokens"])
                if not finished:
                    rec.status, rec.detail = "error", "the stream ended before a finish reason"
                    return
                rec.finish = time.monotonic() - start
        except httpx.HTTPError as err:
            rec.status, rec.detail = "error", f"{type(err).__name__}: {err}"
        finally:
            bar.update(1)

    async def _sample(self, client, start: float, before: dict[str, Any], timeline: list[dict[str, Any]]) -> None:
        """The server's memory, queue and mean level (of requests finished so far) every SAMPLE_EVERY_S."""
        while True:
            try:
                now = scrape((await client.get("/metrics")).text)
            except Exception as err:  # a missed sample leaves a gap in the plot, nothing else
                logger.debug("metrics sample failed: %s", err)
            else:
                timeline.append({"t": time.monotonic() - start, "bytes": now.get("linearize:kv_cache_bytes", 0.0) + now.get("linearize:state_bytes", 0.0),
                                 "running": now.get("linearize:num_requests_running", 0.0), "waiting": now.get("linearize:num_requests_waiting", 0.0),
                                 "mean_level": _mean_level(before, now) or 0.0})  # fmt: skip
            await asyncio.sleep(SAMPLE_EVERY_S)

    def _counted(self, before: dict[str, Any], after: dict[str, Any], timeline: list[dict[str, Any]]) -> dict[str, Any]:
        def delta(name: str) -> int:
            return int(after.get(name, 0.0) - before.get(name, 0.0))

        return {
            "preemptions": delta("linearize:num_preemptions_total"),
            "conversions": delta("linearize:conversions_total"),
            "mean_level": _mean_level(before, after),
            "peak_bytes": int(max((p["bytes"] for p in timeline), default=0)),
            "peak_budget_fraction_bounds": _held_bounds(before, after),
            "server_peak_bytes": int(after["linearize:memory_peak_bytes"]) if "linearize:memory_peak_bytes" in after else None,
            "budget_bytes": int(after.get("linearize:memory_budget_bytes", 0)) or None,
            "server": {"url": self.url, "model": self.model, **self.info},
        }


def _mean_level(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Mean conversion level of the requests that finished between two scrapes."""
    name = "linearize:converted_layers_per_request"
    n = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
    return (after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)) / n if n > 0 else None


def _held_bounds(before: dict[str, Any], after: dict[str, Any]) -> list[float | None] | None:
    """[lo, hi]: the bucket of the server's held-memory histogram (fractions of its budget) holding the
    most any step held between two scrapes (lo < peak <= hi; [0, 0] when every step held nothing, hi
    None past the last edge); None when the server has no such histogram or ran no step."""
    prefix = "linearize:memory_held_budget_fraction_bucket{le="
    steps = {float(k[len(prefix):-1]): after[k] - before.get(k, 0.0) for k in after if k.startswith(prefix)}  # cumulative
    total = steps.get(float("inf"), 0.0)
    if total <= 0:
        return None
    hi = min(edge for edge, n in steps.items() if n >= total)
    lo = max((edge for edge, n in steps.items() if n < total), default=0.0)
    return [lo, None if hi == float("inf") else hi]


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")
