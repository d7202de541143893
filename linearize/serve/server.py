"""Build the server from ServeSettings: load the model, size the budget, pick the policy; run it with
uvicorn (one engine) or as Ray Serve replicas (several engines behind one endpoint)."""

from __future__ import annotations

import logging

from .settings import ServeSettings, parse_bytes

logger = logging.getLogger(__name__)


def budget_bytes(text: str, device) -> int:
    """The budget in bytes: as given, or a fraction of the free memory of ``device`` (CUDA only)."""
    value = parse_bytes(text)
    if isinstance(value, int):
        return value
    import torch

    if device.type != "cuda":
        raise ValueError(f"kv-budget {text!r}: a fraction of free memory needs a CUDA device; on {device.type} give bytes, e.g. 512MiB")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * value)


def load_family(settings: ServeSettings):
    """(model, tokenizer, LevelMemory, device) of ``settings.model`` (a saved family, or ``random:NAME``:
    random weights of a named shape, ``linearize.serve.random_family``); ValueError unless it is a
    nested family. On CUDA the model runs level 0, the middle and the top level it may serve once
    before it returns (``warm_up_levels``): kernel compilation and autotuning happen here, not in
    the first requests that reach a converted level."""
    import torch

    from ..api import load_model
    from ..spec import ConversionSpec
    from .levels import LevelMemory
    from .random_family import build_random_family, is_random

    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA device is available here; use --device cpu")
    if is_random(settings.model):
        model, tokenizer = build_random_family(settings.model, device)
    else:
        model, tokenizer = load_model(settings.model, device=str(device))
    if tokenizer is None:
        raise ValueError(f"model {settings.model!r} has no tokenizer; the server needs one")
    spec = getattr(model.config, "linearize", None)
    if not spec or not spec.get("order"):
        raise ValueError(f"model {settings.model!r} is not a nested family (no conversion order); serve one such as smollm2-135m-dsla-chained")
    levels = LevelMemory.from_spec(ConversionSpec.from_dict(spec), model.config, dtype_bytes=next(model.parameters()).element_size())
    if settings.max_level is not None and not 0 <= settings.max_level <= levels.max_level:
        raise ValueError(f"max-level must be in 0..{levels.max_level}, got {settings.max_level}")
    if device.type == "cuda":
        from .replay import warm_up_levels

        warm_up_levels(model, levels, settings.max_level)
    return model, tokenizer, levels, device


def make_engine(model, tokenizer, levels, device, settings: ServeSettings, policy: str | None = None):
    """An Engine over a loaded family with ``settings``' limits and ``policy`` (default: settings.policy)."""
    from .engine import Engine, EngineConfig
    from .policy import parse_policy

    policy = parse_policy(policy or settings.policy, levels, max_level=settings.max_level, high=settings.high_water, low=settings.low_water)
    config = EngineConfig(kv_budget=budget_bytes(settings.kv_budget, device), max_step_tokens=settings.max_step_tokens,
                          max_running=settings.max_running, runner=settings.runner,
                          graphs=settings.graphs)  # fmt: skip
    return Engine(model, levels, config, policy=policy, tokenizer=tokenizer)


def build_app(settings: ServeSettings):
    """(FastAPI app, engine) for ``settings``; every bad value is a ValueError naming it."""
    from .api import Limits, create_app

    model, tokenizer, levels, device = load_family(settings)
    engine = make_engine(model, tokenizer, levels, device, settings)
    name = settings.served_model_name or settings.model
    limits = Limits(max_prompt_tokens=settings.max_prompt_tokens, max_waiting=settings.max_waiting)
    logger.info("serving %s on %s: policy %s, budget %d bytes, %d levels", name, device, engine.policy, engine.config.kv_budget, levels.max_level)
    return create_app(engine, tokenizer, model_name=name, api_key=settings.api_key, limits=limits), engine


def ray_application(settings: ServeSettings):
    """A Ray Serve application: ``settings.replicas`` replicas, each one engine with the same OpenAI
    routes (one GPU each on CUDA); Ray Serve's proxy spreads requests over them."""
    import torch
    from ray import serve

    gpus = 1 if (settings.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else 0
    def build_replica_app():  # a plain function: Ray Serve calls it once in each replica to make its app
        return build_app(settings)[0]

    ingress = serve.ingress(build_replica_app)
    deployment = serve.deployment(ingress(), name="linearize", num_replicas=settings.replicas,
                                  ray_actor_options={"num_gpus": gpus, "num_cpus": 1})  # fmt: skip
    return deployment.bind()


def run(settings: ServeSettings) -> None:
    """Serve until interrupted: uvicorn for one replica, Ray Serve for several."""
    if settings.replicas == 1:
        import uvicorn

        app, engine = build_app(settings)
        print(f"serving {settings.served_model_name or settings.model} at http://{settings.host}:{settings.port}/v1 "
              f"(policy {engine.policy}, budget {engine.config.kv_budget} bytes)", flush=True)  # fmt: skip
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
        return
    import ray
    from ray import serve

    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    print(f"serving {settings.served_model_name or settings.model} at http://{settings.host}:{settings.port}/v1 "
          f"on {settings.replicas} Ray Serve replicas", flush=True)  # fmt: skip
    serve.run(ray_application(settings), name="linearize", route_prefix="/", blocking=True)
