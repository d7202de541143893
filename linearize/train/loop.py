"""The training loop every stage shares: optimiser, schedule, data order, data parallelism,
metrics, held-out evaluation with early stopping, and atomic checkpoints that ``--resume`` continues
from to the same final weights.

A stage provides an ``objective``: an nn.Module whose ``forward(batch, step=, epoch=)`` returns
(loss, metrics). Under torchrun (WORLD_SIZE > 1) the objective is wrapped in DistributedDataParallel
(gloo on CPU, NCCL on CUDA) and each rank takes a disjoint shard of every global batch.

Time (``LoopState``, the metrics records and the stage summaries): ``seconds`` is the stage's whole
wall time; ``warmup_seconds`` the part spent in the first step of each process that ran it (kernel
compilation and autotuning: on a GPU, flash-linear-attention's Triton autotuning can take minutes);
``overhead_seconds`` the part spent on held-out evaluations and checkpoints; ``train_seconds`` is
``seconds - overhead_seconds`` (warm-up included). ``max_minutes`` is compared with
``seconds - warmup_seconds``: the budget starts once the first step has completed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm.auto import tqdm

from .config import OptimConfig, StageConfig
from ..data import iterate_batches
from ..io import atomic_write

logger = logging.getLogger(__name__)


# --- distributed ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device: torch.device) -> World:
    """Join the process group torchrun set up (WORLD_SIZE > 1); otherwise a world of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return World(rank=dist.get_rank(), size=dist.get_world_size())


