"""Layer sensitivity (DSLA): which layers can be converted first.

Two measures per decoder layer:

- ``attention_entropy``: the cheap proxy. Shannon entropy H = -sum_i A_i log A_i of the last real
  query's softmax attention over keys (the teacher's attention, recomputed from the layer's q and k),
  averaged over heads and sequences. One forward pass.
- ``loss_increase``: the measured sensitivity. Held-out next-token loss with only that layer
  converted (freshly, untrained) minus the teacher's loss. One forward pass per layer.
  ``trained_loss_increase`` measures the same with the layers' current (distilled) parameters.

- ``recall_probes``: what held-out loss misses. Short held-out text says little about whether a layer
  carries long-range retrieval (a layer whose conversion costs 0.001 nats on wiki can still erase
  every needle). A recall probe is a passage, a gap of other text far longer than the window, then
  the same passage again, scored on the repeat only: the teacher copies it (low loss), a model that
  lost the passage must predict it afresh. ``trained_loss_increase`` on probes gives each layer's
  recall increase (retrieval heads in the sense of Wu et al. 2024, "Retrieval Head Mechanistically
  Explains Long-Context Factuality", which find them by copy-paste behaviour).

``sensitivity_report`` puts them side by side with their Spearman rank correlation and the
conversion ``order``: lowest score first, as DSLA converts low-sensitivity layers first, where the
score is the held-out loss increase plus ``recall_weight`` times the (positive part of the) recall
increase (weight 0: the paper's measure alone).

A batch is a LongTensor of input ids (B, T) or a mapping with ``input_ids`` and optionally
``attention_mask`` (1 = real token, left or right padding), ``position_ids`` (derived from the mask
when absent: real tokens count from 0) and ``labels`` (-100 = ignored; default: the input ids).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import rotate_half

from ..convert import convert, new_parameters
from ..io import atomic_write_text, save_png
from ..layers.base import ConvertedAttention
from ..modeling import decoder_layers
from ..ops.common import gqa_groups, repeat_kv
from ..spec import ConversionSpec, SpecError

logger = logging.getLogger(__name__)

Batch = Tensor | Mapping[str, Tensor]


# ----------------------------------------------------------------------------- batches


def _inputs(batch: Batch, device: torch.device) -> dict[str, Tensor]:
    """input_ids, attention_mask (long, 1 = real) and position_ids on ``device``; plus labels if given."""
    batch = {"input_ids": batch} if isinstance(batch, Tensor) else dict(batch)
    ids = batch["input_ids"].to(device)
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.to(device).long()
    positions = batch.get("position_ids")
    positions = (mask.cumsum(-1) - 1).clamp(min=0) if positions is None else positions.to(device)
    out = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    if batch.get("labels") is not None:
        out["labels"] = batch["labels"].to(device)
    return out


def _forward(model: PreTrainedModel, inputs: dict[str, Tensor], **kwargs):
    return model(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
        position_ids=inputs["position_ids"], use_cache=False, **kwargs,
    )


# ----------------------------------------------------------------------------- entropy proxy


def _teacher(attn: torch.nn.Module) -> torch.nn.Module:
    return attn.teacher if isinstance(attn, ConvertedAttention) else attn


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, D), cos/sin (B, T, D): the teacher's rotary embedding (HF Llama convention)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def last_query_entropy(
    attn: torch.nn.Module,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    valid: Tensor,
    layer_mask: Tensor | None = None,
) -> Tensor:
    """(B,) entropy of the teacher's softmax attention of each row's last real query, mean over heads.

    ``attn`` is a decoder layer's self_attn (its teacher is used when it is converted);
    ``hidden_states`` (B, T, hidden) its input; ``valid`` (B, T) bool real tokens; ``layer_mask`` the
    mask the model passed to the layer: when it is a 4D tensor its row of the last real query further
    restricts the keys (e.g. a sliding-window teacher). Rows without a real token give NaN.
    """
    teacher = _teacher(attn)
    b, t, _ = hidden_states.shape
    d = teacher.head_dim
    rows = torch.arange(b, device=valid.device)
    last = t - 1 - valid.flip(-1).int().argmax(-1)  # (B,) index of the last real token
    cos, sin = position_embeddings
    x_last = hidden_states[rows, last][:, None]  # (B, 1, hidden)
    q = teacher.q_proj(x_last).view(b, 1, -1, d).transpose(1, 2)  # (B, Hq, 1, D)
    k = teacher.k_proj(hidden_states).view(b, t, -1, d).transpose(1, 2)  # (B, Hkv, T, D)
    q = _rope(q, cos[rows, last][:, None], sin[rows, last][:, None])
    k = repeat_kv(_rope(k, cos, sin), gqa_groups(q, k))  # (B, Hq, T, D)
    dtype = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)).squeeze(-2) * teacher.scaling  # (B, Hq, T)
    allowed = valid & (torch.arange(t, device=valid.device) <= last[:, None])  # causal + padding (B, T)
    if isinstance(layer_mask, Tensor) and layer_mask.dim() == 4:
        row = layer_mask.expand(b, -1, -1, -1)[rows, 0, last, -t:]  # (B, T)
        allowed = allowed & (row if row.dtype == torch.bool else row == 0)
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)  # (B, Hq, T)
    entropy = torch.special.entr(probs).sum(-1).mean(-1)  # (B,)
    return entropy.masked_fill(~valid.any(-1), float("nan"))


@torch.no_grad()
def attention_entropy(model: PreTrainedModel, batches: Iterable[Batch]) -> list[float]:
    """Per decoder layer: mean over heads and sequences of the entropy of the last real query's
    teacher softmax attention (nats). Each layer's attention input is captured by a forward pre-hook
    during one forward of the model per batch; converted layers are read through their teacher."""
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    sums = [0.0] * len(layers)
    count = 0
    state: dict[str, Tensor] = {}

    def hook(i: int):
        def pre_hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            pos = kwargs.get("position_embeddings")
            if pos is None:
                raise ValueError(f"layer {i} got no position_embeddings: unsupported model forward")
            h = last_query_entropy(module, x, pos, state["valid"], kwargs.get("attention_mask"))
            sums[i] += h.nan_to_num(0.0).sum().item()

        return pre_hook

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for batch in tqdm(batches, desc="attention entropy", leave=False):
            inputs = _inputs(batch, device)
            state["valid"] = inputs["attention_mask"].bool()
            count += int(state["valid"].any(-1).sum())
            _forward(model, inputs, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    if count == 0:
        raise ValueError("attention_entropy needs at least one sequence with a real token")
    return [s / count for s in sums]


# ----------------------------------------------------------------------------- measured sensitivity


@torch.no_grad()
def mean_next_token_loss(model: PreTrainedModel, batches: Iterable[Batch]) -> float:
    """Mean next-token cross-entropy (nats) over every real target token of ``batches`` whose input
    token is real too (labels of -100 skipped); one number over all batches."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        inputs = _inputs(batch, device)
        logits = _forward(model, inputs).logits[:, :-1].float()  # (B, T-1, V)
        mask = inputs["attention_mask"].bool()
        target = inputs.get("labels", inputs["input_ids"])[:, 1:]  # (B, T-1)
        keep = mask[:, :-1] & mask[:, 1:] & (target != -100)
        total += F.cross_entropy(logits[keep], target[keep], reduction="sum").item()
        count += int(keep.sum())
    if count == 0:
        raise ValueError("mean_next_token_loss needs at least one real target token")
    return total / count


