"""Markdown of evaluation results: one suite's report, and tables of models or modes side by side."""

from __future__ import annotations

from typing import Any

from .report import headline


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(columns: dict[str, dict[str, float]], *, extra: dict[str, dict[str, float]] | None = None) -> str:
    """Rows = metrics, columns = models or modes (plus ``extra`` columns such as Delta_LA)."""
    cols = {**columns, **(extra or {})}
    metrics = list(dict.fromkeys(k for c in cols.values() for k in c))
    lines = ["| metric | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for metric in metrics:
        lines.append(f"| {metric} | " + " | ".join(_fmt(c.get(metric)) for c in cols.values()) + " |")
    return "\n".join(lines)


def to_markdown(title: str, result: dict[str, Any]) -> str:
    """A report of one suite result: headline table, perplexity rows, synthetic examples."""
    parts = [f"# {title}", "", f"suite: {result.get('suite')}, {result.get('seconds')} s", "", table({"value": headline(result)})]
    if result.get("mc_skipped"):
        parts += ["", f"Multiple-choice tasks skipped: {result['mc_skipped']}."]
    syn = result.get("synthetic", {})
    if syn:
        parts += ["", "## Synthetic tasks (string_match_all x100; passkey: exact first number)", "",
                  "| task | length | score | samples |", "|---|---|---|---|"]
        for task, by_length in syn.items():
            for length, row in by_length.items():
                parts.append(f"| {task} | {length} | {row['score']:.1f} | {row['n']} |")
    for row in result.get("perplexity", []):
        if "error" in row:
            parts += ["", f"perplexity at {row['length']}: skipped ({row['error']})"]
    return "\n".join(parts) + "\n"
