"""What the commands write: reports (markdown + JSON, atomically, with partial versions while a run
goes on) and the demo's side-by-side text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def write_report(out: str | None, stem: str, markdown: str, data: dict) -> None:
    """Write OUT/STEM.md and .json atomically; the final report replaces any partial one."""
    if out is None:
        return
    from ..io import atomic_write_text

    atomic_write_text(Path(out) / f"{stem}.md", markdown)
    atomic_write_text(Path(out) / f"{stem}.json", json.dumps(data, indent=2, default=str))
    for suffix in (".md", ".json"):
        (Path(out) / f"{stem}.partial{suffix}").unlink(missing_ok=True)
    print(f"wrote {Path(out) / stem}.md and .json")


def partial_writer(out: str | None, stem: str, render: Callable[[dict], str]) -> Callable[[dict], None] | None:
    """on_update callback writing OUT/STEM.partial.md and .json (atomically) after each finished part."""
    if out is None:
        return None
    from ..io import atomic_write_text

    def write(data: dict) -> None:
        atomic_write_text(Path(out) / f"{stem}.partial.md", "(partial: the run has not finished)\n\n" + render(data))
        atomic_write_text(Path(out) / f"{stem}.partial.json", json.dumps({**data, "partial": True}, indent=2, default=str))

    return write


def side_by_side(a: str, b: str, width: int):
    import textwrap

    la = [line for para in a.splitlines() for line in (textwrap.wrap(para, width) or [""])]
    lb = [line for para in b.splitlines() for line in (textwrap.wrap(para, width) or [""])]
    n = max(len(la), len(lb))
    return zip(la + [""] * (n - len(la)), lb + [""] * (n - len(lb)))


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
