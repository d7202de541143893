"""Linearized model classes for the Llama family, registered with transformers' Auto classes.

``LinearizedLlamaForCausalLM`` is ``LlamaForCausalLM`` whose config (``LinearizedLlamaConfig``,
model_type ``linearize_llama``) carries the ConversionSpec in ``config.linearize``; building the
model applies the spec, so ``save_pretrained`` / ``AutoModelForCausalLM.from_pretrained`` round-trip
a converted model with no ``trust_remote_code``. Same for Mistral and Qwen2.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from .layers.base import ConvertedAttention
from .spec import ConversionSpec, SpecError

logger = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The model's architecture is not one linearize can convert."""


class LinearizedMixin:
    """Applies ``config.linearize`` when the model is built (e.g. by from_pretrained)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if getattr(config, "linearize", None) is not None:
            apply_spec(self, ConversionSpec.from_dict(config.linearize))

    @property
    def linearize_spec(self) -> ConversionSpec:
        return ConversionSpec.from_dict(self.config.linearize)


@dataclass(frozen=True)
class Family:
    base_model_type: str
    config_cls: type
    model_cls: type
    linearized_config_cls: type
    linearized_model_cls: type


def _family(model_type: str, config_cls: type, model_cls: type) -> Family:
    name = f"linearize_{model_type}"
    lin_config = type(f"Linearized{config_cls.__name__}", (config_cls,), {"model_type": name, "__module__": __name__})
    lin_model = type(
        f"Linearized{model_cls.__name__}",
        (LinearizedMixin, model_cls),
        {"config_class": lin_config, "__module__": __name__},
    )
    AutoConfig.register(name, lin_config, exist_ok=True)
    AutoModelForCausalLM.register(lin_config, lin_model, exist_ok=True)
    return Family(model_type, config_cls, model_cls, lin_config, lin_model)


FAMILIES: dict[str, Family] = {
    f.base_model_type: f
    for f in (
        _family("llama", LlamaConfig, LlamaForCausalLM),
        _family("mistral", MistralConfig, MistralForCausalLM),
        _family("qwen2", Qwen2Config, Qwen2ForCausalLM),
    )
}
"""Supported base architectures (SmolLM2 is a Llama)."""

LinearizedLlamaConfig = FAMILIES["llama"].linearized_config_cls
LinearizedLlamaForCausalLM = FAMILIES["llama"].linearized_model_cls


def family_of(model: PreTrainedModel) -> Family:
    model_type = model.config.model_type.removeprefix("linearize_")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {model.config.model_type!r}; supported: {', '.join(FAMILIES)} (Llama family)"
        )
    return FAMILIES[model_type]


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    return model.model.layers


def apply_spec(model: PreTrainedModel, spec: ConversionSpec) -> None:
    """Swap the attention of the layers ``spec`` names; restore the teacher's elsewhere.

    Layers already converted keep their trained new parameters where the new module has the same
    names and shapes (e.g. a trained hybrid read as LoLA).
    """
    family = family_of(model)
    layers = decoder_layers(model)
    n = len(layers)
    chosen = spec.resolve_layers(n)
    inactive = set(spec.inactive_layers(n))
    for i, layer in enumerate(layers):
        current = layer.self_attn
        teacher = current.teacher if isinstance(current, ConvertedAttention) else current
        layer_spec = spec.layer_spec(i, n) if i in chosen else None
        if layer_spec is None:
            layer.self_attn = teacher
            continue
        new = layer_spec.kind.layer(teacher, layer_spec, i, model.config)
        new.to(device=teacher.q_proj.weight.device)
        if isinstance(current, ConvertedAttention):
            _carry_parameters(current, new)
        if i in inactive:
            new.mode = "teacher"
        layer.self_attn = new
    model.config.__class__ = family.linearized_config_cls
    model.config.linearize = spec.to_dict()
    model.__class__ = family.linearized_model_cls


def _carry_parameters(old: nn.Module, new: nn.Module) -> None:
    old_state = old.state_dict()
    new_state = new.state_dict()
    carried = {k: v for k, v in old_state.items() if k in new_state and new_state[k].shape == v.shape}
    new.load_state_dict(carried, strict=False)


def check_spec(model: PreTrainedModel, spec: ConversionSpec) -> None:
    """Validate a spec against a model without changing it (layer indices, head sizes)."""
    family_of(model)
    layers = decoder_layers(model)
    n = len(layers)
    chosen = spec.resolve_layers(n)
    for i in chosen:
        spec.layer_spec(i, n).check_head_dim(layers[i].self_attn.head_dim)
    spec.inactive_layers(n)
    extra = sorted({i % n for i in spec.overrides} - set(chosen))
    if extra:
        raise SpecError(f"overrides name layer(s) {extra} that the spec does not convert (layers: {spec.layers})")
