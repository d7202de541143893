"""Validation helpers every layer of the package shares: one wording for bad values.

Each raises the given error class (``ValueError`` by default) with a message naming the field, the bad
value and what is valid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_choice(name: str, value: Any, choices: tuple[str, ...], error: type[ValueError] = ValueError) -> None:
    """Raise ``error`` naming ``value`` and the valid ``choices`` unless it is one."""
    if value not in choices:
        raise error(f"unknown {name} {value!r}; valid choices: {', '.join(choices)}")


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int, *, allow_none: bool = False, error: type[ValueError] = ValueError) -> None:
    """Raise ``error`` unless ``value`` is an integer >= ``minimum`` (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if not is_int(value) or value < minimum:
        raise error(f"{name} must be an integer >= {minimum}{' or None' if allow_none else ''}, got {value!r}")


def check_text(name: str, value: str, error: type[ValueError] = ValueError) -> None:
    """Raise ``error`` unless ``value`` is text that UTF-8 can encode (command-line arguments holding
    bytes that are not UTF-8 arrive as lone surrogates); the message names the bad bytes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = value[err.start:err.end]
        try:
            shown = repr(bad.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:
            shown = ascii(bad)
        raise error(f"{name} is not valid UTF-8 text: it holds {shown} at character {err.start}") from None


def read_yaml(path: str | Path, what: str, error: type[ValueError] = ValueError) -> Any:
    """The YAML (or JSON) file ``path``; ``error`` saying ``what`` it is, the line and the problem
    when it is not valid YAML or not UTF-8 text."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise error(f"{what} {str(path)!r} is not UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise error(f"{what} {str(path)!r} is not valid YAML{at}: {problem}") from None
