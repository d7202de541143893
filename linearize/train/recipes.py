"""Named recipes (YAML files in linearize/recipes) and the runner that executes one end to end.

run(config): load the teacher, build the data, measure the teacher's held-out loss, convert, run the
enabled stages (attention transfer; DSLA sensitivity order + chained fine-tuning; LoRA fine-tuning),
save the adapter (new parameters + LoRA + spec + base model name), reload it the way a user would
and measure its held-out loss. Everything lands in OUTPUT_DIR/NAME: metrics.jsonl, per-stage
checkpoints (``resume=True`` continues a killed run to the same final weights), adapter/ and
summary.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..api import load_model, save_adapter
from ..checks import load_yaml, read_yaml
from ..convert import convert, converted_layers, inference_form, new_parameters, set_active, set_mode
from ..io import atomic_write_text
from ..spec import ConversionSpec
from ..teacher import teacher_modes
from .config import ConfigError, TrainConfig, apply_overrides, from_dict
from ..data import build_dataset
from .finetune import FinetuneObjective, heldout_loss, unwrap
from .loop import MetricsLog, World, init_world, run_stage
from .transfer import TransferObjective

logger = logging.getLogger(__name__)


def recipe_names() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in resources.files("linearize.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A recipe by name (or a YAML path), with dotted-key overrides applied."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        data = read_yaml(path, "recipe", ConfigError) or {}
    elif name_or_path in recipe_names():
        data = load_yaml(resources.files("linearize.recipes").joinpath(f"{name_or_path}.yaml").read_text()) or {}
    else:
        raise ConfigError(f"unknown recipe {name_or_path!r}; valid recipes: {', '.join(recipe_names())} (or a path to a .yaml file)")
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {name_or_path!r} must hold a mapping of recipe fields")
    return from_dict(TrainConfig, apply_overrides(data, overrides or {}))


def _device_and_dtype(config: TrainConfig) -> tuple[torch.device, torch.dtype, torch.dtype | None]:
    """(device, weight dtype, autocast dtype or None) of a run."""
    name = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:  # one GPU per torchrun rank
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    choice = config.dtype if config.dtype != "auto" else ("bf16-mixed" if device.type == "cuda" else "float32")
    if choice == "bf16-mixed":
        return device, torch.float32, torch.bfloat16
    return device, {"float32": torch.float32, "bfloat16": torch.bfloat16}[choice], None


def _train_only(model, names: set[str]) -> dict[str, torch.nn.Parameter]:
    params = {}
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
        if name in names:
            params[name] = p
    return params


def _layer_params(model, layers: list[int]) -> set[str]:
    prefixes = tuple(f"model.layers.{i}.self_attn." for i in layers)
    return {name for name in new_parameters(model) if name.startswith(prefixes)}


def run(config: TrainConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run a recipe; returns (and writes) the summary."""
    torch.manual_seed(config.seed)
    device, dtype, autocast_dtype = _device_and_dtype(config)
    try:
        with precision(device, autocast_dtype):
            return _run(config, device, dtype, autocast_dtype, resume=resume)
    finally:  # leave no process group behind (torchrun ranks exit cleanly)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def precision(device: torch.device, autocast_dtype: torch.dtype | None):
    """The autocast context a whole run sits in (or none). Its weight-cast cache is off: within one
    context it would keep serving the first low-precision copy of every weight being trained, so
    the forward would never see an update (our first GPU runs trained blind this way)."""
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=autocast_dtype, cache_enabled=False)


