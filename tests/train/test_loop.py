"""The training loop's guards, on a toy objective (no model needed)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from linearize.train.config import OptimConfig, StageConfig
from linearize.train.loop import MetricsLog, World, run_stage


class Toy(nn.Module):
    """loss = (w - 1)^2, except at the steps in ``poison``, whose gradient is NaN."""

    def __init__(self, poison: set[int]):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))
        self.poison = poison
        self.seen: list[torch.Tensor] = []

    def forward(self, batch, *, step: int, epoch: int):
        self.seen.append(self.w.detach().clone())
        loss = ((self.w - 1) ** 2).sum()
        if step in self.poison:
            loss = loss * torch.tensor(float("nan"))
        return loss, {}


def test_non_finite_gradients_skip_the_update(tmp_path):
    toy = Toy(poison={1})
    train = torch.zeros(16, 4, dtype=torch.long)
    metrics = MetricsLog(tmp_path / "metrics.jsonl", World())
    state = run_stage(stage="toy", objective=toy, params={"w": toy.w}, train=train, cfg=StageConfig(max_steps=4, eval_every=100),
                      optim=OptimConfig(lr=0.1, batch_size=2), run_dir=tmp_path, seed=0, device=torch.device("cpu"),
                      world=World(), metrics=metrics, log_every=1)
    assert state.skipped_steps == 1 and state.step == 4
    assert torch.isfinite(toy.w).all() and (toy.w > 0).all()
    assert torch.equal(toy.seen[1], toy.seen[2]), "the poisoned step must not change the weights"
    assert not torch.equal(toy.seen[0], toy.seen[1])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1]


class SlowStart(nn.Module):
    """loss = (w - 1)^2; this instance's first forward sleeps ``first`` seconds (kernel warm-up), the
    others ``each``; raises at step ``crash_at`` (a killed run)."""

    def __init__(self, first: float, each: float, crash_at: int | None = None):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))
        self.first, self.each, self.crash_at = first, each, crash_at
        self.calls = 0

    def forward(self, batch, *, step: int, epoch: int):
        if step == self.crash_at:
            raise KeyboardInterrupt("killed")
        time.sleep(self.first if self.calls == 0 else self.each)
        self.calls += 1
        return ((self.w - 1) ** 2).sum(), {}


def _run_slow(toy: SlowStart, tmp_path, max_minutes: float, *, resume: bool = False, save_every: int = 100):
    return run_stage(stage="toy", objective=toy, params={"w": toy.w}, train=torch.zeros(16, 4, dtype=torch.long),
                     cfg=StageConfig(max_steps=10_000, epochs=10_000, max_minutes=max_minutes, eval_every=10_000, save_every=save_every),
                     optim=OptimConfig(lr=0.01, batch_size=2), run_dir=tmp_path, seed=0, device=torch.device("cpu"),
                     world=World(), metrics=MetricsLog(tmp_path / "metrics.jsonl", World()), resume=resume, log_every=1)


def test_wall_time_budget_starts_after_the_first_step(tmp_path):
    """A first step slower than the whole budget (Triton autotuning) must not end the stage."""
    state = _run_slow(SlowStart(first=1.5, each=0.05), tmp_path, max_minutes=1 / 60)
    assert state.warmup_seconds >= 1.5
    assert 5 < state.step < 10_000, "the budget stopped the stage, after steps that ran once the first was done"
    assert 1.0 <= state.seconds - state.warmup_seconds < 1.5
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == state.step and all(r["warmup_seconds"] >= 1.5 for r in records)
    # the stage's final wall time also counts its last evaluation and checkpoint, after the last record
    assert records[0]["seconds"] >= 1.5 and records[-1]["seconds"] <= round(state.seconds, 3)


def test_resumed_stage_excludes_its_own_first_step_from_the_budget(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _run_slow(SlowStart(first=0.4, each=0.01, crash_at=3), tmp_path, max_minutes=0.5 / 60, save_every=1)
    saved = torch.load(tmp_path / "toy" / "checkpoint.pt", weights_only=False)["state"]
    assert saved["step"] == 3 and saved["warmup_seconds"] >= 0.4 and saved["seconds"] >= saved["warmup_seconds"]
    # The resumed process warms up again: its first step is not budgeted either, so it trains on.
    state = _run_slow(SlowStart(first=0.4, each=0.02), tmp_path, max_minutes=0.5 / 60, resume=True, save_every=1)
    assert state.warmup_seconds >= 0.8 and state.step > 6
    assert 0.5 <= state.seconds - state.warmup_seconds < 0.9


@pytest.mark.parametrize("keep_best", [False, True])
def test_keep_best_ends_on_the_best_evaluation_of_any_logged_form(keep_best, tmp_path):
    """Training pulls w to 1 while the held-out value, (w - 0.3)^2 summed, is best part of the way:
    keep_best ends on that evaluation's weights, and values logged beside the held-out loss land in
    metrics.jsonl."""
    toy = Toy(poison=set())

    def heldout():
        w = toy.w.detach()
        return {"heldout_loss": float(((w - 0.3) ** 2).sum()), "heldout_loss_other": float(((w - 1) ** 2).sum())}

    state = run_stage(stage="toy", objective=toy, params={"w": toy.w}, train=torch.zeros(64, 4, dtype=torch.long),
                      cfg=StageConfig(max_steps=12, eval_every=1, keep_best=keep_best), optim=OptimConfig(lr=0.1, batch_size=2),
                      run_dir=tmp_path, seed=0, device=torch.device("cpu"), world=World(),
                      metrics=MetricsLog(tmp_path / "metrics.jsonl", World()), heldout_loss=heldout, log_every=100)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "heldout_loss" in r]
    assert [r["step"] for r in evals] == list(range(1, 13)) and all("heldout_loss_other" in r for r in evals)
    assert 1 < state.best_step < 12, "the toy must peak mid-stage for this test to mean anything"
    final = heldout()
    if keep_best:
        assert final["heldout_loss"] == pytest.approx(state.best_heldout, abs=1e-7)
    else:
        assert final["heldout_loss"] == pytest.approx(evals[-1]["heldout_loss"], abs=1e-7) and final["heldout_loss"] > state.best_heldout + 1e-3
