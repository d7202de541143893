"""What the teacher computes inside a converted model: each converted layer's inputs and output
(one forward with every converted layer in 'teacher' mode) and its softmax attention probabilities.

Attention transfer trains on these; the diagnostic plots compare with them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .convert import converted_layers, kept_modes
from .layers.base import ConvertedAttention
from .ops.softmax import softmax_attention


@dataclass
class LayerInput:
    """What the teacher fed one attention layer, and what that layer returned."""

    hidden_states: Tensor  # (B, T, hidden)
    position_embeddings: tuple[Tensor, Tensor]
    attention_mask: Tensor | None
    teacher_output: Tensor | None  # (B, T, hidden), after o_proj; None when captured before the layer ran

    @classmethod
    def from_call(cls, args, kwargs, output=None) -> "LayerInput":
        """From an attention layer's call as a forward (pre-)hook with kwargs sees it."""
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        return cls(hidden.detach(), kwargs["position_embeddings"], kwargs.get("attention_mask"),
                   None if output is None else output[0].detach())


@contextlib.contextmanager
def teacher_modes(model: nn.Module):
    """Run every converted layer as the teacher inside the block; restore their modes after."""
    with kept_modes(model) as layers:
        for m in layers.values():
            m.mode = "teacher"
        yield


@torch.no_grad()
def capture_teacher(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, layers: list[int],
                    position_ids: Tensor | None = None) -> dict[int, LayerInput]:
    """One teacher forward; returns the inputs and teacher outputs of the given converted layers."""
    modules = converted_layers(model)
    captured: dict[int, LayerInput] = {}
    handles = []
    for i in layers:
        def hook(module, args, kwargs, output, i=i):
            captured[i] = LayerInput.from_call(args, kwargs, output)
        handles.append(modules[i].register_forward_hook(hook, with_kwargs=True))
    try:
        with teacher_modes(model):
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return captured


def teacher_probs(module: ConvertedAttention, q: Tensor, k: Tensor, valid: Tensor | None) -> Tensor:
    """(B, Hq, T, T) float32 softmax probabilities of the teacher's attention on RoPE'd q (B, Hq, T, D)
    and k (B, Hkv, T, D); ``valid`` (B, T) marks real tokens (None: no padding)."""
    b, hkv, t, _ = k.shape
    eye = torch.eye(t, device=q.device, dtype=torch.float32).expand(b, hkv, t, t)
    probs, _ = softmax_attention(q.float(), k.float(), eye, valid=valid, scale=module.scaling)
    return probs  # (B, Hq, T, T)