def _run(config: TrainConfig, device: torch.device, dtype: torch.dtype, autocast_dtype: torch.dtype | None, *, resume: bool) -> dict[str, Any]:
    world = init_world(device)
    run_dir = Path(config.output_dir) / config.name
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", config.to_yaml())
    metrics = MetricsLog(run_dir / "metrics.jsonl", world)
    model, tokenizer = load_model(config.model, dtype=dtype, device=device)
    if tokenizer is None:
        raise ValueError(f"model {config.model!r} has no tokenizer: training needs one to build its data")
    data = build_dataset(config.data, tokenizer, model=model)
    eval_batch = config.finetune.optim.batch_size  # global: ranks share each held-out batch
    shard = dict(rank=world.rank, world_size=world.size)
    summary: dict[str, Any] = {"name": config.name, "model": config.model, "data": data.describe(), "stages": {},
                               "device": str(device), "dtype": str(dtype).removeprefix("torch."), "world_size": world.size,
                               "autocast": None if autocast_dtype is None else str(autocast_dtype).removeprefix("torch.")}
    model.eval()
    # A run may start from a conversion (``--model ADAPTER``): its teacher is then its layers as
    # softmax over the weights it trains on (what transfer and KL read), and the conversion's own
    # loss is recorded as where the run started.
    with teacher_modes(model):
        summary["teacher_heldout_loss"] = heldout_loss(model, data.heldout, batch_size=eval_batch, max_batches=None, device=device, **shard)
    if converted_layers(model):
        summary["started_from"] = config.model
        summary["start_heldout_loss"] = heldout_loss(model, data.heldout, batch_size=eval_batch, max_batches=None, device=device, **shard)

    spec = config.conversion_spec()
    convert(model, spec)
    layers = sorted(converted_layers(model))
    common = dict(run_dir=run_dir, seed=config.seed, device=device, world=world, metrics=metrics, resume=resume, log_every=config.log_every)

    def evaluate(stage_cfg):
        return lambda: heldout_loss(model, data.heldout, batch_size=eval_batch, max_batches=stage_cfg.eval_batches, device=device, **shard)

    if config.transfer.enabled:
        t = config.transfer
        objective = TransferObjective(model, layers, t.objectives, t.gate_similarity_weight, checkpoint_layers=t.checkpoint_layers,
                                      position_offset=t.position_offset, seed=config.seed, rank=world.rank)
        params = _train_only(model, _layer_params(model, layers))
        state = run_stage(stage="transfer", objective=objective, params=params, train=data.train, cfg=t, optim=t.optim,
                          heldout_loss=evaluate(t), **common)
        summary["stages"]["transfer"] = _stage_summary(state)

    if config.chained.enabled:
        summary["stages"]["chained"] = _run_chained(config, model, data, layers, evaluate, common, eval_batch, device)

    if config.finetune.enabled:
        model = _run_finetune(config, model, data, evaluate, common, world, summary)

    final_spec = ConversionSpec.from_dict(unwrap(model).config.linearize).replace(**(config.inference_spec or {})).to_dict()
    adapter_dir = run_dir / "adapter"
    if world.is_main:
        extra = {"training": {k: v for k, v in summary.items() if k != "data"}, "data": summary["data"]}
        save_adapter(model, adapter_dir, base_model=config.model, spec=final_spec, extra=extra)
    if world.size > 1:
        torch.distributed.barrier()
    reloaded, _ = load_model(str(adapter_dir), dtype=dtype, device=device)
    summary["heldout_loss"] = heldout_loss(reloaded, data.heldout, batch_size=eval_batch, max_batches=None, device=device, **shard)
    summary["heldout_ppl"] = math.exp(summary["heldout_loss"])
    summary["teacher_heldout_ppl"] = math.exp(summary["teacher_heldout_loss"])
    summary["adapter"] = str(adapter_dir)
    summary["spec"] = final_spec
    if world.is_main:
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    metrics.close()
    return summary


def _stage_summary(state) -> dict[str, Any]:
    """seconds: the stage's wall time; train_seconds: its training steps (seconds less evaluations and
    checkpoints; tokens_per_s divides by it); warmup_seconds: the part of both spent in the first step
    (of each --resume run): kernel compilation and autotuning, not counted against max_minutes."""
    train_seconds = state.seconds - state.overhead_seconds
    return {"steps": state.step, "tokens": state.tokens, "seconds": round(state.seconds, 2), "train_seconds": round(train_seconds, 2),
            "warmup_seconds": round(state.warmup_seconds, 2),
            "tokens_per_s": round(state.tokens / train_seconds, 1) if train_seconds > 0 else None, "skipped_steps": state.skipped_steps,
            "best_heldout_loss": None if math.isinf(state.best_heldout) else state.best_heldout, "best_step": state.best_step}


