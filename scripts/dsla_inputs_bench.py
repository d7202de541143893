"""Time DSLA's decode inputs kernel (``fused_decode.dsla_decode_inputs``: both Hedgehog maps and
both gates of one token, the gates' down projection from the float32 weight's bfloat16 parts) at
a model's shape and batch, for each way of computing the down projection (``--down-steps``: 0 in
each gate program's own loop over the hidden size; N in a kernel of its own before it, split over
the hidden size in slices of N x 64 units, ``fused_decode.DSLA_DOWN_STEPS``), each number of query
heads a gate program takes (``fused_decode.DSLA_GATE_HEADS``) and each block of rows
(``DSLA_INPUT_ROWS``); every grouping is checked bitwise against the first one listed at the same
block of rows and down projection, and its largest difference from the very first variant is given
(a block of rows of another size, or another split, sums in another order). ``--gemm`` adds the
layers' other form: the down projection as a float32 GEMM before the kernel
(``DSLA_GATE_DOWN=False``; gate heads "gemm", compared by its difference only). ``--rope`` adds q
and k rotated by RoPE: "rope before" (``ops.rope.rope`` on q and k, then the kernel) and "rope in
kernel" (q and k before RoPE, the token's cos and sin given: ``DSLA_ROPE_IN_KERNEL``), each with
the last down projection listed, compared with each other.

    python scripts/dsla_inputs_bench.py OUT [--shapes smollm2-135m,llama3-8b] [--batches 64,224]
        [--down-steps 0,4] [--gate-heads 1] [--rows 16] [--gemm] [--rope]

Writes OUT/dsla_inputs.json and prints a table (TB/s: the bytes the kernel must read and write, the
weights once, over its time).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from linearize.bench.shapes import SHAPES
from linearize.io import atomic_write_text
from linearize.layers.dsla import DslaOptions
from linearize.ops import fused_decode, fused_dsla
from linearize.ops.rope import rope

RANK = DslaOptions().dsla_gate_rank  # the gates' rank the conversions use


def max_diff(want: tuple, got: tuple) -> float:
    """The largest absolute difference between two results of ``dsla_decode_inputs``."""
    return max((w.float() - o.float()).abs().max().item() for w, o in zip(want, got, strict=True))


def output_bytes(shape: str, batch: int) -> int:
    """What the kernel writes: qf and kf (B, Hq, 2d) and both gates' decay (B, 2, Hq, 2d), float32."""
    dims = SHAPES[shape]
    return 4 * batch * dims.heads * 2 * dims.head_dim * 4


def inputs(shape: str, batch: int, device: str) -> tuple:
    """Random bfloat16 q, k, x and maps, float32 gate weights (down as its bfloat16 parts) at ``shape``."""
    dims = SHAPES[shape]
    hq, hkv, d, hidden = dims.heads, dims.kv_heads, dims.head_dim, dims.hidden
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*s, scale=1.0, dtype=torch.bfloat16):
        return (scale * torch.randn(*s, device=device, generator=g)).to(dtype)

    q, k, x = rand(batch, hq, d), rand(batch, hkv, d), rand(batch, hidden)
    weight, bias = rand(2 * hq, d, d, scale=d**-0.5), rand(2 * hq, 1, d, scale=0.1)
    down = rand(2 * RANK, hidden, scale=hidden**-0.5, dtype=torch.float32)
    u, c = fused_dsla.gate_weights(rand(2, hq * 2 * d, RANK, scale=0.5, dtype=torch.float32), rand(2, hq * 2 * d, dtype=torch.float32) - 3, RANK)
    return (q, k, x, fused_decode.bf16_parts(down), weight, bias, u, c), down


def gemm_step(args: tuple, down: torch.Tensor):
    """The layers' other form (``fused_decode.DSLA_GATE_DOWN=False``): the gates' down projection as
    a float32 GEMM (``fused_dsla.gate_inputs``), then the kernel with it given."""
    q, k, x, _, weight, bias, u, c = args
    b = x.shape[0]

    def step():
        xr = fused_dsla.gate_inputs(x.view(b, 1, -1), down, RANK).view(b, 2, -1)
        return fused_decode.dsla_decode_inputs(q, k, x, down, weight, bias, u, c, xr)

    return step


