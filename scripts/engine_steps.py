"""The serving engine's two step kinds timed per conversion level: a one-row prefill chunk and a batched decode step.

    python scripts/engine_steps.py OUT [--model smollm2-135m-dsla-chained] [--levels 0,15,30,4/8/11] [--context 2048]
        [--chunk 512] [--rows 1,8,32] [--profile]

For each level: the pooled runner (with its CUDA graphs where the device has them) prefills rows of
``--context`` tokens in chunks of ``--chunk`` (a first chunk and later chunks timed apart), then
decodes ``--rows`` rows together at that context. A level written as a mix (``4/8/11``) gives the rows
those levels in turn (a decode batch of mixed levels, as length-caps makes them; its prefill rows at the
highest). Times are CUDA-event medians over repeats after
the graphs are captured. ``--profile`` adds each level's kernels (``linearize.bench.profile``:
device time per call; on the CPU the operators) for one later chunk and one decode step at the
largest row count. Writes OUT/engine_steps.json and OUT/engine_steps.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from pathlib import Path

import torch

from linearize.bench.efficiency import time_calls
from linearize.bench.profile import kernel_table, profile_calls
from linearize.io import write_results
from linearize.serve.server import load_family, make_engine
from linearize.serve.settings import ServeSettings


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median ms of ``fn`` over ``repeats`` calls (CUDA events on CUDA, the wall clock otherwise)."""
    return 1e3 * statistics.median(time_calls(fn, repeats, device))


def measure(runner, mix: tuple[int, ...], ids: torch.Tensor, chunk: int, rows: list[int], repeats: int, profile: bool) -> dict:
    """One level's (or a mix of levels') step times on ``runner``: rows of ``ids`` (1, context)
    prefilled in chunks (row i at level ``mix[i % len(mix)]``), then a fresh row's first chunk and a
    later chunk at the highest level, and decode steps of each row count, timed."""
    context, level = ids.shape[1], max(mix)
    runner.reserve(max(rows) + 3, context + 64)
    seqs = []
    for i in range(max(rows)):
        seq = runner.new_sequence(mix[i % len(mix)])
        for s in range(0, context, chunk):
            runner.forward([seq], ids[:, s : s + chunk])
        seqs.append(seq)

    def first_chunk():  # a fresh row's first chunk
        seq = runner.new_sequence(level)
        runner.forward([seq], ids[:, :chunk])
        runner.release(seq)

    probe = runner.new_sequence(level)
    runner.forward([probe], ids[:, :chunk])

    def later_chunk():  # the probe row's second chunk, again and again
        probe.position = chunk
        runner.forward([probe], ids[:, chunk : 2 * chunk])

    for fn in (first_chunk, later_chunk):  # captured first (two calls), then timed
        fn(), fn()
    device = ids.device
    entry = {"first_chunk_ms": timed(first_chunk, repeats, device), "later_chunk_ms": timed(later_chunk, repeats, device)}
    entry["prefill_ms_per_1k"] = (entry["first_chunk_ms"] + (context // chunk - 1) * entry["later_chunk_ms"]) / context * 1000
    token = torch.full((1, 1), 5, device=device)

    def decode(batch):  # one decode step of ``batch`` at the rows' context (positions reset each call)
        for s in batch:
            s.position = context
        runner.forward(batch, token.expand(len(batch), 1).contiguous())

    for r in rows:
        decode(seqs[:r]), decode(seqs[:r])
        entry[f"decode_{r}_ms"] = timed(functools.partial(decode, seqs[:r]), repeats, device)
    if profile:
        entry["later_chunk_kernels"] = profile_calls(later_chunk, calls=1, device=device)
        entry["decode_kernels"] = profile_calls(functools.partial(decode, seqs[: max(rows)]), calls=1, device=device)
    return entry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default="smollm2-135m-dsla-chained")
    p.add_argument("--levels", default="0,15,30")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [int(x) for x in a.rows.split(",")]
    settings = ServeSettings(model=a.model, kv_budget="64GiB" if torch.cuda.is_available() else "4GiB", max_running=max(rows) + 3)
    model, tokenizer, levels, device = load_family(settings)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    result = {"model": a.model, "context": a.context, "chunk": a.chunk, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "levels": {}}  # fmt: skip
    lines = [f"# Engine steps: {a.model}, context {a.context}, chunks of {a.chunk}", "",
             "| level | first chunk ms | later chunk ms | prefill ms / 1K tokens | " + " | ".join(f"decode {r} rows ms" for r in rows) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(rows)]  # fmt: skip
    for level in a.levels.split(","):
        mix = tuple(int(x) for x in level.split("/"))
        engine = make_engine(model, tokenizer, levels, device, settings, policy=f"static:{max(mix)}")
        ids = torch.randint(3, vocab, (1, a.context), generator=gen).to(device)
        entry = measure(engine.runner, mix, ids, a.chunk, rows, a.repeats, a.profile)
        result["levels"][level] = entry
        lines.append(f"| {level} | {entry['first_chunk_ms']:.2f} | {entry['later_chunk_ms']:.2f} | {entry['prefill_ms_per_1k']:.2f} | "
                     + " | ".join(f"{entry[f'decode_{r}_ms']:.2f}" for r in rows) + " |")  # fmt: skip
        print(lines[-1], flush=True)
        engine.close()
    for level, entry in result["levels"].items():
        for name in ("later_chunk_kernels", "decode_kernels"):
            if name in entry:
                lines += ["", f"## level {level}: {name.replace('_', ' ')}", "", *kernel_table(entry[name], unit="call")]
    write_results(out, "engine_steps", result, "\n".join(lines) + "\n", indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
