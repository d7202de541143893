"""Component ablation: a suite under each component mode of the converted layers, with
Delta_LA = score(hybrid) - score(swa_only): a conversion whose Delta_LA is ~0 has not learned linear
attention, whatever its total score. Each kind's default modes are its ``AttentionKind.ablation_modes``."""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..convert import kept_modes, running_layers, set_mode
from ..layers.registry import KINDS
from .report import headline, run_suite
from .suite import EvalSuite

logger = logging.getLogger(__name__)


def ablate(
    model,
    tokenizer,
    suite: EvalSuite,
    *,
    modes: list[str] | None = None,
    data_dir: str | None = None,
    device=None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The suite under each component mode of the converted layers; modes restored afterwards.

    Layers running the teacher's attention (a nested family's layers beyond ``active``) are left as
    they are: the ablation is of the layers that run converted.
    ``on_update(results)``, if given, gets {mode: suite result so far} after each finished part."""
    layers = running_layers(model)
    if not layers:
        raise ValueError("ablate needs a converted model (no converted layers found, or all of them run the teacher)")
    kinds = {m.spec.attention for m in layers.values()}
    if modes is None:
        if len(kinds) != 1:
            raise ValueError(f"converted layers of several kinds ({', '.join(sorted(kinds))}): name the modes to ablate")
        modes = KINDS[kinds.pop()].ablation_modes  # each kind's default ablation modes
    modes = list(modes)
    for mode in modes:  # every mode must exist for every converted layer: fail before any evaluation
        for m in layers.values():
            m.check_mode(mode)
    results = {}
    with kept_modes(model):
        for mode in modes:
            set_mode(model, mode, layers=sorted(layers))
            logger.info("ablation: mode %s on layers %s", mode, sorted(layers))
            def update(partial: dict[str, Any], mode: str = mode) -> None:
                if on_update is not None:
                    on_update({**results, mode: partial})

            results[mode] = run_suite(model, tokenizer, suite, data_dir=data_dir, device=device, on_update=update)
    flat = {mode: headline(r) for mode, r in results.items()}
    delta = {}
    if "hybrid" in flat and "swa_only" in flat:
        delta = {k: flat["hybrid"][k] - flat["swa_only"][k] for k in flat["hybrid"] if k in flat["swa_only"]}
    return {"modes": modes, "results": results, "table": flat, "delta_la": delta}
