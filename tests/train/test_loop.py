"""The training loop's guards, on a toy objective (no model needed)."""

from __future__ import annotations

import json

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
