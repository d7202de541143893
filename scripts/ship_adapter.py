"""Ship a trained run's adapter inside the package: linearize/checkpoints/NAME.

    python scripts/ship_adapter.py RUN_DIR [RUN_DIR ...]
    python scripts/ship_adapter.py RUN_DIR --name smollm2-135m-dsla-chained   (a run made under another name)
    python scripts/ship_adapter.py RUN_DIR [RUN_DIR ...] --pack-to DIR   (DIR/NAME.tgz each, nothing shipped)

Copies RUN_DIR/adapter (new parameters, LoRA, spec, base model name) with every tensor stored as
bfloat16, which halves the repository's size; load_model upcasts to the model's dtype. The run's
summary.json goes beside it as training.json. Absolute paths of the machine that trained it (data
caches, tokenizer folders, output folders) are reduced to their last component, and LoRA's
base_model_name_or_path becomes the base model's name. Written atomically.

--pack-to DIR writes each run instead as DIR/NAME.tgz: the same adapter files (bfloat16 tensors,
scrubbed config) with the run's summary.json, metrics.jsonl and config.yaml, small enough to copy a
run off a lent machine for evaluation elsewhere (scripts/recipe_sweep.sh does).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from linearize.names import ADAPTER_CONFIG, SHIPPED, checkpoint_dir
from linearize.io import atomic_dir


def scrub(obj: Any) -> Any:
    """Every absolute path inside a JSON value reduced to its last component."""
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    if isinstance(obj, str) and obj.startswith("/"):
        return Path(obj).name
    return obj


def ship(run_dir: Path, name: str | None = None) -> Path:
    summary = json.loads((run_dir / "summary.json").read_text())
    if name is not None:
        summary["trained_as"] = summary["name"]
        summary["name"] = name
    name = summary["name"]
    if name not in SHIPPED:
        raise SystemExit(f"run {name!r} is not a shipped name; shipped names: {', '.join(SHIPPED)}")
    target = checkpoint_dir(name)
    with atomic_dir(target) as tmp:
        copy_bf16(run_dir / "adapter", tmp)
        (tmp / "training.json").write_text(json.dumps(scrub(summary), indent=2))
    return target


def copy_bf16(source: Path, target: Path) -> None:
    """The adapter folder ``source`` into the existing folder ``target``: every tensor as bfloat16,
    the config scrubbed of machine paths (LoRA's base_model_name_or_path: the base model's name)."""
    for path in sorted(source.iterdir()):
        if path.suffix == ".safetensors":
            tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(path)).items()}
            save_file(tensors, str(target / path.name), metadata={"format": "pt"})
        elif path.name == ADAPTER_CONFIG:
            meta = scrub(json.loads(path.read_text()))
            meta["storage_dtype"] = "bfloat16"
            if isinstance(meta.get("lora"), dict):
                meta["lora"]["base_model_name_or_path"] = meta["base_model"]
            (target / path.name).write_text(json.dumps(meta, indent=2, sort_keys=True))
        else:
            shutil.copy2(path, target / path.name)


def pack(run_dir: Path, out_dir: Path) -> Path:
    """OUT_DIR/NAME.tgz: NAME/{summary.json, metrics.jsonl, config.yaml} and NAME/adapter/ as ``copy_bf16`` writes it."""
    archive = out_dir / f"{run_dir.name}.tgz"
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp, tarfile.open(archive, "w:gz") as tar:
        for name in ("summary.json", "metrics.jsonl", "config.yaml"):
            tar.add(run_dir / name, f"{run_dir.name}/{name}")
        copy_bf16(run_dir / "adapter", Path(tmp))
        tar.add(tmp, f"{run_dir.name}/adapter")
    return archive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--name", help="ship under this name (one run only), e.g. smollm2-135m-dsla-chained")
    parser.add_argument("--pack-to", type=Path, metavar="DIR", help="write DIR/NAME.tgz per run instead of shipping")
    args = parser.parse_args()
    if args.name and len(args.runs) != 1:
        parser.error("--name takes exactly one RUN_DIR")
    if args.pack_to is not None:
        if args.name:
            parser.error("--pack-to names each archive after its run; it does not take --name")
        for run_dir in args.runs:
            print(f"packed {run_dir} -> {pack(run_dir, args.pack_to)}")
        return
    for run_dir in args.runs:
        print(f"shipped {run_dir} -> {ship(run_dir, args.name)}")


if __name__ == "__main__":
    main()
