"""The OpenAI-compatible HTTP API over the engine (FastAPI; server-sent events through sse-starlette).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not;
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus; vLLM's metric names where they mean the same, under the ``linearize:`` prefix).

The engine runs in one background thread (``EngineLoop``): HTTP handlers submit requests to it and
read their tokens from a per-request queue; a client that disconnects has its request cancelled,
which frees its memory at the next step. Every bad request gets a 4xx with OpenAI's error body
(``{"error": {"message", "type", "param", "code"}}``); a full queue gets a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, StepOutput
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ----------------------------------------------------------------------------- request bodies


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str]
    """Text, a list of one text, or token ids (integers; checked against the vocabulary by the route)."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_are_integers(cls, value: Any) -> Any:
        if isinstance(value, list) and not all(isinstance(t, str) for t in value):
            bad = next((t for t in value if isinstance(t, bool) or not isinstance(t, int)), None)
            if bad is not None:
                raise ValueError(f"a list prompt is token ids (integers) or one string; found {bad!r}")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


# ----------------------------------------------------------------------------- the engine thread


@dataclass
class Limits:
    """What the server accepts."""

    max_prompt_tokens: int = 8192
    max_tokens_default: int = 256
    """max_tokens when a request gives none (lowered to what the model's length leaves)."""
    max_model_len: int | None = None
    """Prompt + max_tokens at most (default: the model's max_position_embeddings)."""
    max_waiting: int = 256
    max_body_bytes: int = 1 << 20


class EngineLoop:
    """Runs ``engine.step()`` in a background thread while there is work; results go to per-request
    asyncio queues. Submit, abort and every step hold one lock (the engine is not thread-safe)."""

    def __init__(self, engine: Engine, metrics: "Metrics | None" = None):
        self.engine, self.metrics = engine, metrics
        self.lock = threading.Lock()
        self.wakeup = threading.Event()
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="linearize-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            rid = self.engine.add_request(prompt, params, request_id=f"cmpl-{uuid.uuid4().hex}")
            self.queues[rid] = (asyncio.get_running_loop(), queue)
        self.wakeup.set()
        return rid, queue

    def abort(self, rid: str) -> None:
        with self.lock:
            if self.engine.abort(rid) and self.metrics is not None:
                self.metrics.aborted.inc()
            self.queues.pop(rid, None)

    def waiting(self) -> int:
        return len(self.engine.waiting)

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stopped:
            if not self.engine.has_work():
                self.wakeup.wait(0.5)
                self.wakeup.clear()
                continue
            with self.lock:
                try:
                    outputs = self.engine.step()
                except Exception:  # keep serving: fail the requests in flight, not the server
                    logger.exception("engine step failed; failing the requests in flight")
                    outputs = []
                    for r in [*self.engine.running, *self.engine.waiting]:
                        self.engine.abort(r.id)
                        outputs.append(StepOutput(r.id, [], "", "error"))
                    self.engine.held_after_step = (0, 0)  # every request was aborted: nothing is held
                if self.metrics is not None:
                    self.metrics.observe_step(self.engine, outputs)
                for out in outputs:
                    target = self.queues.get(out.request_id)
                    if target is not None:
                        loop, queue = target
                        loop.call_soon_threadsafe(queue.put_nowait, out)
                        if out.finish_reason is not None:
                            self.queues.pop(out.request_id, None)


# ----------------------------------------------------------------------------- metrics


HELD_BUCKETS = (0.0, *(k / 20 for k in range(1, 21)), 1.25, 1.5, 2.0, 4.0)
"""Bucket edges of the held-memory histogram (fractions of the budget): every step counts, so a
client that diffs two scrapes learns the most any step held between them, to 5% of the budget."""


class Metrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r, p = self.registry, "linearize:"
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch", labels, registry=r).labels(model_name)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be admitted", labels, registry=r).labels(model_name)
        self.kv_bytes = Gauge(p + "kv_cache_bytes", "Bytes of softmax keys/values held", labels, registry=r).labels(model_name)
        self.state_bytes = Gauge(p + "state_bytes", "Bytes of converted layers' states held", labels, registry=r).labels(model_name)
        self.budget_bytes = Gauge(p + "memory_budget_bytes", "The memory budget in bytes", labels, registry=r).labels(model_name)
        self.peak_bytes = Gauge(p + "memory_peak_bytes", "The most bytes of KV and states held at the end of a step", labels,
                                registry=r).labels(model_name)
        self.held = Histogram(p + "memory_held_budget_fraction", "Bytes of KV and states held at the end of a step, over the budget",
                              labels, registry=r, buckets=HELD_BUCKETS).labels(model_name)
        self.info = Gauge(p + "engine_info", "The engine's conversion policy (value 1)", [*labels, "policy"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", labels, registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)).labels(model_name)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output tokens", labels, registry=r,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5)).labels(model_name)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency", labels, registry=r,
                             buckets=(0.1, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)).labels(model_name)
        self.levels = Histogram(p + "converted_layers_per_request", "Converted layers of a request when it finished", labels,
                                registry=r, buckets=tuple(range(0, 65, 2))).labels(model_name)
        self.conversions = Counter(p + "conversions", "Layer conversions of live requests", labels, registry=r).labels(model_name)
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted (recomputed later)", labels, registry=r).labels(model_name)
        self.aborted = Counter(p + "requests_aborted", "Requests cancelled by their client", labels, registry=r).labels(model_name)
        self.finished = Counter(p + "request_success", "Finished requests by finish reason", [*labels, "finished_reason"], registry=r)
        self.model_name = model_name
        self._seen = {"conversions": 0, "preemptions": 0}
        self._last_token: dict[str, float] = {}

    def observe_step(self, engine: Engine, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        self.budget_bytes.set(engine.config.kv_budget)
        kv, state = engine.held_after_step
        self.kv_bytes.set(kv)
        self.state_bytes.set(state)
        self.peak_bytes.set(engine.peak_bytes)
        if engine.config.kv_budget:
            self.held.observe((kv + state) / engine.config.kv_budget)
        for name, metric in (("conversions", self.conversions), ("preemptions", self.preemptions)):
            delta = engine.counters[name] - self._seen[name]
            if delta:
                metric.inc(delta)
                self._seen[name] = engine.counters[name]
        for out in outputs:
            request = engine.get(out.request_id)
            if request is None:
                continue
            if out.token_ids:
                last = self._last_token.get(out.request_id)
                if last is None:
                    self.ttft.observe(now - request.arrival)
                else:
                    self.itl.observe((now - last) / len(out.token_ids))
                self._last_token[out.request_id] = now
            if out.finish_reason is not None:
                self._last_token.pop(out.request_id, None)
                self.e2e.observe(now - request.arrival)
                self.levels.observe(request.level)
                self.finished.labels(self.model_name, out.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ----------------------------------------------------------------------------- the app


def create_app(engine: Engine, tokenizer, *, model_name: str, api_key: str | None = None, limits: Limits | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``. ``app.state.loop`` is its EngineLoop
    (stopped when the app shuts down)."""
    limits = limits or Limits()
    if limits.max_model_len is None:
        limits.max_model_len = getattr(engine.runner.model.config, "max_position_embeddings", None) or 1 << 30
    if engine.tokenizer is None:
        engine.tokenizer = tokenizer  # text deltas and stop strings
    metrics = Metrics(model_name)
    metrics.info.labels(model_name, str(engine.policy)).set(1)
    loop = EngineLoop(engine, metrics)
    created = int(time.time())

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        loop.stop()

    app = FastAPI(title="linearize", lifespan=lifespan)
    app.state.loop, app.state.metrics = loop, metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return APIError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return APIError(err.status_code, str(err.detail), type="invalid_request_error" if err.status_code < 500 else "server_error").response()

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", type="authentication_error",
                                code="invalid_api_key").response()
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            return APIError(413, f"request body of {length} bytes exceeds the limit of {limits.max_body_bytes}").response()
        try:
            return await call_next(request)
        except Exception:  # never let a handler bug take the server down or leak a traceback
            logger.exception("internal error on %s", request.url.path)
            return APIError(500, "internal server error", type="server_error").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(engine.running), "waiting": len(engine.waiting), "pid": os.getpid()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "linearize"}]}

    def check_model(name: str | None) -> None:
        if name not in (None, model_name):
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}", code="model_not_found", param="model")

    def sampling(body: _Sampling, max_tokens: int | None, n_prompt: int) -> SamplingParams:
        room = limits.max_model_len - n_prompt
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} with a prompt of {n_prompt} tokens exceeds the model's length of "
                                f"{limits.max_model_len} tokens; at most {room} here", param="max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(max_tokens=max_tokens or min(limits.max_tokens_default, room), temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, seed=body.seed, stop=body.stop or (), ignore_eos=body.ignore_eos)  # fmt: skip
        except ValueError as err:
            raise APIError(400, str(err)) from None

    def check_prompt(ids: list[int]) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(ids) >= min(limits.max_prompt_tokens + 1, limits.max_model_len):
            most = min(limits.max_prompt_tokens, limits.max_model_len - 1)
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {most}", param="prompt",
                           code="context_length_exceeded")
        vocab = engine.runner.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range: token ids must lie in 0..{vocab - 1}", param="prompt")
        if loop.waiting() >= limits.max_waiting:
            raise APIError(503, f"server busy: {limits.max_waiting} requests are waiting; retry later", type="server_overloaded")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (a list of one string, a string, or a list of token ids)", param="prompt")
            prompt = prompt[0]
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if isinstance(prompt, str) else list(prompt)
        check_prompt(ids)
        params = sampling(body, body.max_tokens, len(ids))
        return await respond(request, ids, params, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        check_model(body.model)
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else _text_parts(m.content)} for m in body.messages]
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model {model_name!r} has no chat template; use /v1/completions")
        try:
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as err:  # a template that rejects these messages (roles out of order, ...)
            raise APIError(400, f"messages do not fit the chat template: {err}", param="messages") from None
        ids = list(out["input_ids"] if isinstance(out, Mapping) else out)
        check_prompt(ids)
        params = sampling(body, body.max_completion_tokens or body.max_tokens, len(ids))
        return await respond(request, ids, params, body, chat=True)

    async def respond(request: Request, ids: list[int], params: SamplingParams, body: _Sampling, *, chat: bool):
        rid, queue = loop.submit(ids, params)
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(_stream(request, rid, queue, len(ids), kind, include_usage, chat), ping=15)
        text, n_out, reason = "", 0, None
        try:
            while reason is None:
                out: StepOutput = await queue.get()
                text, n_out, reason = text + out.text, n_out + len(out.token_ids), out.finish_reason
        except asyncio.CancelledError:
            loop.abort(rid)
            raise
        if reason == "rejected":
            raise APIError(400, "the prompt does not fit this server's memory budget at any conversion level", param="prompt",
                           code="context_length_exceeded")
        if reason == "error":
            raise APIError(500, "the engine failed on this request", type="server_error")
        usage = {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name, "choices": [choice], "usage": usage}

    async def _stream(request: Request, rid: str, queue: asyncio.Queue, n_prompt: int, kind: str, include_usage: bool, chat: bool):
        obj = f"{kind}.chunk" if chat else kind
        created, n_out = int(time.time()), 0

        def chunk(choices: list, usage: dict | None = None) -> str:
            payload: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return json.dumps(payload)

        try:
            if chat:
                yield {"data": chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])}
            while True:
                out: StepOutput = await queue.get()
                n_out += len(out.token_ids)
                reason = out.finish_reason
                if reason in ("rejected", "error"):
                    message = "the prompt does not fit the memory budget" if reason == "rejected" else "the engine failed on this request"
                    yield {"data": json.dumps({"error": {"message": message, "type": "invalid_request_error" if reason == "rejected"
                                                         else "server_error", "param": None, "code": None}})}  # fmt: skip
                    break
                if out.text or reason is not None:
                    if chat:
                        choice = {"index": 0, "delta": {"content": out.text} if out.text else {}, "finish_reason": reason, "logprobs": None}
                    else:
                        choice = {"index": 0, "text": out.text, "finish_reason": reason, "logprobs": None}
                    yield {"data": chunk([choice])}
                if reason is not None:
                    if include_usage:
                        yield {"data": chunk([], {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out})}
                    break
            yield {"data": "[DONE]"}
        except asyncio.CancelledError:  # the client went away: free its memory
            loop.abort(rid)
            raise

    return app


def _text_parts(parts: list[dict[str, Any]]) -> str:
    """The text of a message given as content parts (only text parts are supported)."""
    texts = []
    for part in parts:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"content part of type {part.get('type')!r} is not supported; only 'text'", param="messages")
        texts.append(part["text"])
    return "".join(texts)
