"""The serving engine: continuous batching, chunked prefill, memory-bounded admission, run-time conversion.

Each ``step()``:
1. drops cancelled requests (their memory is free at once);
2. asks the policy which live requests rise a level (memory policy: when use passes its high-water
   mark); a rise is applied by recompute: the request's memory is rebuilt from its tokens at the new
   level in later prefill chunks, so it continues exactly as if it had run at that level from its
   first token;
3. makes room for this step's decode tokens: if the softmax layers' growth would pass the budget,
   the newest running request is preempted (its memory freed, the request put back at the head of
   the queue with the tokens it has; it resumes by recompute), as vLLM does;
4. launches the decode of one token for every running request whose prompt is in (one batched
   forward; its tokens start back to the host without waiting);
5. spends the rest of the step's token budget on prefill chunks (launched while the device still
   runs the decode; cut to multiples of the runner's ``prefill_align``, all but a prompt's last
   (which its static path pads), where its static path wants them): first requests already running, then new ones in arrival order, each admitted
   only when the bytes of its prompt fit the budget at the level the policy gives it. A request
   that cannot fit even alone at the highest level allowed is rejected (finish_reason 'rejected'),
   never dropped silently;
6. takes the decode's tokens (requests that finish with them free their memory for the next step).
Bytes are counted by the level formula (``LevelMemory.bytes``: exactly what the states hold).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable

import torch

from ..generate import eos_token_ids as default_eos_token_ids
from .levels import LevelMemory
from .policy import MemoryView, Policy, RequestView, SoftmaxPolicy
from .pool import PooledRunner, PooledSequence
from .runner import Runner, Sequence, on_device
from .sampling import SamplingParams, StopChecker, make_generator, sample
from .settings import check_runner

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "rejected")


@dataclass
class Request:
    """A request and everything the engine keeps about it."""

    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    level: int = 0
    seq: Sequence | PooledSequence | None = None
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    raises: int = 0
    token_levels: list[int] = field(default_factory=list)
    """The level each output token was generated at."""
    text: str = ""
    generator: torch.Generator | None = field(default=None, repr=False)
    stop_checker: StopChecker | None = field(default=None, repr=False)
    _text_ids: list[int] = field(default_factory=list, repr=False)
    """The output tokens the text is decoded from (end-of-sequence tokens left out)."""
    _prefix: int = field(default=0, repr=False)
    """Where the window decoded for the next text delta starts in ``_text_ids``."""
    _read: int = field(default=0, repr=False)
    """How many of ``_text_ids`` the emitted text covers."""

    @property
    def tokens(self) -> list[int]:
        """Prompt and output so far: what the request's memory must hold."""
        return self.prompt + self.output

    @property
    def held(self) -> int:
        """Tokens its memory holds now."""
        return 0 if self.seq is None else self.seq.position

    @property
    def target(self) -> int:
        """Tokens its memory must hold before it can decode: all but the last output token (which
        the next decode step feeds), or the whole prompt before the first token."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def prefilled(self) -> bool:
        """Whether its memory holds ``target`` tokens (it decodes next)."""
        return self.seq is not None and self.seq.position == self.target

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """What one step produced for one request: new tokens (and text, with a tokenizer)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None


@dataclass(frozen=True)
class StepWork:
    """One engine step's work: the decode forward (one token for each of ``decode_rows`` requests)
    and the prefill chunks after it (``prefill_tokens`` in ``prefill_chunks`` forwards, recomputes
    included), each with its wall time. The prefill chunks are launched while the decode runs on the
    device: ``decode_s`` is the decode's launch plus the wait for its tokens after the chunks'
    launches, ``prefill_s`` the chunks' launches plus the final wait for the device; together the
    step's work, and on a GPU the device's work is in one or the other."""

    decode_rows: int = 0
    decode_s: float = 0.0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0


