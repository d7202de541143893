"""Ship a trained run's adapter inside the package: linearize/checkpoints/NAME.

    python scripts/ship_adapter.py RUN_DIR [RUN_DIR ...]
    python scripts/ship_adapter.py RUN_DIR --name smollm2-135m-dsla-chained   (a run made under another name)
    python scripts/ship_adapter.py RUN_DIR --parent STAGE1_RUN_DIR   (a run started from STAGE1_RUN_DIR's adapter)
    python scripts/ship_adapter.py RUN_DIR [RUN_DIR ...] --pack-to DIR   (DIR/NAME.tgz each, nothing shipped)
    python scripts/ship_adapter.py --stand-alone NAME   (a shipped conversion built on another, made to need it no more)

Copies RUN_DIR/adapter (new parameters, LoRA, spec, base model name) with every tensor stored as
bfloat16, which halves the repository's size; load_model upcasts to the model's dtype. The run's
summary.json goes beside it as training.json. Absolute paths of the machine that trained it (data
caches, tokenizer folders, output folders) are reduced to their last component, LoRA's
base_model_name_or_path becomes the base model's name, and a run started from another adapter is
re-based on that adapter's base (``linearize.api.copy_adapter``). Written atomically.

--pack-to DIR writes each run instead as DIR/NAME.tgz: the same adapter files (bfloat16 tensors,
scrubbed config) with the run's summary.json, metrics.jsonl and config.yaml, small enough to copy a
run off a lent machine for evaluation elsewhere (scripts/recipe_sweep.sh does).

--stand-alone NAME rewrites the shipped conversion NAME, trained on top of another shipped
conversion with LoRA (it loads only on that one's weights), so that it builds on the base model
alone: the parent's LoRA and its own become one LoRA of the summed rank (``linearize.api.stand_alone``).
Do this before the parent is replaced.
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

from linearize.api import copy_adapter, scrub_paths, stand_alone
from linearize.names import ADAPTER_CONFIG, SHIPPED, checkpoint_dir
from linearize.io import atomic_dir, atomic_write


def with_parent(summary: dict, parent: dict) -> dict:
    """The summary of a run started from another run's adapter (``train --model ADAPTER``), completed
    with that run's: its stages first, the real teacher's held-out loss (the child's "teacher" is the
    parent's adapter), and the parent's own held-out result kept as ``parent``."""
    out = dict(summary)
    out["stages"] = {**parent["stages"], **summary["stages"]}
    out["model"] = parent["model"]
    out["teacher_heldout_loss"], out["teacher_heldout_ppl"] = parent["teacher_heldout_loss"], parent["teacher_heldout_ppl"]
    out["parent"] = {"name": parent["name"], "heldout_loss": parent["heldout_loss"], "heldout_ppl": parent["heldout_ppl"],
                     "started_as": summary["model"]}
    return out


def ship(run_dir: Path, name: str | None = None, parent: Path | None = None) -> Path:
    summary = json.loads((run_dir / "summary.json").read_text())
    if parent is not None:
        summary = with_parent(summary, json.loads((parent / "summary.json").read_text()))
    if name is not None:
        summary["trained_as"] = summary["name"]
        summary["name"] = name
    name = summary["name"]
    if name not in SHIPPED:
        raise SystemExit(f"run {name!r} is not a shipped name; shipped names: {', '.join(SHIPPED)}")
    target = checkpoint_dir(name)
    with atomic_dir(target) as tmp:
        copy_adapter(run_dir / "adapter", tmp)
        if parent is not None:  # the adapter's own training record (save_adapter's) is the child run's alone
            meta = json.loads((tmp / ADAPTER_CONFIG).read_text())
            meta["training"] = scrub_paths({k: v for k, v in summary.items() if k != "data"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
        (tmp / "training.json").write_text(json.dumps(scrub_paths(summary), indent=2))
    return target


def pack(run_dir: Path, out_dir: Path) -> Path:
    """OUT_DIR/NAME.tgz: NAME/{summary.json, metrics.jsonl, config.yaml} and NAME/adapter/ as ``copy_adapter`` writes it."""
    archive = out_dir / f"{run_dir.name}.tgz"
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        copy_adapter(run_dir / "adapter", Path(tmp))

        def write(file) -> None:
            with tarfile.open(fileobj=file, mode="w:gz") as tar:
                for name in ("summary.json", "metrics.jsonl", "config.yaml"):
                    tar.add(run_dir / name, f"{run_dir.name}/{name}")
                tar.add(tmp, f"{run_dir.name}/adapter")

        atomic_write(archive, write)
    return archive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--name", help="ship under this name (one run only), e.g. smollm2-135m-dsla-chained")
    parser.add_argument("--pack-to", type=Path, metavar="DIR", help="write DIR/NAME.tgz per run instead of shipping")
    parser.add_argument("--parent", type=Path, metavar="RUN_DIR",
                        help="the run whose adapter this one started from (one run only): its stages and teacher go into training.json")
    parser.add_argument("--stand-alone", metavar="NAME", choices=SHIPPED,
                        help="rewrite the shipped conversion NAME so that it no longer builds on another shipped conversion")
    args = parser.parse_args()
    if args.stand_alone:
        if args.runs or args.name or args.parent or args.pack_to:
            parser.error("--stand-alone takes no RUN_DIR and no other option")
        print(f"{args.stand_alone} stands alone: {stand_alone(checkpoint_dir(args.stand_alone), checkpoint_dir(args.stand_alone))}")
        return
    if not args.runs:
        parser.error("give at least one RUN_DIR")
    if args.name and len(args.runs) != 1:
        parser.error("--name takes exactly one RUN_DIR")
    if args.parent and (len(args.runs) != 1 or args.pack_to is not None):
        parser.error("--parent takes exactly one RUN_DIR, shipped (not with --pack-to)")
    if args.pack_to is not None:
        if args.name:
            parser.error("--pack-to names each archive after its run; it does not take --name")
        for run_dir in args.runs:
            print(f"packed {run_dir} -> {pack(run_dir, args.pack_to)}")
        return
    for run_dir in args.runs:
        print(f"shipped {run_dir} -> {ship(run_dir, args.name, args.parent)}")


if __name__ == "__main__":
    main()