def _run_finetune(config: TrainConfig, model, data, evaluate, common, world: World, summary) -> Any:
    from peft import LoraConfig, get_peft_model

    f = config.finetune
    set_mode(model, f.mode)
    own = _chosen_new_parameters(model, f.new_params) if f.train_new_params else set()
    if f.lora_rank == 0:  # the conversion's own parameters alone (the config requires train_new_params)
        peft_model, trainable = model, own
    else:
        lora = LoraConfig(r=f.lora_rank, lora_alpha=f.lora_alpha, target_modules=list(f.lora_targets), lora_dropout=f.lora_dropout,
                          bias="none")  # fmt: skip
        peft_model = get_peft_model(model, lora)
        new_names = {f"base_model.model.{n}" for n in own}
        trainable = {n for n, p in peft_model.named_parameters() if "lora_" in n} | new_names
    params = _train_only(peft_model, trainable)
    objective = FinetuneObjective(peft_model, ce_weight=f.ce_weight, kl_weight=f.kl_weight, kl_temperature=f.kl_temperature,
                                  swa_dropout=f.swa_dropout, seed=config.seed, rank=world.rank, position_offset=f.position_offset)
    state = run_stage(stage="finetune", objective=objective, params=params, train=data.train, cfg=f, optim=f.optim,
                      heldout_loss=_finetune_heldout(config, unwrap(peft_model), evaluate(f)), on_epoch=objective.on_epoch, **common)
    summary["stages"]["finetune"] = {**_stage_summary(state), "heldout_form": f.heldout_form}
    set_mode(unwrap(peft_model), "hybrid")
    if f.swa_dropout != "none":  # keep the window the schedule ended with
        window = next(m.options.window for m in converted_layers(unwrap(peft_model)).values())
        spec = ConversionSpec.from_dict(unwrap(peft_model).config.linearize)
        unwrap(peft_model).config.linearize = spec.replace(window=window).to_dict()
    return peft_model


def _chosen_new_parameters(model, chosen: list[str]) -> set[str]:
    """The names of the conversion's own parameters that stage 2 trains: all, or those named by
    ``chosen`` (a name's last part, or a module on its path). Raises when one names nothing."""
    names = set(new_parameters(model))
    if not chosen:
        return names
    parts = {n: n.split(".") for n in names}
    picked = set()
    for want in chosen:
        hit = {n for n, p in parts.items() if want in p}
        if not hit:
            valid = sorted({part for p in parts.values() for part in p[p.index("self_attn") + 1:]})  # below the attention module
            raise ConfigError(f"finetune.new_params {want!r} names none of the conversion's parameters; valid: {', '.join(valid)}")
        picked |= hit
    return picked


def _finetune_heldout(config: TrainConfig, model, training_form):
    """Stage 2's held-out evaluation: ``training_form`` (the model as it trains) or, with
    heldout_form 'inference', the model as it ships scored first and the training form logged beside it."""
    if config.finetune.heldout_form == "training":
        return training_form

    def both() -> dict[str, float]:
        with inference_form(model, config.inference_spec):
            shipped = training_form()
        return {"heldout_loss": shipped, "heldout_loss_training_form": training_form()}

    return both


def _run_chained(config: TrainConfig, model, data, layers, evaluate, common, eval_batch, device) -> dict[str, Any]:
    """Sensitivity order, then step k trains only layer pi_k with pi_1..pi_{k-1} converted and frozen."""
    from .sensitivity import recall_probes, trained_sensitivity

    c = config.chained
    spec = ConversionSpec.from_dict(model.config.linearize)
    heldout = [data.heldout[i * eval_batch:(i + 1) * eval_batch].to(device) for i in range(min(c.sensitivity_batches, max(1, data.heldout.shape[0] // eval_batch)))]
    report = None
    if c.order_from == "given":
        order = [int(i) for i in c.order]
    else:
        probes = (recall_probes(data.heldout, passage=c.recall_passage, batch_size=eval_batch, max_probes=c.sensitivity_batches * eval_batch)
                  if c.recall_weight > 0 else None)
        report = trained_sensitivity(model, heldout, probes, recall_weight=c.recall_weight)
        order = report["order"] if c.order_from == "measured" else [r["layer"] for r in sorted(report["layers"], key=lambda r: (r["entropy"], r["layer"]))]
    order = [i for i in order if i in layers]
    steps = []
    for k, layer in enumerate(order, start=1):
        model.config.linearize = {**spec.to_dict(), "order": order, "active": k}
        set_active(model, k)
        params = _train_only(model, _layer_params(model, [layer]))
        objective = FinetuneObjective(model, ce_weight=c.ce_weight, kl_weight=c.kl_weight, kl_temperature=c.kl_temperature, seed=config.seed,
                                      rank=common["world"].rank, position_offset=c.position_offset)
        state = run_stage(stage=f"chained-{k:02d}-layer{layer:02d}", objective=objective, params=params, train=data.train, cfg=c,
                          optim=c.optim, heldout_loss=evaluate(c), **common)
        steps.append({"k": k, "layer": layer, **_stage_summary(state)})
    set_active(model, len(order))
    return {"order": order, "sensitivity": report, "steps": steps,
            "tokens": sum(s["tokens"] for s in steps), "seconds": round(sum(s["seconds"] for s in steps), 2)}