def _only_layer(spec: ConversionSpec, layers: list[int], n: int) -> ConversionSpec:
    """``spec`` restricted to ``layers``: its per-layer fields and overrides for those layers kept, every
    other layer-selection field (e.g. a nested family's order) back to its default."""
    overrides = {i: spec.overrides[j] for i in layers for j in (i, i - n) if j in spec.overrides}
    return spec.replace(layers=layers, overrides=overrides, order=None, active=None)


class _ConversionSnapshot:
    """The model's conversion state (attention modules, their modes and new parameters, config spec,
    classes, train/eval flags), put back exactly by ``restore``: the same module and Parameter objects,
    so optimizers that hold them stay valid."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.attn = [layer.self_attn for layer in decoder_layers(model)]
        self.values = {name: p.detach().clone() for name, p in new_parameters(model).items()}
        self.had_spec = hasattr(model.config, "linearize")
        self.spec = copy.deepcopy(getattr(model.config, "linearize", None))
        self.classes = (model.__class__, model.config.__class__)
        self.training = [m.training for m in model.modules()]

    @torch.no_grad()
    def restore(self) -> None:
        model = self.model
        for layer, attn in zip(decoder_layers(model), self.attn):
            layer.self_attn = attn
        model.__class__, model.config.__class__ = self.classes
        if self.had_spec:
            model.config.linearize = copy.deepcopy(self.spec)
        elif hasattr(model.config, "linearize"):
            del model.config.linearize
        for name, p in new_parameters(model).items():  # values too, should anything have written them
            p.copy_(self.values[name])
        for m, training in zip(model.modules(), self.training):
            m.training = training


@torch.no_grad()
def loss_increase(
    model: PreTrainedModel,
    spec_for_layer: ConversionSpec | dict[str, Any],
    batches: Iterable[Batch],
    layers: Sequence[int] | None = None,
) -> list[float]:
    """Per layer of ``layers`` (default: all, in order): held-out next-token loss with only that layer
    converted by ``spec_for_layer`` minus the teacher's loss (no layer converted).

    Each layer is measured with a fresh conversion (the spec's untrained initialisation, reproducible:
    seeded by the layer index), whatever the model holds. The model comes back exactly as it was:
    same attention modules, modes, trained new parameters and config spec.
    """
    spec = ConversionSpec.coerce(spec_for_layer)
    batches = list(batches)
    n = len(decoder_layers(model))
    targets = list(range(n)) if layers is None else [int(i) for i in layers]
    if not all(-n <= i < n for i in targets):
        raise SpecError(f"layer indices {targets} out of range: the model has {n} layers")
    targets = [i % n for i in targets]
    snapshot = _ConversionSnapshot(model)
    try:
        model.eval()
        convert(model, _only_layer(spec, [], n))
        teacher = mean_next_token_loss(model, batches)
        logger.info("teacher next-token loss %.4f", teacher)
        out = []
        for i in tqdm(targets, desc=f"loss increase ({spec.attention})", leave=False):
            convert(model, _only_layer(spec, [], n))  # fresh: never carry parameters into layer i
            convert(model, _only_layer(spec, [i], n)).eval()
            out.append(mean_next_token_loss(model, batches) - teacher)
            logger.info("layer %d: loss increase %.4f", i, out[-1])
    finally:
        snapshot.restore()
    return out


def recall_probes(rows: Tensor, *, passage: int = 64, batch_size: int = 8, max_probes: int | None = None) -> list[dict[str, Tensor]]:
    """Copy probes built from packed token rows (R, T), each as long as a row: row r's first
    ``passage`` tokens, then ``T - 2 * passage`` tokens of row r + 1 (the gap), then the same passage
    again. Labels (-100 = ignored) keep only the repeat's tokens after its first (the first is not a
    copy: nothing before it says the passage starts again), so the loss is the loss of recalling a
    passage read ``T - passage`` tokens earlier. Returns batches of ``batch_size`` probes for
    ``mean_next_token_loss`` / ``trained_loss_increase`` (R - 1 probes, or ``max_probes``)."""
    if not isinstance(rows, Tensor) or rows.dim() != 2 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"recall_probes needs a (rows, tokens) integer tensor, got {getattr(rows, 'shape', type(rows))}")
    r, t = rows.shape
    if not isinstance(passage, int) or isinstance(passage, bool) or passage < 2 or t - 2 * passage < 1:
        raise ValueError(f"recall probe passage must be an integer in 2..{max((t - 1) // 2, 1)} for rows of {t} tokens, got {passage!r}")
    if r < 2:
        raise ValueError(f"recall_probes needs at least 2 rows (a passage and a gap from another), got {r}")
    n = r - 1 if max_probes is None else min(r - 1, int(max_probes))
    gap = t - 2 * passage
    text = rows[:n, :passage]
    ids = torch.cat([text, rows[1:n + 1, :gap], text], dim=1)  # (n, T)
    labels = torch.full_like(ids, -100)
    labels[:, t - passage + 1:] = ids[:, t - passage + 1:]
    return [{"input_ids": ids[i:i + batch_size], "labels": labels[i:i + batch_size]} for i in range(0, n, batch_size)]


# ----------------------------------------------------------------------------- report and order


def trained_loss_increase(model: PreTrainedModel, batches: Iterable[Batch]) -> dict[int, float]:
    """Per converted layer, with its CURRENT (e.g. distilled) parameters: held-out loss with only that
    layer running converted (all others in 'teacher' mode) minus the teacher's loss. Modes restored."""
    from ..convert import kept_modes

    batches = list(batches)
    with kept_modes(model) as modules:
        for m in modules.values():
            m.mode = "teacher"
        teacher = mean_next_token_loss(model, batches)
        out = {}
        for i in tqdm(sorted(modules), desc="layer sensitivity", leave=False):
            modules[i].mode = "hybrid"
            out[i] = mean_next_token_loss(model, batches) - teacher
            modules[i].mode = "teacher"
        return out


