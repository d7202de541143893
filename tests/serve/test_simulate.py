"""The replay on a model of the engine's steps: the real engine's decisions on a virtual clock."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linearize.convert import convert
from linearize.hub import build_tiny_llama
from linearize.serve.engine import Engine, EngineConfig
from linearize.serve.levels import LevelMemory
from linearize.serve.policy import parse_policy
from linearize.serve.replay import ReplayRequest
from linearize.serve.sampling import SamplingParams
from linearize.serve.simulate import CostRunner, StepCosts, simulate_replay, simulated_summary
from linearize.spec import ConversionSpec

PROMPTS = [(37, 9), (90, 4), (15, 20), (64, 12), (120, 3), (8, 15)]


def _family():
    model = build_tiny_llama(0, num_hidden_layers=4)
    spec = ConversionSpec.from_dict({"attention": "dsla", "order": [2, 0, 3, 1]})
    convert(model, spec)
    return model.eval(), LevelMemory.from_spec(spec, model.config, dtype_bytes=4)


def _steps(engine: Engine) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    for n, out in PROMPTS:
        prompt = torch.randint(0, 128, (n,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_work():
        engine.step()
        w = engine.last_step
        steps.append((w.decode_rows, w.prefill_tokens, len(engine.running), len(engine.waiting), engine.held_after_step,
                       tuple(r.level for r in engine.running)))  # fmt: skip
        assert len(steps) < 500
    return steps


@pytest.mark.parametrize("policy", ["softmax", "length-caps", "memory:high=0.5:low=0.3"])
def test_the_cost_runner_makes_the_engine_step_as_with_the_model(policy):
    """The same requests on the real engine over the tiny model and on the engine over a CostRunner,
    under a budget that makes requests wait, convert and be preempted: every step decodes the
    same rows, prefills the same tokens, holds the same bytes (the runners' caches against
    LevelMemory's count) and keeps the same requests at the same levels."""
    model, levels = _family()
    budget = levels.bytes(0, 140) + levels.bytes(0, 60)
    config = EngineConfig(kv_budget=budget, max_step_tokens=64, max_running=4)
    real = Engine(model, levels, config, policy=parse_policy(policy, levels), eos_token_ids=())
    modelled = Engine(None, levels, config, policy=parse_policy(policy, levels), eos_token_ids=(),
                      runner=CostRunner(levels, model.config, prefill_align=1))  # fmt: skip
    want, got = _steps(real), _steps(modelled)
    assert got == want
    assert real.counters["preemptions"] + real.counters["conversions"] + sum(1 for s in want if s[3]) > 0  # the budget bound
    assert real.counters == modelled.counters


def test_step_costs_fit_recovers_the_costs_of_a_timeline():
    costs = StepCosts(decode_fixed_s=3e-3, decode_row_s=1e-4, prefill_fixed_s=2e-3, prefill_token_s=1.5e-5)
    gen = torch.Generator().manual_seed(1)
    t, timeline = 0.0, [{"t": 0.0, "running": 1, "decode_rows": 0, "prefill_tokens": 0}]
    for _ in range(200):
        rows = int(torch.randint(0, 6, (), generator=gen))
        tokens = int(torch.randint(0, 512, (), generator=gen)) * int(torch.rand((), generator=gen) < 0.3)
        t += costs.step_s(rows, tokens)
        timeline.append({"t": t, "running": 3, "decode_rows": rows, "prefill_tokens": tokens})
    fitted = StepCosts.fit(timeline)
    for name in ("decode_fixed_s", "decode_row_s", "prefill_fixed_s", "prefill_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(costs, name), rel=1e-6)
    with pytest.raises(ValueError, match="too short"):
        StepCosts.fit(timeline[:3])


def test_the_virtual_clock_stamps_tokens_with_the_steps_costs():
    """One request of 10 prompt tokens and 3 outputs arriving at 2 s: its first token after the
    prefill step's cost, the next two after a decode step's cost each; a second request, arriving
    while it decodes, prefills in the step after its arrival."""
    model, levels = _family()
    costs = StepCosts(decode_fixed_s=0.01, decode_row_s=0.001, prefill_fixed_s=0.1, prefill_token_s=0.001)
    requests = [ReplayRequest(2.0, [5] * 10, 3, 0, 0), ReplayRequest(2.115, [7] * 4, 1, 1, 0)]
    records, timeline = simulate_replay(levels, model.config, EngineConfig(kv_budget=10**9, max_step_tokens=64), parse_policy("softmax", levels),
                                        requests, costs, prefill_align=1)  # fmt: skip
    first, second = records
    assert first.token_times == pytest.approx([2.11, 2.121, 2.236])  # prefill; decode; decode + the second's prefill in one step
    assert second.token_times == pytest.approx([2.236]) and second.arrival == 2.115
    assert first.finish == second.finish == pytest.approx(2.236) and first.status == second.status == "ok"
    summary = simulated_summary(records, timeline, costs)
    assert summary["completed"] == 2 and summary["lost"] == 0 and summary["steps"] == len(timeline) == 3
    with pytest.raises(ValueError, match="rate_scale"):
        simulate_replay(levels, model.config, EngineConfig(kv_budget=10**9), parse_policy("softmax", levels), requests, costs, rate_scale=0)


def test_the_script_models_a_window_at_several_rates(tmp_path):
    """scripts/replay_model.py: costs per policy from a report's timelines, the window's requests at
    each rate on the tiny random family; slower arrivals never wait longer."""
    costs = StepCosts(decode_fixed_s=3e-3, decode_row_s=2e-4, prefill_fixed_s=2e-3, prefill_token_s=2e-5)
    t, timeline = 0.0, [{"t": 0.0, "running": 1, "decode_rows": 0, "prefill_tokens": 0}]
    for i in range(50):
        rows, tokens = i % 5, (i * 37) % 300 if i % 3 == 0 else 0
        t += costs.step_s(rows, tokens)
        timeline.append({"t": t, "running": 2, "decode_rows": rows, "prefill_tokens": tokens})
    report = tmp_path / "report.json.gz"
    with gzip.open(report, "wt") as f:
        json.dump({"raw": {p: {"timeline": timeline} for p in ("softmax", "static:2")}}, f)
    script = Path(__file__).resolve().parents[2] / "scripts" / "replay_model.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), "--costs", str(report), "--model", "random:tiny",
                           "--kv-budget", "1MiB", "--requests", "12", "--max-prompt", "3000", "--policies", "softmax,static:2",
                           "--rates", "0.5,4"], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "replay_model.json").read_text())
    rows = {(r["rate_scale"], r["policy"]): r for r in result["rows"]}
    assert set(rows) == {(0.5, "softmax"), (0.5, "static:2"), (4.0, "softmax"), (4.0, "static:2")}
    for r in rows.values():
        assert r["completed"] + r["rejected"] == 12 and r["lost"] == 0 and r["costs"]["decode_row_s"] == pytest.approx(2e-4)
    assert rows[(0.5, "softmax")]["speedup_vs_softmax"] == 1.0
    assert rows[(0.5, "softmax")]["ttft_s"]["mean"] <= rows[(4.0, "softmax")]["ttft_s"]["mean"]
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "bad"), "--costs", str(report), "--model", "random:tiny",
                          "--policies", "length-caps"], capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "length-caps" in bad.stderr and "report.json.gz" in bad.stderr and "--costs-as" in bad.stderr
    stand_in = subprocess.run([sys.executable, str(script), str(tmp_path / "as"), "--costs", str(report), "--model", "random:tiny",
                               "--kv-budget", "1MiB", "--requests", "12", "--max-prompt", "3000", "--policies", "softmax,length-caps",
                               "--costs-as", "softmax"], capture_output=True, text=True)  # fmt: skip
    assert stand_in.returncode == 0, stand_in.stderr[-3000:]
    costed = json.loads((tmp_path / "as" / "replay_model.json").read_text())
    assert costed["costs_from"]["length-caps"].endswith("as softmax")
    assert {r["policy"]: r["costs"]["decode_row_s"] for r in costed["rows"]} == pytest.approx({"softmax": 2e-4, "length-caps": 2e-4})
