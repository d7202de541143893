"""Time the decode state kernels' layouts: [S | z] kept as (F, C) rows (the default: a program
reduces over feature rows, C = Dv + 1 columns, unpadded or padded to 16 bytes) against the
column-major (C, F) form (``fused_decode.COLUMN_STATES``: each value column F contiguous floats, the
read a reduction along them), for the hybrid's linear step and DSLA's two gated states; with a plain
read-modify-write of the same bytes as the bandwidth reference. Every variant is checked against
the torch step first.

    python scripts/state_layout_bench.py OUT [--shapes smollm2-135m,llama3-8b] [--batch 64] [--kinds hybrid,window,dsla]
        [--kernel-option fused_decode.DSLA_BLOCKS_BY_ROW=False ...]

Writes OUT/state_layouts.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from torch import Tensor

from linearize.bench.shapes import SHAPES
from linearize.io import atomic_write_text
from linearize.ops import fused_decode, kernel_options

DEVICE = "cuda"
CHECK_ONLY = False
LAYOUTS = ("rows", "columns")


def bench(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph (0 with ``--check-only``)."""
    if CHECK_ONLY:
        return 0.0
    fn()
    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=200)


ROW_TILES = ((32, 64, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8), (128, 128, 8), (8, 256, 4))
COLUMN_TILES = ((128, 8, 4), (128, 16, 4), (128, 32, 4), (128, 64, 8), (256, 16, 4), (256, 32, 8), (256, 8, 4), (64, 64, 4), (64, 32, 4))
"""(feature rows, value columns, warps): the tiles timed for each layout."""


def time_tiles(out: list[dict], row: dict, step, state: Tensor, want_state: Tensor, want_read: Tensor, tiles, state_bytes: int) -> None:
    """``step(state)`` (a state kernel's op, its layout taken from ``state``'s strides) on a copy
    of ``state`` with the kernel held to each of ``tiles`` in turn (on the CPU, the interpreter's
    tile from the same numbers): its first step checked against ``want_state`` and ``want_read``
    (their first columns), then timed."""
    cols, read_cols = want_state.shape[-1], want_read.shape[-1]
    for bk, bv, warps in tiles:
        if bk > state.shape[-2]:
            continue
        items = [f"fused_decode.STATE_TILES={((bk, bv, warps),)}", f"fused_decode.COLUMN_TILES={((bk, bv, warps),)}",
                 f"fused_decode.BLOCK_K={bk}", f"fused_decode.BLOCK_V={bv}"]  # fmt: skip
        with kernel_options.applied_for(items):
            fused_decode._kernels.cache_clear()
            work = state.clone()  # (the same strides)
            read = step(work)
            err = max((work[..., :cols] - want_state).abs().max().item(),
                      (read[..., :read_cols] - want_read).abs().max().item() / want_read.abs().max().item())  # fmt: skip
            us = bench(lambda work=work: step(work))
        out.append(dict(**row, tile=f"{bk}x{bv} w{warps}", us=us, tbps=state_bytes / us / 1e6 if us else 0.0, err=err))
    fused_decode._kernels.cache_clear()


def reference_rows(out: list[dict], row: dict, x: Tensor, state_bytes: int) -> None:
    """A read-modify-write of ``x`` in place: the bandwidth the state kernels are measured against."""
    us = bench(lambda: x.mul_(1.0))
    out.append(dict(**row, layout="x.mul_(1) reference", tile="", us=us, tbps=state_bytes / us / 1e6 if us else 0.0, err=0.0))


def hybrid_rows(shape: str, batch: int, out: list[dict]) -> None:
    """``hybrid_linear_step`` on [S | z] row-major (Dv + 1 columns, and padded to 16 bytes) and
    column-major, per tile."""
    hq, hkv, d = SHAPES[shape].heads, SHAPES[shape].kv_heads, SHAPES[shape].head_dim
    f, dv, w, n_rep = 2 * d, d, 64, hq // hkv
    rows, bk = batch * hq, batch * hkv
    g = torch.Generator(device=DEVICE).manual_seed(0)
    feats = torch.rand(bk, w, n_rep * f, device=DEVICE, generator=g).to(torch.bfloat16) / f
    qf = torch.rand(rows, f, device=DEVICE, generator=g).to(torch.bfloat16) / f
    index = torch.tensor(5, device=DEVICE)
    state_bytes = rows * f * (dv + 1) * 4 * 2
    lin = torch.rand(rows, f, dv + 1, device=DEVICE, generator=g)
    vals = torch.randn(bk, w, dv + 1, device=DEVICE, generator=g).to(torch.bfloat16)
    vals[..., dv] = 1.0
    want = lin + feats[:, 5].reshape(rows, f, 1).float() * vals[:, 5].float().repeat_interleave(n_rep, 0)[:, None, :]
    want_read = torch.einsum("rf,rfc->rc", qf.float(), want)
    row = dict(kind="hybrid", shape=shape, batch=batch)
    for layout, width, tiles in (("(F, C)", dv + 1, ROW_TILES), ("(F, C) padded", dv + 4, ROW_TILES), ("(C, F)", dv + 1, COLUMN_TILES)):
        pad = width - dv - 1
        state = torch.nn.functional.pad(lin, (0, pad))
        state = fused_decode.column_major(state) if layout == "(C, F)" else state
        v = torch.nn.functional.pad(vals, (0, pad))
        time_tiles(out, dict(row, layout=layout), lambda s, v=v: fused_decode.hybrid_linear_step(s, feats, v, qf, index, 0), state, want,
                   want_read, tiles, state_bytes)  # fmt: skip
    reference_rows(out, row, lin.clone(), state_bytes)


