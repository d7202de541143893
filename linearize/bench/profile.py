"""Where a decode step's time goes: the kernels of one static decode step, teacher and conversion.

    result = profile_decode(model, spec, context=8000, batch_size=64, device="cuda")
    print(profile_markdown(result))

Each side decodes on a ``StaticDecoder`` without CUDA graphs (so every kernel is seen; ``compile``:
its step compiled first), ``steps`` steps under ``torch.profiler`` after warm-up steps. Reported per
step: device time, kernel launches, and the kernels that take the most device time. On the CPU the
"kernels" are the operators' CPU time. This is the profile a missed target names as its cause.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..convert import convert
from ..io import write_results
from ..spec import ConversionSpec
from ..teacher import teacher_modes
from .efficiency import _place, _random_ids

logger = logging.getLogger(__name__)


class LastLaunch:
    """A Triton kernel wrapped to keep what its last launch returned (the compiled kernel on a GPU;
    None in Triton's interpreter), for that kernel's registers, spills and shared memory."""

    def __init__(self, kernel) -> None:
        self.kernel, self.last = kernel, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = self.kernel[grid](*args, **kwargs)
            return self.last

        return launch

    def resources(self) -> dict[str, int | None]:
        """Registers per thread, spilled registers and shared memory bytes of the last launch's kernel
        (None each where unknown)."""
        compiled = self.last
        return {"registers": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
                "shared_bytes": getattr(getattr(compiled, "metadata", None), "shared", None)}  # fmt: skip


def profile_calls(fn: Callable[[], Any], *, calls: int, device: torch.device, top: int = 25) -> dict[str, Any]:
    """``fn()`` run ``calls`` times under ``torch.profiler`` (warm it up first): device time and
    kernel launches per call, and its ``top`` kernels by device time (name, calls and microseconds
    per call, share). On the CPU the "kernels" are the operators, timed by their CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.device_time)
        total_us = sum(sum(v) for v in by_name.values())
        launches = len(kernels)
    else:
        averages = [a for a in prof.key_averages() if a.self_cpu_time_total > 0]
        by_name = {a.key: [a.self_cpu_time_total / max(a.count, 1)] * a.count for a in averages}
        total_us = sum(a.self_cpu_time_total for a in averages)
        launches = sum(a.count for a in averages)
    rows = [{"name": name, "calls_per_step": len(times) / calls, "us_per_step": sum(times) / calls,
             "share": sum(times) / total_us if total_us else 0.0}
            for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]  # fmt: skip
    return {"steps": calls, "device_ms_per_step": total_us / calls / 1e3, "launches_per_step": launches / calls, "top": rows}


@torch.inference_mode()
def profile_step(model, *, context: int, batch_size: int, steps: int = 5, warmup: int = 3, compile: bool = False,
                 device: str | torch.device | None = None, top: int = 25, seed: int = 0, fuse_projections: bool = True) -> dict[str, Any]:
    """One model's static decode step at ``context`` tokens: device time and launches per step, and
    its ``top`` kernels by device time (name, calls and microseconds per step). ``fuse_projections``
    as ``StaticDecoder`` takes it."""
    from ..decoding import StaticDecoder

    device = _place(model, device)
    decoder = StaticDecoder(model, batch_size=batch_size, max_length=context + warmup + steps + 1, graphs=False, compile=compile,
                            fuse_projections=fuse_projections)
    decoder.prefill(_random_ids(model, 1, context, device, seed))
    for _ in range(warmup):
        decoder.step()
    profiled = profile_calls(decoder.step, calls=steps, device=device, top=top)
    return {"context": context, "batch_size": batch_size, "compiled": decoder.compiled, **profiled}


def profile_decode(model_name_or_model, spec: ConversionSpec | dict[str, Any] | None, *, context: int, batch_size: int,
                   steps: int = 5, compile: bool = False, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                   out_dir: str | Path | None = None) -> dict[str, Any]:
    """The teacher's and the conversion's step profiles (``profile_step``) in one run; a model that is
    already converted is profiled as it is, against its teacher mode. With ``out_dir``: profile.json
    and profile.md there."""
    if isinstance(model_name_or_model, (str, Path)):
        from ..api import load_model

        model, _ = load_model(str(model_name_or_model), dtype=dtype, device=device)
    else:
        model = model_name_or_model
    converted = model if spec is None else convert(model, spec)
    kw = dict(context=context, batch_size=batch_size, steps=steps, compile=compile, device=device)
    result: dict[str, Any] = {"model": str(model_name_or_model) if isinstance(model_name_or_model, (str, Path)) else None,
                              "spec": None if spec is None else ConversionSpec.coerce(spec).to_dict(),
                              "device": torch.cuda.get_device_name(_place(converted, device)) if torch.cuda.is_available() else "cpu"}  # fmt: skip
    with teacher_modes(converted):
        result["teacher"] = profile_step(converted, **kw)
    result["converted"] = profile_step(converted, **kw)
    if out_dir is not None:
        write_results(out_dir, "profile", result, profile_markdown(result))
        logger.info("wrote %s/profile.{json,md}", out_dir)
    return result


def kernel_table(profiled: dict[str, Any], unit: str = "step") -> list[str]:
    """Markdown lines: a ``profile_calls`` result's top kernels (calls and us per ``unit``, share)."""
    out = [f"| kernel | calls / {unit} | us / {unit} | share |", "|---|---:|---:|---:|"]
    for row in profiled["top"]:
        name = row["name"].replace("|", "/")
        name = name if len(name) <= 90 else name[:87] + "..."
        out.append(f"| `{name}` | {row['calls_per_step']:.1f} | {row['us_per_step']:.1f} | {row['share'] * 100:.1f}% |")
    return out


def profile_markdown(result: dict[str, Any]) -> str:
    t, c = result["teacher"], result["converted"]
    out = [f"Decode step profile: batch {t['batch_size']} at {t['context']} tokens on {result['device']}"
           f"{' (compiled)' if c['compiled'] else ''}; device time and launches per step.\n",
           "| side | device ms / step | launches / step |", "|---|---:|---:|"]  # fmt: skip
    for side, r in (("teacher", t), ("converted", c)):
        out.append(f"| {side} | {r['device_ms_per_step']:.3f} | {r['launches_per_step']:.0f} |")
    for side, r in (("teacher", t), ("converted", c)):
        out += [f"\n### {side}: top kernels\n", *kernel_table(r)]
    return "\n".join(out) + "\n"
