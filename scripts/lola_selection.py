"""Time LoLA's prefill selection (``ops.fused_lola.lola_prefill`` with ``output=False``: the
selection kernel alone, one launch over every chunk) and the whole prefill op at one layer's shape
(CUDA, bfloat16), for each variant of kernel options, and check that every variant keeps the first
variant's caches.

    python scripts/lola_selection.py OUT_DIR [--shape smollm2-135m] [--length 8192] [--sparse 256] [--features F]
        [--variant NAME=MODULE.NAME=VALUE[,MODULE.NAME=VALUE...]] ...

``--features``: Hedgehog-like features a head (default 2 x head_dim, a square map's; head_dim: a
rectangular map's, LoLCATs' 8B size).

Default variants: ``VARIANTS`` (the selection's warps and blocks of candidates). A variant with no
options runs the module's defaults. OUT_DIR/lola_selection.json holds, per variant, the selection's milliseconds
and microseconds per chunk, the whole op's milliseconds, the compiled selection kernel's registers,
spills and shared memory, and its agreement with the first variant: the share of the last cache's
slots and of every chunk's cache (as sets) that hold the same positions, and the largest
difference of S and of the output.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from linearize.bench.efficiency import cuda_mean_us
from linearize.bench.profile import LastLaunch
from linearize.bench.shapes import SHAPES
from linearize.io import atomic_write_text
from linearize.ops import fused_lola, kernel_options

VARIANTS = {
    "w8-c128": [],
    "w4": ["fused_lola.PREFILL_WARPS=4"],
    "w16": ["fused_lola.PREFILL_WARPS=16"],
    "c64": ["fused_lola.PREFILL_BLOCK_CACHE=64"],
    "c256": ["fused_lola.PREFILL_BLOCK_CACHE=256"],
    "c64-w4": ["fused_lola.PREFILL_BLOCK_CACHE=64", "fused_lola.PREFILL_WARPS=4"],
}
"""The module's defaults (8 warps, blocks of 128 candidates), then other warps and blocks."""


def _ms(fn, device: str) -> float:
    """Milliseconds per call: the mean of 5 after 2 on CUDA; one call elsewhere."""
    if device == "cuda":
        return cuda_mean_us(fn, repeats=5, warmup=2) / 1e3
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _sets(caches: torch.Tensor) -> torch.Tensor:
    """Each cache's positions sorted (empty slots, -1, last): caches compared as sets."""
    big = torch.iinfo(caches.dtype).max
    return caches.masked_fill(caches < 0, big).sort(dim=-1).values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--sparse", type=int, default=256)
    ap.add_argument("--features", type=int, default=None, help="features a head, even (default: 2 x head_dim)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels in Triton's interpreter (TRITON_INTERPRET=1), a check of the script")
    ap.add_argument("--variant", action="append", default=[], help="NAME=MODULE.NAME=VALUE[,...] or NAME=defaults (repeatable; default: VARIANTS)")
    args = ap.parse_args()
    variants = dict(VARIANTS)
    if args.variant:
        variants = {}
        for item in args.variant:
            name, _, options = item.partition("=")
            if not name or not options:
                ap.error(f"--variant {item!r}: expected NAME=MODULE.NAME=VALUE[,...]")
            variants[name] = [o for o in options.split(",") if o != "defaults"]
    for options in variants.values():  # every option checked before anything runs
        try:
            kernel_options.check(options)
        except ValueError as e:
            ap.error(str(e))
    shape = SHAPES[args.shape]
    hq, hkv, d, t, lam, w = shape.heads, shape.kv_heads, shape.head_dim, args.length, args.sparse, 64
    feats = 2 * d if args.features is None else args.features
    if feats < 2 or feats % 2:
        ap.error(f"--features must be an even number >= 2, got {feats}")
    dev, dt = args.device, torch.bfloat16
    torch.manual_seed(0)
    q, k = torch.randn(1, hq, t, d, device=dev, dtype=dt), torch.randn(1, hkv, t, d, device=dev, dtype=dt)
    v = torch.randn(1, hkv, t, d, device=dev, dtype=dt)

    def features(x: torch.Tensor) -> torch.Tensor:  # Hedgehog-like: (softmax(p), softmax(-p)), feats features
        p = x.float() @ (0.3 * torch.randn(d, feats // 2, device=dev))
        return torch.cat([p.softmax(-1), (-p).softmax(-1)], -1).to(dt)

    qphi, kphi = features(q), features(k.repeat_interleave(hq // hkv, dim=1))
    args_ = (q, k, v, qphi, kphi, torch.full((1,), t, device=dev), torch.ones(hq, device=dev), torch.full((hq,), 0.1, device=dev))
    opts = dict(window=w, sparse=lam, chunk=w, sinks=4, scale=d**-0.5, weight_tokens=0, read_state=True, read_sparse=True)
    kernels = tuple(LastLaunch(x) for x in fused_lola._prefill_kernels())
    fused_lola._prefill_kernels = lambda: kernels
    report = {"shape": args.shape, "length": t, "heads": hq, "kv_heads": hkv, "head_dim": d, "features": feats, "sparse": lam,
              "window": w, "chunk": w, "chunks": -(-t // w), "device": torch.cuda.get_device_name() if dev == "cuda" else dev, "variants": {}}  # fmt: skip
    reference = None
    for name, options in variants.items():
        try:
            with kernel_options.applied_for(options), torch.no_grad():
                kernels[0].last = None
                select = _ms(lambda: fused_lola.lola_prefill(*args_, **opts, output=False), dev)
                resources = kernels[0].resources()
                whole = _ms(lambda: fused_lola.lola_prefill(*args_, **opts), dev)
                result = fused_lola.lola_prefill(*args_, **opts)
            row = {"options": options, "select_ms": select, "select_us_per_chunk": select * 1e3 / report["chunks"], "whole_ms": whole,
                   "select_kernel": resources}  # fmt: skip
            if reference is None:
                reference = result
            else:
                out, s_, _, pos, caches = result
                row["same_last_cache"] = (_sets(pos) == _sets(reference[3])).float().mean().item()
                row["same_chunk_caches"] = (_sets(caches) == _sets(reference[4])).float().mean().item()
                row["max_state_diff"] = (s_ - reference[1]).abs().max().item()
                row["max_output_diff"] = (out.float() - reference[0].float()).abs().max().item()
        except Exception as e:  # noqa: BLE001 (a variant that fails is reported, not fatal)
            row = {"options": options, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        report["variants"][name] = row
        print(name, json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "lola_selection.json", json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
