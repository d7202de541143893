"""Throughput at equal memory: the largest batch each model fits at one context, and its tokens/s there.

    result = bench_capacity(model, {"attention": "hybrid", "window": 64}, context=32768, memory_bytes=100 * 2**30)
    print(capacity_markdown(result))

The teacher (the model with its converted layers in mode 'teacher') and the conversion are measured
alike, each with ``linearize.decoding.StaticDecoder`` (on CUDA each step one CUDA graph replay):

- bytes per request: what one row of a StaticDecoder holds for ``context + steps`` tokens (softmax
  layers' keys and values; converted layers' decode states; the row's logits), measured on a
  one-row decoder, plus the step's working memory per row (``working_bytes_per_row``);
- batch: the memory budget // bytes per request, at most ``max_batch``. On CUDA a batch that runs
  out of memory is retried at 7/8 of its size, and once one has run, halfway between the largest
  that ran and the smallest that did not, to within 1/64 (``largest_batch``); the row records the
  batch, every attempt (where one ran out of memory: the stage, buffers, prefill, warm-up and
  capture or timing, and the error) and the chosen batch's memory after its prefill and at its peak;
- tokens/s: batch / the median step time over ``steps`` steps after the decoder's warm-up, after
  a one-row prompt of ``context`` random tokens repeated to the batch;
- with ``profile``: each side's step at that batch once more, without CUDA graphs, under
  ``torch.profiler`` (``linearize.bench.profile.profile_step``): device time, launches and the
  kernels that take the most time, the profile a missed throughput target names as its cause.

The budget is ``memory_bytes``, or on CUDA ``memory_fraction`` of the memory free once the model is
loaded. A model whose position limit is below ``context + steps`` has it lifted for the benchmark
(RoPE is defined at every position; the result says so): speed and memory do not depend on quality.
Nothing here asserts on time.
"""

from __future__ import annotations

import gc
import logging
import statistics
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import transformers

from ..checks import check_int
from ..convert import convert, converted_layers
from ..decoding import StaticDecoder
from ..io import write_results
from ..ops import kernel_options
from ..runtime import max_positions
from ..spec import ConversionSpec
from ..teacher import teacher_modes
from .efficiency import _decode_tokens, _random_ids, time_calls, decode_warmup
from .profile import kernel_table, profile_step

logger = logging.getLogger(__name__)


def working_bytes_per_row(model) -> int:
    """The decode step's transient memory per row: its logits once more in the model's dtype (a
    compiled step's lm_head output before its copy into the decoder's logits) and a few
    hidden-sized activations."""
    config = model.config
    elem = torch.tensor([], dtype=model.dtype).element_size()
    return config.vocab_size * elem + 8 * max(config.hidden_size, config.intermediate_size) * elem


def request_bytes(model, max_length: int) -> int:
    """Bytes one row of a StaticDecoder of ``max_length`` tokens holds (its memory and logits)."""
    decoder = StaticDecoder(model, batch_size=1, max_length=max_length, graphs=False)
    device = next(model.parameters()).device
    decoder.prefill(torch.zeros(1, 1, dtype=torch.long, device=device))
    held = sum(decoder.nbytes_by_layer().values()) + decoder.logits.numel() * decoder.logits.element_size()
    del decoder
    return held


def _lift_position_limit(model, length: int) -> int | None:
    """Raise the model's position limit to ``length`` when it is lower; the old limit, or None."""
    limit = max_positions(model)
    if limit is None or limit >= length:
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.max_position_embeddings = length
    logger.info("position limit lifted from %d to %d for this benchmark", limit, length)
    return limit


def _budget(device: torch.device, memory_bytes: int | None, memory_fraction: float) -> int:
    if memory_bytes is not None:
        return int(memory_bytes)
    if device.type != "cuda":
        raise ValueError("give memory_bytes (the memory budget) on a device other than CUDA")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * memory_fraction)


def largest_batch(attempt: Callable[[int], Any], start: int, *, retry: float = 7 / 8,
                  tolerance: float = 1 / 64, label: str = "") -> tuple[int, Any, list[dict[str, Any]]]:
    """The largest batch from ``start`` down for which ``attempt(batch)`` returns instead of raising
    ``torch.OutOfMemoryError``: ``start`` first; while none has run, ``retry`` x the last batch that
    ran out of memory; once one has, halfway between the largest that ran and the smallest that did
    not, until they are at most ``max(1, tolerance x the largest that ran)`` apart. Returns the batch,
    its ``attempt``'s result and every attempt (``batch``, ``ran``, and where it ran out of memory,
    ``stage`` (an attribute the error may carry), the error's first line and the innermost frames it
    was raised from); ``label`` prefixes the warnings. Raises the error when a batch of 1 does not fit."""
    check_int("start", start, 1)
    if not 0 < retry < 1 or not 0 <= tolerance < 1:
        raise ValueError(f"retry must lie in (0, 1) and tolerance in [0, 1), got {retry!r} and {tolerance!r}")
    attempts: list[dict[str, Any]] = []
    ran, result, failed, batch = 0, None, None, start
    while True:
        try:
            out = attempt(batch)
        except torch.OutOfMemoryError as e:
            where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)[-4:]]
            attempts.append({"batch": batch, "ran": False, "stage": getattr(e, "stage", None), "error": str(e).splitlines()[0],
                             "where": where})  # fmt: skip
            logger.warning("%sbatch %d ran out of memory%s: %s", f"{label}: " if label else "", batch, f" in its {attempts[-1]['stage']}" if attempts[-1]["stage"] else "",
                           attempts[-1]["error"])  # fmt: skip
            if batch == 1:
                raise
            failed = batch
        else:
            attempts.append({"batch": batch, "ran": True})
            ran, result = batch, out
        if failed is None:
            return ran, result, attempts
        if ran:
            if failed - ran <= max(1, int(tolerance * ran)):
                return ran, result, attempts
            batch = (ran + failed) // 2
        else:
            batch = max(1, min(failed - 1, int(failed * retry)))


