"""Validation helpers every layer of the package shares: one wording for bad values.

Each raises the given error class (``ValueError`` by default) with a message naming the field, the bad
value and what is valid.
"""

from __future__ import annotations

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
