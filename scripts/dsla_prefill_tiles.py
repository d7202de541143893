"""Time DSLA's fused prefill (``ops.fused_dsla.dsla_prefill_fused``: a state kernel and an output
kernel, both states together) with each block length, at one layer's prefill shape (CUDA, bfloat16),
against flash softmax over q, k, v of the same shape.

    python scripts/dsla_prefill_tiles.py OUT_DIR [--lengths 32768,131072] [--blocks 32,64,128] [--batch 1] [--shape llama3-8b]

The layer (``--shape``: a name of ``linearize bench --layer``) is read as DSLA with a square Hedgehog
map (2 x head_dim features per query head, random softmax rows here), gates of rank 16 at their
initial values plus a data-dependent part. Only the attention is timed: no projections, no feature
maps (the layer benchmark times those). OUT_DIR/dsla_prefill_tiles.json holds, per length, the
milliseconds of softmax (SDPA, causal, grouped heads) and of the op with each block length, each
block's kernels (``profile_ms``) and the tiles the autotuner chose (``configs``).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from linearize.bench.efficiency import cuda_mean_us
from linearize.bench.shapes import SHAPES
from linearize.ops import fused_dsla
from linearize.ops.dsla import init_gate_bias

RANK = 16


def _chosen(kernel) -> dict[str, str]:
    """The autotuner's choice per key (tiles, warps, stages), as text."""
    cache = getattr(kernel, "cache", {})
    return {str(key): str(config) for key, config in cache.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    b, hq, hkv, d = args.batch, shape.heads, shape.kv_heads, shape.head_dim
    f, dev, dt = 2 * d, "cuda", torch.bfloat16
    blocks = [int(x) for x in args.blocks.split(",")]
    torch.manual_seed(0)
    up = torch.randn(2, hq * f, RANK, device=dev) / 8
    bias = torch.stack([torch.full((hq * f,), init_gate_bias(a), device=dev) for a in (0.999, 0.9)])
    up, bias = fused_dsla.gate_weights(up, bias, RANK)
    gamma = torch.tensor(0.5, device=dev)
    report = {"shape": args.shape, "batch": b, "heads": hq, "kv_heads": hkv, "head_dim": d, "features": f, "rank": RANK,
              "device": torch.cuda.get_device_name(), "lengths": {}}  # fmt: skip
    for t in (int(x) for x in args.lengths.split(",")):
        q, k, v = (torch.randn(b, h, t, d, device=dev, dtype=dt) for h in (hq, hkv, hkv))
        softmax = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True)
        rows: dict = {"softmax_ms": cuda_mean_us(softmax, repeats=5, warmup=2) / 1e3, "blocks": {}}
        del q, k
        qf = torch.randn(b, t, hq, f, device=dev).softmax(-1).to(dt)
        kf = torch.randn(b, t, hq, f, device=dev).softmax(-1).to(dt)
        values = v.transpose(1, 2).contiguous()
        xr = torch.randn(b, t, 2, RANK, device=dev)
        for block in blocks:
            call = functools.partial(fused_dsla.dsla_prefill_fused, qf, kf, values, xr, up, bias, gamma, normalize=True, block=block)
            entry: dict = {}
            try:
                with torch.no_grad():
                    entry["ms"] = cuda_mean_us(call, repeats=3, warmup=1) / 1e3
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        call()
                        torch.cuda.synchronize()
                entry["over_softmax"] = entry["ms"] / rows["softmax_ms"]
                kernels = {e.key: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0}
                entry["profile_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:6])
            except Exception as e:  # noqa: BLE001 (a block that does not compile or fit is reported, not fatal)
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows["blocks"][block] = entry
            print(t, block, json.dumps(entry), flush=True)
        kernels = fused_dsla._kernels()
        rows["configs"] = {"states": _chosen(kernels.states), "output": _chosen(kernels.output)}
        report["lengths"][t] = rows
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dsla_prefill_tiles.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