def trained_sensitivity(model: PreTrainedModel, batches: Iterable[Batch], probes: Iterable[Batch] | None = None,
                        recall_weight: float = 0.0) -> dict[str, Any]:
    """``sensitivity_report`` of a converted model's own (trained) layers: attention entropy and
    ``trained_loss_increase`` on ``batches``, and with ``probes`` (``recall_probes``) each layer's
    recall increase, weighted by ``recall_weight`` in the order."""
    batches = list(batches)
    entropy = attention_entropy(model, batches)
    increase = trained_loss_increase(model, batches)
    layers = sorted(increase)
    recall = None
    if probes is not None:
        by_layer = trained_loss_increase(model, probes)
        recall = [by_layer[i] for i in layers]
    return sensitivity_report([entropy[i] for i in layers], [increase[i] for i in layers], layers,
                              recall=recall, recall_weight=recall_weight)


def _average_ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda k: values[k])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in order[start : end + 1]:
            ranks[k] = (start + end) / 2 + 1  # ties share the mean of their ranks
        start = end + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman rank correlation (Pearson correlation of average ranks, so ties are handled);
    None when undefined (fewer than 2 points or a constant input)."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs vectors of equal length, got {len(x)} and {len(y)}")
    rx, ry = _average_ranks(x), _average_ranks(y)
    if len(rx) < 2:
        return None
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return None if sx == 0 or sy == 0 else cov / (sx * sy)


