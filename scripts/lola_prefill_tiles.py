"""Time LoLA's fused prefill (``ops.fused_lola.lola_prefill``: the selection kernel, one program per
row and query head through the chunks, then the read kernel, one program per chunk and block of
queries) with each tiling, at one layer's prefill shape (CUDA, bfloat16 model), against flash
softmax over the same q, k, v.

    python scripts/lola_prefill_tiles.py OUT_DIR [--lengths 8192,32768] [--batch 1] [--shape llama3-8b] [--sparse 256]
        [--tiles 128,128,128,8,4,64,64;64,128,128,8,4,64,64]

The layer (``--shape``: a name of ``linearize bench --layer``) is read as LoLA with window 64, chunk
64 and 256 sparse slots, a square Hedgehog map (2 x head_dim features). A tiling is seven numbers:
cache entries per block of candidates, feature rows and value columns of a state tile, warps of the
selection kernel, warps of the read kernel, feature rows of the read's state tile, queries per read
program (named ``cCfFvVwWrRrfGqQ``). OUT_DIR/lola_prefill_tiles.json holds, per length, the
milliseconds of softmax (SDPA, causal, grouped heads) and, per tiling, of the whole op from an empty
memory (``lola_attention``: the features of every query and key, the kernels, the memory gathered),
the milliseconds of each kernel in one profiled call and each kernel's registers per thread, spilled
registers and shared memory as compiled (a failed compile gives its error); then the best tiling's
call by kernel (``profile_ms``).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from linearize.bench.efficiency import cuda_mean_us
from linearize.bench.profile import LastLaunch
from linearize.bench.shapes import SHAPES
from linearize.io import atomic_write_text
from linearize.ops import fused_lola
from linearize.ops.feature_maps import hedgehog
from linearize.ops.lola import lola_attention

TILES = (
    (128, 128, 128, 8, 4, 64, 64),
    (128, 128, 128, 16, 4, 64, 64),
    (128, 64, 128, 8, 4, 64, 64),
    (64, 128, 128, 8, 4, 64, 64),
    (128, 128, 128, 4, 4, 64, 64),
    (128, 64, 64, 8, 4, 64, 64),
    (128, 128, 128, 8, 8, 32, 64),
)
"""The default tilings (the module's defaults first)."""
SETTINGS = ("PREFILL_BLOCK_CACHE", "PREFILL_BLOCK_FEATURES", "PREFILL_BLOCK_VALUES", "PREFILL_WARPS", "PREFILL_READ_WARPS",
            "PREFILL_READ_BLOCK_FEATURES", "PREFILL_READ_QUERIES")  # fmt: skip


def _use(tile: tuple[int, ...]) -> None:
    for name, value in zip(SETTINGS, tile, strict=True):
        setattr(fused_lola, name, value)


def _name(tile: tuple[int, ...]) -> str:
    return "c{}f{}v{}w{}r{}rf{}q{}".format(*tile)


def _profile(call) -> dict[str, float]:
    """Milliseconds by CUDA kernel of one call, the ten longest."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = {e.key: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0}
    return dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--sparse", type=int, default=256)
    ap.add_argument("--tiles", default=None, help="tilings of seven numbers each, separated by ';' (default: TILES)")
    args = ap.parse_args()
    tiles = TILES
    if args.tiles:
        tiles = tuple(tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";"))
        bad = [t for t in tiles if len(t) != len(SETTINGS)]
        if bad:
            ap.error(f"--tiles: each tiling is {len(SETTINGS)} numbers ({', '.join(SETTINGS)}); got {bad}")
    shape = SHAPES[args.shape]
    b, hq, hkv, d, lam, w = args.batch, shape.heads, shape.kv_heads, shape.head_dim, args.sparse, 64
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    phi_q, phi_k = (functools.partial(hedgehog, weight=0.1 * torch.randn(hq, d, d, device=dev, dtype=dt),
                                      bias=torch.zeros(hq, d, device=dev, dtype=dt)) for _ in range(2))  # fmt: skip
    launches = tuple(LastLaunch(k) for k in fused_lola._prefill_kernels())
    fused_lola._prefill_kernels = lambda: launches
    report = {"shape": args.shape, "batch": b, "heads": hq, "kv_heads": hkv, "head_dim": d, "sparse": lam, "window": w, "chunk": w,
              "settings": SETTINGS, "device": torch.cuda.get_device_name(), "lengths": {}}  # fmt: skip
    for t in (int(x) for x in args.lengths.split(",")):
        q, k, v = (torch.randn(b, h, t, d, device=dev, dtype=dt) for h in (hq, hkv, hkv))
        softmax = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True)
        rows = {"softmax_ms": cuda_mean_us(softmax, repeats=5, warmup=2) / 1e3, "tilings": {}}
        call = functools.partial(lola_attention, q, k, v, phi_q=phi_q, phi_k=phi_k, window=w, sparse=lam, chunk=w,
                                 window_factor=torch.ones(hq, device=dev), sinks=4, linear_weight=0.1)  # fmt: skip
        for tile in tiles:
            _use(tile)
            try:
                with torch.no_grad():
                    ms = cuda_mean_us(call, repeats=3, warmup=1) / 1e3
                prof = _profile(call)
                row = {"ms": ms, "kernels_ms": {k: prof[k] for k in prof if k.startswith("lola_")},
                       "select": launches[0].resources(), "read": launches[1].resources()}  # fmt: skip
            except Exception as e:  # noqa: BLE001 (a tiling that does not compile is reported, not fatal)
                row = f"{type(e).__name__}: {str(e)[:200]}"
            rows["tilings"][_name(tile)] = row
            print(t, _name(tile), row, flush=True)
        timed = {name: row["ms"] for name, row in rows["tilings"].items() if isinstance(row, dict)}
        if timed:
            best = min(timed, key=timed.get)
            _use(next(x for x in tiles if _name(x) == best))
            rows["best"] = best
            rows["best_over_softmax"] = timed[best] / rows["softmax_ms"]
            rows["profile_ms"] = _profile(call)
        report["lengths"][t] = rows
        print(json.dumps(rows, indent=1), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "lola_prefill_tiles.json", json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
