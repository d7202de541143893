"""Time LoLA's fused decode step (``ops.fused_lola``: an errors kernel and a commit kernel, or the
two as one kernel) with each tile, against the torch step it replaces, at one layer's decode shape
(CUDA, bfloat16 model, eager: the step's few torch kernels around the fused ones included).

    python scripts/lola_step_tiles.py OUT_DIR [--batch 64] [--heads 32] [--kv-heads 8] [--head-dim 128] [--sparse 256]
        [--variants state,kept,scalar,features] [--tiles K] [--kernel-option MODULE.NAME=VALUE ...]

The defaults are a Llama-3-8B-shaped layer read as LoLA with 256 sparse slots and a square Hedgehog
map (256 features); SmolLM2's is ``--heads 9 --kv-heads 3 --head-dim 64``. OUT_DIR/lola_step_tiles.json
holds the megabytes one step must move (the cache's bfloat16 keys and values once, [S | z] read and
written once; with kept recalls, those read and written too, and [S | z] read once and written every
``DEFERRED_WRITES`` tokens; with scalar recalls, 4 floats per slot read and written, [S | z] read
and written once), the microseconds per call of the torch step (``torch_step_us``; its
state pass in the hybrid's state kernel) and of each tile of the fused step, scoring the cache from
the state (``state``), from kept recall vectors (``kept``: LoLA's ``keep_recalls`` with
``fused_lola.SCALAR_RECALLS`` False) and from kept recall scalars (``scalar``: ``keep_recalls``, its
default form), and from those with the slots' features kept as well (``features``, ``fused_lola.KEPT_FEATURES``), and each one's best
tile's kernels by device time over 10 steps (``VARIANT_profile_us``). A tile is
named ``KERNELS-BLxBVwWcCsS``: two kernels or one (``ONE_KERNEL_ROWS``), candidates per program x
value columns of a state tile, warps of the errors kernel (of the one kernel), warps of the commit
kernel (two kernels only), pipelining stages (``STAGES``), and ``-p1`` where the errors' products
take the state's bfloat16 part alone (``SPLIT_STATE`` off), ``-rN`` with the registers capped at N
(``MAX_REGISTERS``); a failed compile gives its error.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from linearize.bench.efficiency import cuda_mean_us
from linearize.ops import fused_decode, fused_lola, kernel_options
from linearize.ops.feature_maps import hedgehog
from linearize.ops.lola import LolaDecodeState, lola_decode_step, lola_state_empty

TILES = (
    ("two", 128, 64, 8, 4, 3, True, None), ("two", 128, 64, 8, 8, 3, True, None), ("two", 128, 64, 8, 8, 2, True, None),
    ("two", 128, 64, 8, 8, 1, True, None), ("two", 64, 128, 8, 8, 1, True, None), ("two", 64, 64, 8, 4, 3, True, None),
    ("two", 128, 64, 8, 8, 1, True, 128),
    ("one", 128, 64, 8, 0, 3, True, None), ("one", 128, 64, 8, 0, 2, True, None), ("one", 128, 64, 8, 0, 1, True, None),
    ("one", 64, 64, 8, 0, 1, True, None), ("one", 128, 64, 4, 0, 3, True, None),
    ("two", 128, 64, 8, 8, 1, False, None), ("one", 128, 64, 8, 0, 1, False, None),
)
"""(kernels, BLOCK_ROWS, BLOCK_VALUES, warps, COMMIT_WARPS, STAGES, SPLIT_STATE, MAX_REGISTERS); the first is
the default."""


def tile_name(tile) -> str:
    kernels, bl, bv, warps, commit_warps, stages, split, regs = tile
    name = f"{kernels}-{bl}x{bv}w{warps}" + (f"c{commit_warps}" if kernels == "two" else "") + f"s{stages}"
    return name + ("" if split else "-p1") + ("" if regs is None else f"-r{regs}")


def use_tile(tile) -> None:
    """Set the step's module constants to ``tile``."""
    kernels, bl, bv, warps, commit_warps, stages, split, regs = tile
    fused_lola.BLOCK_ROWS, fused_lola.BLOCK_VALUES, fused_lola.STAGES, fused_lola.SPLIT_STATE = bl, bv, stages, split
    fused_lola.MAX_REGISTERS = regs
    if kernels == "one":
        fused_lola.ONE_KERNEL_ROWS, fused_lola.ONE_KERNEL_WARPS = 0, warps
    else:
        fused_lola.ONE_KERNEL_ROWS, fused_lola.WARPS, fused_lola.COMMIT_WARPS = None, warps, commit_warps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sparse", type=int, default=256)
    ap.add_argument("--variants", default="state,kept,scalar,features", help="comma-separated, of state, kept, scalar, features")
    ap.add_argument("--tiles", type=int, default=len(TILES), help=f"time the first this many tiles (of {len(TILES)}; 1: the default)")
    ap.add_argument("--kernel-option", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a kernel constant set before the decode states are made, e.g. fused_lola.STATE_ALIGN=1 (repeatable)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if not variants or any(v not in ("state", "kept", "scalar", "features") for v in variants):
        ap.error(f"--variants {args.variants!r}: choose from state, kept, scalar, features")
    if not 1 <= args.tiles <= len(TILES):
        ap.error(f"--tiles {args.tiles}: choose 1 to {len(TILES)}")
    try:
        options = kernel_options.apply(args.kernel_option)
    except ValueError as e:
        ap.error(str(e))
    tiles_run = TILES[: args.tiles]
    b, hq, hkv, d, lam, w = args.batch, args.heads, args.kv_heads, args.head_dim, args.sparse, 64
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    wk, wq = (torch.randn(hq, d, d, device=dev, dtype=dt) * 0.1 for _ in range(2))
    bk, bq = (torch.zeros(hq, d, device=dev, dtype=dt) for _ in range(2))
    phi_k, phi_q = functools.partial(hedgehog, weight=wk, bias=bk), functools.partial(hedgehog, weight=wq, bias=bq)
    state = lola_state_empty(b, hq, hkv, w, lam, d, d, 2 * d, dev)
    for x in (state.window.keys, state.window.values, state.sparse.keys, state.sparse.values):
        x.normal_()
    state.window.valid.fill_(True)
    state.window.positions.copy_(torch.arange(10_000, 10_000 + w, device=dev))
    state.sparse.valid.fill_(True)
    state.sparse.positions.copy_(torch.arange(lam, device=dev).expand_as(state.sparse.positions) * 30)
    state.linear.kv.uniform_()
    state.linear.k_sum.uniform_(1, 2)
    q, k, v = (torch.randn(b, h, 1, d, device=dev, dtype=dt) for h in (hq, hkv, hkv))
    rows = {}
    lin = b * hq * 2 * d * fused_lola.state_width(d) * 4  # [S | z], its rows padded
    cache = 2 * b * hq * lam * d * 2  # bfloat16 cache k, v once
    recalls = 2 * b * hq * lam * fused_lola.recall_width(d) * 4  # the kept recalls read + written
    bytes_moved = {"state": cache + 2 * lin,  # [S | z] read + written
                   "kept": cache + recalls + lin + 2 * lin / fused_lola.DEFERRED_WRITES,  # read, written every DEFERRED_WRITES tokens
                   "scalar": cache + 2 * b * hq * lam * fused_lola.SCALAR_RECALL_WIDTH * 4 + 2 * lin}
    bytes_moved["features"] = bytes_moved["scalar"] + b * hq * lam * 2 * d * 2  # the slots' bfloat16 features read (2f = 2 D here)
    for variant in ("torch", *variants):  # the torch step; the fused step scoring the cache from the state; from kept recalls
        fused_lola.SCALAR_RECALLS = variant in ("scalar", "features")  # read where the decode state is made
        fused_lola.KEPT_FEATURES = variant == "features"
        ds = LolaDecodeState.from_state(state, phi_q=phi_q, phi_k=phi_k, window_factor=torch.ones(hq, device=dev), scale=d**-0.5,
                                        dtype=dt, sinks=4, linear_weight=0.1, key_map=(wk, bk), keep_recalls=variant in ("kept", "scalar", "features"))  # fmt: skip
        step = functools.partial(lola_decode_step, ds, q, k, v)
        with fused_decode.use_fused(variant != "torch"):
            if variant == "torch":
                rows["torch_step_us"] = cuda_mean_us(step, repeats=50, warmup=3)
                continue
            tiles = {}
            for tile in tiles_run:
                name = tile_name(tile)
                use_tile(tile)
                try:
                    tiles[name] = cuda_mean_us(step, repeats=50, warmup=3)
                except Exception as e:  # noqa: BLE001 (a tile that does not compile is reported, not fatal)
                    tiles[name] = f"{type(e).__name__}: {str(e)[:200]}"
                print(variant, name, tiles[name], flush=True)
            rows[variant] = tiles
            best = min((k for k in tiles if isinstance(tiles[k], float)), key=tiles.get, default=None)
            if best:  # the kernels of the best tile's step, from the profiler
                use_tile(next(t for t in tiles_run if tile_name(t) == best))
                step()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        step()
                    torch.cuda.synchronize()
                kernels = {e.key: e.device_time_total / 10 for e in prof.key_averages() if e.device_time_total > 0}
                rows[f"{variant}_profile_us"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])
    report = {"batch": b, "heads": hq, "kv_heads": hkv, "head_dim": d, "sparse": lam,
              "bytes_moved_MB": {k: v / 1e6 for k, v in bytes_moved.items()},
              "kernel_options": options, "device": torch.cuda.get_device_name(), "us_per_step": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lola_step_tiles.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