def sensitivity_report(
    entropy: Sequence[float], increase: Sequence[float], layers: Sequence[int] | None = None,
    recall: Sequence[float] | None = None, recall_weight: float = 0.0,
) -> dict[str, Any]:
    """Rows {layer, entropy, loss_increase[, recall_increase, score]}, the Spearman correlation of
    entropy and loss increase, and ``order``: the layers by score ascending (least sensitive first;
    ties: lower layer index first). score = loss increase + ``recall_weight`` * max(recall increase, 0)
    (a layer cannot earn an earlier place by improving recall; noise below zero counts as none).
    ``entropy[k]``, ``increase[k]`` and ``recall[k]`` belong to layer ``layers[k]`` (default: layer k)."""
    layers = list(range(len(increase))) if layers is None else [int(i) for i in layers]
    if not len(entropy) == len(increase) == len(layers):
        raise ValueError(f"entropy ({len(entropy)}), increase ({len(increase)}) and layers ({len(layers)}) differ in length")
    if recall is not None and len(recall) != len(layers):
        raise ValueError(f"recall ({len(recall)}) and layers ({len(layers)}) differ in length")
    if not isinstance(recall_weight, (int, float)) or isinstance(recall_weight, bool) or not math.isfinite(recall_weight) or recall_weight < 0:
        raise ValueError(f"recall_weight must be a finite number >= 0, got {recall_weight!r}")
    if recall_weight > 0 and recall is None:
        raise ValueError(f"recall_weight {recall_weight} needs the recall increases (recall=...)")
    rows = []
    for k, (i, e, d) in enumerate(zip(layers, entropy, increase)):
        row = {"layer": i, "entropy": float(e), "loss_increase": float(d)}
        if recall is not None:
            row["recall_increase"] = float(recall[k])
            row["score"] = float(d) + recall_weight * max(float(recall[k]), 0.0)
        rows.append(row)
    order = [r["layer"] for r in sorted(rows, key=lambda r: (r.get("score", r["loss_increase"]), r["layer"]))]
    report = {"layers": rows, "spearman": spearman(entropy, increase), "order": order}
    if recall is not None:
        report["recall_weight"] = float(recall_weight)
    return report


