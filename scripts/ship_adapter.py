"""Ship a trained run's adapter inside the package: linearize/checkpoints/NAME.

    python scripts/ship_adapter.py RUN_DIR [RUN_DIR ...]

Copies RUN_DIR/adapter (new parameters, LoRA, spec, base model name) with every tensor stored as
bfloat16, which halves the repository's size; load_model upcasts to the model's dtype. The run's
summary.json goes beside it as training.json. Written atomically.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from linearize.api import ADAPTER_CONFIG, SHIPPED, _checkpoint_dir
from linearize.io import atomic_dir


def ship(run_dir: Path) -> Path:
    summary = json.loads((run_dir / "summary.json").read_text())
    name = summary["name"]
    if name not in SHIPPED:
        raise SystemExit(f"run {name!r} is not a shipped name; shipped names: {', '.join(SHIPPED)}")
    source = run_dir / "adapter"
    target = _checkpoint_dir(name)
    with atomic_dir(target) as tmp:
        for path in sorted(source.iterdir()):
            if path.suffix == ".safetensors":
                tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(path)).items()}
                save_file(tensors, str(tmp / path.name), metadata={"format": "pt"})
            elif path.name == ADAPTER_CONFIG:
                meta = json.loads(path.read_text())
                meta["storage_dtype"] = "bfloat16"
                (tmp / path.name).write_text(json.dumps(meta, indent=2, sort_keys=True))
            else:
                shutil.copy2(path, tmp / path.name)
        (tmp / "training.json").write_text(json.dumps(summary, indent=2))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    for run_dir in parser.parse_args().runs:
        print(f"shipped {run_dir} -> {ship(run_dir)}")


if __name__ == "__main__":
    main()
