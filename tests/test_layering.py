"""Imports flow one way: ops -> layers -> core -> train / eval / bench -> cli (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "linearize"

LEVELS = {
    # 0: kernels and leaf utilities
    "ops": 0, "checks": 0, "io": 0, "recipes": 0,
    # 1: converted attention modules (one file per kind, the kind registry) and their cache slots
    "layers": 1, "cache": 1,
    # 2: core: the spec, conversion, loading, memory, data, teacher targets
    "__init__": 2, "spec": 2, "modeling": 2, "convert": 2, "memory": 2, "api": 2, "hub": 2, "generate": 2, "decoding": 2,
    "summary": 2, "data": 2, "teacher": 2, "runtime": 2, "names": 2,
    # 3: workflows, none of which imports another
    "train": 3, "eval": 3, "bench": 3, "serve": 3,
    # 4: the command line
    "cli": 4,
}
WORKFLOWS = 3


def unit_of(module: str) -> str:
    """'linearize.eval.plots' -> 'eval'; 'linearize' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every linearize import in ``path``, lazy ones included."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "linearize"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if not node.module:  # from . import x: each name is a module or an attribute of the package
                    out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
                    continue
            else:
                target = node.module or ""
            if target.split(".")[0] == "linearize":
                out.append((node.lineno, target))
    return out


def violations(path: Path) -> list[str]:
    source_unit = unit_of(module_name(path))
    source = LEVELS[source_unit]
    found = []
    for line, target in imported_modules(path):
        unit = unit_of(target)
        if unit not in LEVELS:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}: {unit!r} has no level in LEVELS")
            continue
        level = LEVELS[unit]
        if unit == source_unit or level < source or (level == source and source != WORKFLOWS):
            continue
        found.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({source_unit}, level {source}) imports {target} ({unit}, level {level})")
    return found


def test_every_unit_has_a_level():
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(LEVELS), f"give these a level in LEVELS: {sorted(units - set(LEVELS))}"


def test_no_module_imports_a_higher_layer():
    found = [v for path in sorted(PACKAGE.rglob("*.py")) for v in violations(path)]
    assert not found, "imports against the layering:\n" + "\n".join(found)


@pytest.mark.parametrize("source, code, bad", [
    ("eval/x.py", "from ..train.data import DataConfig\n", True),
    ("eval/x.py", "from ..data import DataConfig\n", False),
    ("bench/x.py", "def f():\n    from linearize.eval import report\n", True),
    ("layers/x.py", "from ..spec import ConversionSpec\n", True),
    ("convert.py", "from .layers.base import GENERIC_MODES\n", False),
    ("ops/x.py", "from . import states\n", False),
])
def test_the_check_catches_an_upward_import(tmp_path, monkeypatch, source, code, bad):
    root = tmp_path / "linearize"
    path = root / source
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(code)
    monkeypatch.setitem(globals(), "PACKAGE", root)
    assert bool(violations(path)) == bad
