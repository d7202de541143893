"""``linearize serve``: the OpenAI-compatible server with run-time layer conversion. Its flags are
generated from ``linearize.serve.settings.ServeSettings`` (the attribute docstrings are the help)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

from ..serve.settings import ServeSettings
from .spec_flags import _field_docs


def dataclass_flags(p, cls, names: tuple[str, ...] | None = None, helps: dict[str, str] | None = None) -> None:
    """A ``--field-name`` flag per field of dataclass ``cls`` (or the ``names`` among them), typed by
    its hint, helped by its attribute docstring (or ``helps[name]``); unset flags stay None (the
    dataclass default applies)."""
    docs, hints = {**_field_docs(cls), **(helps or {})}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        hint = hints[f.name]
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint) if typing.get_origin(hint) else hint
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "" if f.name == "api_key" or default is None else f" (default: {default})"
        helped = (docs.get(f.name, "") + shown).replace("%", "%%")
        if kind is bool:  # --flag / --no-flag
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=helped)
            continue
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None, help=helped)


def from_args(cls, args):
    """An instance of dataclass ``cls`` from the flags that were given."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None})


ENGINE_FIELDS = ("model", "kv_budget", "max_level", "high_water", "low_water", "max_step_tokens", "max_running", "runner", "graphs",
                 "device")
"""The ServeSettings fields a replay uses (its engine)."""


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with run-time layer conversion under memory pressure")
    dataclass_flags(p, ServeSettings)
    p.set_defaults(func=cmd_serve)

    from ..serve.settings import ReplaySettings  # no torch: the parser stays light

    p = sub.add_parser("replay", help="replay a request trace against the engine under several policies, or against a running "
                                      "server (--url); latency report and plots")  # fmt: skip
    dataclass_flags(p, ServeSettings, ENGINE_FIELDS + CLIENT_FIELDS, REPLAY_HELP)
    dataclass_flags(p, ReplaySettings)
    p.set_defaults(func=cmd_replay)


CLIENT_FIELDS = ("served_model_name", "api_key")
"""The ServeSettings fields a replay against a server (--url) uses: the model name it asks for and the key."""
REPLAY_HELP = {
    "model": "The nested family to replay against (shipped name, directory, or random:llama2-7b, random:tiny); with --url: the "
             "family the server serves (the prompts' tokenizer and position limit).",
    "served_model_name": "With --url: the model name to ask the server for (default: the one its /v1/models lists).",
    "api_key": "With --url: the server's key, sent as 'Authorization: Bearer KEY' (default: $LINEARIZE_API_KEY, else none).",
}
"""Help of the ServeSettings flags whose meaning differs in ``linearize replay``."""


def settings_from_args(args) -> ServeSettings:
    return from_args(ServeSettings, args)


def prompt_stream(model_name: str, tokenizer, replay):
    """Token ids the replay's prompts are cut from: the corpus through the model's tokenizer, or for a
    random family (``random:NAME``) seeded random ids (its tokenizer has no real text)."""
    from ..serve.random_family import is_random, random_tokens

    if is_random(model_name):
        return random_tokens(len(tokenizer), seed=replay.seed)
    from ..data import DataConfig
    from ..eval.perplexity import heldout_tokens

    return heldout_tokens(tokenizer, DataConfig(source=replay.corpus, seq_len=1024))


def replay_requests(trace, replay, tokenizer, model_name: str, max_positions: int):
    """(the augmented requests, the prompt cap used) for a model of ``max_positions`` positions."""
    from ..serve.replay import augment, prompt_cap

    max_prompt = prompt_cap(trace, replay.max_prompt, max_positions)
    stream = prompt_stream(model_name, tokenizer, replay)
    requests = augment(trace, stream, turns_mean=replay.turns_mean, max_prompt=max(1, max_prompt), seed=replay.seed)
    return requests, max_prompt


