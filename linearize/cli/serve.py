"""``linearize serve``: the OpenAI-compatible server with run-time layer conversion."""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

DEFAULT_SERVE_MODEL = "smollm2-135m-dsla-chained"
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int | float:
    """'8GiB', '512MiB', '1.5GB', '123456' -> bytes (int); '0.5' or '50%' -> a fraction (float) of the
    device memory free at start. ValueError naming the value and the forms."""
    t = str(text).strip().lower()
    if t.endswith("%"):
        try:
            fraction = float(t[:-1]) / 100
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            raise ValueError(f"--kv-budget {text!r}: a percentage must lie in (0%, 100%]")
        return fraction
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]i?b|b)?", t)
    if m is None:
        raise ValueError(f"--kv-budget {text!r}: expected bytes ('8GiB', '512MiB', '2GB', '1000000') or a fraction of free GPU memory ('0.5', '50%')")
    value, unit = float(m.group(1)), m.group(2) or ""
    if unit == "" and value < 1 and "." in m.group(1):
        if value <= 0:
            raise ValueError(f"--kv-budget {text!r}: a fraction must lie in (0, 1]")
        return value
    n = int(value * UNITS[unit])
    if n < 1:
        raise ValueError(f"--kv-budget {text!r} is not a positive number of bytes")
    return n


def budget_bytes(text: str, device) -> int:
    """The budget in bytes: as given, or a fraction of the free memory of ``device`` (CUDA only)."""
    value = parse_bytes(text)
    if isinstance(value, int):
        return value
    import torch

    if device.type != "cuda":
        raise ValueError(f"--kv-budget {text!r}: a fraction of free memory needs a CUDA device; on {device.type} give bytes, e.g. 512MiB")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * value)


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with run-time layer conversion under memory pressure")
    p.add_argument("--model", default=DEFAULT_SERVE_MODEL,
                   help=f"a nested family (shipped name or adapter dir; default {DEFAULT_SERVE_MODEL}): its conversion order gives the levels")
    p.add_argument("--served-model-name", help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="memory",
                   help="softmax | static:K | static:P%% | length-caps | memory (default): how many layers each request runs converted")
    p.add_argument("--kv-budget", default="1GiB",
                   help="bytes all requests' KV and states may hold: 8GiB, 512MiB, ... or a fraction of free GPU memory (0.5, 50%%)")
    p.add_argument("--max-level", type=int, help="memory policy: convert at most this many layers per request (a quality cap)")
    p.add_argument("--high-water", type=float, default=0.9, help="memory policy: raise levels above this fraction of the budget")
    p.add_argument("--low-water", type=float, default=0.6, help="memory policy: new requests start unconverted below this fraction")
    p.add_argument("--max-step-tokens", type=int, default=512, help="tokens per engine step (decodes first, then prefill chunks)")
    p.add_argument("--max-running", type=int, default=64, help="requests decoding together at most")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond this get 503")
    p.add_argument("--api-key", default=os.environ.get("LINEARIZE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $LINEARIZE_API_KEY, else none)")
    p.add_argument("--device", help="cpu | cuda (default: cuda when available)")
    p.set_defaults(func=cmd_serve)


def build_server(args):
    """(app, model name, engine) from the parsed flags; every bad value is a ValueError naming it."""
    import torch

    from ..api import load_model
    from ..serve.api import Limits, create_app
    from ..serve.engine import Engine, EngineConfig
    from ..serve.levels import LevelMemory
    from ..serve.policy import parse_policy
    from ..spec import ConversionSpec

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu")
    model, tokenizer = load_model(args.model, device=str(device))
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; the server needs one")
    spec = getattr(model.config, "linearize", None)
    if not spec or not spec.get("order"):
        raise ValueError(f"model {args.model!r} is not a nested family (no conversion order); serve one such as {DEFAULT_SERVE_MODEL}")
    levels = LevelMemory.from_spec(ConversionSpec.from_dict(spec), model.config, dtype_bytes=next(model.parameters()).element_size())
    if args.max_level is not None and not 0 <= args.max_level <= levels.max_level:
        raise ValueError(f"--max-level must be in 0..{levels.max_level}, got {args.max_level}")
    policy = parse_policy(args.policy, levels, max_level=args.max_level, high=args.high_water, low=args.low_water)
    config = EngineConfig(kv_budget=budget_bytes(args.kv_budget, device), max_step_tokens=args.max_step_tokens, max_running=args.max_running)
    engine = Engine(model, levels, config, policy=policy, tokenizer=tokenizer)
    name = args.served_model_name or args.model
    limits = Limits(max_prompt_tokens=args.max_prompt_tokens, max_waiting=args.max_waiting)
    logger.info("serving %s on %s: policy %s, budget %d bytes, %d levels", name, device, policy, config.kv_budget, levels.max_level)
    return create_app(engine, tokenizer, model_name=name, api_key=args.api_key, limits=limits), name, engine


def cmd_serve(args) -> int:
    import uvicorn

    app, name, engine = build_server(args)
    print(f"serving {name} at http://{args.host}:{args.port}/v1 (policy {engine.policy}, budget {engine.config.kv_budget} bytes)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    return 0