def save_order(report: dict[str, Any], path: str | Path) -> None:
    """Write the report (rows, correlation, order) as JSON, atomically."""
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")


def load_order(path: str | Path) -> list[int]:
    """The layer conversion order saved by ``save_order``."""
    data = json.loads(Path(path).read_text())
    order = data.get("order") if isinstance(data, dict) else None
    if not isinstance(order, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in order):
        raise ValueError(f"{str(path)!r} holds no layer order (a JSON object with an 'order' list of layer indices)")
    return order


def plot_sensitivity(report: dict[str, Any], path: str | Path) -> None:
    """PNG scatter of entropy vs measured loss increase, one labelled point per layer; with recall
    increases, a second panel of each layer's held-out and recall increases in conversion order
    (matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    rows = report["layers"]
    recall = all("recall_increase" in r for r in rows)
    fig = Figure(figsize=(12 if recall else 6, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if recall else 1, 1)
    ax.scatter([r["entropy"] for r in rows], [r["loss_increase"] for r in rows])
    for r in rows:
        ax.annotate(str(r["layer"]), (r["entropy"], r["loss_increase"]), textcoords="offset points", xytext=(3, 3), fontsize=8)
    rho = report.get("spearman")
    ax.set(
        xlabel="last-query attention entropy (nats)", ylabel="loss increase, layer converted alone (nats)",
        title=f"layer sensitivity (Spearman {'n/a' if rho is None else f'{rho:.2f}'})",
    )
    if recall:
        by_layer = {r["layer"]: r for r in rows}
        order = report["order"]
        x = list(range(len(order)))
        bx = fig.add_subplot(1, 2, 2)
        bx.bar([i - 0.2 for i in x], [by_layer[i]["loss_increase"] for i in order], width=0.4, label="held-out loss increase")
        bx.bar([i + 0.2 for i in x], [by_layer[i]["recall_increase"] for i in order], width=0.4, label="recall-probe loss increase")
        bx.set_xticks(x, [str(i) for i in order], fontsize=7)
        bx.set(xlabel="layer, in conversion order (least sensitive first)", ylabel="nats",
               title=f"held-out + {report.get('recall_weight', 0):g} x recall")
        bx.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


__all__ = [
    "attention_entropy",
    "last_query_entropy",
    "load_order",
    "loss_increase",
    "mean_next_token_loss",
    "plot_sensitivity",
    "recall_probes",
    "save_order",
    "sensitivity_report",
    "spearman",
    "trained_sensitivity",
]
