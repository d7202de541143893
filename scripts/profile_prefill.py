"""Profile one whole-model prefill of a converted model (default: SmolLM2-135M with every layer LoLA,
window 64, 256 slots, chunk 64; bfloat16, batch 1): its wall time, the kernels by device time, and
the operations that synchronised the host with the GPU (``torch.cuda.set_sync_debug_mode``).

    python scripts/profile_prefill.py OUT_DIR [--length 8192] [--model smollm2-135m]
        [--spec '{"attention": "lola", "window": 64, "sparse_cache": 256, "chunk": 64}'] [--kernel-option MODULE.NAME=VALUE ...]

OUT_DIR/prefill_prof.json: ``wall_ms`` (one call, after two warm-up calls), ``device_ms_total`` (the
profiler's self device time; a custom op's range counts beside its kernels), ``top_ms_count`` (the
30 largest: name, ms, calls), ``syncs`` (the warnings the sync debug mode raised in one call) and ``kernel_options`` (those set).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from linearize.api import load_model
from linearize.bench.capacity import _lift_position_limit
from linearize.bench.efficiency import _prefill
from linearize.convert import convert
from linearize.io import atomic_write_text
from linearize.ops import kernel_options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default='{"attention": "lola", "window": 64, "sparse_cache": 256, "chunk": 64}', help="conversion spec (JSON)")
    ap.add_argument("--kernel-option", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a constant of linearize.ops.MODULE for this run (repeatable), as `linearize bench --kernel-option`")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    try:
        kernel_options.apply(args.kernel_option)
    except ValueError as e:
        ap.error(str(e))
    spec = json.loads(args.spec)
    model, _ = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    _lift_position_limit(model, args.length)
    convert(model, spec)
    ids = torch.randint(0, 1000, (1, args.length), device="cuda")
    with torch.inference_mode():
        for _ in range(2):
            _prefill(model, ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        _prefill(model, ids)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
            _prefill(model, ids)
            torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            _prefill(model, ids)
            torch.cuda.set_sync_debug_mode(0)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows = sorted(((e.key[:120], e.self_device_time_total / 1e3, e.count) for e in events), key=lambda r: -r[1])[:30]
    report = {"model": args.model, "spec": spec, "length": args.length, "device": torch.cuda.get_device_name(), "kernel_options": kernel_options.applied(),
              "wall_ms": wall * 1e3, "device_ms_total": sum(e.self_device_time_total for e in events) / 1e3, "top_ms_count": rows,
              "syncs": [f"{w.filename}:{w.lineno} {str(w.message)[:150]}" for w in caught]}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "prefill_prof.json", json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