# --- metrics -------------------------------------------------------------------------------------
class MetricsLog:
    """Appends JSON lines (and TensorBoard scalars when tensorboard is installed) on the main rank."""

    def __init__(self, path: Path, world: World):
        self.path, self.world = path, world
        self._tb = None
        if world.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(ImportError):
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(path.parent / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.world.is_main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{record.get('stage', 'train')}/{key}", value, record.get("step", 0))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


# --- checkpoints ---------------------------------------------------------------------------------
@dataclass
class LoopState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0
    seconds: float = 0.0
    """Wall time of the stage so far: training steps, evaluations, checkpoints (a --resume continues
    from the checkpoint's value)."""
    best_heldout: float = math.inf
    best_step: int = -1
    evals_without_improvement: int = 0
    done: bool = False
    skipped_steps: int = 0
    """Steps whose gradients were not finite: no update was made (as AMP's GradScaler does)."""
    overhead_seconds: float = 0.0
    """Part of ``seconds`` spent on held-out evaluation and checkpoints, not training."""
    warmup_seconds: float = 0.0
    """Part of ``seconds`` spent in the first step of each run_stage call (the stage's first step and the
    first after each --resume): kernel compilation and autotuning. Not counted against ``max_minutes``."""
    history: list[dict] = field(default_factory=list)


def save_checkpoint(path: Path, params: dict[str, nn.Parameter], optimizer, scheduler, state: LoopState, best: dict | None) -> None:
    """Write everything --resume needs, atomically (temp file + rename)."""
    payload = {
        "params": {name: p.detach().cpu().clone() for name, p in params.items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "state": asdict(state),
        "best": best,
    }
    atomic_write(path, lambda f: torch.save(payload, f))


def load_checkpoint(path: Path, params: dict[str, nn.Parameter], optimizer, scheduler) -> tuple[LoopState, dict | None]:
    payload = torch.load(path, map_location="cpu", weights_only=False)
    missing = sorted(set(params) - set(payload["params"]))
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} does not match this run: missing parameters {missing[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(payload["params"][name].to(p.device, p.dtype))
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    return LoopState(**payload["state"]), payload["best"]


# --- the loop ------------------------------------------------------------------------------------
def make_optimizer(params: dict[str, nn.Parameter], cfg: OptimConfig, total_steps: int):
    optimizer = torch.optim.AdamW([params[n] for n in sorted(params)], lr=cfg.lr, weight_decay=cfg.weight_decay)

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def steps_per_epoch(n_sequences: int, batch_size: int) -> int:
    steps = n_sequences // batch_size
    if steps == 0:
        raise ValueError(f"{n_sequences} training sequences are fewer than one batch of {batch_size}")
    return steps


def run_stage(
    *,
    stage: str,
    objective: nn.Module,
    params: dict[str, nn.Parameter],
    train: Tensor,
    cfg: StageConfig,
    optim: OptimConfig,
    run_dir: Path,
    seed: int,
    device: torch.device,
    world: World,
    metrics: MetricsLog,
    heldout_loss: Callable[[], float | Mapping[str, float]] | None = None,
    resume: bool = False,
    log_every: int = 10,
    on_epoch: Callable[[int], None] | None = None,
) -> LoopState:
    """Train ``params`` of ``objective`` on ``train`` (N, T) token ids; returns the final loop state.

    ``heldout_loss()`` returns the held-out loss, or a mapping with it under ``heldout_loss`` and
    other values to log beside it (e.g. the same loss in another form of the model). With early
    stopping or ``cfg.keep_best`` the best held-out weights are restored at the end. ``on_epoch(epoch)`` runs
    before each epoch's first step (schedules that change per epoch). ``cfg.max_minutes`` bounds the
    wall time after this call's first step (``state.seconds - state.warmup_seconds``): the first step
    pays for compiling and autotuning kernels, which would otherwise eat a short budget. One function
    on purpose: resume, warm-up, budget, evaluation and checkpoint are one control flow around the
    step (the step itself is ``_apply_gradients``; its metrics line ``_step_record``).
    """
    if not params:
        raise ValueError(f"stage {stage!r} has no trainable parameters")
    per_epoch = steps_per_epoch(train.shape[0], optim.batch_size)
    total = min(cfg.max_steps or math.inf, math.ceil(cfg.epochs * per_epoch))
    optimizer, scheduler = make_optimizer(params, optim, total)
    ckpt = run_dir / stage / "checkpoint.pt"
    state, best = LoopState(), None
    if resume and ckpt.is_file():
        state, best = load_checkpoint(ckpt, params, optimizer, scheduler)
        logger.info("%s: resumed at step %d", stage, state.step)
    if state.done:
        _restore_best(params, best)
        return state
    if optim.batch_size % world.size:
        raise ValueError(f"batch_size {optim.batch_size} is not divisible by the {world.size} data-parallel ranks")
    model = objective
    if world.size > 1:
        model = nn.parallel.DistributedDataParallel(objective, find_unused_parameters=True)
    objective.train()
    bar = tqdm(total=total, initial=state.step, desc=stage, disable=not world.is_main, dynamic_ncols=True)
    started = time.perf_counter() - state.seconds
    entry_seconds, warm = state.seconds, False  # this call's first step is the warm-up
    stop = False
    while state.step < total and not stop:
        if on_epoch is not None:
            on_epoch(state.epoch)  # idempotent: also re-applies the schedule after a resume mid-epoch
        batches = iterate_batches(
            train, optim.batch_size // world.size, seed=seed, epoch=state.epoch, rank=world.rank, world_size=world.size,
            start_batch=state.batch_in_epoch,
        )
        for batch in batches:
            batch = batch.to(device)
            loss, values = model(batch, step=state.step, epoch=state.epoch)
            loss.backward()
            grad_norm = _apply_gradients(stage, params, optim, optimizer, scheduler, state)
            state.step += 1
            state.batch_in_epoch += 1
            state.tokens += batch.numel() * world.size
            state.seconds = time.perf_counter() - started
            if not warm:
                warm = True
                state.warmup_seconds += state.seconds - entry_seconds
                logger.info("%s: first step (step %d) took %.1f s, kernel compilation and autotuning included; "
                            "not counted against max_minutes", stage, state.step, state.seconds - entry_seconds)
            bar.update(1)
            if state.step % log_every == 0 or state.step == total:
                record = _step_record(stage, state, loss, scheduler.get_last_lr()[0], grad_norm, values)
                metrics.write(record)
                bar.set_postfix(loss=f"{record['loss']:.4g}")
            out_of_time = _out_of_time(state.seconds - state.warmup_seconds, cfg.max_minutes, world, device)
            if out_of_time:
                logger.info("%s: %.1f-minute budget reached at step %d (%.1f s after the first step; %.1f s of warm-up not counted)",
                            stage, cfg.max_minutes, state.step, state.seconds - state.warmup_seconds, state.warmup_seconds)
            paused = time.perf_counter()
            if heldout_loss is not None and (state.step % cfg.eval_every == 0 or state.step == total or out_of_time):
                stop, best = _evaluate(stage, state, params, best, heldout_loss, cfg, metrics, objective)
            stop = stop or out_of_time
            if state.step % cfg.save_every == 0 and world.is_main:
                save_checkpoint(ckpt, params, optimizer, scheduler, state, best)
            state.overhead_seconds += time.perf_counter() - paused
            state.seconds = time.perf_counter() - started  # wall time includes the evaluation and checkpoint
            if state.step >= total or stop:
                break
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
    bar.close()
    state.done = True
    if world.is_main:
        save_checkpoint(ckpt, params, optimizer, scheduler, state, best)
    _restore_best(params, best)
    return state


def _apply_gradients(stage: str, params: dict[str, nn.Parameter], optim: OptimConfig, optimizer, scheduler,
                     state: LoopState) -> float:
    """Clip, then step the optimiser unless the gradients are not finite (counted and skipped, so no
    NaN reaches the weights); the schedule advances either way. Returns the gradient norm."""
    trained = [params[n] for n in sorted(params)]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trained, optim.max_grad_norm or math.inf))
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        state.skipped_steps += 1
        logger.warning("%s: step %d has non-finite gradients (norm %s); update skipped (%d so far)",
                       stage, state.step + 1, grad_norm, state.skipped_steps)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _step_record(stage: str, state: LoopState, loss: Tensor, lr: float, grad_norm: float, values: dict) -> dict:
    """One line of metrics.jsonl for a training step."""
    return {"stage": stage, "step": state.step, "epoch": state.epoch, "loss": float(loss.detach()),
            "lr": lr, "tokens": state.tokens, "seconds": round(state.seconds, 3),
            "train_seconds": round(state.seconds - state.overhead_seconds, 3),
            "warmup_seconds": round(state.warmup_seconds, 3),
            "grad_norm": grad_norm, "skipped_steps": state.skipped_steps, **values}


def _out_of_time(seconds: float, max_minutes: float | None, world: World, device: torch.device) -> bool:
    """Whether ``seconds`` (the budgeted wall time: warm-up excluded) spend the stage's budget; all
    ranks agree (rank 0's clock decides)."""
    if max_minutes is None:
        return False
    flag = seconds >= 60.0 * max_minutes
    if world.size > 1:
        t = torch.tensor([float(flag)], device=device)
        torch.distributed.broadcast(t, src=0)
        flag = bool(t.item())
    return flag


def _evaluate(stage, state: LoopState, params, best, heldout_loss, cfg: StageConfig, metrics: MetricsLog, objective) -> tuple[bool, dict | None]:
    objective.eval()
    with torch.no_grad():
        result = heldout_loss()
    objective.train()
    extra = {k: float(v) for k, v in result.items() if k != "heldout_loss"} if isinstance(result, Mapping) else {}
    value = float(result["heldout_loss"] if isinstance(result, Mapping) else result)
    improved = value < state.best_heldout
    if improved:
        state.best_heldout, state.best_step, state.evals_without_improvement = value, state.step, 0
        if cfg.early_stopping_patience is not None or cfg.keep_best:
            best = {name: p.detach().cpu().clone() for name, p in params.items()}
    else:
        state.evals_without_improvement += 1
    state.history.append({"step": state.step, "heldout_loss": value, **extra})
    metrics.write({"stage": stage, "step": state.step, "tokens": state.tokens, "heldout_loss": value,
                   "heldout_ppl": math.exp(min(value, 50.0)), **extra})
    patience = cfg.early_stopping_patience
    stop = patience is not None and state.evals_without_improvement >= patience
    if stop:
        logger.info("%s: early stop at step %d (best held-out %.4f at step %d)", stage, state.step, state.best_heldout, state.best_step)
    return stop, best


def _restore_best(params: dict[str, nn.Parameter], best: dict | None) -> None:
    if best is None:
        return
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(best[name].to(p.device, p.dtype))
