"""The training results table: one row per run from its summary.json (tokens and seconds per stage,
held-out loss and perplexity against the teacher)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_summaries(run_dirs: list[str | Path]) -> list[dict[str, Any]]:
    out = []
    for d in run_dirs:
        path = Path(d) / "summary.json"
        if not path.is_file():
            raise FileNotFoundError(f"no summary.json in {str(d)!r}: is it a finished run directory?")
        out.append(json.loads(path.read_text()))
    return out


def training_table(summaries: list[dict[str, Any]]) -> str:
    """Markdown: per run, tokens and seconds of each stage, held-out loss/ppl of teacher and conversion."""
    header = ("| run | stage tokens (transfer / chained / finetune) | seconds (transfer / chained / finetune) | world | "
              "teacher loss | loss | teacher ppl | ppl | ppl ratio |")
    lines = [header, "|" + "---|" * 9]
    for s in summaries:
        stages = s.get("stages", {})

        def get(key: str, stages: dict = stages) -> str:
            return " / ".join(f"{stages[n][key]:,}" if n in stages else "-" for n in ("transfer", "chained", "finetune"))

        lines.append(
            f"| {s['name']} | {get('tokens')} | {get('seconds')} | {s.get('world_size', 1)} | {s['teacher_heldout_loss']:.4f} | "
            f"{s['heldout_loss']:.4f} | {s['teacher_heldout_ppl']:.2f} | {s['heldout_ppl']:.2f} | {s['heldout_ppl'] / s['teacher_heldout_ppl']:.2f} |"
        )
    return "\n".join(lines)
