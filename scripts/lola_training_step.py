"""Time one LoLA attention call with gradients (forward and backward, as in training) two ways: the
chunk loop, and the training path (each chunk's cache chosen without gradients, every chunk read at
once given those caches: ``ops.lola.lola_given_caches``), on the same inputs, with the largest
difference between their outputs and gradients.

    python scripts/lola_training_step.py OUT_DIR [--shape smollm2-135m] [--length 2048] [--batch 4]
        [--repeats 3] [--window 64] [--sparse 256] [--chunk 64]

The layer's heads (``--shape``: a name of ``linearize bench --layer``) with random inputs and a
square Hedgehog map (2 x head_dim features) whose weights ask for gradients, as in attention
transfer; q, k and v ask for them too, as under LoRA; bfloat16, on CUDA (the training path needs the
fused kernels for its choices).
OUT_DIR/lola_training_step.json holds the milliseconds of each path (median of ``--repeats`` after
one warm-up), their ratio, and the differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from linearize.bench.shapes import SHAPES
from linearize.io import atomic_write_text
from linearize.ops import lola
from linearize.ops.feature_maps import hedgehog


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sparse", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    b, hq, hkv, d, t = args.batch, shape.heads, shape.kv_heads, shape.head_dim, args.length
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: the training path chooses the caches with the fused kernels")
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    maps = [(0.1 * torch.randn(hq, d, d, device=dev, dtype=dt)).requires_grad_(True) for _ in range(2)]
    bias = torch.zeros(hq, d, device=dev, dtype=dt)
    q, k, v = (torch.randn(b, h, t, d, device=dev, dtype=dt) for h in (hq, hkv, hkv))
    kw = dict(phi_q=lambda x: hedgehog(x, weight=maps[0], bias=bias), phi_k=lambda x: hedgehog(x, weight=maps[1], bias=bias),
              window=args.window, sparse=args.sparse, chunk=args.chunk, window_factor=torch.ones(hq, device=dev), sinks=4,
              linear_weight=0.1)  # fmt: skip
    probe = torch.randn(b, hq, t, d, device=dev, dtype=dt)

    def step(loop: bool):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        extra = {}
        if loop:  # an explicit empty memory takes the chunk loop
            extra["state"] = lola.lola_state_empty(b, hq, hkv, args.window, args.sparse, d, d, 2 * d, dev)
        out, _ = lola.lola_attention(*leaves, **kw, **extra)
        grads = torch.autograd.grad((out.float() * probe.float()).sum(), leaves + maps)
        torch.cuda.synchronize()
        return out.detach(), grads

    report = {"shape": args.shape, "batch": b, "length": t, "window": args.window, "sparse": args.sparse, "chunk": args.chunk,
              "device": str(dev), "dtype": str(dt)}  # fmt: skip
    results = {}
    for name, loop in (("loop", True), ("training_path", False)):
        times = []
        for i in tqdm(range(args.repeats + 1), desc=name):
            start = time.perf_counter()
            results[name] = step(loop)
            if i:  # the first is the warm-up
                times.append((time.perf_counter() - start) * 1e3)
        report[f"{name}_ms"] = statistics.median(times)
    report["loop_over_training_path"] = report["loop_ms"] / report["training_path_ms"]
    (out_l, g_l), (out_p, g_p) = results["loop"], results["training_path"]
    report["max_output_difference"] = (out_l.float() - out_p.float()).abs().max().item()
    report["max_relative_gradient_difference"] = max(
        ((a.float() - c.float()).abs().max() / c.float().abs().max().clamp_min(1e-30)).item() for a, c in zip(g_l, g_p)
    )
    print(json.dumps(report, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "lola_training_step.json", json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
