"""Spec flags of the command line, generated from the ConversionSpec and every registered attention
kind's options (attribute docstrings become the help), so the CLI, YAML spec files and the Python
API share one definition; a flag the chosen kind does not have is an error."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing

from ..layers.registry import KINDS, option_fields
from ..spec import ConversionSpec, LayerSpec


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal right after each field) of a dataclass."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


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
    return None if text.lower() == "none" else int(text)


def int_list_or_none(text: str) -> list[int]:
    return [] if text == "none" else int_list(text)


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _spec_flag_fields() -> list[tuple[dataclasses.Field, type, str, str]]:
    """(field, type hint, doc, which kinds have it) of every spec flag: the attention, each kind's
    options and the selection. A field several kinds share under different docstrings gets each
    kind's, named."""
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
    out = []
    for name, (f, hint) in fields.items():
        texts = docs[name]
        doc = next(iter(texts)) if len(texts) == 1 else " ".join(f"{owner}: {text}" for text, owner in texts.items())
        kinds = f" [attention: {', '.join(owners[name])}]" if name in owners else ""
        out.append((f, hint, doc, kinds))
    return out


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per spec field (default None = keep the spec file's or the default value)."""
    group = parser.add_argument_group("conversion spec (each overrides --spec; a field the chosen attention lacks is an error)")
    for f, hint, doc, kinds in _spec_flag_fields():
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict = {"default": None, "help": f"{doc}{kinds} (default: {_default(f)})"}
        if f.name == "layers":
            kwargs.update(type=_parse_layers, metavar="all|I,J,...")
        elif hint is bool:
            kwargs.update(type=_parse_bool, metavar="true|false")
        elif hint is int:
            kwargs.update(type=int)
        elif hint is float:
            kwargs.update(type=float)
        elif hint == (int | None):
            kwargs.update(type=_parse_optional_int)
        elif hint == (list[int] | None):
            kwargs.update(type=int_list, metavar="I,J,...")
        else:
            kwargs.update(type=str)
        group.add_argument(flag, dest=f"spec_{f.name}", **kwargs)
    group.add_argument("--spec", dest="spec_file", help="YAML/JSON spec file (flags above override its values)")


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _spec_flags(args: argparse.Namespace) -> dict:
    """The spec fields given as flags (--window 8 -> {"window": 8})."""
    return {k[5:]: v for k, v in vars(args).items() if k.startswith("spec_") and k != "spec_file" and v is not None}


def spec_from_args(args: argparse.Namespace, base: dict | None = None) -> ConversionSpec | None:
    """The spec the flags describe, or None when no spec flag was given. The flags override --spec;
    without --spec they override ``base`` (a loaded model's own spec), if given."""
    flags = _spec_flags(args)
    if not flags and not args.spec_file:
        return None
    if args.spec_file:
        return ConversionSpec.from_file(args.spec_file).replace(**flags)
    if base is not None:
        return ConversionSpec.from_dict(base).replace(**flags)
    return ConversionSpec.from_dict(flags)
