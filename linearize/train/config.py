"""Training configuration: one dataclass tree feeding recipes (YAML), the CLI and the Python API.

A recipe is a YAML file of these fields; ``linearize train --recipe NAME --transfer.optim.lr 0.01``
overrides any field by its dotted path. Unknown fields and bad values raise errors naming them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..checks import check_choice, check_int
from ..spec import SELECTION_FIELDS, ConversionSpec, SpecError
from ..data import DataConfig

OBJECTIVES = ("weights", "la_weights", "la_mse", "hybrid_mse", "output_mse")
"""Attention-transfer objectives: soft cross-entropy on hybrid (weights) or linear-only (la_weights)
attention weights; MSE of the linear-only (la_mse) or hybrid (hybrid_mse) output; output_mse for
DSLA layers (any mode: the layer's normal output)."""
SWA_DROPOUT_SCHEDULES = ("none", "a", "b", "c")
SCHEDULES = ("constant", "cosine")
FINETUNE_MODES = ("hybrid", "la_only")
HELDOUT_FORMS = ("training", "inference")
ORDER_SOURCES = ("measured", "entropy", "given")
DTYPES = ("auto", "float32", "bfloat16", "bf16-mixed")


class ConfigError(ValueError):
    """A bad training configuration value (the message names it and the valid choices)."""


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    check_choice(name, value, choices, ConfigError)


def _check_positive(name: str, value, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")


@dataclass
class OptimConfig:
    """Optimiser and schedule of one stage."""

    lr: float = 1e-2
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    schedule: str = "constant"
    """constant | cosine (after warm-up)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off)."""
    batch_size: int = 8
    """Sequences per step (global: split over data-parallel ranks)."""

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_positive("weight_decay", self.weight_decay, allow_zero=True)
        _check_positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _check_positive("max_grad_norm", self.max_grad_norm, allow_zero=True)
        _check_positive("batch_size", self.batch_size)
        _check_choice("schedule", self.schedule, SCHEDULES)


@dataclass
class StageConfig:
    """What every stage shares: length, evaluation, checkpoints."""

    enabled: bool = True
    """Run this stage."""
    epochs: float = 1.0
    """Passes over the training sequences."""
    max_steps: int | None = None
    """Stop after this many optimiser steps (None: epochs decide)."""
    max_minutes: float | None = None
    """Also stop once the stage has trained this many minutes of wall time (None: no limit): a fixed
    budget on a lent GPU, counted from the end of the stage's first step (its kernel compilation and
    autotuning is logged as warmup_seconds, not counted). The summary records the steps and tokens
    actually run."""
    eval_every: int = 50
    """Held-out loss every N steps (and at the end)."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    save_every: int = 50
    """Checkpoint (for --resume) every N steps."""
    early_stopping_patience: int | None = None
    """Stop when the held-out loss has not improved for N evaluations; keep the best weights."""
    keep_best: bool = False
    """End the stage with the weights of its best held-out evaluation, not its last step (always so
    with early_stopping_patience)."""
    position_offset: int = 0
    """Each training row's position ids start at a random offset in 0..position_offset (one draw per
    row and step, from the seed): the converted layers see absolute positions up to position_offset
    + seq_len while the teacher's targets (RoPE: relative positions) stay the same; 0 = off.
    Held-out losses always use positions 0..seq_len-1."""

    def __post_init__(self) -> None:
        _check_positive("epochs", self.epochs)
        check_int("position_offset", self.position_offset, 0, error=ConfigError)
        _check_positive("max_steps", self.max_steps, allow_none=True)
        _check_positive("max_minutes", self.max_minutes, allow_none=True)
        _check_positive("eval_every", self.eval_every)
        _check_positive("eval_batches", self.eval_batches)
        _check_positive("save_every", self.save_every)
        _check_positive("early_stopping_patience", self.early_stopping_patience, allow_none=True)


@dataclass
class TransferConfig(StageConfig):
    """Stage 1, attention transfer: layer-local, teacher hidden states feed each converted layer,
    only the new parameters (feature maps, window factors, gates, gamma) train."""

    objectives: dict[str, float] = field(default_factory=lambda: {"hybrid_mse": 1000.0})
    """Objective name -> weight; names: weights, la_weights, la_mse, hybrid_mse, output_mse."""
    gate_similarity_weight: float = 0.1
    """DSLA: lambda, the weight of the cosine similarity of the two gates (pushes them apart)."""
    checkpoint_layers: bool = True
    """Recompute each layer's objective in the backward pass (torch.utils.checkpoint) instead of
    holding every layer's activations at once: the same gradients, in the memory of one layer
    (the attention-weight objectives hold B x H x T x T per layer), for ~1.3x the compute."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-2))
    """Optimiser of stage 1 (the papers: lr 1e-2)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.objectives:
            raise ConfigError(f"transfer.objectives must name at least one of: {', '.join(OBJECTIVES)}")
        for name, weight in self.objectives.items():
            _check_choice("transfer objective", name, OBJECTIVES)
            _check_positive(f"weight of objective {name}", weight)
        _check_positive("gate_similarity_weight", self.gate_similarity_weight, allow_zero=True)


@dataclass
class FinetuneConfig(StageConfig):
    """Stage 2: LoRA fine-tuning (peft) with next-token cross-entropy and/or KL to the teacher."""

    lora_rank: int = 8
    """LoRA rank r; 0: no LoRA, stage 2 trains only the conversion's new parameters (needs
    train_new_params), so the teacher's q/k/v/o stay as they are (e.g. for an inference-time hybrid,
    whose window reads them at inference)."""
    lora_alpha: float = 16.0
    """LoRA alpha."""
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names LoRA adapts."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA path."""
    train_new_params: bool = False
    """Also train the conversion's new parameters in stage 2 (LoLCATs keeps them frozen)."""
    new_params: list[str] = field(default_factory=list)
    """With train_new_params: only the conversion's parameters named by one of these (the last part of
    the name, or a module on its path: gate_logit, window_factor_logit, feature_map_q, ...) train, the
    others stay frozen; e.g. [gate_logit] fits the gate mix's per-head g alone. Empty: all of them."""
    ce_weight: float = 1.0
    """Weight of next-token cross-entropy."""
    kl_weight: float = 0.0
    """Weight of KL(teacher || student) on the logits."""
    kl_temperature: float = 1.0
    """Temperature of that KL."""
    mode: str = "hybrid"
    """Component mode the converted layers train in: hybrid | la_only (inference-time hybrid)."""
    swa_dropout: str = "none"
    """Scheduled sliding-window dropout (SSD): none | a | b | c (HedgeCATs paper schedules)."""
    heldout_form: str = "training"
    """The model the held-out evaluations score, and so what keep_best and early stopping select:
    training (the converted layers as this stage trains them, ``mode``) | inference (as they ship:
    mode hybrid with the recipe's inference_spec applied, e.g. an inference-time hybrid's window
    beside the linear part it trains alone). With inference, the training form's loss is logged
    beside it as heldout_loss_training_form."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Optimiser of stage 2 (the papers: lr 1e-4)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("lora_rank", self.lora_rank, 0, error=ConfigError)
        if self.lora_rank == 0 and not self.train_new_params:
            raise ConfigError("finetune.lora_rank 0 (no LoRA) trains nothing unless finetune.train_new_params is true")
        if self.new_params and not self.train_new_params:
            raise ConfigError(f"finetune.new_params {self.new_params!r} names parameters to train, which needs finetune.train_new_params true")
        _check_positive("lora_alpha", self.lora_alpha)
        _check_positive("ce_weight", self.ce_weight, allow_zero=True)
        _check_positive("kl_weight", self.kl_weight, allow_zero=True)
        _check_positive("kl_temperature", self.kl_temperature)
        if self.ce_weight == 0 and self.kl_weight == 0:
            raise ConfigError("finetune needs ce_weight > 0 or kl_weight > 0")
        _check_choice("finetune mode", self.mode, FINETUNE_MODES)
        _check_choice("swa_dropout", self.swa_dropout, SWA_DROPOUT_SCHEDULES)
        _check_choice("finetune heldout_form", self.heldout_form, HELDOUT_FORMS)


@dataclass
class ChainedConfig(StageConfig):
    """DSLA chained fine-tuning: step k trains only layer pi_k with pi_1..pi_{k-1} converted and
    frozen, so one set of weights serves every prefix of the order."""

    enabled: bool = False
    order_from: str = "measured"
    """measured (held-out loss increase when only that layer is converted) | entropy | given."""
    order: list[int] | None = None
    """The order itself when order_from is 'given'."""
    sensitivity_batches: int = 4
    """Held-out batches used to measure sensitivity."""
    recall_weight: float = 0.0
    """Measured order: weight of each layer's recall-probe loss increase (a held-out passage repeated
    after a gap far beyond the window, scored on the repeat) beside its held-out loss increase;
    0 = held-out loss alone (the paper's measure)."""
    recall_passage: int = 64
    """Tokens in each recall probe's passage (the gap is the rest of a row: seq_len - 2 * passage)."""
    ce_weight: float = 0.0
    """Weight of next-token cross-entropy in each chained step."""
    kl_weight: float = 1.0
    """Weight of KL to the teacher's logits in each chained step."""
    kl_temperature: float = 1.0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("order_from", self.order_from, ORDER_SOURCES)
        _check_positive("recall_weight", self.recall_weight, allow_zero=True)
        check_int("recall_passage", self.recall_passage, 2, error=ConfigError)
        if self.order_from == "given" and not self.order:
            raise ConfigError("chained.order_from 'given' needs chained.order (a list of layer indices)")


@dataclass
class TrainConfig:
    """A whole conversion run: model, spec, data, the stages, where results go."""

    name: str = "custom"
    """Run name (the recipe's name)."""
    description: str = ""
    """What this recipe does and where it comes from."""
    model: str = "smollm2-135m"
    """Teacher: alias, checkpoint dir or hub id."""
    spec: dict[str, Any] = field(default_factory=lambda: {"attention": "hybrid", "layers": "all", "window": 64})
    """The ConversionSpec (fields as in linearize.ConversionSpec)."""
    inference_spec: dict[str, Any] | None = None
    """Spec changes applied after training, for inference (e.g. attach the window: inference-time hybrid)."""
    data: DataConfig = field(default_factory=DataConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    chained: ChainedConfig = field(default_factory=ChainedConfig)
    output_dir: str = "runs"
    """Runs go to OUTPUT_DIR/NAME (checkpoints, metrics.jsonl, adapter/, summary.json)."""
    seed: int = 0
    """Seed of everything random (initialisation, data order, dropout draws)."""
    dtype: str = "auto"
    """auto (bf16-mixed on CUDA, float32 on CPU) | float32 | bfloat16 (all weights) | bf16-mixed
    (float32 weights and optimiser state, forward and backward under bfloat16 autocast)."""
    device: str = "auto"
    """auto (cuda if available) | cpu | cuda."""
    log_every: int = 10
    """Metrics to metrics.jsonl every N steps."""

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, ("auto", "cpu", "cuda"))
        _check_positive("log_every", self.log_every)
        try:
            ConversionSpec.from_dict(self.spec)
            if self.inference_spec is not None:
                ConversionSpec.from_dict(self.spec).replace(**self.inference_spec)
        except SpecError as err:
            raise ConfigError(f"spec: {err}") from None
        structural = sorted(set(self.inference_spec or {}) & {"attention", *SELECTION_FIELDS})
        if self.finetune.enabled and self.finetune.heldout_form == "inference" and structural:
            raise ConfigError(f"finetune.heldout_form 'inference' evaluates the trained layers in place, and inference_spec changes "
                              f"{structural}, which swap modules: use heldout_form 'training'")
        c = self.chained
        if c.enabled and c.recall_weight > 0 and 2 * c.recall_passage >= self.data.seq_len:
            raise ConfigError(f"chained.recall_passage {c.recall_passage} leaves no gap between a passage and its repeat in rows of "
                              f"data.seq_len {self.data.seq_len} tokens: use a passage below {(self.data.seq_len + 1) // 2}")

    def conversion_spec(self) -> ConversionSpec:
        return ConversionSpec.from_dict(self.spec)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --- building from dicts, YAML and dotted overrides ------------------------------------------------
def from_dict(cls, data: dict[str, Any], path: str = ""):
    """Build dataclass ``cls`` from a dict, recursing into dataclass fields; unknown keys raise."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f" in {path}" if path else ""
        raise ConfigError(f"unknown field(s) {unknown}{where}; valid fields: {', '.join(fields)}")
    values = {}
    for key, value in data.items():
        sub = _dataclass_type(hints[key])
        values[key] = from_dict(sub, value, f"{path}.{key}" if path else key) if sub and isinstance(value, dict) else value
    try:
        return cls(**values)
    except TypeError as err:
        raise ConfigError(f"{path or cls.__name__}: {err}") from None


def _dataclass_type(hint):
    if dataclasses.is_dataclass(hint):
        return hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``transfer.optim.lr``) in a nested dict; a key that is no field raises."""
    out = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for dotted, value in overrides.items():
        node, cls = out, TrainConfig
        parts = dotted.split(".")
        for depth, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(cls)] if cls else None
            if names is not None and part not in names:
                raise ConfigError(f"unknown override {dotted!r}: {part!r} is not a field of {'.'.join(parts[:depth]) or 'the recipe'}; valid: {', '.join(names)}")
            if depth == len(parts) - 1:
                node[part] = value
            else:
                hint = typing.get_type_hints(cls)[part] if cls else None
                cls = _dataclass_type(hint) if hint is not None else None
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
    return out
