"""Whole-model decode with kernel options on and off, in one process: the teacher once per kind, then
each variant (a set of ``--kernel-option`` items) with the same converted model, compiled and captured
as ``linearize bench --graphs --compile`` runs it, then the teacher again. The defaults run first
and again last, so drift over the run shows.

    python scripts/decode_options_ab.py OUT --kinds dsla,hybrid --batch-size 64 --context 8000 \
        --variant row=fused_decode.COLUMN_STATES=False --variant dsla:parts1=fused_decode.DSLA_INPUT_PARTS=1

A variant is [KIND:]NAME=ITEM[;ITEM...] (with KIND, for that kind only), each ITEM a kernel option
(MODULE.NAME=VALUE). Writes OUT/options.json after every measurement (a run cut short keeps what it
measured), and OUT/options.md and OUT/options.png (bars against the teacher) at the end;
``--replot`` writes those two again from OUT/options.json. ``--device cpu --eager`` checks the
script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from linearize import convert
from linearize.api import load_model
from linearize.bench.efficiency import bench_decode
from linearize.io import atomic_write_text
from linearize.ops import kernel_options
from linearize.teacher import teacher_modes

SPECS = {
    "hybrid": {"attention": "hybrid", "window": 64},
    "dsla": {"attention": "dsla"},
    "lola": {"attention": "lola", "window": 64, "sparse_cache": 256, "chunk": 64},
}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """NAME=ITEMS -> (NAME, items); NAME may be KIND:NAME (the variant runs for that kind only)."""
    name, eq, items = text.partition("=")
    if not eq or not name or not items:
        raise SystemExit(f"--variant {text!r}: expected NAME=MODULE.NAME=VALUE[;MODULE.NAME=VALUE...]")
    items_list = [item for item in items.split(";") if item]
    kernel_options.check(items_list)
    return name, items_list


def write(out: Path, result: dict) -> None:
    """OUT/options.json, atomically (after every measurement)."""
    atomic_write_text(out / "options.json", json.dumps(result, indent=1))


def markdown(result: dict) -> str:
    lines = [f"{result['model']} on {result['device']}, batch {result['batch_size']} at {result['context']} tokens, {result['decoder']}", "",
             "| kind | variant | options | ms / token | tokens/s | teacher ms | teacher / variant |", "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for kind, rows in result["kinds"].items():
        teacher = rows.get("teacher")
        for row in rows["variants"]:
            ratio = f"{teacher['median_s'] / row['median_s']:.3f}x" if teacher else ""
            lines.append(f"| {kind} | {row['name'].rpartition(':')[2]} | {'; '.join(row['items']) or '-'} | {row['median_s'] * 1e3:.3f} | {row['tokens_per_s']:,.0f} | "
                         f"{teacher['median_s'] * 1e3:.3f} | {ratio} |" if teacher else f"| {kind} | {row['name'].rpartition(':')[2]} | | {row['median_s'] * 1e3:.3f} | | | |")  # fmt: skip
    for kind, rows in result["kinds"].items():
        if rows.get("teacher") and rows.get("teacher_again"):
            lines.append(f"\n{kind}: the teacher {rows['teacher']['median_s'] * 1e3:.3f} ms first, "
                         f"{rows['teacher_again']['median_s'] * 1e3:.3f} ms after the variants (the ratios are against the first)")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """ms per token of each variant (bars, in the order run) against the teacher's (a line), one panel per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from linearize.io import save_png

    kinds = list(result["kinds"].items())
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
    for ax, (kind, rows) in zip(axes[0], kinds):
        names = [row["name"].rpartition(":")[2] for row in rows["variants"]]
        ms = [row["median_s"] * 1e3 for row in rows["variants"]]
        palette = iter(["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"])
        colors: dict[tuple, str] = {(): "tab:gray"}  # one color per set of options; the defaults gray
        for row in rows["variants"]:
            if tuple(row["items"]) not in colors:
                colors[tuple(row["items"])] = next(palette, "tab:blue")
        ax.bar(range(len(ms)), ms, color=[colors[tuple(row["items"])] for row in rows["variants"]])
        if rows.get("teacher"):
            teacher = rows["teacher"]["median_s"] * 1e3
            ax.axhline(teacher, color="tab:red", label=f"teacher {teacher:.2f} ms")
            ax.axhline(teacher / 2.5, color="tab:red", linestyle="--", label="teacher / 2.5")
        ax.set_xticks(range(len(ms)), names, rotation=30, ha="right", fontsize=8)
        ax.set(title=kind, ylabel="ms per token (batch)")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{result['model']} on {result['device']}, batch {result['batch_size']} at {result['context']} tokens")
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--kinds", default="dsla,hybrid")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--replot", action="store_true", help="write options.md and options.png from OUT/options.json; measure nothing"
    )
    parser.add_argument("--eager", action="store_true", help="static buffers without torch.compile (a quick check on the CPU)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kinds = [k for k in args.kinds.split(",") if k]
    for kind in kinds:
        if kind not in SPECS:
            raise SystemExit(f"--kinds: {kind!r} is not one of {', '.join(SPECS)}")
    variants = [("default", []), *(parse_variant(v) for v in args.variant), ("default again", [])]
    out = Path(args.out)
    if args.replot:
        result = json.loads((out / "options.json").read_text())
        atomic_write_text(out / "options.md", markdown(result))
        plot(result, out / "options.png")
        return
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "batch_size": args.batch_size,
              "context": args.context, "steps": args.steps,
              "decoder": "static buffers, eager" if args.eager else "compiled and captured", "versions": {"torch": torch.__version__}, "kinds": {}}  # fmt: skip
    start = time.perf_counter()
    for kind in kinds:
        model, _ = load_model(args.model, dtype=torch.bfloat16, device=args.device)
        convert(model, SPECS[kind])
        rows = result["kinds"].setdefault(kind, {"spec": SPECS[kind], "variants": []})
        kwargs = dict(steps=args.steps, batch_size=args.batch_size, device=args.device, static=True if args.eager else "compile")
        with teacher_modes(model):
            torch._dynamo.reset()
            rows["teacher"] = bench_decode(model, [args.context], **kwargs)[0]
        print(f"[{time.perf_counter() - start:6.0f} s] {kind} teacher {rows['teacher']['median_s'] * 1e3:.3f} ms", flush=True)
        write(out, result)
        for name, items in variants:
            only, _, _ = name.rpartition(":")
            if only and only != kind:
                continue
            with kernel_options.applied_for(items):
                torch._dynamo.reset()
                row = bench_decode(model, [args.context], **kwargs)[0]
            rows["variants"].append({"name": name.rpartition(":")[2], "items": items, **row})
            print(f"[{time.perf_counter() - start:6.0f} s] {kind} {name} {row['median_s'] * 1e3:.3f} ms "
                  f"({rows['teacher']['median_s'] / row['median_s']:.3f}x the teacher)", flush=True)  # fmt: skip
            write(out, result)
        with teacher_modes(model):  # the teacher again: how far the machine's speed drifted over the kind's rows
            torch._dynamo.reset()
            rows["teacher_again"] = bench_decode(model, [args.context], **kwargs)[0]
        print(
            f"[{time.perf_counter() - start:6.0f} s] {kind} teacher again {rows['teacher_again']['median_s'] * 1e3:.3f} ms",
            flush=True,
        )
        write(out, result)
        del model
        torch.cuda.empty_cache()
    atomic_write_text(out / "options.md", markdown(result))
    plot(result, out / "options.png")
    print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
