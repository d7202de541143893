"""Time the ways a softmax layer can decode one token per row over a static key/value buffer, at the
shapes of the throughput-at-equal-memory rows (CUDA, bfloat16), and say how close each comes to the
memory bandwidth: the scores' GEMM and a float32 masked softmax over the whole buffer (the static
decoder's matmul path), the flash-decoding kernel reading each row's keys so far
(``ops.softmax.slot_attention``, its default on CUDA), and PyTorch's SDPA with the same boolean
mask (whichever backend it picks), each checked against the float32 reference.

    python scripts/softmax_decode_paths.py OUT_DIR [--shape smollm2-135m:100 --shape llama3-8b:10]
        [--context 32768] [--peak-tbps 3.35]

A shape is NAME:BATCH (``linearize bench --layer``'s shapes; the batch the teacher fits at the
context). OUT_DIR/softmax_decode_paths.json holds per shape and path the microseconds per call
(mean of 50 after 5), the bytes of keys and values read (each row's context once), the fraction of
``--peak-tbps`` that makes, and the largest difference from the reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from linearize.bench.efficiency import cuda_mean_us
from linearize.bench.shapes import SHAPES
from linearize.io import atomic_write_text
from linearize.ops import softmax as softmax_ops


def _matmul(q, keys, values, blocked, scale):
    """The static decoder's matmul path: (B, Hq, D) -> (B, Hq, Dv)."""
    b, hkv, _, d = keys.shape
    hq = q.shape[1]
    scores = torch.matmul(q.reshape(b, hkv, hq // hkv, d), keys.transpose(-1, -2))
    weights = (scores.float() * scale).masked_fill_(blocked, float("-inf")).softmax(dim=-1)
    return torch.matmul(weights.to(values.dtype), values).reshape(b, hq, -1)


def _sdpa(q, keys, values, allowed, scale):
    """SDPA over the buffer with a boolean mask, the query heads of a KV head as its queries."""
    b, hkv, _, d = keys.shape
    hq = q.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), keys, values, attn_mask=allowed, scale=scale)
    return o.reshape(b, hq, -1)


def _time_shape(name: str, b: int, context: int, peak_tbps: float) -> dict:
    """Every path at one shape: microseconds, bandwidth reached, difference from the reference."""
    shape = SHAPES[name]
    hq, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    length = context + 8  # the buffer: the context and a few decode slots, the last ones empty
    filled = context + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(b, hkv, length, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    values = torch.randn(b, hkv, length, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(b, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    scale = d**-0.5
    blocked = (torch.arange(length, device="cuda") >= filled).view(1, 1, 1, length).expand(b, 1, 1, length)
    rows = torch.arange(b, device="cuda")
    lengths = torch.full((b,), filled, device="cuda", dtype=torch.long)
    ref = softmax_ops.slot_attention_reference(q, keys, values, rows, lengths, scale)
    paths = {
        "matmul": lambda: _matmul(q, keys, values, blocked, scale),
        "flash-decoding": lambda: softmax_ops.slot_attention(q, keys, values, rows, lengths, scale),
        "sdpa": lambda: _sdpa(q, keys, values, ~blocked, scale),
    }
    moved = 2 * b * hkv * filled * d * 2  # keys and values, bf16, each row's context once
    row = {"batch": b, "heads": hq, "kv_heads": hkv, "head_dim": d, "bytes": moved, "paths": {}}
    for path, fn in paths.items():
        try:
            out = fn()
            us = cuda_mean_us(fn, repeats=50, warmup=5)
            row["paths"][path] = {"us": us, "tbps": moved / us / 1e6, "of_peak": moved / us / 1e6 / peak_tbps,
                                  "max_diff": (out.float() - ref.float()).abs().max().item()}  # fmt: skip
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            row["paths"][path] = {"error": str(exc).splitlines()[0]}
        print(name, b, path, row["paths"][path], flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", action="append", default=[], metavar="NAME:BATCH", help="default: smollm2-135m:100 and llama3-8b:10")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--peak-tbps", type=float, default=3.35, help="the device's memory bandwidth, TB/s (H100 SXM 3.35, H200 4.8)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    results = {"context": args.context, "device": torch.cuda.get_device_name(), "peak_tbps": args.peak_tbps, "shapes": {}}
    for item in args.shape or ["smollm2-135m:100", "llama3-8b:10"]:
        name, _, batch = item.partition(":")
        if name not in SHAPES or not batch.isdigit() or int(batch) < 1:
            raise SystemExit(f"bad --shape {item!r}: NAME:BATCH with NAME one of {sorted(SHAPES)} and BATCH a positive integer")
        results["shapes"][item] = _time_shape(name, int(batch), args.context, args.peak_tbps)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "softmax_decode_paths.json", json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