def rope_steps(args: tuple, device: str) -> tuple:
    """The kernel on q and k rotated by RoPE at random positions: (rope before: ``ops.rope.rope`` on q
    and k, then the kernel; rope in kernel: q and k before RoPE with the rows' cos and sin)."""
    q, k, *rest = args
    b, _, d = q.shape
    angle = torch.rand(b, 1, d // 2, device=device, generator=torch.Generator(device=device).manual_seed(1)).mul(1000.0).repeat(1, 1, 2)
    cos, sin = angle.cos().to(q.dtype), angle.sin().to(q.dtype)

    def before():
        return fused_decode.dsla_decode_inputs(rope(q.unsqueeze(2), cos, sin).squeeze(2), rope(k.unsqueeze(2), cos, sin).squeeze(2), *rest)

    def inside():
        return fused_decode.dsla_decode_inputs(q, k, *rest, None, cos[:, 0], sin[:, 0])

    return before, inside


def time_us(step, device: str) -> float:
    """Microseconds per call of ``step`` in a CUDA graph (0 off a GPU)."""
    return 1000 * triton.testing.do_bench_cudagraph(step, rep=100) if device == "cuda" else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    p.add_argument("--batches", default="64,224", help="batch sizes, each timed at every shape")
    p.add_argument("--down-steps", default="0,4", help="0: the down projection in each gate program; N: in a kernel of its own, "
                   "N x 64 hidden units a program (fused_decode.DSLA_DOWN_STEPS)")
    p.add_argument("--gate-heads", default="1", help="values of fused_decode.DSLA_GATE_HEADS")
    p.add_argument("--rows", default="16", help="values of fused_decode.DSLA_INPUT_ROWS")
    p.add_argument("--gemm", action="store_true", help="also time the down projection as a float32 GEMM before the kernel "
                   "(fused_decode.DSLA_GATE_DOWN=False), at each block of rows with one head per gate program")
    p.add_argument("--rope", action="store_true", help="also time RoPE before the kernel against RoPE in it")
    a = p.parse_args()
    unknown = sorted(set(a.shapes.split(",")) - set(SHAPES))
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    steps_list = [int(v) for v in a.down_steps.split(",")]
    if any(v < 0 for v in steps_list):
        raise SystemExit(f"--down-steps takes 0 or positive numbers of steps, got {a.down_steps}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a.out.mkdir(parents=True, exist_ok=True)
    names = "DSLA_GATE_HEADS", "DSLA_INPUT_ROWS", "DSLA_DOWN_SPLIT_ROWS", "DSLA_DOWN_STEPS"
    before = {n: getattr(fused_decode, n) for n in names}

    def use(heads: int, block: int, steps: int) -> None:
        fused_decode.DSLA_GATE_HEADS, fused_decode.DSLA_INPUT_ROWS = heads, block
        fused_decode.DSLA_DOWN_SPLIT_ROWS, fused_decode.DSLA_DOWN_STEPS = (1, steps) if steps else (None, before["DSLA_DOWN_STEPS"])

    rows = []
    try:
        for shape in a.shapes.split(","):
            for batch in map(int, a.batches.split(",")):
                args, down = inputs(shape, batch, device)
                nbytes = sum(t.numel() * t.element_size() for t in args) + output_bytes(shape, batch)
                first = None
                for block in map(int, a.rows.split(",")):
                    for steps in steps_list:
                        want = None
                        for heads in map(int, a.gate_heads.split(",")):
                            use(heads, block, steps)
                            with fused_decode.use_fused(True):
                                got = fused_decode.dsla_decode_inputs(*args)
                                want = got if want is None else want
                                first = got if first is None else first
                                exact = all(torch.equal(w, o) for w, o in zip(want, got, strict=True))
                                diff = max_diff(first, got)
                                us = time_us(lambda args=args: fused_decode.dsla_decode_inputs(*args), device)
                            rows.append(dict(shape=shape, batch=batch, rows=block, down_steps=steps, gate_heads=heads,
                                             used=fused_decode.dsla_gate_heads(SHAPES[shape].heads), us=us, tbps=nbytes / us / 1e6 if us else 0.0,
                                             exact=exact, max_diff=diff))  # fmt: skip
                    if a.gemm:
                        use(1, block, 0)
                        step = gemm_step(args, down)
                        with fused_decode.use_fused(True):
                            got = step()
                            diff = max_diff(first, got)
                            us = time_us(step, device)
                        rows.append(dict(shape=shape, batch=batch, rows=block, down_steps=0, gate_heads="gemm", used=1, us=us,
                                         tbps=nbytes / us / 1e6 if us else 0.0, exact=None, max_diff=diff))  # fmt: skip
                    if a.rope:
                        use(1, block, steps_list[-1])
                        results = []
                        for label, step in zip(("rope before", "rope in kernel"), rope_steps(args, device), strict=True):
                            with fused_decode.use_fused(True):
                                results.append(step())
                                us = time_us(step, device)
                            rows.append(dict(shape=shape, batch=batch, rows=block, down_steps=steps_list[-1], gate_heads=label, used=1, us=us,
                                             tbps=nbytes / us / 1e6 if us else 0.0, exact=None, max_diff=max_diff(results[0], results[-1])))  # fmt: skip
    finally:
        for n, v in before.items():
            setattr(fused_decode, n, v)
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else device}; exact: bitwise equal to gate heads {a.gate_heads.split(',')[0]} "
          f"at the same rows and down projection; max diff: from the first variant")
    print("| shape | batch | rows per program | down steps | gate heads (used) | us | TB/s | exact | max diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['rows']} | {r['down_steps'] or 'in gate programs'} | {r['gate_heads']} ({r['used']}) | {r['us']:.1f} "
              f"| {r['tbps']:.2f} | {'' if r['exact'] is None else r['exact']} | {r['max_diff']:.1e} |")  # fmt: skip
    atomic_write_text(a.out / "dsla_inputs.json", json.dumps(dict(device=torch.cuda.get_device_name() if device == "cuda" else device, rows=rows), indent=1))


if __name__ == "__main__":
    main()