def window_rows(shape: str, batch: int, out: list[dict]) -> None:
    """``hybrid_window_read`` with a program per query head or per KV head, at 4 and 8 warps."""
    hq, hkv, d = SHAPES[shape].heads, SHAPES[shape].kv_heads, SHAPES[shape].head_dim
    w, dev = 64, DEVICE
    g = torch.Generator(device=dev).manual_seed(2)
    q = torch.randn(batch, hq, d, device=dev, generator=g)
    keys = torch.randn(batch * hkv, w, d, device=dev, generator=g)
    values = torch.randn(batch * hkv, w, d + 1, device=dev, generator=g)
    values[..., d] = 1.0
    valid = torch.ones(batch, w, dtype=torch.bool, device=dev)
    lin = torch.rand(batch * hq, d + 1, device=dev, generator=g)
    factor = torch.rand(hq, device=dev, generator=g)
    window_bytes = keys.numel() * 4 + values.numel() * 4
    want, before = None, (fused_decode.WINDOW_GROUPED, fused_decode.WINDOW_WARPS)
    for grouped in (False, True):
        for warps in (4, 8):
            fused_decode.WINDOW_GROUPED, fused_decode.WINDOW_WARPS = grouped, warps
            o = fused_decode.hybrid_window_read(q, keys, values, valid, lin, factor, d**-0.5, False)
            want = o if want is None else want
            us = bench(lambda: fused_decode.hybrid_window_read(q, keys, values, valid, lin, factor, d**-0.5, False))
            out.append(dict(kind="window", shape=shape, batch=batch, layout="per KV head" if grouped else "per query head",
                            tile=f"w{warps}", us=us, tbps=window_bytes / us / 1e6 if us else 0.0, err=(o - want).abs().max().item()))  # fmt: skip
    fused_decode.WINDOW_GROUPED, fused_decode.WINDOW_WARPS = before


def dsla_rows(shape: str, batch: int, out: list[dict]) -> None:
    """``dsla_state_step`` on both states row-major (padded to 16 bytes) and column-major, per tile."""
    hq, hkv, d = SHAPES[shape].heads, SHAPES[shape].kv_heads, SHAPES[shape].head_dim
    k_, dv = 2 * d, d
    rows = batch * hq
    g = torch.Generator(device=DEVICE).manual_seed(1)
    qf = torch.rand(batch, hq, k_, device=DEVICE, generator=g).to(torch.bfloat16) / k_
    kf = torch.rand(batch, hq, k_, device=DEVICE, generator=g).to(torch.bfloat16) / k_
    v = torch.randn(batch, hkv, dv, device=DEVICE, generator=g).to(torch.bfloat16)
    decay = torch.rand(batch, 2, hq, k_, device=DEVICE, generator=g) * 0.1 + 0.9
    state_bytes = 2 * rows * k_ * (dv + 1) * 4 * 2
    vn = torch.cat([v.float().repeat_interleave(hq // hkv, 1), torch.ones(batch, hq, 1, device=DEVICE)], -1)  # (B, Hq, Dv + 1)
    states = torch.rand(2, batch, hq, k_, dv + 1, device=DEVICE, generator=g)
    want = decay.transpose(0, 1)[..., None] * states + kf.float()[..., None] * vn[:, :, None, :]
    want_read = torch.einsum("bhk,sbhkc->sbhc", qf.float(), want)

    def step(s: Tensor) -> Tensor:
        return fused_decode.dsla_read(fused_decode.dsla_state_step(s, qf, kf, v, decay, True))

    row = dict(kind="dsla", shape=shape, batch=batch)
    if "rows" in LAYOUTS:
        time_tiles(out, dict(row, layout="(K, C) padded"), step, torch.nn.functional.pad(states, (0, 3)), want, want_read, ROW_TILES,
                   state_bytes)  # fmt: skip
    if "columns" in LAYOUTS:
        time_tiles(out, dict(row, layout="(C, K)"), step, fused_decode.column_major(states), want, want_read, COLUMN_TILES, state_bytes)
    reference_rows(out, row, states.clone(), state_bytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--kinds", default="hybrid,window,dsla")
    p.add_argument("--layouts", default="rows,columns", help="dsla: the state layouts timed (rows: (K, C) padded; columns: (C, K))")
    p.add_argument("--kernel-option", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="a kernel option held for the whole run (repeatable), e.g. fused_decode.DSLA_BLOCKS_BY_ROW=False")
    p.add_argument("--check-only", action="store_true", help="check the variants, time nothing (runs on the CPU under TRITON_INTERPRET=1)")
    a = p.parse_args()
    global DEVICE, CHECK_ONLY, LAYOUTS
    CHECK_ONLY = a.check_only
    LAYOUTS = tuple(a.layouts.split(","))
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    kernel_options.check(a.kernel_option)  # a bad option fails before OUT is made
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with kernel_options.applied_for(a.kernel_option):
        for shape in a.shapes.split(","):
            if "hybrid" in a.kinds:
                hybrid_rows(shape, a.batch, rows)
            if "window" in a.kinds:
                window_rows(shape, a.batch, rows)
            if "dsla" in a.kinds:
                dsla_rows(shape, a.batch, rows)
    options = f"; options {', '.join(a.kernel_option)}" if a.kernel_option else ""
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE} batch {a.batch}{options}; TB/s = state bytes read and written / time")
    print("| kind | shape | layout | tile | us | TB/s | max error |")
    print("|---|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['shape']} | {r['layout']} | {r['tile']} | {r['us']:.1f} | {r['tbps']:.2f} | {r['err']:.1e} |")
    atomic_write_text(a.out / "state_layouts.json", json.dumps(dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, kernel_options=a.kernel_option, rows=rows), indent=1))


if __name__ == "__main__":
    main()
