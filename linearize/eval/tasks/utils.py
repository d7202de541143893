"""Loader shared by the local task YAMLs in this folder: a jsonl file (plus a labels file) from data_dir.

lm-eval calls ``custom_dataset(**metadata, **dataset_kwargs)``; ``data_dir`` comes from the task
metadata (``TaskManager(metadata={"data_dir": ...})``, or ``--metadata '{"data_dir": "..."}'`` on the
command line), ``file`` / ``labels`` from the YAML's ``dataset_kwargs``.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets


def load_local(data_dir: str | None = None, file: str | None = None, labels: str | None = None, **_) -> datasets.DatasetDict:
    if not data_dir:
        raise ValueError(
            f"local task data ({file}) needs a data directory: evaluate_tasks(..., data_dir=DIR) "
            "or, on the command line, --data_dir DIR (or --metadata '{\"data_dir\": \"DIR\"}')"
        )
    paths = [Path(data_dir).expanduser() / name for name in (file, labels) if name]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"eval data file not found: {path}")
    with open(paths[0], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if labels:  # PIQA: one label (0/1) a line in a separate file
        gold = [int(line) for line in paths[1].read_text().split()]
        if len(gold) != len(rows):
            raise ValueError(f"{paths[1]} has {len(gold)} labels for {len(rows)} rows of {paths[0]}")
        rows = [{**row, "label": g} for row, g in zip(rows, gold)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
