"""Time the decode state kernels' layouts: [S | z] kept as (F, C) rows (the current form: a program
reduces over feature rows, C = Dv + 1 columns, unpadded or padded to 16 bytes) against the
transposed (C, F) form (each value column a row of F contiguous floats, the read a reduction along
the contiguous axis), for the hybrid's linear step and DSLA's two gated states; with a plain
read-modify-write of the same bytes as the bandwidth reference. Every variant is checked against
the torch step first.

    python scripts/state_layout_bench.py OUT [--shapes smollm2-135m,llama3-8b] [--batch 64]

Writes OUT/state_layouts.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton

from linearize.ops import fused_decode

DEVICE = "cuda"
CHECK_ONLY = False
SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # query heads, KV heads, head dim


def bench(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph (0 with ``--check-only``)."""
    if CHECK_ONLY:
        return 0.0
    fn()
    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=200)


def hybrid_rows(shape: str, batch: int, out: list[dict]) -> None:
    hq, hkv, d = SHAPES[shape]
    f, dv, w, n_rep = 2 * d, d, 64, hq // hkv
    rows, bk = batch * hq, batch * hkv
    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(0)
    feats = torch.rand(bk, w, n_rep * f, device=dev, generator=g).to(torch.bfloat16) / f
    qf = torch.rand(rows, f, device=dev, generator=g).to(torch.bfloat16) / f
    index = torch.tensor(5, device=dev)
    state_bytes = rows * f * (dv + 1) * 4 * 2
    kern = fused_decode._kernels().hybrid.fn  # the jitted kernel under its autotuner
    for width in (dv + 1, dv + 4):  # unpadded, padded to 16 bytes
        vals = torch.randn(bk, w, width, device=dev, generator=g).to(torch.bfloat16)
        vals[..., dv] = 1.0
        vals[..., dv + 1 :] = 0.0
        lin = torch.rand(rows, f, width, device=dev, generator=g)
        ref_lin = lin.clone()
        ref_lin[:, :, : dv + 1] += (feats[:, 5].view(bk, n_rep, f).reshape(rows, f, 1).float() * vals[:, 5, : dv + 1].float().repeat_interleave(n_rep, 0)[:, None, :])
        ref = torch.einsum("rf,rfc->rc", qf.float(), ref_lin)[:, : dv + 1]
        for bk_, bv, nw in ((32, 64, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8), (128, 128, 8), (8, 256, 4)):
            o = torch.empty(rows, width, device=dev)
            grid = (rows, -(-width // bv))

            def run(lin=lin, o=o, grid=grid, bk_=bk_, bv=bv, nw=nw, vals=vals, width=width):
                kern[grid](lin, feats, vals, qf, o, index, 0, rows, n_rep, feats.stride(0), feats.stride(1), vals.stride(0), vals.stride(1),
                           qf.stride(0), F=f, V=width, SF=width, SV=1, DEVICE_INDEX=True, BK=bk_, BV=bv, num_warps=nw)  # fmt: skip

            work = lin.clone()
            kern[grid](work, feats, vals, qf, o, index, 0, rows, n_rep, feats.stride(0), feats.stride(1), vals.stride(0), vals.stride(1),
                       qf.stride(0), F=f, V=width, SF=width, SV=1, DEVICE_INDEX=True, BK=bk_, BV=bv, num_warps=nw)  # fmt: skip
            err = max((work - ref_lin).abs().max().item(), (o[:, : dv + 1] - ref).abs().max().item() / ref.abs().max().item())
            us = bench(run)
            out.append(dict(kind="hybrid", shape=shape, batch=batch, layout=f"(F, {width})", tile=f"{bk_}x{bv} w{nw}", us=us,
                            tbps=state_bytes / us / 1e6 if us else 0.0, err=err))  # fmt: skip
    # transposed: (C, F)
    c = dv + 1
    vals = torch.randn(bk, w, c, device=dev, generator=g).to(torch.bfloat16)
    vals[..., dv] = 1.0
    lin = torch.rand(rows, f, c, device=dev, generator=g)
    ref_lin = lin + feats[:, 5].view(bk, n_rep, f).reshape(rows, f, 1).float() * vals[:, 5].float().repeat_interleave(n_rep, 0)[:, None, :]
    ref = torch.einsum("rf,rfc->rc", qf.float(), ref_lin)
    lin_t = lin.transpose(1, 2).contiguous()
    for bc, bf, nw in ((8, 128, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8), (8, 256, 4), (64, 64, 4), (32, 64, 4)):
        if bf > f:
            continue
        o = torch.empty(rows, c, device=dev)
        grid = (rows, -(-c // bc))
        work = lin_t.clone()
        kern[grid](work, feats, vals, qf, o, index, 0, rows, n_rep, feats.stride(0), feats.stride(1), vals.stride(0), vals.stride(1),
                   qf.stride(0), F=f, V=c, SF=1, SV=f, BK=bf, BV=bc, DEVICE_INDEX=True, num_warps=nw)  # fmt: skip
        err = max((work.transpose(1, 2) - ref_lin).abs().max().item(), (o - ref).abs().max().item() / ref.abs().max().item())

        def run(o=o, grid=grid, bc=bc, bf=bf, nw=nw, work=work):
            kern[grid](work, feats, vals, qf, o, index, 0, rows, n_rep, feats.stride(0), feats.stride(1), vals.stride(0), vals.stride(1),
                       qf.stride(0), F=f, V=c, SF=1, SV=f, BK=bf, BV=bc, DEVICE_INDEX=True, num_warps=nw)  # fmt: skip

        us = bench(run)
        out.append(dict(kind="hybrid", shape=shape, batch=batch, layout=f"({c}, F)", tile=f"{bc}x{bf} w{nw}", us=us,
                        tbps=state_bytes / us / 1e6 if us else 0.0, err=err))  # fmt: skip
    x = torch.rand(rows, f, c, device=dev)
    us = bench(lambda: x.mul_(1.0))
    out.append(dict(kind="hybrid", shape=shape, batch=batch, layout="x.mul_(1) reference", tile="", us=us, tbps=state_bytes / us / 1e6 if us else 0.0, err=0.0))


def window_rows(shape: str, batch: int, out: list[dict]) -> None:
    """``hybrid_window_read`` with a program per query head or per KV head, at 4 and 8 warps."""
    hq, hkv, d = SHAPES[shape]
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
    hq, hkv, d = SHAPES[shape]
    k_, dv = 2 * d, d
    rows = batch * hq
    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(1)
    qf = torch.rand(batch, hq, k_, device=dev, generator=g).to(torch.bfloat16) / k_
    kf = torch.rand(batch, hq, k_, device=dev, generator=g).to(torch.bfloat16) / k_
    v = torch.randn(batch, hkv, dv, device=dev, generator=g).to(torch.bfloat16)
    decay = torch.rand(batch, 2, hq, k_, device=dev, generator=g) * 0.1 + 0.9
    state_bytes = 2 * rows * k_ * (dv + 1) * 4 * 2
    vn = torch.cat([v.float().repeat_interleave(hq // hkv, 1), torch.ones(batch, hq, 1, device=dev)], -1)  # (B, Hq, Dv + 1)
    for width in (dv + 4,):
        states = torch.rand(2, batch, hq, k_, width, device=dev, generator=g)
        states[..., dv + 1 :] = 0
        ref_s = states.clone()
        for s in range(2):
            ref_s[s, ..., : dv + 1] = decay[:, s, :, :, None] * states[s, ..., : dv + 1] + kf.float()[..., None] * vn[:, :, None, :]
        ref = torch.einsum("bhk,sbhkc->sbhc", qf.float(), ref_s)
        for bk_, bv, nw in ((32, 64, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8), (8, 256, 4)):
            fused_decode.STATE_TILES = fused_decode.COLUMN_TILES = ((bk_, bv, nw),)
            fused_decode._kernels.cache_clear()
            work = states.clone()
            o = fused_decode.dsla_read(fused_decode.dsla_state_step(work, qf, kf, v, decay, True))
            err = max((work - ref_s).abs().max().item(), (o - ref).abs().max().item() / ref.abs().max().item())
            us = bench(lambda work=work: fused_decode.dsla_state_step(work, qf, kf, v, decay, True))
            out.append(dict(kind="dsla", shape=shape, batch=batch, layout=f"(K, {width})", tile=f"{bk_}x{bv} w{nw}", us=us,
                            tbps=state_bytes / us / 1e6 if us else 0.0, err=err))  # fmt: skip
    c = dv + 1
    states = torch.rand(2, batch, hq, k_, c, device=dev, generator=g)
    ref_s = torch.stack([decay[:, s, :, :, None] * states[s] + kf.float()[..., None] * vn[:, :, None, :] for s in range(2)])
    ref = torch.einsum("bhk,sbhkc->sbhc", qf.float(), ref_s)
    for bc, bf, nw in ((8, 128, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8), (8, 256, 4), (32, 64, 4)):
        if bf > k_:
            continue
        fused_decode.STATE_TILES = fused_decode.COLUMN_TILES = ((bf, bc, nw),)
        fused_decode._kernels.cache_clear()
        work = fused_decode.column_major(states)
        o = fused_decode.dsla_read(fused_decode.dsla_state_step(work, qf, kf, v, decay, True))
        err = max((work - ref_s).abs().max().item(), (o - ref).abs().max().item() / ref.abs().max().item())
        us = bench(lambda work=work: fused_decode.dsla_state_step(work, qf, kf, v, decay, True))
        out.append(dict(kind="dsla", shape=shape, batch=batch, layout=f"({c}, K)", tile=f"{bc}x{bf} w{nw}", us=us,
                        tbps=state_bytes / us / 1e6 if us else 0.0, err=err))  # fmt: skip
    x = torch.rand(2, rows, k_, c, device=dev)
    us = bench(lambda: x.mul_(1.0))
    out.append(dict(kind="dsla", shape=shape, batch=batch, layout="x.mul_(1) reference", tile="", us=us, tbps=state_bytes / us / 1e6 if us else 0.0, err=0.0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--kinds", default="hybrid,window,dsla")
    p.add_argument("--check-only", action="store_true", help="check the variants, time nothing (runs on the CPU under TRITON_INTERPRET=1)")
    a = p.parse_args()
    global DEVICE, CHECK_ONLY
    CHECK_ONLY = a.check_only
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for shape in a.shapes.split(","):
        if "hybrid" in a.kinds:
            hybrid_rows(shape, a.batch, rows)
        if "window" in a.kinds:
            window_rows(shape, a.batch, rows)
        if "dsla" in a.kinds:
            dsla_rows(shape, a.batch, rows)
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE} batch {a.batch}; TB/s = state bytes read and written / time")
    print("| kind | shape | layout | tile | us | TB/s | max error |")
    print("|---|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['shape']} | {r['layout']} | {r['tile']} | {r['us']:.1f} | {r['tbps']:.2f} | {r['err']:.1e} |")
    tmp = a.out / "state_layouts.json.tmp"
    tmp.write_text(json.dumps(dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, rows=rows), indent=1))
    os.replace(tmp, a.out / "state_layouts.json")


if __name__ == "__main__":
    main()
