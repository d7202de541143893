"""convert(), set_mode() and what a conversion holds in memory."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from .layers.base import GENERIC_MODES, ConvertedAttention
from .layers.registry import all_modes
from .modeling import apply_spec, check_spec, decoder_layers
from .spec import SELECTION_FIELDS, ConversionSpec, SpecError

logger = logging.getLogger(__name__)

MODES = all_modes()
"""Component modes of every registered kind (``AttentionKind.modes``: hybrid is the normal one;
hybrid's swa_only, la_only; LoLA's no_state, no_sparse, window_only; DSLA's history_only,
recent_only) and the generic ones every layer has: sinks_only (softmax over the first 8 tokens),
none (attention output zeroed), teacher (the original softmax attention with plain KV; the new
parameters stay, inactive). Each layer supports its kind's modes and the generic ones (see set_mode)."""


def convert(model: PreTrainedModel, spec: ConversionSpec | dict[str, Any] | None = None) -> PreTrainedModel:
    """Swap the attention of the layers ``spec`` chooses, in place; returns the model.

    The teacher's q/k/v/o projections are reused (not copied). The spec is stored in
    ``model.config.linearize`` so ``save_pretrained`` keeps it. Converting an already converted model
    applies the new spec (layers left out get the teacher's attention back; new parameters of
    layers that stay converted are kept where names and shapes match).
    """
    spec = ConversionSpec.coerce(spec)
    check_spec(model, spec)
    apply_spec(model, spec)
    logger.info("converted layers %s to %s attention", spec.resolve_layers(len(decoder_layers(model))), spec.attention)
    return model


def converted_layers(model: PreTrainedModel) -> dict[int, ConvertedAttention]:
    return {i: layer.self_attn for i, layer in enumerate(decoder_layers(model)) if isinstance(layer.self_attn, ConvertedAttention)}


def running_layers(model: PreTrainedModel) -> dict[int, ConvertedAttention]:
    """Converted layers that run converted: all but a nested family's layers beyond ``active``, which
    run the teacher's attention (and hold its KV cache)."""
    return {i: m for i, m in converted_layers(model).items() if m.mode != "teacher"}


def set_mode(model: PreTrainedModel, mode: str, layers: Sequence[int] | None = None) -> PreTrainedModel:
    """Switch the component mode of converted layers (all of them when ``layers`` is None)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    converted = converted_layers(model)
    if not converted:
        raise SpecError(f"mode {mode!r} applies to converted layers, and this model has none: convert it first (e.g. spec flags)")
    n = len(decoder_layers(model))
    targets = sorted(converted) if layers is None else [int(i) for i in layers]
    for i in targets:
        if not -n <= i < n:
            raise SpecError(f"layer index {i} out of range: the model has {n} layers")
        if i % n not in converted:
            raise SpecError(f"layer {i} is not converted; converted layers: {sorted(converted)}")
    for i in targets:
        converted[i % n].set_mode(mode)
    return model


def set_active(model: PreTrainedModel, active: int) -> PreTrainedModel:
    """Choose how many layers of a nested family's order run converted (the rest run the teacher)."""
    spec = ConversionSpec.from_dict({**model.config.linearize, "active": active})
    n = len(decoder_layers(model))
    inactive = set(spec.inactive_layers(n))
    for i, module in converted_layers(model).items():
        if i in inactive:
            module.mode = "teacher"
        elif module.mode == "teacher":
            module.mode = "hybrid"
    model.config.linearize = spec.to_dict()
    return model


@contextlib.contextmanager
def kept_modes(model: PreTrainedModel) -> Iterator[dict[int, ConvertedAttention]]:
    """Yields the converted layers {index: module}; their modes are put back after the block."""
    layers = converted_layers(model)
    saved = {i: m.mode for i, m in layers.items()}
    try:
        yield layers
    finally:
        for i, m in layers.items():
            m.mode = saved[i]


@contextlib.contextmanager
def inference_form(model: PreTrainedModel, changes: dict[str, Any] | None = None) -> Iterator[dict[int, ConvertedAttention]]:
    """Inside the block the converted layers run as they will ship: mode 'hybrid' (layers in mode
    'teacher', a nested family's inactive ones, stay so) with the flat option ``changes`` (a recipe's
    ``inference_spec``, e.g. ``{"overlap": True}``) applied to each layer's spec in place, so the
    parameters being trained are the ones evaluated. Modes and specs are put back after the block.
    Changes of attention kind or of layer selection cannot be made in place: SpecError."""
    changes = dict(changes or {})
    structural = sorted(k for k in changes if k in ("attention", *SELECTION_FIELDS))
    if structural:
        raise SpecError(f"inference_form changes layer options in place; {structural} change which module runs and need "
                        "apply_spec (a reload), not an in-place change")
    layers = converted_layers(model)
    saved = {i: (m.mode, m.spec) for i, m in layers.items()}
    try:
        for m in layers.values():
            if changes:
                m.spec = m.spec.layer_replace(**changes)
            if m.mode != "teacher":
                m.set_mode("hybrid")
        yield layers
    finally:
        for i, m in layers.items():
            m.mode, m.spec = saved[i]


def layer_modes(model: PreTrainedModel) -> dict[int, str]:
    return {i: m.mode for i, m in converted_layers(model).items()}


def new_parameters(model: PreTrainedModel) -> dict[str, torch.nn.Parameter]:
    """The parameters a conversion adds (feature maps, window factors, gates, gamma), by name."""
    teacher = {id(p) for layer in decoder_layers(model) for p in _teacher_params(layer.self_attn)}
    return {
        name: p
        for name, p in model.named_parameters()
        if ".self_attn." in name and id(p) not in teacher and "lora_" not in name
    }


def _teacher_params(attn) -> list[torch.nn.Parameter]:
    teacher = attn.teacher if isinstance(attn, ConvertedAttention) else attn
    return list(teacher.parameters())


__all__ = ["convert", "set_mode", "set_active", "layer_modes", "kept_modes", "inference_form", "converted_layers", "running_layers", "new_parameters", "MODES", "GENERIC_MODES"]