@dataclass
class EngineConfig:
    """Engine limits (the ``linearize serve`` flags)."""

    kv_budget: int
    """Bytes all requests' memory (softmax KV and converted states) may hold."""
    max_step_tokens: int = 512
    """Tokens one step processes: decodes first, prefill chunks with the rest."""
    max_running: int = 64
    """Requests decoding together at most."""
    runner: str = "pooled"
    """pooled: every request's memory in per-layer slot pools (one gather and one attention call per
    layer and group); reference: per-request states merged for every layer (the plain form it is
    tested against)."""
    graphs: bool = True
    """Pooled runner on CUDA: decode steps and prefill chunks of multiples of 64 tokens on static
    buffers, captured as CUDA graphs (``serve.graphs``); False: launched op by op."""

    def __post_init__(self) -> None:
        for name in ("kv_budget", "max_step_tokens", "max_running"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_runner(self.runner)


class Engine:
    """Continuous batching over a nested family with per-request conversion levels."""

    def __init__(self, model, levels: LevelMemory, config: EngineConfig, *, policy: Policy | None = None, tokenizer=None,
                 eos_token_ids: Iterable[int] | None = None, runner=None):
        """``runner``: what runs the model's forwards, in place of the one ``config.runner`` names
        (``serve.simulate.CostRunner`` runs none and counts what they would cost); ``model`` is
        then the runner's."""
        if runner is not None:
            self.device, self.runner = torch.device(runner.device), runner
        else:
            self.device = next(model.parameters()).device
            if config.runner == "pooled":
                self.runner = PooledRunner(model, levels, config.max_running, graphs=config.graphs and self.device.type == "cuda")
            else:
                self.runner = Runner(model, levels)
        model = self.runner.model
        self.levels, self.config = levels, config
        self.policy = policy or SoftmaxPolicy()
        self.tokenizer = tokenizer
        self.eos = default_eos_token_ids(model) if eos_token_ids is None else frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[str, Request] = {}
        self.counters: Counter = Counter()
        self.peak_bytes = 0
        self.held_after_step = (0, 0)
        """(KV bytes, state bytes) the running requests held at the end of the last step."""
        self.last_step = StepWork()
        """What the last step ran: its decode forward and its prefill chunks, with their wall times."""
        self._ids = itertools.count()

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None) -> str:
        if not prompt or not all(isinstance(t, int) and 0 <= t < self.runner.model.config.vocab_size for t in prompt):
            raise ValueError(f"prompt must be a non-empty list of token ids in 0..{self.runner.model.config.vocab_size - 1}")
        request_id = request_id or f"req-{next(self._ids)}"
        if self.get(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        request = Request(request_id, list(prompt), params)
        request.generator = None if params.greedy else make_generator(params)
        request.stop_checker = StopChecker(params.stop)
        self.waiting.append(request)
        self.counters["requests"] += 1
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its memory is freed at once. False if it is unknown or already finished."""
        for queue in (self.waiting, self.running):
            for r in list(queue):
                if r.id == request_id:
                    queue.remove(r)
                    self._finish(r, "abort")
                    return True
        return False

    def get(self, request_id: str) -> Request | None:
        return next((r for r in itertools.chain(self.waiting, self.running) if r.id == request_id), None) or self.finished.get(request_id)

    def reserve(self, tokens: int) -> None:
        """Allocate now what ``max_running`` requests of up to ``tokens`` tokens each need (the pooled
        runner's arena; nothing for the reference runner), so that no step grows it later."""
        reserve = getattr(self.runner, "reserve", None)
        if reserve is not None:
            reserve(self.config.max_running, tokens)

    def close(self) -> None:
        """Free the runner's memory now (its pools and graphs): the engine cannot step after."""
        for request in list(self.running):
            self._drop_memory(request)
        self.runner.close()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- memory -----------------------------------------------------------------------------
    def _reserved(self, request: Request) -> int:
        """Bytes a running request holds or will hold once its prompt (or recompute) is in."""
        return self.levels.bytes(request.level, max(request.held, request.target))

    def used_bytes(self) -> int:
        """Bytes reserved by the running requests: what admission and preemption compare to the budget."""
        return sum(self._reserved(r) for r in self.running)

    def held_bytes(self) -> int:
        """Bytes the running requests' memory holds now (their states' own sizes)."""
        return sum(r.seq.nbytes() for r in self.running if r.seq is not None)

    def _view(self, extra: int = 0) -> MemoryView:
        return MemoryView(self.config.kv_budget, self.used_bytes() + extra, self.levels)

    # --- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs: dict[str, StepOutput] = {}
        self._apply_raises(self._view())
        decoding = self._make_room(outputs)
        start = time.perf_counter()
        pending = self._decode(decoding) if decoding else None  # launched; its tokens come back while the prefill launches
        launched = time.perf_counter()
        chunks, tokens = self.counters["prefill_chunks"], self.counters["prefill_tokens"]  # before this step's prefill
        self._prefill(self.config.max_step_tokens - len(decoding), outputs, busy=decoding)
        prefilled = time.perf_counter()
        if pending is not None:
            for r, token in zip(decoding, pending.tokens()):
                self._append(r, token, outputs)
        decoded = time.perf_counter()
        if self.counters["prefill_chunks"] > chunks and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # chunks are not read back one by one: the step's prefill time includes the device's work
        self.last_step = StepWork(decode_rows=len(decoding), decode_s=(launched - start) + (decoded - prefilled) if decoding else 0.0,
                                  prefill_chunks=self.counters["prefill_chunks"] - chunks, prefill_tokens=self.counters["prefill_tokens"] - tokens,
                                  prefill_s=(prefilled - launched) + (time.perf_counter() - decoded))  # fmt: skip
        by_kind = [r.seq.nbytes_by_kind() for r in self.running if r.seq is not None]
        self.held_after_step = (sum(kv for kv, _ in by_kind), sum(state for _, state in by_kind))
        held = sum(self.held_after_step)
        self.peak_bytes = max(self.peak_bytes, held)
        if held > self.config.kv_budget:  # admission and room-making keep this from happening
            raise RuntimeError(f"memory accounting: {held} bytes held over the budget of {self.config.kv_budget}")
        self.counters["steps"] += 1
        return list(outputs.values())

    def _apply_raises(self, view: MemoryView) -> None:
        views = [RequestView(r.id, max(r.held, r.target), r.level) for r in self.running]
        for rid, level in self.policy.raises(views, view).items():
            request = next(r for r in self.running if r.id == rid)
            if not request.level < level <= self.policy.level_cap(self.levels):
                raise RuntimeError(f"policy {self.policy} moved request {rid} from level {request.level} to {level}")
            logger.info("request %s: level %d -> %d at %d tokens (recompute)", rid, request.level, level, request.target)
            self.counters["conversions"] += level - request.level
            request.level, request.raises = level, request.raises + 1
            self._drop_memory(request)  # rebuilt from its tokens at the new level by the next prefill chunks

    def _decoding(self) -> list[Request]:
        return [r for r in self.running if r.prefilled and r.output][: self.config.max_step_tokens]

    def _growth(self, decoding: list[Request]) -> int:
        return sum(self.levels.bytes(r.level, r.held + 1) - self.levels.bytes(r.level, r.held) for r in decoding)

    def _make_room(self, outputs: dict[str, StepOutput]) -> list[Request]:
        """The requests that decode this step, after converting (the policy's raises) and then
        preempting the newest requests until their new tokens fit the budget."""
        decoding = self._decoding()
        if decoding and self.used_bytes() + self._growth(decoding) > self.config.kv_budget:
            self._apply_raises(self._view(self._growth(decoding)))  # converting before preempting
            decoding = self._decoding()
        while decoding and self.used_bytes() + self._growth(decoding) > self.config.kv_budget:
            if len(self.running) == 1:  # alone and its next token does not fit at any level it may take
                request = self.running[0]
                logger.warning("request %s stopped at %d tokens: its memory reaches the budget", request.id, len(request.tokens))
                self._finish(request, "length")
                outputs.setdefault(request.id, StepOutput(request.id, [], "", None)).finish_reason = "length"
                self.running.remove(request)
                return []
            self._preempt(max(self.running, key=lambda r: r.arrival))
            decoding = self._decoding()
        return decoding

    def _preempt(self, request: Request) -> None:
        logger.info("preempting request %s (%d tokens held, level %d)", request.id, request.held, request.level)
        self.running.remove(request)
        self._drop_memory(request)
        request.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(request)

    def _decode(self, decoding: list[Request]) -> "_NextTokens":
        """Launch the decode forward of ``decoding`` (one token each); its next tokens on their way."""
        ids = on_device([[r.output[-1]] for r in decoding], self.device)  # (B, 1)
        logits = self.runner.forward([r.seq for r in decoding], ids)  # (B, vocab) on the device
        return _NextTokens.start(decoding, logits)

    def _prefill(self, budget: int, outputs: dict[str, StepOutput], busy: list[Request] = ()) -> None:
        """Prefill and recompute chunks within ``budget`` tokens (the running requests' first, then
        admitted ones); ``busy``: requests whose decode forward this step launched (their token is
        not in yet)."""
        skip = {id(r) for r in busy}
        candidates = [r for r in self.running if not r.prefilled and id(r) not in skip]
        align = getattr(self.runner, "prefill_align", 1)  # chunks of its multiples run on static buffers
        while budget > 0:
            if not candidates:
                admitted = self._admit(outputs)
                if admitted is None:
                    return
                candidates = [admitted]
            request = candidates.pop(0)
            if request.seq is None:
                request.seq = self.runner.new_sequence(request.level)
            start = request.seq.position
            take = min(request.target - start, budget)
            cut = align > 1 and align <= take < request.target - start  # not the last chunk: a multiple of align
            if cut:
                take -= take % align
            chunk = request.tokens[start : start + take]
            logits = self.runner.forward([request.seq], on_device([chunk], self.device))
            budget -= len(chunk)
            self.counters["prefill_tokens"] += len(chunk)
            self.counters["prefill_chunks"] += 1
            if request.prefilled and not request.output:  # the first token comes with the prompt's last chunk
                self._append(request, _NextTokens.start([request], logits).tokens()[0], outputs)
            if cut and budget < align:  # what is left would be a small chunk of another request: next step
                return

    def _admit(self, outputs: dict[str, StepOutput]) -> Request | None:
        """The next waiting request, running, if its memory fits now; None if it must wait."""
        cap = self.policy.level_cap(self.levels)
        while self.waiting and len(self.running) < self.config.max_running:
            request = self.waiting[0]
            if not request.output and not request.preemptions:
                final = len(request.prompt) + request.params.max_tokens
                request.level = self.policy.admission_level(len(request.prompt), final, self._view())
            allowed = range(request.level, max(request.level, cap) + 1)  # a state can outweigh a short KV: not monotonic
            need = min(self.levels.bytes(k, request.target) for k in allowed)
            if need > self.config.kv_budget:
                self.waiting.popleft()
                logger.warning("request %s rejected: %d tokens need %d bytes at best (levels %d..%d), over the budget of %d",
                               request.id, request.target, need, allowed[0], allowed[-1], self.config.kv_budget)
                self._finish(request, "rejected")
                outputs[request.id] = StepOutput(request.id, [], "", "rejected")
                continue
            if self.used_bytes() + self.levels.bytes(request.level, request.target) > self.config.kv_budget:
                if self.running:
                    return None  # wait for memory to free up
                request.level = next(k for k in allowed if self.levels.bytes(k, request.target) <= self.config.kv_budget)
            self.waiting.popleft()
            self.running.append(request)
            self.counters["admitted"] += 1
            return request
        return None

    def _append(self, request: Request, token: int, outputs: dict[str, StepOutput]) -> None:
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        request.output.append(token)
        request.token_levels.append(request.level)
        self.counters["generated_tokens"] += 1
        out = outputs.setdefault(request.id, StepOutput(request.id, [], "", None))
        out.token_ids.append(token)
        stopped = False
        if self.tokenizer is not None:
            delta, stopped = self._text_delta(request)
            out.text += delta
        if stopped:
            self._finish(request, "stop")
        elif token in self.eos and not request.params.ignore_eos:
            self._finish(request, "stop")
        elif len(request.output) >= request.params.max_tokens:
            self._finish(request, "length")
        if request.finished:
            if self.tokenizer is not None and request.finish_reason == "length":
                tail = request.stop_checker.flush()
                out.text += tail
                request.text += tail
            out.finish_reason = request.finish_reason
            self.running.remove(request)

    def _text_delta(self, request: Request) -> tuple[str, bool]:
        """Text the newest token adds (held back while it may be a stop string's start or half a
        character), decoded incrementally: only the tokens since the last emitted piece and the piece
        before them (its context: a word's leading space, a character's first bytes), so a token
        costs the same at any output length. The pieces join to the decode of the whole output."""
        token = request.output[-1]
        if token in self.eos:
            return "", False
        ids = request._text_ids
        ids.append(token)
        before = self.tokenizer.decode(ids[request._prefix : request._read], skip_special_tokens=True)
        text = self.tokenizer.decode(ids[request._prefix :], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):  # nothing new yet, or an incomplete UTF-8 sequence
            return "", False
        request._prefix, request._read = request._read, len(ids)
        emit, stopped = request.stop_checker.feed(text[len(before) :])
        request.text += emit
        return emit, stopped

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        self._drop_memory(request)
        self.finished[request.id] = request
        self.counters[f"finished_{reason}"] += 1

    def _drop_memory(self, request: Request) -> None:
        """Free what a request holds (its slot goes back to the pools)."""
        if request.seq is not None:
            self.runner.release(request.seq)
        request.seq = None

    # --- convenience ------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> dict[str, Request]:
        """Step until every request has finished (or ``max_steps``); the finished requests by id."""
        for _ in itertools.count() if max_steps is None else range(max_steps):
            if not self.has_work():
                break
            self.step()
        return self.finished


@dataclass
class _NextTokens:
    """Requests' next tokens on their way from the device: the greedy rows' argmax taken there and
    their ids, with the sampled rows' logits (for their own generators, as ``sample``), copied to the
    host without waiting (pinned buffers and an event on CUDA), so the host can launch more work
    before it reads them."""

    requests: list[Request]
    picked: list[int]  # rows decided by argmax
    ids: torch.Tensor | None  # their token ids, host
    drawn: list[int]  # rows sampled on the host
    logits: torch.Tensor | None  # their logits, host
    ready: torch.cuda.Event | None = None

    @classmethod
    def start(cls, requests: list[Request], logits: torch.Tensor) -> "_NextTokens":
        greedy = [r.params.greedy for r in requests]
        picked = [i for i, g in enumerate(greedy) if g]
        drawn = [i for i, g in enumerate(greedy) if not g]

        def rows(index: list[int]) -> torch.Tensor:
            return logits if len(index) == len(requests) else logits.index_select(0, on_device(index, logits.device))

        ids = _to_host(rows(picked).argmax(dim=-1)) if picked else None
        drawn_logits = _to_host(rows(drawn)) if drawn else None
        ready = None
        if logits.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return cls(requests, picked, ids, drawn, drawn_logits, ready)

    def tokens(self) -> list[int]:
        """Each request's next token (waits for the copies)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = [0] * len(self.requests)
        if self.ids is not None:
            for i, token in zip(self.picked, self.ids.tolist()):
                tokens[i] = token
        if self.logits is not None:
            for i, row in zip(self.drawn, self.logits):
                tokens[i] = sample(row, self.requests[i].params, self.requests[i].generator)
        return tokens


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x``: from CUDA into pinned memory without waiting (read it after the event)."""
    if not x.is_cuda:
        return x.cpu()
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x, non_blocking=True)
