"""Time DSLA's fused decode state kernel with each tile it can take, at pooled batch sizes (CUDA).

    python scripts/dsla_tiles.py OUT_DIR [--heads 32] [--features 256] [--head-dim 128] [--rows 1,8,18,40]

The defaults are the Llama-2-7B shape the trace replay serves (32 heads, 256 learned features, 128
values plus the normaliser, padded to 132 columns). Each row of OUT_DIR/dsla_tiles.json holds the
batch (``rows``), how many programs share each state's feature rows (``splits``), the megabytes one step reads and writes (``bytes_rw_MB``), the microseconds per
call of every tile (``BKxBVwW``: feature rows x value columns, warps; a failed compile gives its
error), and the op itself with the tile its autotuning picked (``op_autotuned_us``, ``best_config``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from linearize.bench.efficiency import cuda_mean_us
from linearize.ops import fused_decode
from linearize.ops.fused_decode import STATE_TILES

EXTRA_TILES = ((64, 64, 4), (32, 128, 4), (16, 64, 2), (32, 32, 2))


def _row(kernel, states: torch.Tensor, b: int, dv: int) -> dict:
    """One batch size: every tile's time and the op's with its tuned tile."""
    _, slots, hq, dk, width = states.shape
    qf = torch.randn(b, hq, dk, device="cuda", dtype=torch.bfloat16)
    kf = torch.randn_like(qf)
    v = torch.randn(b, hq, dv, device="cuda", dtype=torch.bfloat16)
    decay = torch.rand(b, 2, hq, dk, device="cuda", dtype=torch.bfloat16)
    index = torch.randperm(slots, device="cuda")[:b]
    splits = fused_decode.dsla_splits(b * hq, dk)
    programs, split = fused_decode.dsla_split_launch(splits, dk)
    out = torch.empty(splits, 2, b, hq, width, device="cuda")
    row = {"rows": b, "splits": splits, "bytes_rw_MB": 2 * 2 * b * hq * dk * width * 4 / 1e6}
    for bk, bv, warps in STATE_TILES + EXTRA_TILES:

        def call(bk=bk, bv=bv, warps=warps):
            kernel.fn[(b * hq, -(-width // bv), programs)](
                states, qf, kf, v, decay, out, index, b * hq, slots * hq, 1 << (b - 1).bit_length(), 1,
                qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), v.stride(0), v.stride(1),
                decay.stride(0), decay.stride(1), decay.stride(2),
                H=hq, K=dk, V=width, DV=dv, NORMALIZE=True, INDEXED=True, BK=bk, BV=bv, num_warps=warps, **split,
            )  # fmt: skip

        row[f"{bk}x{bv}w{warps}"] = round(cuda_mean_us(call), 1)
    row["op_autotuned_us"] = round(cuda_mean_us(lambda: fused_decode.dsla_state_step(states, qf, kf, v, decay, True, index)), 1)
    row["best_config"] = str(kernel.best_config)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rows", default="1,8,18,40")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    width = -(-(args.head_dim + 1) // 4) * 4  # the normaliser's column, rows padded to 16 bytes
    states = torch.zeros(2, max(rows) + 1, args.heads, args.features, width, device="cuda")
    kernel = fused_decode._kernels().dsla
    results = []
    for b in rows:
        results.append(_row(kernel, states, b, args.head_dim))
        print(json.dumps(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "dsla_tiles.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(args.out / "dsla_tiles.json")


if __name__ == "__main__":
    main()
