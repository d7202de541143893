"""One attention layer on synthetic shapes: converted vs flash softmax, against the roofline.

    result = bench_layer("llama3-8b", {"attention": "hybrid", "window": 64}, prefill_lengths=[8192, 32768],
                         decode_contexts=[32768], batch_sizes=[1, 64], device="cuda")
    print(layer_markdown(result))

What is timed is the whole attention module of one decoder layer, projections included: hidden
states (B, T, hidden) in, (B, T, hidden) out, random weights of the named shape, bf16 on CUDA.

- Softmax baseline: the teacher's q/k/v/o weights, RoPE, and ``scaled_dot_product_attention`` with
  grouped KV heads (``enable_gqa``, no repeated heads), causal for prefill; for decode a static KV
  cache (preallocated to the context, one slot written per step, no concatenation). Every SDPA
  backend the device has (flash, efficient, cuDNN on CUDA; flash and math on CPU) is timed and the
  fastest is the baseline; the table names it and the JSON keeps every backend's time.
- Converted: the layer ``convert`` builds for the spec (its fast path: fla on CUDA when installed),
  called as a model calls it. Prefill: no cache. Decode: a cache holding the state after a prefill
  of ``min(context, state_prefill)`` tokens of one request, repeated to the batch, then single-token
  steps at position ``context`` (a converted layer's state has the same size at every context, so
  the step costs the same; its state is updated in the cache each step, as in generation).
- Roofline: the time an ideal kernel needs, max(bytes moved / bandwidth, FLOPs / peak). Bytes: the
  four weight matrices, the layer's input and output, q/k/v/o once each (prefill), and for decode the
  whole KV cache read (softmax) or the state read and written (converted, from the kind's memory
  formula). FLOPs: projections + attention (causal softmax counts half the square; the window, sparse
  cache and linear state their own terms). ``roofline_fraction`` = roofline time / measured time.
  Default peaks: H200 (4.3 TB/s, 790 TFLOP/s bf16 dense), override with ``bandwidth``/``flops``.
Ratios are converted / softmax time in the same run: lower is better. Nothing here asserts on time.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..cache import cache_kwargs, state_layer
from ..checks import check_choice
from ..convert import convert
from ..decoding import StaticSlot, cuda_graph
from ..hub import build_tiny_llama
from ..io import save_png, write_results
from ..layers.base import project_qkv
from ..layers.registry import KINDS
from ..ops import fused_decode, kernel_options
from ..spec import ConversionSpec
from .efficiency import time_calls
from .shapes import SHAPES, LayerShape

logger = logging.getLogger(__name__)


H200_BANDWIDTH = 4.3e12
"""Bytes per second the roofline assumes by default (H200 HBM3e, achievable)."""
H200_FLOPS = 790e12
"""bf16 dense FLOP/s the roofline assumes by default (H200)."""


def layer_shape(shape: str | LayerShape) -> LayerShape:
    """A LayerShape from its name in SHAPES (ValueError naming the valid ones) or as it is."""
    if isinstance(shape, LayerShape):
        return shape
    check_choice("layer shape", shape, tuple(SHAPES))
    return SHAPES[shape]


# ----------------------------------------------------------------------------- the layer


def build_layer(shape: LayerShape, spec: ConversionSpec | dict | None, *, max_positions: int, device, dtype, seed: int = 0):
    """A one-layer random Llama of ``shape`` (converted with ``spec`` when given) on ``device``."""
    model = build_tiny_llama(
        seed, vocab_size=256, hidden_size=shape.hidden, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=max_positions,
    )  # fmt: skip
    if spec is not None:
        convert(model, spec)
    return model.to(device=device, dtype=dtype).eval()


def _positions(model, x: Tensor, start: int) -> tuple[Tensor, Tensor]:
    ids = torch.arange(start, start + x.shape[1], device=x.device)[None]  # (1, T)
    return model.model.rotary_emb(x, ids)


def sdpa_backends(device: torch.device) -> dict[str, Any]:
    """The SDPA backends worth timing on ``device``: name -> SDPBackend."""
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


class SoftmaxLayer:
    """The teacher's attention on SDPA with grouped KV heads and a static KV cache."""

    def __init__(self, attn, shape: LayerShape):
        self.attn, self.shape = attn, shape
        self.k_cache = self.v_cache = None

    def _out(self, o: Tensor) -> Tensor:
        b, _, t, _ = o.shape
        return self.attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def prefill(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v, _, _ = project_qkv(self.attn, x, (cos, sin))
        return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    def fill(self, batch: int, context: int, steps: int, device, dtype) -> None:
        """A static cache for ``context + steps`` positions; the first ``context`` hold random keys/values."""
        size = (batch, self.shape.kv_heads, context + steps, self.shape.head_dim)
        gen = torch.Generator(device=device).manual_seed(0)
        self.k_cache = torch.randn(size, generator=gen, device=device, dtype=dtype)
        self.v_cache = torch.randn(size, generator=gen, device=device, dtype=dtype)
        self.position = self.context = context

    def fixed_step(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``step`` at the context, always (its slot rewritten each call): the same shapes every
        call, so a compiled step compiles once."""
        q, k, v, _, _ = project_qkv(self.attn, x, (cos, sin))
        p = self.context
        self.k_cache[:, :, p : p + 1].copy_(k)
        self.v_cache[:, :, p : p + 1].copy_(v)
        o = F.scaled_dot_product_attention(q, self.k_cache[:, :, : p + 1], self.v_cache[:, :, : p + 1], enable_gqa=True)
        return self._out(o)

    def step(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v, _, _ = project_qkv(self.attn, x, (cos, sin))
        p = self.position
        self.k_cache[:, :, p : p + 1].copy_(k)
        self.v_cache[:, :, p : p + 1].copy_(v)
        self.position = p + 1
        o = F.scaled_dot_product_attention(q, self.k_cache[:, :, : p + 1], self.v_cache[:, :, : p + 1], enable_gqa=True)
        return self._out(o)


# ----------------------------------------------------------------------------- roofline


def roofline(kind: str, options, config, shape: LayerShape, *, phase: str, batch: int, length: int, elem: int,
             bandwidth: float = H200_BANDWIDTH, flops: float = H200_FLOPS) -> dict[str, float]:
    """Bytes, FLOPs and the ideal time of one call (``phase`` 'prefill': ``length`` tokens; 'decode':
    one token at context ``length``) of attention ``kind`` ('softmax' or a converted kind with its
    spec ``options``) in a layer of ``shape`` (module docstring)."""
    b, hq, hkv, d, hid = batch, shape.heads, shape.kv_heads, shape.head_dim, shape.hidden
    t = length if phase == "prefill" else 1
    proj_cols = 2 * hq * d + 2 * hkv * d
    nbytes = elem * hid * proj_cols + 2 * elem * b * t * hid  # weights, layer input and output
    nflops = 2 * b * t * hid * proj_cols
    if phase == "prefill":
        nbytes += elem * b * t * d * (2 * hq + 2 * hkv)  # q, k, v, o once
    if kind == "softmax":
        if phase == "prefill":
            nflops += 4 * b * hq * d * t * t / 2  # causal: half the square, QK and PV
        else:
            nbytes += 2 * elem * b * hkv * (length + 1) * d  # the whole KV cache read
            nflops += 4 * b * hq * d * (length + 1)
    else:
        _, fixed = KINDS[kind].memory(options, config, elem)
        if phase == "decode":
            nbytes += 2 * b * fixed  # the state read and written
        window = getattr(options, "window", 0)
        slots = getattr(options, "sparse_cache", 0)
        features = options.features(d) if hasattr(options, "features") else d
        states = 2 if kind == "dsla" else 1
        keys = min(window + slots, length)
        nflops += 4 * b * hq * d * t * keys  # window (and sparse cache) softmax
        nflops += states * 4 * b * hq * t * features * d  # write and read of each linear state
        if hasattr(options, "feature_map") and options.feature_map == "hedgehog":
            nflops += 2 * b * t * (hq + hkv) * d * features / 2  # the feature maps' projections
    seconds = max(nbytes / bandwidth, nflops / flops)
    return {"bytes": float(nbytes), "flops": float(nflops), "roofline_s": seconds,
            "bound": "memory" if nbytes / bandwidth >= nflops / flops else "compute"}


# ----------------------------------------------------------------------------- timing


def _median(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    time_calls(fn, warmup, device)
    return statistics.median(time_calls(fn, repeats, device))


def _fastest_backend(make_run: Callable[[], Callable[[], Any]], device: torch.device, warmup: int, repeats: int,
                     per_call: int = 1, skip: tuple[str, ...] = ()) -> tuple[str, float, dict[str, float | str]]:
    """Time a fresh ``make_run()`` under each SDPA backend but ``skip`` (seconds per call / ``per_call``);
    (fastest backend, its seconds, every backend's seconds or why it did not run)."""
    from torch.nn.attention import sdpa_kernel

    times: dict[str, float | str] = {name: "not timed" for name in skip}
    for name, backend in sdpa_backends(device).items():
        if name in skip:
            continue
        try:
            with sdpa_kernel([backend]), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "kernel not used because ...": the error below says it
                run = make_run()  # inside: a CUDA graph records the backend chosen here
                times[name] = _median(run, device, warmup, repeats) / per_call
        except RuntimeError as err:  # the backend does not take these shapes on this device
            times[name] = f"unsupported: {str(err).splitlines()[0][:120]}"
    timed = {k: v for k, v in times.items() if isinstance(v, float)}
    if not timed:
        raise RuntimeError(f"no SDPA backend ran on {device}: {times}")
    best = min(timed, key=timed.get)
    return best, timed[best], times


@torch.inference_mode()
def bench_layer(
    shape: str | LayerShape,
    spec: ConversionSpec | dict[str, Any],
    *,
    prefill_lengths: Sequence[int] = (2048, 8192),
    decode_contexts: Sequence[int] = (4096,),
    batch_sizes: Sequence[int] = (1,),
    decode_steps: int = 8,
    state_prefill: int = 4096,
    max_prefill_tokens: int = 131072,
    warmup: int = 2,
    repeats: int = 5,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    bandwidth: float = H200_BANDWIDTH,
    flops: float = H200_FLOPS,
    seed: int = 0,
    graphs: bool = False,
    compile: bool = False,
    profile: bool = False,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Converted layer vs softmax on SDPA, prefill and decode; JSON-able result with roofline columns.

    ``graphs`` (CUDA): each side's decode step is captured once as a CUDA graph and replayed, so the
    time is the kernels' alone, without the host's launches: the softmax step at its context, the
    converted step on its state in static form (``static_decoding``; kinds without one run eagerly,
    and the row says so). Kinds with fused state kernels (``FUSED_KINDS``) are also timed with the
    torch step they replace (``converted_unfused_s``); kinds with a fused prefill
    (``FUSED_PREFILL_KINDS``) likewise with the exact prefill. ``compile``: each side's decode step goes
    through ``torch.compile`` first (the softmax step at the context, once per SDPA backend; the
    converted step on its state in static form, o_proj included), then, with ``graphs``, is captured.

    ``profile``: each prefill case is also run under ``torch.profiler`` (``profile_calls``), each side
    once per repeat, and the row keeps both sides' device time, kernel launches and top kernels: where
    a converted prefill spends its time.

    A prefill case runs when batch x length <= ``max_prefill_tokens`` (one long prompt, or a batch of
    shorter ones); cases that run out of device memory are recorded as such, not raised."""
    spec = ConversionSpec.coerce(spec)
    shape = layer_shape(shape)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if graphs and device.type != "cuda":
        raise ValueError(f"graphs=True needs a CUDA device; got {device}")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    for name, values in (("prefill length", prefill_lengths), ("decode context", decode_contexts), ("batch size", batch_sizes)):
        bad = [v for v in values if not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"{name}s must be positive integers, got {bad}")
    max_positions = max([*prefill_lengths, *(c + (warmup + repeats) * decode_steps for c in decode_contexts)])
    model = build_layer(shape, spec, max_positions=max_positions, device=device, dtype=dtype, seed=seed)
    attn = model.model.layers[0].self_attn
    if compile and decode_contexts and not attn.has_static_decoding():
        raise ValueError(f"compile=True compiles the static decode step; attention {spec.attention!r} has none")
    softmax = SoftmaxLayer(attn, shape)
    elem = torch.tensor([], dtype=dtype).element_size()
    rows: list[dict[str, Any]] = []
    result = {
        "shape": dataclasses.asdict(shape),
        "shape_name": next((k for k, v in SHAPES.items() if v == shape), None),
        "spec": spec.to_dict(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "versions": {"torch": torch.__version__}, "kernel_options": kernel_options.applied(),
        "kernel": _kernel(attn),
        "settings": dict(decode_steps=decode_steps, state_prefill=state_prefill, max_prefill_tokens=max_prefill_tokens, warmup=warmup,
                         repeats=repeats, bandwidth=bandwidth, flops=flops, graphs=graphs, compile=compile, profile=profile),  # fmt: skip
        "rows": rows,
    }
    cases = [("prefill", b, n) for b in batch_sizes for n in prefill_lengths if b * n <= max_prefill_tokens]
    cases += [("decode", b, n) for b in batch_sizes for n in decode_contexts]
    gen = torch.Generator(device=device).manual_seed(seed)
    for phase, batch, length in tqdm(cases, desc=f"layer {spec.attention}", unit="case"):
        row: dict[str, Any] = {"phase": phase, "batch_size": batch, "length": length}
        try:
            if phase == "prefill":
                t_soft, best, backends, t_conv, extra = _prefill_times(model, softmax, shape, batch, length, warmup, repeats, gen, device,
                                                                       dtype, profile)  # fmt: skip
            else:
                t_soft, best, backends, t_conv, extra = _decode_times(
                    model, softmax, shape, batch, length, decode_steps, state_prefill, warmup, repeats, gen, device, dtype, graphs, compile)
            row.update(extra)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            torch.cuda.empty_cache()
            rows.append(row)
            logger.warning("%s batch %d length %d: out of memory", phase, batch, length)
            if on_row is not None:
                on_row(result)
            continue
        common = dict(phase=phase, batch=batch, length=length, elem=elem, bandwidth=bandwidth, flops=flops)
        soft_line = roofline("softmax", None, model.config, shape, **common)
        conv_line = roofline(attn.spec.attention, attn.options, model.config, shape, **common)
        row.update(
            softmax_s=t_soft, softmax_backend=best, softmax_backends=backends, converted_s=t_conv, ratio=t_conv / t_soft,
            softmax_roofline=soft_line, converted_roofline=conv_line,
            softmax_roofline_fraction=soft_line["roofline_s"] / t_soft, converted_roofline_fraction=conv_line["roofline_s"] / t_conv,
        )  # fmt: skip
        rows.append(row)
        result["autotuned"] = fused_decode.autotuned_choices()
        if on_row is not None:
            on_row(result)
    result["autotuned"] = fused_decode.autotuned_choices()
    return result


def _kernel(attn) -> str | None:
    from ..layers.base import resolve_kernel

    kernel = getattr(getattr(attn, "options", None), "kernel", None)
    return resolve_kernel(kernel, next(attn.parameters()).device) if kernel else None


def _prefill_times(model, softmax, shape, batch, length, warmup, repeats, gen, device, dtype, profile=False):
    """(softmax seconds, its backend, every backend's time, converted seconds, the row's other
    fields: for kinds with a fused prefill, the time of the exact form it replaces; with ``profile``,
    both sides' kernel profiles)."""
    attn = model.model.layers[0].self_attn
    x = torch.randn(batch, length, shape.hidden, generator=gen, device=device, dtype=dtype)
    cos, sin = _positions(model, x, 0)
    best, t_soft, backends = _fastest_backend(lambda: lambda: softmax.prefill(x, cos, sin), device, warmup, repeats)

    def run():
        return attn(x, position_embeddings=(cos, sin), attention_mask=None)

    t_conv = _median(run, device, warmup, repeats)
    extra = {}
    if attn.spec.attention in FUSED_PREFILL_KINDS and fused_decode.enabled(x):
        with fused_decode.use_fused(False):
            extra["converted_unfused_s"] = _median(run, device, warmup, repeats)
    if profile:
        from torch.nn.attention import sdpa_kernel

        from .profile import profile_calls

        with sdpa_kernel([sdpa_backends(device)[best]]):
            soft = profile_calls(lambda: softmax.prefill(x, cos, sin), calls=repeats, device=device)
        extra["profile"] = {"softmax": soft, "converted": profile_calls(run, calls=repeats, device=device)}
    return t_soft, best, backends, t_conv, extra


def _decode_times(model, softmax, shape, batch, context, steps, state_prefill, warmup, repeats, gen, device, dtype, graphs=False,
                  compile=False):
    """(softmax seconds per step, its backend, every backend's time, converted seconds per step,
    the row's other fields: whether the converted step ran as a CUDA graph, the torch step's time)."""
    attn = model.model.layers[0].self_attn
    x1 = torch.randn(batch, 1, shape.hidden, generator=gen, device=device, dtype=dtype)
    n_steps = (warmup + repeats) * steps
    pe = [_positions(model, x1, context + i) for i in range(n_steps)]

    def stepper(fn):
        counter = iter(range(n_steps))

        def run():
            for _ in range(steps):
                fn(x1, *pe[next(counter)])

        return run

    def soft_run():
        softmax.fill(batch, context, n_steps, device, dtype)  # a fresh static cache for each backend
        if compile:  # compiled under this backend (a fresh compilation), at the context
            torch._dynamo.reset()
            step = torch.compile(softmax.fixed_step, dynamic=False)
            call = lambda: step(x1, *pe[0])  # noqa: E731
            return repeated(cuda_graph(call, device).replay if graphs else call)
        if graphs:  # one step at the context, recorded after two warm-up steps; each replay rewrites its slot
            return repeated(cuda_graph(lambda: softmax.step(x1, *pe[0]), device).replay)
        return stepper(softmax.step)

    def repeated(replay):
        def run():
            for _ in range(steps):
                replay()

        return run

    # cuDNN is left out of graphs: it builds its own graph per shape, and a failed capture spoils the device's next calls
    best, t_soft, backends = _fastest_backend(soft_run, device, warmup, repeats, per_call=steps, skip=("cudnn",) if graphs else ())
    softmax.k_cache = softmax.v_cache = None

    cache = DynamicCache()
    prefix = torch.randn(1, min(context, state_prefill), shape.hidden, generator=gen, device=device, dtype=dtype)
    attn(prefix, position_embeddings=_positions(model, prefix, 0), attention_mask=None, **cache_kwargs(cache))
    slot = state_layer(cache, 0)
    slot.batch_repeat_interleave(batch)
    slot.seen = context

    def conv(x, cos, sin):
        attn(x, position_embeddings=(cos, sin), attention_mask=None, **cache_kwargs(cache))

    static = (graphs or compile) and attn.static_decoding(slot, batch, device, dtype)
    graphed = graphs and static
    extra = {"converted_graph": graphed}

    def converted_run() -> Callable[[], None]:
        call = lambda: conv(x1, *pe[0])  # noqa: E731
        if compile:  # the static step and o_proj, as StaticDecoder runs them; a fresh compilation (no cache limit reached)
            torch._dynamo.reset()
            sslot = StaticSlot(slot.decode_state)

            def step(x, cos, sin):
                o = attn.decode_step(x, (cos, sin), sslot)  # (B, Hq, 1, D)
                return attn.o_proj(o.transpose(1, 2).reshape(batch, 1, -1).to(x.dtype))

            compiled = torch.compile(step, dynamic=False)
            call = lambda: compiled(x1, *pe[0])  # noqa: E731
        if graphed:
            return repeated(cuda_graph(call, device).replay)
        return repeated(call) if compile else stepper(conv)  # a compiled step is timed at the context

    if static and fused_decode.enabled(x1) and attn.spec.attention in FUSED_KINDS:
        with fused_decode.use_fused(False):  # the torch step, built on its own, for the same-run comparison
            unfused = converted_run()
            extra["converted_unfused_s"] = _median(unfused, device, warmup, repeats) / steps
    t_conv = _median(converted_run(), device, warmup, repeats) / steps
    return t_soft, best, backends, t_conv, extra


FUSED_KINDS = ("hybrid", "dsla")
"""Kinds whose decode step has fused kernels (``linearize.ops.fused_decode``)."""
FUSED_PREFILL_KINDS = ("hybrid", "dsla", "lola")
"""Kinds whose inference prefill has a fused form (the hybrid's ``ops.fused_prefill``, DSLA's
token-major ``ops.dsla.dsla_prefill``, RoPE as one kernel for both; LoLA's ``ops.fused_lola.lola_prefill``)."""


# ----------------------------------------------------------------------------- report


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f}"


def layer_markdown(results: Sequence[dict[str, Any]]) -> str:
    """One table per phase over every result (one per converted kind): times in ms, ratio, roofline."""
    if not results:
        return ""
    first = results[0]
    out = [f"Layer benchmark: shape {first['shape_name'] or first['shape']} on {first['device']} ({first['dtype']}); "
           f"times in ms per call; ratio = converted / softmax (lower is better); roofline % = ideal time / measured.\n"]
    for phase in ("prefill", "decode"):
        lines = []
        for result in results:
            for row in result["rows"]:
                if row["phase"] != phase:
                    continue
                label = _label(result)
                if "error" in row:
                    lines.append(f"| {label} | {row['batch_size']} | {row['length']} | {row['error']} | | | | | |")
                    continue
                graphed = " (graph)" if phase == "decode" and result["settings"].get("graphs") else ""
                conv_graphed = " (graph)" if graphed and row.get("converted_graph") else ""
                if "converted_unfused_s" in row:
                    conv_graphed += f"; {'exact form' if phase == 'prefill' else 'torch step'} {_fmt_s(row['converted_unfused_s'])}"
                lines.append(
                    f"| {label} | {row['batch_size']} | {row['length']} | {_fmt_s(row['softmax_s'])} ({row['softmax_backend']}{graphed}) "
                    f"| {_fmt_s(row['converted_s'])}{conv_graphed} | {row['ratio']:.3f} | {row['softmax_roofline_fraction'] * 100:.3g}% "
                    f"| {row['converted_roofline_fraction'] * 100:.3g}% | {row['converted_roofline']['bound']} |"
                )
        if lines:
            what = "prefill length" if phase == "prefill" else "decode context"
            out.append(f"\n### {phase}\n\n| converted | batch | {what} | softmax ms (backend) | converted ms | ratio "
                       f"| softmax roofline % | converted roofline % | converted bound |\n|---|---:|---:|---|---:|---:|---:|---:|---|")
            out.extend(lines)
    out.extend(_profile_markdown(results))
    out.extend(_autotuned_markdown(results))
    return "\n".join(out) + "\n"


def _autotuned_markdown(results: Sequence[dict[str, Any]]) -> list[str]:
    """What Triton's autotuner chose for the converted kernels (on a GPU; none in the interpreter)."""
    choices = {}
    for result in results:  # one process: later results repeat the earlier ones' choices
        for c in result.get("autotuned") or []:
            choices[(c["kernel"], tuple(c["key"].items()), tuple(c["dtypes"]))] = c
    if not choices:
        return []
    out = ["\n### autotuner's choices\n", "| kernel | key | dtypes | chosen |", "|---|---|---|---|"]
    for c in choices.values():
        key = ", ".join(f"{k}={v}" for k, v in c["key"].items())
        conf = ", ".join(f"{k} {v}" for k, v in c["config"].items() if v is not None)
        out.append(f"| {c['kernel']} | {key} | {', '.join(c['dtypes'])} | {conf} |")
    return out


def _profile_markdown(results: Sequence[dict[str, Any]]) -> list[str]:
    """The prefill profiles' sections: per case, each side's device ms and launches per call, then the
    converted side's top kernels."""
    from .profile import kernel_table

    out = []
    for result in results:
        for row in result["rows"]:
            prof = row.get("profile")
            if not prof:
                continue
            soft, conv = prof["softmax"], prof["converted"]
            out += [f"\n### prefill kernels: {_label(result)}, batch {row['batch_size']}, length {row['length']}\n",
                    "| side | device ms / call | launches / call | measured ms / call |", "|---|---:|---:|---:|",
                    f"| softmax ({row['softmax_backend']}) | {soft['device_ms_per_step']:.3f} | {soft['launches_per_step']:.0f} "
                    f"| {_fmt_s(row['softmax_s'])} |",
                    f"| converted | {conv['device_ms_per_step']:.3f} | {conv['launches_per_step']:.0f} | {_fmt_s(row['converted_s'])} |",
                    "", *kernel_table(conv, unit="call")]  # fmt: skip
    return out


def _label(result: dict[str, Any]) -> str:
    spec = result["spec"]
    options = spec.get("options", {})
    bits = [spec.get("attention", "?")]
    for key in ("window", "sparse_cache"):
        if key in options:
            bits.append(f"{key} {options[key]}")
    if result.get("kernel"):
        bits.append(result["kernel"])
    return " ".join(bits)


def plot_layer(results: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Ratio converted / softmax against length, one line per kind and batch size, prefill and decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("prefill", "decode")):
        for result in results:
            for batch in sorted({r["batch_size"] for r in result["rows"]}):
                rows = [r for r in result["rows"] if r["phase"] == phase and r["batch_size"] == batch and "ratio" in r]
                if rows:
                    ax.plot([r["length"] for r in rows], [r["ratio"] for r in rows], marker="o", label=f"{_label(result)}, batch {batch}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="prefill length" if phase == "prefill" else "decode context", ylabel="converted / softmax time", title=phase)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
    first = results[0]
    fig.suptitle(f"one attention layer, {first['shape_name'] or first['shape']}, {first['device']} ({first['dtype']})")
    fig.tight_layout()
    save_png(fig, path)


def run_layer_bench(shape: str | LayerShape, specs: Sequence[ConversionSpec | dict[str, Any]], *, out_dir: str | Path | None = None,
                    **kwargs) -> list[dict[str, Any]]:
    """``bench_layer`` for each spec; with ``out_dir`` writes layer.json and layer.md after every case
    (atomically: a run cut short keeps what it measured) and layer.png at the end."""
    results: list[dict[str, Any]] = []

    def write(partial: dict[str, Any] | None = None) -> None:
        if out_dir is not None:
            done = results + ([partial] if partial is not None else [])
            write_results(out_dir, "layer", done, layer_markdown(done))

    for spec in specs:
        results.append(bench_layer(shape, spec, on_row=write, **kwargs))
    if out_dir is not None:
        out = Path(out_dir)
        write()
        plot_layer(results, out / "layer.png")
        logger.info("wrote %s/layer.{json,md,png}", out)
    return results


__all__ = ["SHAPES", "LayerShape", "bench_layer", "build_layer", "layer_markdown", "layer_shape", "plot_layer", "roofline", "run_layer_bench"]
