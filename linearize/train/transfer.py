"""Stage 1, attention transfer: every converted layer learns to reproduce its teacher layer.

Layer-local: one teacher forward (no gradient) captures each converted layer's input (the normed
hidden states, RoPE embeddings, mask) and the teacher attention's output; each converted layer then
runs on the teacher's input and its objectives compare it with the teacher. Only the conversion's
new parameters train (feature maps, window factors, gates, gamma); layers are independent.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..convert import converted_layers
from ..layers.base import ConvertedAttention, has_two_gates, key_padding_from_mask
from ..teacher import LayerInput, capture_teacher, teacher_probs
from .positions import offset_position_ids


# --- objectives: fn(module, layer input) -> loss -------------------------------------------------
def layer_output(module: ConvertedAttention, inp: LayerInput, mode: str) -> Tensor:
    """The converted layer's output (after o_proj) in ``mode``, on the teacher's input; no cache."""
    b, t, _ = inp.hidden_states.shape
    proj = module.project(inp.hidden_states, inp.position_embeddings)
    valid = key_padding_from_mask(inp.attention_mask, t)
    out, _ = module.attend_modes()[mode](proj, inp.hidden_states, valid, None)
    return module.o_proj(out.transpose(1, 2).reshape(b, t, -1).to(inp.hidden_states.dtype))


def _mse(module, inp, mode):
    return F.mse_loss(layer_output(module, inp, mode).float(), inp.teacher_output.float())


def _weights_ce(module: ConvertedAttention, inp: LayerInput, branches: str) -> Tensor:
    """Soft cross-entropy -sum_t sum_{i<=t} A_teacher[t, i] log A_student[t, i], mean over queries and heads."""
    t = inp.hidden_states.shape[1]
    proj = module.project(inp.hidden_states, inp.position_embeddings)
    valid = key_padding_from_mask(inp.attention_mask, t)
    with torch.no_grad():
        target = teacher_probs(module, proj.q, proj.k, valid)
    student = module.attention_weights(proj, valid, branches)  # (B, Hq, T, T)
    ce = -(target * torch.log(student.float().clamp_min(1e-12))).sum(-1)  # (B, Hq, T)
    if valid is not None:
        return ce.masked_select(valid[:, None, :].expand_as(ce)).mean()
    return ce.mean()


def _gate_similarity(module: ConvertedAttention, inp: LayerInput) -> Tensor:
    """Mean cosine similarity of the two gates' values per (token, head) (DSLA: pushed apart)."""
    log_h, log_r = module.log_gates(inp.hidden_states)  # (B, Hq, T, D) each
    return F.cosine_similarity(log_h.exp(), log_r.exp(), dim=-1).mean()


Objective = Callable[[ConvertedAttention, LayerInput], Tensor]
OBJECTIVE_FUNCTIONS: dict[str, Objective] = {
    "weights": lambda m, inp: _weights_ce(m, inp, "both"),
    "la_weights": lambda m, inp: _weights_ce(m, inp, "linear"),
    "la_mse": lambda m, inp: _mse(m, inp, "la_only"),
    "hybrid_mse": lambda m, inp: _mse(m, inp, "hybrid"),
    "output_mse": lambda m, inp: _mse(m, inp, "hybrid"),
}
"""Objective name -> loss of one layer (see TransferConfig.objectives)."""
NEEDS_WEIGHTS = ("weights", "la_weights")
"""Objectives that need the layer's normalised attention weights (``ConvertedAttention.has_weights``)."""
NEEDS_MODE = {"la_mse": "la_only"}
"""Objectives that run the layer in a mode of its own."""
_LAYER_LOSSES: dict[str, Objective] = {**OBJECTIVE_FUNCTIONS, "gate_cosine": _gate_similarity}


class TransferObjective(nn.Module):
    """forward(batch) -> (sum over layers of weighted objectives, per-objective metrics)."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[int],
        objectives: dict[str, float],
        gate_similarity_weight: float = 0.0,
        *,
        checkpoint_layers: bool = False,
        position_offset: int = 0,
        seed: int = 0,
        rank: int = 0,
    ):
        super().__init__()
        self.checkpoint_layers = checkpoint_layers
        self.position_offset, self.seed, self.rank = position_offset, seed, rank
        self.model = model
        self.layers = layers
        self.objectives = dict(objectives)
        self.gate_similarity_weight = gate_similarity_weight
        modules = converted_layers(model)
        for i in layers:
            module = modules[i]
            for name in self.objectives:
                if name in NEEDS_WEIGHTS and not module.has_weights:
                    raise ValueError(f"objective {name!r} needs layers with attention weights (hybrid, lola); "
                                     f"layer {i} is {module.spec.attention!r}")
                if name in NEEDS_MODE and NEEDS_MODE[name] not in module.modes():
                    raise ValueError(f"objective {name!r} needs mode {NEEDS_MODE[name]!r}; layer {i} is "
                                     f"{module.spec.attention!r} (modes: {', '.join(module.modes())})")

    def forward(self, input_ids: Tensor, *, attention_mask: Tensor | None = None, step: int = 0, epoch: int = 0):
        position_ids = offset_position_ids(*input_ids.shape, self.position_offset if self.training else 0,  # held-out: 0..T-1
                                           seed=self.seed, step=step, rank=self.rank, device=input_ids.device)
        captured = capture_teacher(self.model, input_ids, attention_mask, self.layers, position_ids)
        modules = converted_layers(self.model)
        total = torch.zeros((), device=input_ids.device)
        metrics: dict[str, float] = {}
        for i in self.layers:
            module, inp = modules[i], captured[i]
            weights = self._weights(module)
            if self.checkpoint_layers and torch.is_grad_enabled():
                # the layer's objectives are recomputed in backward: one layer's activations at a time
                values = checkpoint(self._layer_losses, module, inp, use_reentrant=False)
            else:
                values = self._layer_losses(module, inp)
            for name, value in values.items():
                total = total + weights[name] * value
                metrics[name] = metrics.get(name, 0.0) + float(value.detach()) / len(self.layers)
        return total / len(self.layers), metrics

    def _weights(self, module: ConvertedAttention) -> dict[str, float]:
        """Loss name -> weight for one layer: the objectives, plus DSLA's gate similarity."""
        if self.gate_similarity_weight and has_two_gates(module):
            return {**self.objectives, "gate_cosine": self.gate_similarity_weight}
        return self.objectives

    def _layer_losses(self, module: ConvertedAttention, inp: LayerInput) -> dict[str, Tensor]:
        """One layer's unweighted losses, by the names of _weights."""
        return {name: _LAYER_LOSSES[name](module, inp) for name in self._weights(module)}
