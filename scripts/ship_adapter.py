"""Ship a trained run's adapter inside the package: linearize/checkpoints/NAME.

    python scripts/ship_adapter.py RUN_DIR [RUN_DIR ...]
    python scripts/ship_adapter.py RUN_DIR --name smollm2-135m-dsla-chained   (a run made under another name)

Copies RUN_DIR/adapter (new parameters, LoRA, spec, base model name) with every tensor stored as
bfloat16, which halves the repository's size; load_model upcasts to the model's dtype. The run's
summary.json goes beside it as training.json. Absolute paths of the machine that trained it (data
caches, tokenizer folders, output folders) are reduced to their last component, and LoRA's
base_model_name_or_path becomes the base model's name. Written atomically.
"""

from __future__ import annotations

import argparse
import json
import shutil
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
    source = run_dir / "adapter"
    target = checkpoint_dir(name)
    with atomic_dir(target) as tmp:
        for path in sorted(source.iterdir()):
            if path.suffix == ".safetensors":
                tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(path)).items()}
                save_file(tensors, str(tmp / path.name), metadata={"format": "pt"})
            elif path.name == ADAPTER_CONFIG:
                meta = scrub(json.loads(path.read_text()))
                meta["storage_dtype"] = "bfloat16"
                if isinstance(meta.get("lora"), dict):
                    meta["lora"]["base_model_name_or_path"] = meta["base_model"]
                (tmp / path.name).write_text(json.dumps(meta, indent=2, sort_keys=True))
            else:
                shutil.copy2(path, tmp / path.name)
        (tmp / "training.json").write_text(json.dumps(scrub(summary), indent=2))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--name", help="ship under this name (one run only), e.g. smollm2-135m-dsla-chained")
    args = parser.parse_args()
    if args.name and len(args.runs) != 1:
        parser.error("--name takes exactly one RUN_DIR")
    for run_dir in args.runs:
        print(f"shipped {run_dir} -> {ship(run_dir, args.name)}")


if __name__ == "__main__":
    main()
