"""Prefill latency, decode latency and memory per request: teacher vs converted, as ratios of one run.

    result = benchmark(model, {"attention": "hybrid", "window": 64}, prefill_lengths=[256, 512, 1024],
                       decode_contexts=[512, 1024])     # converts in place; teacher = converted layers in 'teacher' mode
    print(to_markdown(result)); plot_efficiency(result, "efficiency.png")

- Prefill: one forward of (batch, L) random tokens into a fresh cache (logits of the last position
  only, as generate() does); median seconds over ``repeats`` after ``warmup`` calls.
- Decode: prefill L tokens into a cache (converted layers keep their state there, the others KV),
  then greedy single-token steps with that cache; median seconds per step over ``steps`` steps
  after ``warmup`` untimed ones (the context grows by one token per step).
- Memory: bytes the cache holds after prefilling L tokens of one request (``cache_nbytes``: KV of
  unconverted layers, states of converted ones) beside the formula (``memory.running_request_memory``: each layer's ``memory.layer_memory``).
- Timing: CUDA events (read after one synchronize) on GPU, time.perf_counter on CPU. Teacher and
  converted alternate length by length, so slow drift of the machine hits both alike.
Absolute times depend on the machine; the ratios converted / teacher measured in the same run are the
numbers to compare. Nothing here asserts on time.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import transformers
from torch import Tensor
from tqdm.auto import tqdm

from ..cache import cache_kwargs, cache_nbytes, output_cache
from ..checks import check_int, is_int
from ..convert import convert, converted_layers
from ..io import save_png, write_results
from ..memory import running_request_memory
from ..ops import cpu_kernels, kernel_options
from ..runtime import check_length, configure_cpu, eval_mode
from ..spec import ConversionSpec
from ..teacher import teacher_modes

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_LENGTHS = (256, 512, 1024)
DEFAULT_DECODE_CONTEXTS = (512, 1024)


# ----------------------------------------------------------------------------- helpers


def _place(model, device: str | torch.device | None) -> torch.device:
    """Move the model to ``device`` when given; the device it runs on."""
    if device is not None:
        model.to(device)
    return next(model.parameters()).device


def _random_ids(model, batch_size: int, length: int, device: torch.device, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch_size, length), generator=gen).to(device)  # (B, L)


def cuda_mean_us(fn: Callable[[], Any], repeats: int = 100, warmup: int = 5) -> float:
    """Mean microseconds per call of ``fn`` over ``repeats`` calls back to back on the current CUDA
    device, after ``warmup`` calls (two events around the whole run: launch gaps included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1000


def time_calls(fn: Callable[[], Any], n: int, device: torch.device) -> list[float]:
    """Seconds of each of ``n`` successive calls of ``fn``."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _prefill(model, ids: Tensor):
    """Forward of ``ids`` into a fresh cache; logits of the last position only."""
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)


def _decoder(model, ids: Tensor, max_steps: int) -> Callable[[], None]:
    """Prefill ``ids`` (B, L) into a cache; returns one greedy single-token step with that cache."""
    out = _prefill(model, ids)
    cache = output_cache(out)
    mask = torch.ones(ids.shape[0], ids.shape[1] + max_steps, dtype=torch.long, device=ids.device)  # (B, L + steps)
    last = {"ids": out.logits[:, -1:].argmax(-1), "seen": ids.shape[1]}  # (B, 1) next token

    def step() -> None:
        seen = last["seen"] + 1
        o = model(input_ids=last["ids"], attention_mask=mask[:, :seen], **cache_kwargs(cache), use_cache=True)
        last["ids"], last["seen"] = o.logits[:, -1:].argmax(-1), seen

    return step


# ----------------------------------------------------------------------------- measurements


@torch.inference_mode()
def bench_prefill(
    model, lengths: Sequence[int], *, batch_size: int = 1, warmup: int = 1, repeats: int = 3,
    device: str | torch.device | None = None, seed: int = 0,
) -> list[dict[str, Any]]:
    """Median prefill latency per prompt length: rows of length, batch_size, median_s, tokens_per_s."""
    device = _place(model, device)
    rows = []
    with eval_mode(model):
        for length in tqdm(lengths, desc="prefill", unit="length", disable=len(lengths) < 2):
            check_length(model, length)
            ids = _random_ids(model, batch_size, length, device, seed)
            call = functools.partial(_prefill, model, ids)
            time_calls(call, warmup, device)
            median = statistics.median(time_calls(call, repeats, device))
            rows.append({"length": length, "batch_size": batch_size, "median_s": median, "tokens_per_s": batch_size * length / median})
            logger.info("prefill %d x %d: %.2f ms", batch_size, length, median * 1e3)
    return rows


def _decoder_name(decoder) -> str:
    """How decode steps ran: 'cache' (the model's forward with its cache; ``decoder`` None) or
    'static' (+ '-compiled' where the compiled step ran, + '-graph' where it was a CUDA graph, +
    '-flash-decoding' or '-matmul': how its softmax layers read their buffers, where it has any)."""
    if decoder is None:
        return "cache"
    path = decoder.softmax_path
    return "static" + ("-compiled" if decoder.compiled else "") + ("-graph" if decoder.graphs else "") + (f"-{path}" if path else "")


def decode_warmup(warmup: int, static: bool | str) -> int:
    """The untimed steps before timing decode: ``warmup``, and with a StaticDecoder at least its eager
    warm-up steps and the capture, so that the timed steps replay the graph."""
    from ..decoding import WARMUP_STEPS

    return max(warmup, WARMUP_STEPS + 1) if static else warmup


def _decode_tokens(context: int, warmup: int, steps: int, static: bool | str) -> int:
    """Positions a decode measurement reaches (a StaticDecoder holds one more slot)."""
    return context + decode_warmup(warmup, static) + steps + bool(static)


def _static_decoder(model, ids: Tensor, batch_size: int, max_steps: int, compile: bool = False):
    """A StaticDecoder of ``batch_size`` rows with ``ids`` (1, L) prefilled."""
    from ..decoding import StaticDecoder

    decoder = StaticDecoder(model, batch_size=batch_size, max_length=ids.shape[1] + max_steps + 1, compile=compile)
    decoder.prefill(ids)
    return decoder


@torch.inference_mode()
def bench_decode(
    model, context_lengths: Sequence[int], *, steps: int = 16, batch_size: int = 1, warmup: int = 2,
    device: str | torch.device | None = None, seed: int = 0, static: bool | str = False,
) -> list[dict[str, Any]]:
    """Median per-token decode latency after prefilling each context length: rows of context, median_s, tokens_per_s.

    ``static``: decode with ``linearize.decoding.StaticDecoder`` (static buffers; on CUDA each step
    is one CUDA graph replay, captured during the untimed steps; "compile": its step compiled with
    ``torch.compile`` first), after one prompt repeated to the batch; otherwise ``model(...)`` with
    the model's cache, after a batch of prompts. Rows say which in ``decoder``."""
    device = _place(model, device)
    rows = []
    warmup = decode_warmup(warmup, static)
    with eval_mode(model):
        for context in tqdm(context_lengths, desc="decode", unit="context", disable=len(context_lengths) < 2):
            check_length(model, _decode_tokens(context, warmup, steps, static))
            decoder = None
            if static:
                decoder = _static_decoder(model, _random_ids(model, 1, context, device, seed), batch_size, warmup + steps,
                                          compile=static == "compile")  # fmt: skip
                step = decoder.step
            else:
                step = _decoder(model, _random_ids(model, batch_size, context, device, seed), warmup + steps)
            time_calls(step, warmup, device)
            median = statistics.median(time_calls(step, steps, device))
            rows.append({"context": context, "batch_size": batch_size, "steps": steps, "warmup": warmup, "median_s": median,
                         "tokens_per_s": batch_size / median, "decoder": _decoder_name(decoder)})  # fmt: skip
            logger.info("decode batch %d @ %d: %.2f ms/token", batch_size, context, median * 1e3)
    return rows


@torch.inference_mode()
def memory_per_request(
    model, context_lengths: Sequence[int], *, device: str | torch.device | None = None, seed: int = 0,
) -> list[dict[str, Any]]:
    """Bytes the cache holds after prefilling each context length (one request), and the formula."""
    device = _place(model, device)
    rows = []
    with eval_mode(model):
        for context in context_lengths:
            check_length(model, context)
            cache = output_cache(_prefill(model, _random_ids(model, 1, context, device, seed)))
            rows.append({"context": context, "measured_bytes": sum(cache_nbytes(cache).values()), "formula_bytes": running_request_memory(model, context)})
            del cache
    return rows


# ----------------------------------------------------------------------------- teacher vs converted


def check_settings(*, prefill_lengths, decode_contexts, batch_size, decode_steps, warmup, repeats, memory_contexts=None) -> None:
    """ValueError naming the first bad setting (lengths and counts >= 1, warmup >= 0)."""
    lists = {"prefill_lengths": prefill_lengths, "decode_contexts": decode_contexts, "memory_contexts": memory_contexts}
    for name, values in lists.items():
        if values is not None and (isinstance(values, str) or not all(is_int(v) and v >= 1 for v in values)):
            raise ValueError(f"{name} must be integers >= 1, got {values!r}")
    for name, value in (("batch_size", batch_size), ("decode_steps", decode_steps), ("repeats", repeats)):
        check_int(name, value, 1)
    check_int("warmup", warmup, 0)


def benchmark(
    model,
    spec: ConversionSpec | dict[str, Any] | None,
    *,
    prefill_lengths: Sequence[int] = DEFAULT_PREFILL_LENGTHS,
    decode_contexts: Sequence[int] = DEFAULT_DECODE_CONTEXTS,
    memory_contexts: Sequence[int] | None = None,
    batch_size: int = 1,
    decode_steps: int = 16,
    warmup: int = 1,
    repeats: int = 3,
    device: str | torch.device | None = None,
    static_decode: bool | str = False,
) -> dict[str, Any]:
    """Teacher vs converted: convert ``model`` in place with ``spec`` and measure both; JSON-able result.
    ``static_decode``: as ``bench_decode``'s ``static`` (True or "compile"), for both sides.

    The teacher is the same model with every converted layer in 'teacher' mode (the original attention
    and plain KV: the teacher's exact compute); at each length the teacher runs first, then the
    converted model. An already converted model (a trained conversion) with ``spec`` None is measured
    as it is. ``memory_contexts`` default: the prefill lengths and decode contexts. ``ratios`` holds
    converted / teacher per length.
    """
    check_settings(prefill_lengths=prefill_lengths, decode_contexts=decode_contexts, memory_contexts=memory_contexts,
                   batch_size=batch_size, decode_steps=decode_steps, warmup=warmup, repeats=repeats)
    if spec is None and not converted_layers(model):
        raise ValueError("the model is not converted: pass a conversion spec (e.g. {'attention': 'hybrid', 'window': 64})")
    spec = ConversionSpec.coerce(spec) if spec is not None else None
    memory_contexts = sorted(set(prefill_lengths) | set(decode_contexts)) if memory_contexts is None else list(memory_contexts)
    for length in [*prefill_lengths, *memory_contexts, *(_decode_tokens(c, warmup, decode_steps, static_decode) for c in decode_contexts)]:
        check_length(model, length)  # fail before any measurement
    device = _place(model, device)
    settings = dict(prefill_lengths=list(prefill_lengths), decode_contexts=list(decode_contexts), memory_contexts=memory_contexts,
                    batch_size=batch_size, decode_steps=decode_steps, warmup=warmup, decode_warmup=decode_warmup(warmup, static_decode),
                    repeats=repeats, static_decode=static_decode)  # fmt: skip
    if spec is not None:
        convert(model, spec)
    teacher, converted = _interleaved(model, [
        ("prefill", bench_prefill, prefill_lengths, dict(batch_size=batch_size, warmup=warmup, repeats=repeats)),
        ("decode", bench_decode, decode_contexts, dict(steps=decode_steps, batch_size=batch_size, warmup=warmup, static=static_decode)),
        ("memory", memory_per_request, memory_contexts, {}),
    ])  # fmt: skip
    return {
        "model": str(getattr(model.config, "linearize_base_model", None) or getattr(model, "name_or_path", "") or model.config.model_type),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "kernel_options": kernel_options.applied(),
        "spec": getattr(model.config, "linearize", None),
        "settings": settings,
        "teacher": teacher,
        "converted": converted,
        "ratios": _ratios(teacher, converted),
    }


def _interleaved(model, parts) -> tuple[dict[str, list], dict[str, list]]:
    """Rows of each (name, bench function, lengths, kwargs): at each length the teacher (converted layers
    in 'teacher' mode), then the converted model, so drift of the machine's speed hits both alike."""
    teacher: dict[str, list] = {}
    converted: dict[str, list] = {}
    for name, fn, lengths, kwargs in parts:
        teacher[name], converted[name] = [], []
        for length in tqdm(lengths, desc=name, unit="length"):
            with teacher_modes(model):
                teacher[name] += fn(model, [length], **kwargs)
            converted[name] += fn(model, [length], **kwargs)
    return teacher, converted


def _ratios(teacher: dict, converted: dict) -> dict[str, list[dict[str, Any]]]:
    def times(part: str, key: str) -> list[dict[str, Any]]:
        return [
            {key: t[key], "teacher_s": t["median_s"], "converted_s": c["median_s"], "ratio": c["median_s"] / t["median_s"]}
            for t, c in zip(teacher[part], converted[part])
        ]

    memory = [
        {
            "context": t["context"],
            "teacher_bytes": t["measured_bytes"], "converted_bytes": c["measured_bytes"],
            "ratio": c["measured_bytes"] / t["measured_bytes"],
            "teacher_formula_bytes": t["formula_bytes"], "converted_formula_bytes": c["formula_bytes"],
            "formula_ratio": c["formula_bytes"] / t["formula_bytes"],
        }  # fmt: skip
        for t, c in zip(teacher["memory"], converted["memory"])
    ]
    return {"prefill": times("prefill", "length"), "decode": times("decode", "context"), "memory": memory}


# ----------------------------------------------------------------------------- reports


_STATIC_NOTE = {True: "; StaticDecoder: static buffers, each step a CUDA graph replay on CUDA",
                "compile": "; StaticDecoder with torch.compile: static buffers, each step a CUDA graph replay on CUDA"}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _describe(spec: dict[str, Any]) -> str:
    """'hybrid (window 64), layers all' from a spec's dict (``ConversionSpec.to_dict``)."""
    given = spec.get("options")
    if given is None:  # results written before the spec nested its options
        given = {k: spec[k] for k in ("window",) if k in spec}
    options = ", ".join(f"{k.replace('_', ' ')} {given[k]}" for k in ("window", "sparse_cache", "chunk") if k in given)
    layers = spec.get("layers")
    return f"{spec.get('attention', '?')}" + (f" ({options})" if options else "") + f", layers {'all' if layers is None else layers}"


def to_markdown(result: dict[str, Any]) -> str:
    """Markdown tables of the result: times, bytes and the converted / teacher ratios."""
    r, s = result["ratios"], result["settings"]
    spec = result.get("spec") or {}
    lines = [
        f"**{result['model']}** on {result['device']} ({result['dtype']}), batch {s['batch_size']}; converted: "
        f"{_describe(spec)}",
        "",
        f"Prefill (median of {s['repeats']} after {s['warmup']} warm-up)",
        "",
        "| prompt tokens | teacher ms | converted ms | converted / teacher |",
        "|---:|---:|---:|---:|",
        *(f"| {x['length']} | {x['teacher_s'] * 1e3:.2f} | {x['converted_s'] * 1e3:.2f} | {x['ratio']:.3g} |" for x in r["prefill"]),
        "",
        f"Decode, per token (median of {s['decode_steps']} steps after {s.get('decode_warmup', s['warmup'])} warm-up"
        f"{_STATIC_NOTE.get(s.get('static_decode') or False, '')})",
        "",
        "| context tokens | teacher ms | converted ms | converted / teacher |",
        "|---:|---:|---:|---:|",
        *(f"| {x['context']} | {x['teacher_s'] * 1e3:.2f} | {x['converted_s'] * 1e3:.2f} | {x['ratio']:.3g} |" for x in r["decode"]),
        "",
        "Memory per request (cache after prefill; formula beside)",
        "",
        "| context tokens | teacher MiB | converted MiB | converted / teacher | formula teacher MiB | formula converted MiB | formula ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {x['context']} | {_mib(x['teacher_bytes'])} | {_mib(x['converted_bytes'])} | {x['ratio']:.3g} | "
            f"{_mib(x['teacher_formula_bytes'])} | {_mib(x['converted_formula_bytes'])} | {x['formula_ratio']:.3g} |"
            for x in r["memory"]
        ),
    ]
    return "\n".join(lines) + "\n"


def plot_efficiency(result: dict[str, Any], path: str | Path) -> None:
    """PNG: prefill latency, decode latency per token and memory per request vs length, teacher vs converted."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(14, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    panels = (("prefill", "length", "median_s", 1e3, "prefill latency (ms)", "prompt tokens"),
              ("decode", "context", "median_s", 1e3, "decode latency per token (ms)", "context tokens"),
              ("memory", "context", "measured_bytes", 2.0**-20, "memory per request (MiB)", "context tokens"))  # fmt: skip
    for ax, (part, x, y, scale, ylabel, xlabel) in zip(axes, panels):
        for name, style in (("teacher", "C0"), ("converted", "C1")):
            rows = result[name][part]
            ax.plot([row[x] for row in rows], [row[y] * scale for row in rows], marker="o", color=style, label=name)
            if part == "memory":
                ax.plot([row[x] for row in rows], [row["formula_bytes"] * scale for row in rows], ls="--", color=style, label=f"{name} (formula)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']} on {result['device']} ({result['dtype']}, batch {result['settings']['batch_size']})")
    fig.tight_layout()
    save_png(fig, path)


def run_efficiency(
    model_name_or_model,
    spec: ConversionSpec | dict[str, Any] | None = None,
    *,
    prefill_lengths: Sequence[int] = DEFAULT_PREFILL_LENGTHS,
    decode_contexts: Sequence[int] = DEFAULT_DECODE_CONTEXTS,
    batch_size: int = 1,
    decode_steps: int = 16,
    warmup: int = 1,
    repeats: int = 3,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    out_dir: str | Path | None = None,
    static_decode: bool | str = False,
) -> dict[str, Any]:
    """Entry for the CLI: load the model (a name for ``linearize.load_model``, or a model), benchmark it,
    and with ``out_dir`` write efficiency.json, efficiency.md and efficiency.png there (each atomically)."""
    check_settings(prefill_lengths=prefill_lengths, decode_contexts=decode_contexts, batch_size=batch_size,
                   decode_steps=decode_steps, warmup=warmup, repeats=repeats)  # before the model loads
    if isinstance(model_name_or_model, (str, Path)):
        from ..api import load_model

        model, _ = load_model(str(model_name_or_model), dtype=dtype, device=device)
    else:
        model = model_name_or_model
    result = benchmark(
        model, spec, prefill_lengths=prefill_lengths, decode_contexts=decode_contexts, batch_size=batch_size,
        decode_steps=decode_steps, warmup=warmup, repeats=repeats, device=device, static_decode=static_decode,
    )  # fmt: skip
    if isinstance(model_name_or_model, (str, Path)):
        result["model"] = str(model_name_or_model)
    if out_dir is not None:
        out = Path(out_dir)
        write_results(out, "efficiency", result, to_markdown(result))
        plot_efficiency(result, out / "efficiency.png")
        logger.info("wrote %s/efficiency.{json,md,png}", out)
    return result


# ----------------------------------------------------------------------------- decode speed by context

DEFAULT_SPEED_CONTEXTS = (256, 1024, 4096)
FLOOR_CONTEXT = 16
"""The context of the reference's floor step: the part of a decode step every model shares
(weights read, MLP, q/k/v/o projections, norms, lm_head) plus attention over this few tokens."""


@torch.inference_mode()
def decode_speed(
    names: Sequence[str],
    contexts: Sequence[int] = DEFAULT_SPEED_CONTEXTS,
    *,
    steps: int = 16,
    warmup: int = 2,
    device: str | torch.device | None = None,
    seed: int = 0,
    floor_context: int | None = FLOOR_CONTEXT,
) -> dict[str, Any]:
    """Greedy decode tokens/s of several models (the first is the reference, e.g. the teacher) after
    each context length, measured in one run: all models are loaded first; at each context every
    model prefills ``context`` random tokens into a fresh cache (its seconds: one call) and takes
    ``warmup`` untimed steps, then the models take ``steps`` timed single-token steps in turn (one
    step each, round after round), so a slower spell of a shared machine hits them alike. The median
    step is the decode time, ``tokens_per_s`` its inverse; ``ratio``: tokens/s over the reference's at
    that context.

    ``floor``: at each context the reference also steps after ``floor_context`` tokens (at most the
    context), in the same rounds (None: not measured). That step is the part every model shares plus next to no attention,
    so reference step / floor step (``bound``) is the most any converted model of the same
    architecture could reach at that context through the same loop, were its attention free."""
    from ..api import load_model

    check_int("floor_context", floor_context, 1, allow_none=True)
    threads = configure_cpu()
    models = {}
    for name in tqdm(names, desc="load", unit="model"):
        model, _ = load_model(name, device=device)
        models[name] = model.eval()
    for model in models.values():
        for context in contexts:
            check_length(model, context + warmup + steps)
    first = next(iter(models.values()))
    dev = next(first.parameters()).device
    rows, floor = [], []
    with tqdm(total=len(contexts) * len(models), desc="decode speed", unit="run") as bar:
        for context in contexts:
            ids = _random_ids(first, 1, context, dev, seed)
            steps_of, prefill_s = {}, {}
            for name, model in models.items():
                start = time.perf_counter()
                steps_of[name] = _decoder(model, ids, warmup + steps)  # prefill into a fresh cache
                prefill_s[name] = time.perf_counter() - start
                time_calls(steps_of[name], warmup, dev)
            runs = dict(steps_of)
            if floor_context is not None:  # the reference after a few tokens, stepping in the same rounds
                runs[None] = _decoder(first, ids[:, :floor_context], warmup + steps)
                time_calls(runs[None], warmup, dev)
            times: dict[str | None, list[float]] = {name: [] for name in runs}
            for _ in range(steps):  # one step of each model in turn: a slower spell of the machine hits all alike
                for name, step in runs.items():
                    times[name] += time_calls(step, 1, dev)
            if floor_context is not None:
                floor_s, reference_s = statistics.median(times[None]), statistics.median(times[names[0]])
                floor.append({"context": context, "floor_context": min(floor_context, context), "decode_s": floor_s,
                              "tokens_per_s": 1 / floor_s, "bound": reference_s / floor_s})  # fmt: skip
            for name, model in models.items():
                median = statistics.median(times[name])
                spec = getattr(model.config, "linearize", None) or {}
                rows.append({"model": name, "context": context, "converted_layers": len(converted_layers(model)),
                             "attention": spec.get("attention", "softmax (teacher)"), "active": spec.get("active"),
                             "prefill_s": prefill_s[name], "prefill_tokens_per_s": context / prefill_s[name],
                             "decode_s": median, "tokens_per_s": 1 / median})  # fmt: skip
                logger.info("%s @ %d: %.1f ms/token (prefill %.2f s)", name, context, median * 1e3, prefill_s[name])
                bar.update()
            del steps_of, runs
    reference = {r["context"]: r["tokens_per_s"] for r in rows if r["model"] == names[0]}
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / reference[r["context"]]
    return {
        "reference": names[0],
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(first.dtype).removeprefix("torch."),
        "threads": threads,
        "flush_denormal": True,
        "cpu_kernels": dev.type == "cpu" and cpu_kernels.enabled(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "kernel_options": kernel_options.applied(),
        "settings": {"contexts": list(contexts), "steps": steps, "warmup": warmup, "batch_size": 1, "seed": seed,
                     "floor_context": floor_context},
        "rows": rows,
        "floor": floor,
    }


def speed_markdown(result: dict[str, Any]) -> str:
    """Markdown table: decode tokens/s (and / the reference) by context, one row per model."""
    contexts = result["settings"]["contexts"]
    by = {(r["model"], r["context"]): r for r in result["rows"]}
    names = list(dict.fromkeys(r["model"] for r in result["rows"]))
    load = result.get("load_average")
    lines = [
        f"Decode tokens/s on {result['device']} ({result['dtype']}, batch 1, {result['threads']} threads"
        + (f", load average {load[0]:.2f} at the end" if load else "") + f"): median of {result['settings']['steps']} "
        f"greedy steps after prefilling the context; x = / {result['reference']} at the same context, same run."
        + ("" if "cpu_kernels" not in result else " Converted layers decode through the fused CPU kernels."
           if result["cpu_kernels"] else " Converted layers decode through PyTorch operations (no CPU kernels)."),
        "",
        "| model | converted layers | " + " | ".join(f"{_tokens(c)} tok/s | x" for c in contexts) + " |",
        "|---|---:|" + "---:|---:|" * len(contexts),
    ]
    for name in names:
        cells = " | ".join(f"{by[name, c]['tokens_per_s']:.1f} | {by[name, c]['ratio']:.2f}" for c in contexts)
        first = by[name, contexts[0]]
        layers = f"{first['converted_layers']} ({first['attention']})" if first["converted_layers"] else "0"
        lines.append(f"| {name} | {layers} | {cells} |")
    lines += [
        "",
        "Prefill seconds (one call each, the prefill before decoding)",
        "",
        "| model | " + " | ".join(_tokens(c) for c in contexts) + " |",
        "|---|" + "---:|" * len(contexts),
        *(f"| {name} | " + " | ".join(f"{by[name, c]['prefill_s']:.2f}" for c in contexts) + " |" for name in names),
    ]
    if result.get("floor"):
        floor = {f["context"]: f for f in result["floor"]}
        lines += [
            "",
            f"Floor: {result['reference']} stepping after {result['floor'][0]['floor_context']} tokens in the same rounds "
            "(the part every model shares, next to no attention); bound = its tokens/s over the reference's at "
            "the context: about the most a converted model could reach there (were its attention free; the floor "
            "still pays the reference's attention over those few tokens, so a converted model can pass it slightly)",
            "",
            "| | " + " | ".join(_tokens(c) for c in contexts) + " |",
            "|---|" + "---:|" * len(contexts),
            "| floor tok/s | " + " | ".join(f"{floor[c]['tokens_per_s']:.1f}" for c in contexts) + " |",
            "| bound x | " + " | ".join(f"{floor[c]['bound']:.2f}" for c in contexts) + " |",
        ]
    return "\n".join(lines) + "\n"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def plot_speed(result: dict[str, Any], path: str | Path) -> None:
    """PNG: decode tokens/s and prefill seconds vs context, one line per model."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    names = list(dict.fromkeys(r["model"] for r in result["rows"]))
    for name in names:
        rows = [r for r in result["rows"] if r["model"] == name]
        style = dict(marker="o", ls="--" if name == result["reference"] else "-", label=name)
        axes[0].plot([r["context"] for r in rows], [r["tokens_per_s"] for r in rows], **style)
        axes[1].plot([r["context"] for r in rows], [r["prefill_s"] for r in rows], **style)
    for ax, ylabel in zip(axes, ("decode tokens/s", "prefill seconds")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="context tokens", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['device']}, {result['threads']} threads, batch 1 ({result['dtype']})")
    fig.tight_layout()
    save_png(fig, path)


def run_decode_speed(names: Sequence[str], contexts: Sequence[int] = DEFAULT_SPEED_CONTEXTS, *, steps: int = 16,
                     device: str | torch.device | None = None, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Entry for the CLI: ``decode_speed``, and with ``out_dir`` speed.json, speed.md, speed.png there."""
    result = decode_speed(names, contexts, steps=steps, device=device)
    if out_dir is not None:
        out = Path(out_dir)
        write_results(out, "speed", result, speed_markdown(result))
        plot_speed(result, out / "speed.png")
        logger.info("wrote %s/speed.{json,md,png}", out)
    return result


__all__ = [
    "bench_decode",
    "bench_prefill",
    "benchmark",
    "decode_speed",
    "memory_per_request",
    "plot_efficiency",
    "plot_speed",
    "run_decode_speed",
    "run_efficiency",
    "speed_markdown",
    "to_markdown",
]
