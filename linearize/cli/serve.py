"""``linearize serve``: the OpenAI-compatible server with run-time layer conversion. Its flags are
generated from ``linearize.serve.settings.ServeSettings`` (the attribute docstrings are the help)."""

from __future__ import annotations

import dataclasses
import typing

from ..serve.settings import ServeSettings
from .spec_flags import _field_docs


def dataclass_flags(p, cls, names: tuple[str, ...] | None = None) -> None:
    """A ``--field-name`` flag per field of dataclass ``cls`` (or the ``names`` among them), typed by
    its hint, helped by its attribute docstring; unset flags stay None (the dataclass default applies)."""
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        hint = hints[f.name]
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint) if typing.get_origin(hint) else hint
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "" if f.name == "api_key" or default is None else f" (default: {default})"
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                       help=(docs.get(f.name, "") + shown).replace("%", "%%"))  # fmt: skip


def from_args(cls, args):
    """An instance of dataclass ``cls`` from the flags that were given."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None})


ENGINE_FIELDS = ("model", "kv_budget", "max_level", "high_water", "low_water", "max_step_tokens", "max_running", "device")
"""The ServeSettings fields a replay uses (its engine)."""


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with run-time layer conversion under memory pressure")
    dataclass_flags(p, ServeSettings)
    p.set_defaults(func=cmd_serve)

    from ..serve.settings import ReplaySettings  # no torch: the parser stays light

    p = sub.add_parser("replay", help="replay a request trace against the engine under several policies; latency report and plots")
    dataclass_flags(p, ServeSettings, ENGINE_FIELDS)
    dataclass_flags(p, ReplaySettings)
    p.set_defaults(func=cmd_replay)


def settings_from_args(args) -> ServeSettings:
    return from_args(ServeSettings, args)


def cmd_replay(args) -> int:
    from ..data import DataConfig
    from ..eval.perplexity import heldout_tokens
    from ..serve.replay import ReplaySettings, augment, load_trace, parse_slo, replay_markdown, run_replay
    from ..serve.server import load_family, make_engine

    replay = from_args(ReplaySettings, args)
    serve = from_args(ServeSettings, args)
    trace = load_trace(replay.trace_path())[replay.start : replay.start + replay.requests]
    if not trace:
        raise ValueError(f"start {replay.start} is past the trace's end")
    model, tokenizer, levels, device = load_family(serve)
    policies = [p.strip() for p in replay.policies.split(",") if p.strip()]
    for policy in policies:  # fail on a bad name before replaying anything
        make_engine(model, tokenizer, levels, device, serve, policy)
    max_prompt = min(replay.max_prompt, getattr(model.config, "max_position_embeddings", replay.max_prompt) - max(r.output_tokens for r in trace))
    stream = heldout_tokens(tokenizer, DataConfig(source=replay.corpus, seq_len=1024))
    requests = augment(trace, stream, turns_mean=replay.turns_mean, max_prompt=max(1, max_prompt), seed=replay.seed)
    settings = {"model": serve.model, "trace": replay.trace, "start": replay.start, "kv_budget": serve.kv_budget, "device": str(device),
                "max_prompt": max_prompt, "turns_mean": replay.turns_mean, "seed": replay.seed}  # fmt: skip
    result = run_replay(lambda policy: make_engine(model, tokenizer, levels, device, serve, policy), requests, policies,
                        rate_scale=replay.rate_scale, slo=parse_slo(replay.slo), timeout=replay.timeout, out_dir=replay.out,
                        settings=settings)  # fmt: skip
    print(replay_markdown(result))
    return 0


def cmd_serve(args) -> int:
    from ..serve.server import run

    run(settings_from_args(args))
    return 0
