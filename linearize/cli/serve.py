"""``linearize serve``: the OpenAI-compatible server with run-time layer conversion. Its flags are
generated from ``linearize.serve.settings.ServeSettings`` (the attribute docstrings are the help)."""

from __future__ import annotations

import dataclasses
import typing

from ..serve.settings import ServeSettings
from .spec_flags import _field_docs


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with run-time layer conversion under memory pressure")
    docs, hints = _field_docs(ServeSettings), typing.get_type_hints(ServeSettings)
    for f in dataclasses.fields(ServeSettings):
        hint = hints[f.name]
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint) if typing.get_origin(hint) else hint
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "" if f.name == "api_key" or default is None else f" (default: {default})"
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                       help=docs.get(f.name, "").replace("%", "%%") + shown)  # fmt: skip
    p.set_defaults(func=cmd_serve)


def settings_from_args(args) -> ServeSettings:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeSettings) if getattr(args, f.name, None) is not None}
    return ServeSettings(**given)


def cmd_serve(args) -> int:
    from ..serve.server import run

    run(settings_from_args(args))
    return 0
