"""Validation helpers every layer of the package shares: one wording for bad values.

Each raises the given error class (``ValueError`` by default) with a message naming the field, the bad
value and what is valid.
"""

from __future__ import annotations

import functools
import re
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


_FLOAT_12 = r"[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"
"""Floats as YAML 1.2 writes them: also ``1e-3`` (YAML 1.1, PyYAML's default, reads it as a string)."""


@functools.cache
def _yaml_loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader with YAML 1.2's floats; the integer resolver, registered first, still takes plain integers."""

    Loader.yaml_implicit_resolvers = {first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:float"]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(f"^(?:{_FLOAT_12})$"), list("-+0123456789."))
    return Loader


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` of ``text``, with ``1e-3`` read as a float as YAML 1.2 and JSON read it
    (PyYAML's YAML 1.1 resolver wants a dot, ``1.0e-3``, and otherwise returns the string)."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())  # noqa: S506  (a SafeLoader subclass)


def read_yaml(path: str | Path, what: str, error: type[ValueError] = ValueError) -> Any:
    """The YAML (or JSON) file ``path``; ``error`` saying ``what`` it is, the line and the problem
    when it is not valid YAML or not UTF-8 text."""
    import yaml

    try:
        return load_yaml(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise error(f"{what} {str(path)!r} is not UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise error(f"{what} {str(path)!r} is not valid YAML{at}: {problem}") from None
