"""Constants of the ``linearize.ops`` modules set for one run: the tile sizes, warps, stages and paths
the Triton kernels read at launch (``fused_lola.ONE_KERNEL_ROWS``, ``fused_lola.STAGES``, ...).

``linearize bench --kernel-option MODULE.NAME=VALUE`` and ``scripts/kernel_resources.py --set`` use
``apply``; the benchmarks record ``applied()`` beside their library versions, so a result says which
settings produced it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import logging
import re
from collections.abc import Iterable, Iterator

logger = logging.getLogger(__name__)

_APPLIED: dict[str, object] = {}


def _constants(module) -> list[str]:
    """The module's own scalar constants (assigned at its top level, not imported)."""
    own = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*(?::[^=]*)?=", inspect.getsource(module), re.MULTILINE))
    return sorted(n for n, v in vars(module).items() if n in own and isinstance(v, (bool, int, float, tuple, type(None))))


def apply(items: Iterable[str]) -> dict[str, object]:
    """Set each ``MODULE.NAME=VALUE`` (a constant of ``linearize.ops.MODULE``, a Python literal of the
    constant's type; None where the constant is declared ``int | None``) and return what was set. Raises ValueError
    naming the bad item and the valid choices; nothing is set unless every item is valid."""
    return _set(_staged(items))


def check(items: Iterable[str]) -> None:
    """Raise ValueError as ``apply`` would for the first bad item; set nothing."""
    _staged(items)


@contextlib.contextmanager
def applied_for(items: Iterable[str]) -> Iterator[dict[str, object]]:
    """``apply(items)`` for the ``with`` block (yielding what was set), then every constant set back to
    its value before and ``applied()`` as it was: one run's variants one after another."""
    staged = _staged(items)
    before = [(module, attr, getattr(module, attr)) for module, attr, _, _ in staged]
    recorded = dict(_APPLIED)
    try:
        yield _set(staged)
    finally:
        for module, attr, value in reversed(before):
            setattr(module, attr, value)
        _APPLIED.clear()
        _APPLIED.update(recorded)


def _set(staged: list[tuple[object, str, str, object]]) -> dict[str, object]:
    """Set each staged constant and record it; what was set (name -> value)."""
    for module, attr, name, value in staged:
        setattr(module, attr, value)
        _APPLIED[name] = value
        logger.info("kernel option %s = %r", name, value)
    return {name: value for _, _, name, value in staged}


def _staged(items: Iterable[str]) -> list[tuple[object, str, str, object]]:
    """(module, constant, MODULE.NAME, value) of each item, checked as ``apply`` documents."""
    staged = []
    for item in items:
        name, eq, text = item.partition("=")
        module_name, _, attr = name.rpartition(".")
        usage = f"kernel option {item!r}: expected MODULE.NAME=VALUE with NAME a constant of linearize.ops.MODULE and VALUE a literal"
        if not eq or not module_name or "." in module_name or not attr:
            raise ValueError(usage)
        try:
            module = importlib.import_module(f"linearize.ops.{module_name}")
        except ImportError:
            raise ValueError(f"{usage}; no module linearize.ops.{module_name}") from None
        choices = _constants(module)
        if attr not in choices:
            raise ValueError(f"{usage}; {module_name}'s constants: {', '.join(choices)}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"{usage}; {text!r} is not a literal") from None
        old = getattr(module, attr)
        optional = old is None or "None" in str(getattr(module, "__annotations__", {}).get(attr, ""))  # declared `X: int | None`
        fits = type(value) is type(old) or (value is None and optional) or (old is None and type(value) is int)
        if not fits:
            raise ValueError(f"{usage}; {name} is {type(old).__name__} ({old!r}), got {type(value).__name__}")
        staged.append((module, attr, name, value))
    return staged


def applied() -> dict[str, object]:
    """The kernel options set in this process so far (name -> value)."""
    return dict(_APPLIED)
