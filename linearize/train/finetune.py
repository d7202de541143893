"""Stage 2 (and DSLA's chained steps): end-to-end training of the converted model.

Loss = ce_weight * next-token cross-entropy + kl_weight * T^2 KL(teacher || student) on logits at
temperature T. The teacher is the same model with LoRA disabled and every converted layer in
'teacher' mode, so it costs no second copy of the weights. Scheduled sliding-window dropout (SSD):
per epoch a drop probability and a window size; one draw per (layer, sequence, step) from a generator
seeded by (seed, rank, step, layer), so runs and resumed runs draw the same; a dropped row runs
linear attention over all positions; no rescaling.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..convert import converted_layers
from ..layers.hybrid import HybridAttention, WindowedLinearAttention
from .positions import offset_position_ids
from ..teacher import teacher_modes

SSD_SCHEDULES: dict[str, tuple[list[float], list[int]]] = {
    "a": ([0.9, 0.75, 0.5, 0.5], [32]),
    "b": ([0.5], [4, 8, 16, 32, 64]),
    "c": ([0.5], [16]),
}
"""HedgeCATs paper schedules: per-epoch drop probabilities and window sizes (the last value holds on)."""


def ssd_schedule(name: str, epoch: int) -> tuple[float, int]:
    """(drop probability, window) of ``epoch`` under schedule a | b | c."""
    if name not in SSD_SCHEDULES:
        raise ValueError(f"unknown SWA dropout schedule {name!r}; valid: {', '.join(SSD_SCHEDULES)}")
    probs, windows = SSD_SCHEDULES[name]
    return probs[min(epoch, len(probs) - 1)], windows[min(epoch, len(windows) - 1)]


def set_window(model: nn.Module, window: int) -> None:
    """Change the window of every converted layer with one (hybrid, lola; SSD schedules vary it per epoch)."""
    for module in converted_layers(model).values():
        if isinstance(module, WindowedLinearAttention):
            module.spec = module.spec.layer_replace(window=window)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def as_teacher(model: nn.Module):
    """The exact teacher: LoRA disabled and every converted layer in 'teacher' mode."""
    adapters = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
    with adapters, teacher_modes(unwrap(model)):
        yield


def kl_to_teacher(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """T^2 * KL(teacher || student) per token, averaged (float32)."""
    t = temperature
    log_p = F.log_softmax(teacher_logits.float() / t, dim=-1)
    log_q = F.log_softmax(student_logits.float() / t, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean() * t * t


def next_token_loss(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Mean cross-entropy of next-token prediction over real tokens."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


@torch.no_grad()
def heldout_loss(model: nn.Module, heldout: Tensor, *, batch_size: int, max_batches: int | None, device,
                 rank: int = 0, world_size: int = 1) -> float:
    """Mean next-token loss per token over the first ``max_batches`` (all when None) held-out batches
    of ``batch_size`` sequences (all sequences when there are fewer than one batch).

    Under data parallelism each of ``world_size`` ranks scores a disjoint share of those same
    sequences (micro-batches of batch_size / world_size, dealt round-robin) and the token sums are
    all-reduced, so every world size measures the same sequences and gets the same value.
    """
    n = max(1, heldout.shape[0] // batch_size)
    n = min(n, max_batches) if max_batches else n
    rows = heldout[: n * batch_size]
    micro = max(1, -(-min(batch_size, rows.shape[0]) // world_size))
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, tokens)
    for index, start in enumerate(range(0, rows.shape[0], micro)):
        if index % world_size != rank:
            continue
        batch = rows[start:start + micro].to(device)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        total += torch.tensor([float(next_token_loss(model, batch)) * tokens, tokens], dtype=torch.float64, device=device)
    if world_size > 1:
        torch.distributed.all_reduce(total)
    return float(total[0] / total[1])


class FinetuneObjective(nn.Module):
    """forward(batch) -> (ce/kl loss, metrics); applies SWA dropout draws when a schedule is set."""

    def __init__(self, model: nn.Module, *, ce_weight: float, kl_weight: float, kl_temperature: float,
                 swa_dropout: str = "none", seed: int = 0, rank: int = 0, position_offset: int = 0):
        super().__init__()
        self.model = model
        self.ce_weight, self.kl_weight, self.kl_temperature = ce_weight, kl_weight, kl_temperature
        self.swa_dropout, self.seed, self.rank = swa_dropout, seed, rank
        self.drop_probability = 0.0
        self.position_offset = position_offset

    def on_epoch(self, epoch: int) -> None:
        if self.swa_dropout != "none":
            self.drop_probability, window = ssd_schedule(self.swa_dropout, epoch)
            set_window(unwrap(self.model), window)

    def _draw_window_dropout(self, batch: int, step: int) -> None:
        for i, module in converted_layers(unwrap(self.model)).items():
            if not isinstance(module, HybridAttention):
                continue
            if self.drop_probability <= 0:
                module.window_dropout = None
                continue
            gen = torch.Generator().manual_seed(((self.seed * 1_000_003 + self.rank) * 1_000_033 + step) * 1_009 + i)
            module.window_dropout = torch.rand(batch, generator=gen) < self.drop_probability

    def _clear_window_dropout(self) -> None:
        for module in converted_layers(unwrap(self.model)).values():
            if isinstance(module, HybridAttention):
                module.window_dropout = None

    def forward(self, input_ids: Tensor, *, attention_mask: Tensor | None = None, step: int = 0, epoch: int = 0):
        metrics: dict[str, float] = {}
        self._draw_window_dropout(input_ids.shape[0], step)
        position_ids = offset_position_ids(*input_ids.shape, self.position_offset if self.training else 0,  # held-out: 0..T-1
                                           seed=self.seed, step=step, rank=self.rank, device=input_ids.device)
        try:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
        finally:
            self._clear_window_dropout()
        total = torch.zeros((), device=input_ids.device)
        if self.ce_weight:
            shifted = logits[:, :-1].float()
            ce = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), input_ids[:, 1:].reshape(-1))
            total = total + self.ce_weight * ce
            metrics["ce"] = float(ce.detach())
        if self.kl_weight:
            with torch.no_grad(), as_teacher(self.model):
                teacher = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
            kl = kl_to_teacher(logits, teacher, self.kl_temperature)
            total = total + self.kl_weight * kl
            metrics["kl"] = float(kl.detach())
        return total, metrics
