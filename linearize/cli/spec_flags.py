"""Spec flags of the command line, generated from the ConversionSpec and every registered attention
kind's options (attribute docstrings become the help), so the CLI, YAML spec files and the Python
API share one definition; a flag the chosen kind does not have is an error.

Building the parser reads ``spec_flags.json``, the flag table ``flag_table()`` derives from the
spec and the kinds, stored beside this file so that ``--help`` and argument errors answer without
importing torch (the kinds' modules do). A test keeps it equal to ``flag_table()``; after changing
a spec field, rewrite it with ``python -c "from linearize.cli.spec_flags import write_flag_table;
write_flag_table()"``.
"""

from __future__ import annotations

import argparse
import math
import functools
import json
from pathlib import Path

TABLE_FILE = Path(__file__).with_name("spec_flags.json")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parse_layers(text: str):
    if text == "all":
        return "all"
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers must be 'all' or comma-separated indices like 0,1,-1; got {text!r}") from None


def _parse_optional_int(text: str):
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def int_list_or_none(text: str) -> list[int]:
    """'none' or comma-separated integers >= 1."""
    return [] if text == "none" else positive_int_list(text)


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int_list(text: str) -> list[int]:
    """Comma-separated integers, each >= 1 (lengths, contexts)."""
    values = int_list(text)
    bad = [v for v in values if v < 1]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def non_negative_float_list(text: str) -> list[float]:
    """argparse type: comma-separated numbers >= 0."""
    values = [non_negative_float(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 0, got {text!r}")
    return values


def _number_or_list(text: str) -> float | list[float]:
    """argparse type: one number >= 0, or comma-separated numbers >= 0 (one per head)."""
    values = non_negative_float_list(text)
    return values[0] if "," not in text else values


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (weights)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


non_negative_float.__name__ = "number >= 0"


def int_at_least(minimum: int):
    """argparse type: an integer >= ``minimum`` (counts, sizes)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


# ----------------------------------------------------------------------------- the flag table

_TYPES = {
    "layers": dict(type=_parse_layers, metavar="all|I,J,..."),
    "bool": dict(type=_parse_bool, metavar="true|false"),
    "int": dict(type=int),
    "float": dict(type=float),
    "optional_int": dict(type=_parse_optional_int),
    "float_or_list": dict(type=_number_or_list, metavar="W|W1,W2,..."),
    "int_list": dict(type=int_list, metavar="I,J,..."),
    "str": dict(type=str),
}


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal right after each field) of a dataclass."""
    import ast
    import dataclasses
    import inspect

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _type_name(name: str, hint) -> str:
    if name == "layers":
        return "layers"
    for key, candidate in (("bool", bool), ("int", int), ("float", float), ("float_or_list", float | list[float]), ("optional_int", int | None), ("int_list", list[int] | None)):
        if hint == candidate:
            return key
    return "str"


def flag_table() -> dict:
    """What the parser needs from the spec and the registered kinds, derived from them (imports them):
    one entry per spec field (the attention, each kind's options, the selection; a field several kinds
    share under different docstrings gets each kind's, named), every component mode, and each kind's
    default ablation modes."""
    import dataclasses
    import typing

    from ..layers.registry import KINDS, all_modes, option_fields
    from ..spec import ConversionSpec, LayerSpec

    owners = option_fields()
    fields: dict[str, tuple[dataclasses.Field, type]] = {}
    docs: dict[str, dict[str, str]] = {}
    sources = [("", LayerSpec)] + [(name, kind.options) for name, kind in KINDS.items()] + [("", ConversionSpec)]
    for owner, cls in sources:
        field_docs, hints = _field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in ("options", "overrides"):
                continue
            fields.setdefault(f.name, (f, hints[f.name]))
            docs.setdefault(f.name, {}).setdefault(field_docs.get(f.name, ""), owner)
    flags = []
    for name, (f, hint) in fields.items():
        texts = docs[name]
        doc = next(iter(texts)) if len(texts) == 1 else " ".join(f"{owner}: {text}" for text, owner in texts.items())
        kinds = f" [attention: {', '.join(owners[name])}]" if name in owners else ""
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flags.append({"name": name, "type": _type_name(name, hint), "help": f"{doc}{kinds} (default: {default})"})
    return {
        "flags": flags,
        "modes": list(all_modes()),
        "ablation_modes": {name: list(kind.ablation_modes) for name, kind in KINDS.items()},
    }


def write_flag_table(path: str | Path = TABLE_FILE) -> None:
    """Store ``flag_table()`` where the parser reads it."""
    from ..io import atomic_write_text

    atomic_write_text(path, json.dumps(flag_table(), indent=1) + "\n")


@functools.cache
def stored_flag_table() -> dict:
    """The stored flag table (``flag_table()`` when none is stored)."""
    if TABLE_FILE.is_file():
        return json.loads(TABLE_FILE.read_text())
    return flag_table()


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per spec field (default None = keep the spec file's or the default value)."""
    group = parser.add_argument_group("conversion spec (each overrides --spec; a field the chosen attention lacks is an error)")
    for flag in stored_flag_table()["flags"]:
        group.add_argument("--" + flag["name"].replace("_", "-"), dest=f"spec_{flag['name']}", default=None,
                           help=flag["help"], **_TYPES[flag["type"]])
    group.add_argument("--spec", dest="spec_file", help="YAML/JSON spec file (flags above override its values)")


def _spec_flags(args: argparse.Namespace) -> dict:
    """The spec fields given as flags (--window 8 -> {"window": 8})."""
    return {k[5:]: v for k, v in vars(args).items() if k.startswith("spec_") and k != "spec_file" and v is not None}


def spec_from_args(args: argparse.Namespace, base: dict | None = None):
    """The ConversionSpec the flags describe, or None when no spec flag was given. The flags override
    --spec; without --spec they override ``base`` (a loaded model's own spec), if given."""
    from ..spec import ConversionSpec

    flags = _spec_flags(args)
    if not flags and not args.spec_file:
        return None
    if args.spec_file:
        return ConversionSpec.from_file(args.spec_file).replace(**flags)
    if base is not None:
        return ConversionSpec.from_dict(base).replace(**flags)
    return ConversionSpec.from_dict(flags)