def cmd_replay(args) -> int:
    from ..serve.replay import ReplaySettings, load_trace, replay_markdown, sweep_markdown, sweep_report, write_sweep

    replay = from_args(ReplaySettings, args)
    serve = from_args(ServeSettings, args)
    trace = load_trace(replay.trace_path())[replay.start : replay.start + replay.requests]
    if not trace:
        raise ValueError(f"start {replay.start} is past the trace's end")
    rates = replay.rate_list()
    family = None if replay.url is not None else _load_replay_family(replay, serve)
    results = {}
    for rate in rates:  # one rate: into --out itself; a sweep: OUT/rate-X/ each
        out = replay.out if len(rates) == 1 or replay.out is None else str(Path(replay.out) / f"rate-{rate:g}")
        at_rate = dataclasses.replace(replay, rate_scale=rate, rate_scales=None, out=out)
        results[rate] = replay_server(at_rate, serve, trace) if family is None else replay_in_process(at_rate, serve, trace, *family)
        print(replay_markdown(results[rate]))
    if len(rates) > 1:
        sweep = sweep_report(results)
        if replay.out is not None:
            write_sweep(sweep, replay.out)
        print(sweep_markdown(sweep))
    return 0


def _load_replay_family(replay, serve: ServeSettings):
    """(model, tokenizer, levels, device) for an in-process replay, every policy's name checked first."""
    from ..serve.server import load_family, make_engine

    model, tokenizer, levels, device = load_family(serve)
    for policy in replay.policy_list():  # fail on a bad name before replaying anything
        make_engine(model, tokenizer, levels, device, serve, policy)
    return model, tokenizer, levels, device


def replay_in_process(replay, serve: ServeSettings, trace, model, tokenizer, levels, device) -> dict:
    """``linearize replay`` without --url: the augmented requests against an engine in this process,
    once per policy in ``replay.run_list()``, at ``replay.rate_scale``."""
    from ..serve.replay import parse_slo, run_replay
    from ..serve.server import make_engine

    max_positions = getattr(model.config, "max_position_embeddings", replay.max_prompt)
    requests, max_prompt = replay_requests(trace, replay, tokenizer, serve.model, max_positions)
    settings = {"model": serve.model, "trace": replay.trace, "start": replay.start, "kv_budget": serve.kv_budget, "device": str(device),
                "max_prompt": max_prompt, "turns_mean": replay.turns_mean, "seed": replay.seed}  # fmt: skip
    return run_replay(lambda policy: make_engine(model, tokenizer, levels, device, serve, policy), requests, replay.run_list(),
                      rate_scale=replay.rate_scale, slo=parse_slo(replay.slo), timeout=replay.timeout, out_dir=replay.out,
                      settings=settings, profile_steps=replay.profile_steps, profile_from=replay.profile_from)  # fmt: skip


def replay_server(replay, serve: ServeSettings, trace) -> dict:
    """``linearize replay --url``: the same augmented requests against the server at ``replay.url``
    (one policy: the server's). ``serve.model`` names the family it serves, for the prompts' tokenizer
    and its position limit; only that tokenizer is kept (a random family's is built, no weights)."""
    from ..serve.client import HTTPReplay
    from ..serve.random_family import is_random, random_shape, word_tokenizer
    from ..serve.replay import parse_slo, report_runs

    if is_random(serve.model):
        shape = random_shape(serve.model)
        tokenizer, max_positions = word_tokenizer(shape.vocab), shape.max_positions
    else:
        from ..api import load_model

        model, tokenizer = load_model(serve.model, device="cpu")
        max_positions = getattr(model.config, "max_position_embeddings", replay.max_prompt)
        del model
    requests, max_prompt = replay_requests(trace, replay, tokenizer, serve.model, max_positions)
    client = HTTPReplay(replay.url, requests, model=serve.served_model_name, api_key=serve.api_key, rate_scale=replay.rate_scale,
                        timeout=replay.timeout)  # fmt: skip
    info = client.connect()
    policy = replay.policy_list()[0] if replay.policies else info.get("policy", "server")
    settings = {"server": replay.url, "served_model": client.model, "policy": info.get("policy", "unknown"), "model": serve.model,
                "trace": replay.trace, "start": replay.start, "max_prompt": max_prompt, "turns_mean": replay.turns_mean,
                "seed": replay.seed}  # fmt: skip
    return report_runs({policy: client.run}, n_requests=len(requests), rate_scale=replay.rate_scale, slo=parse_slo(replay.slo),
                       out_dir=replay.out, settings=settings)  # fmt: skip


def cmd_serve(args) -> int:
    from ..serve.server import run

    run(settings_from_args(args))
    return 0