@torch.inference_mode()
def _measure(model, side: str, *, context: int, steps: int, budget: int, max_batch: int, compile: bool, seed: int,
             profile: bool = False) -> dict[str, Any]:
    device = next(model.parameters()).device
    max_length = _decode_tokens(context, 0, steps, True)
    per_request = request_bytes(model, max_length) + working_bytes_per_row(model)
    batch = min(max_batch, budget // per_request)
    row: dict[str, Any] = {"side": side, "bytes_per_request": per_request, "fits": int(budget // per_request)}
    if batch < 1:
        row["error"] = f"one request ({per_request} bytes) does not fit in {budget} bytes"
        return row
    ids = _random_ids(model, 1, context, device, seed)
    cuda = device.type == "cuda"

    def attempt(b: int) -> dict[str, Any]:
        """Time a batch of ``b``: its step's median and what the decoder ran with; on CUDA the memory
        it held after its prefill and at its peak. An out-of-memory error carries the stage it hit."""
        # what the attempt before left: a failed one's decoder is freed only once its error was handled
        _release_memory(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        stage = "buffers"
        try:
            # the largest batch is memory-bound: no stacked copies of the projections' weights beside it
            decoder = StaticDecoder(model, batch_size=b, max_length=max_length, compile=compile, fuse_projections=False)
            stage = "prefill"
            decoder.prefill(ids)
            out = {"allocated_after_prefill_bytes": torch.cuda.memory_allocated(device)} if cuda else {}
            stage = "warm-up and capture"
            time_calls(decoder.step, decode_warmup(0, True), device)  # eager steps, then the capture
            stage = "timing"
            out["median"] = statistics.median(time_calls(decoder.step, steps, device))
            out.update(compiled=decoder.compiled, graphs=decoder.graphs, softmax_path=decoder.softmax_path)
            if cuda:
                out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            return out
        except torch.OutOfMemoryError as e:
            e.stage = stage
            raise

    if cuda:
        batch, out, attempts = largest_batch(attempt, batch, label=side)
    else:  # no out-of-memory error to search by: the budget's batch
        out, attempts = attempt(batch), [{"batch": batch, "ran": True}]
    _release_memory(device)  # the last decoder's cached blocks
    median = out.pop("median")
    row.update(batch_size=batch, step_s=median, tokens_per_s=batch / median, held_bytes=batch * per_request, attempts=attempts, **out)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    logger.info("%s: %d bytes per request, batch %d, %.0f tokens/s", side, per_request, batch, row["tokens_per_s"])
    if profile:
        _profile(model, row, context=context, compile=compile, seed=seed)
    return row


def _profile(model, row: dict[str, Any], *, context: int, compile: bool, seed: int) -> None:
    """``row["profile"]``: the side's decode step at its measured batch under ``torch.profiler``
    (``row["profile_error"]`` instead where that batch runs out of memory without CUDA graphs)."""
    try:
        row["profile"] = profile_step(model, context=context, batch_size=row["batch_size"], steps=3, warmup=2, compile=compile,
                                      fuse_projections=False, seed=seed)  # fmt: skip
    except torch.OutOfMemoryError as e:
        row["profile_error"] = f"out of memory at batch {row['batch_size']} without CUDA graphs: {e}".splitlines()[0]
        logger.warning("%s: %s", row["side"], row["profile_error"])
    _release_memory(next(model.parameters()).device)


def _release_memory(device: torch.device) -> None:
    """Free what a dropped decoder held: collect it and, on CUDA, return the cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_capacity(
    model,
    spec: ConversionSpec | dict[str, Any] | None,
    *,
    context: int = 32768,
    steps: int = 8,
    memory_bytes: int | None = None,
    memory_fraction: float = 0.9,
    max_batch: int = 65536,
    compile: bool = False,
    device: str | torch.device | None = None,
    seed: int = 0,
    profile: bool = False,
) -> dict[str, Any]:
    """The teacher and the conversion (``model`` converted in place with ``spec``; an already converted
    model with ``spec`` None is measured as it is) at their largest batch within one memory budget;
    ``profile``: each side's step profiled at that batch as well."""
    check_int("context", context, 1)
    check_int("steps", steps, 1)
    check_int("max_batch", max_batch, 1)
    if memory_bytes is not None:
        check_int("memory_bytes", memory_bytes, 1)
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must lie in (0, 1], got {memory_fraction!r}")
    if spec is None and not converted_layers(model):
        raise ValueError("the model is not converted: pass a conversion spec (e.g. {'attention': 'hybrid', 'window': 64})")
    if device is not None:
        model.to(device)
    device = next(model.parameters()).device
    lifted = _lift_position_limit(model, _decode_tokens(context, 0, steps, True))
    if spec is not None:
        convert(model, spec)
    model.eval()
    budget = _budget(device, memory_bytes, memory_fraction)
    kw = dict(context=context, steps=steps, budget=budget, max_batch=max_batch, compile=compile, seed=seed, profile=profile)
    with teacher_modes(model):
        teacher = _measure(model, "teacher", **kw)
    converted = _measure(model, "converted", **kw)
    result = {
        "model": str(getattr(model.config, "linearize_base_model", None) or getattr(model, "name_or_path", "") or model.config.model_type),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(model.dtype).removeprefix("torch."),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "kernel_options": kernel_options.applied(),
        "spec": getattr(model.config, "linearize", None),
        "settings": dict(context=context, steps=steps, memory_bytes=memory_bytes, memory_fraction=memory_fraction, budget_bytes=budget,
                         max_batch=max_batch, compile=compile, position_limit_lifted_from=lifted, profile=profile),  # fmt: skip
        "teacher": teacher,
        "converted": converted,
    }
    if "tokens_per_s" in teacher and "tokens_per_s" in converted:
        result["throughput_ratio"] = converted["tokens_per_s"] / teacher["tokens_per_s"]
    return result


def capacity_markdown(result: dict[str, Any]) -> str:
    """The two rows (teacher, conversion) and the throughput ratio as a markdown table."""
    s = result["settings"]
    lines = [
        f"**{result['model']}** on {result['device']} ({result['dtype']}): largest batch within {s['budget_bytes'] / 2**30:.2f} GiB "
        f"at {s['context']} tokens of context, greedy decode tokens/s there (StaticDecoder"
        f"{', compiled' if s['compile'] else ''}; median of {s['steps']} steps)"
        + (f"; position limit lifted from {s['position_limit_lifted_from']}" if s["position_limit_lifted_from"] else ""),
        "",
        "| model | MiB per request | batch | ms per step | us per row | tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in (result["teacher"], result["converted"]):
        if "error" in row:
            lines.append(f"| {row['side']} | {row['bytes_per_request'] / 2**20:.2f} | {row['error']} | | | |")
        else:  # us per row: the step's time over its rows, what tokens/s at this batch follows from
            side = row["side"] + (f" ({row['softmax_path']})" if row.get("softmax_path") else "")
            lines.append(f"| {side} | {row['bytes_per_request'] / 2**20:.2f} | {row['batch_size']} | {row['step_s'] * 1e3:.2f} "
                         f"| {row['step_s'] * 1e6 / row['batch_size']:.1f} | {row['tokens_per_s']:.0f} |")  # fmt: skip
    if "throughput_ratio" in result:
        lines += ["", f"Converted / teacher tokens/s: **{result['throughput_ratio']:.2f}x**"]
    for row in (result["teacher"], result["converted"]):
        if any(not a["ran"] for a in row.get("attempts", ())):
            tried = ", ".join(str(a["batch"]) if a["ran"] else f"{a['batch']} (out of memory in its {a['stage'] or 'step'})" for a in row["attempts"])
            lines += ["", f"{row['side']}: batches tried {tried}"]
    for row in (result["teacher"], result["converted"]):
        if "profile" in row:
            prof = row["profile"]
            lines += ["", f"### {row['side']}: one step at batch {prof['batch_size']} without CUDA graphs"
                      f"{' (compiled)' if prof['compiled'] else ''}: {prof['device_ms_per_step']:.2f} ms of device time, "
                      f"{prof['launches_per_step']:.0f} launches", "", *kernel_table(prof)]  # fmt: skip
        elif "profile_error" in row:
            lines += ["", f"### {row['side']}: not profiled: {row['profile_error']}"]
    return "\n".join(lines) + "\n"


def run_capacity(model_name_or_model, spec=None, *, out_dir: str | Path | None = None, **kwargs) -> dict[str, Any]:
    """Entry for the CLI: load the model (a name for ``linearize.load_model``, or a model), run
    ``bench_capacity``, and with ``out_dir`` write capacity.json and capacity.md there (atomically)."""
    if isinstance(model_name_or_model, (str, Path)):
        from ..api import load_model

        model, _ = load_model(str(model_name_or_model), device=kwargs.get("device"))
    else:
        model = model_name_or_model
    result = bench_capacity(model, spec, **kwargs)
    if isinstance(model_name_or_model, (str, Path)):
        result["model"] = str(model_name_or_model)
    if out_dir is not None:
        write_results(Path(out_dir), "capacity", result, capacity_markdown(result))
    return result
