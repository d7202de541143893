"""Trace replay: traces parse, sessions augment with exact lengths, replays lose nothing, metrics follow
vllm bench serve's definitions."""

import json

import pytest
import torch

from linearize.data import TRACES
from linearize.serve.policy import parse_policy
from linearize.serve.replay import (ReplayRequest, RequestRecord, TraceRequest, across_runs, augment, base_policy, decode_fit, load_trace,
                                    memory_bound, parse_slo, run_replay, step_stats, summarize, sweep_markdown, sweep_report)
from linearize.serve.settings import ReplaySettings

from .test_api import tiny_engine


def test_the_shipped_azure_traces_parse():
    conv = load_trace(TRACES / "azure_llm_2023_conv.csv")
    assert len(conv) == 19366 and conv[0].arrival == 0.0
    assert all(a.arrival <= b.arrival for a, b in zip(conv, conv[1:]))
    assert 1100 < sum(r.input_tokens for r in conv) / len(conv) < 1200  # mean 1155
    assert 3000 < conv[-1].arrival < 3600  # about 58 minutes
    assert len(load_trace(TRACES / "azure_llm_2023_code.csv")) == 8819


def test_mooncake_jsonl_and_bad_traces(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": []})
                           for t, i, o in [(5000, 10, 3), (5500, 20, 4)]) + "\n")  # fmt: skip
    assert load_trace(p) == [TraceRequest(0.0, 10, 3), TraceRequest(0.5, 20, 4)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 1"):
        load_trace(bad)
    with pytest.raises(ValueError, match="unknown format '.txt'"):
        (tmp_path / "x.txt").write_text("")
        load_trace(tmp_path / "x.txt")
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        load_trace(tmp_path / "nope.csv")


def test_sessions_carry_their_history_with_exact_lengths():
    trace = [TraceRequest(float(i), 5 + i, 3) for i in range(30)]
    stream = torch.arange(3, 120)
    requests = augment(trace, stream, seed=1, max_prompt=10**6)
    assert len(requests) == 30 and [r.arrival for r in requests] == [float(i) for i in range(30)]
    sessions = {}
    for r, t in zip(requests, trace):
        sessions.setdefault(r.session, []).append((r, t))
    assert 3 < len(sessions) < 30  # Poisson(3) turns
    for turns in sessions.values():
        expected = 0
        for k, (r, t) in enumerate(turns):
            assert r.turn == k and r.output_tokens == t.output_tokens
            expected += t.input_tokens
            assert len(r.prompt) == expected  # history + the new message
            if k:
                assert r.prompt[: len(turns[k - 1][0].prompt)] == turns[k - 1][0].prompt
            expected += t.output_tokens
    capped = augment(trace, stream, seed=1, max_prompt=12)
    assert max(len(r.prompt) for r in capped) == 12


def test_metrics_follow_vllm_definitions():
    r = RequestRecord(arrival=1.0, prompt_tokens=10, output_tokens=3, token_times=[1.5, 1.7, 2.0], finish=2.0)
    assert r.ttft == 0.5 and r.e2e == 1.0 and r.tpot == pytest.approx(0.25) and r.itls == pytest.approx([0.2, 0.3])
    assert r.normalized == pytest.approx(1.0 / 3)
    lost = RequestRecord(arrival=1.2, prompt_tokens=5, output_tokens=2, status="unfinished")
    m = summarize([r, lost], slo=parse_slo("ttft=1s,tpot=300ms"))
    assert (m["completed"], m["lost"], m["goodput"]) == (1, 1, pytest.approx(1.0))
    assert parse_slo("ttft=2s,tpot=100ms") == {"ttft": 2.0, "tpot": 0.1}
    with pytest.raises(ValueError, match="keys are ttft, tpot and e2e"):
        parse_slo("latency=1s")


def test_decode_fit_splits_a_forward_into_fixed_and_per_row_cost():
    rows = [1, 2, 4, 8, 8, 16]
    seconds = [0.030 + 0.0005 * r for r in rows]
    fit = decode_fit(rows, seconds)
    assert fit["fixed_s"] == pytest.approx(0.030) and fit["per_row_s"] == pytest.approx(0.0005)
    assert decode_fit([4, 4, 4], [0.1, 0.2, 0.3]) is None  # one row count: no line
    assert decode_fit([], []) is None
    timeline = [{"t": 0.1 * i, "running": r, "decode_rows": r, "decode_s": s, "prefill_tokens": 0, "prefill_s": 0.0}
                for i, (r, s) in enumerate(zip(rows, seconds))]
    assert step_stats(timeline)["decode_fit"]["per_row_s"] == pytest.approx(0.0005)


def test_replay_every_policy_loses_nothing(tmp_path):
    trace = [TraceRequest(i * 0.05, 20 + 7 * (i % 5), 4 + i % 3) for i in range(10)]
    requests = augment(trace, torch.arange(3, 128), seed=0, max_prompt=300)

    def factory(policy):
        _, engine = tiny_engine(policy)
        engine.config.kv_budget = 300_000
        return engine

    result = run_replay(factory, requests, ["softmax", "static:2", "length-caps", "memory"], rate_scale=2.0,
                        slo=parse_slo("ttft=5s"), out_dir=tmp_path)  # fmt: skip
    for policy, m in result["policies"].items():
        assert m["lost"] == 0 and m["completed"] + m["rejected"] == 10, policy
        assert m["peak_bytes"] <= m["budget_bytes"]
        assert m["normalized_latency_s"]["mean"] > 0
        steps = m["engine_steps"]
        assert steps["steps"] > 1 and steps["duration_s"]["p50"] > 0 and steps["mean_running"] > 0
        assert steps["decode_s"]["p50"] > 0 and steps["mean_decode_rows"] >= 1 and steps["prefill_s_per_token"] > 0
        assert 0 < steps["prefill_share"] < 1
        assert m["arena_bytes"] > 0
    assert result["policies"]["softmax"]["speedup_vs_softmax"] == pytest.approx(1.0)
    for name in ("report.json", "report.md", "latency_cdf.png", "latency_vs_length.png", "memory_levels.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| memory |" in (tmp_path / "report.md").read_text()
    assert "Engine steps (in process)" in (tmp_path / "report.md").read_text()
    assert result["policies"]["softmax"]["memory_bound"]["capacity_vs_softmax"] == pytest.approx(1.0)
    assert "| vs softmax | memory bound |" in (tmp_path / "report.md").read_text()
    assert "| 1.00x | 1.00x |" in (tmp_path / "report.md").read_text()  # softmax: its ratio and its bound


def test_memory_bound_counts_each_request_at_its_final_length_and_its_policys_level():
    """Softmax's bytes over the policy's, every request at prompt + output tokens: static at its
    level, length-caps at its prompt's cap (4 layers: 12.5% and 25% -> 1 layer, 37.5% and 50% -> 2),
    memory at its level cap; a state outweighs a short context, so the bound can fall below 1."""
    _, engine = tiny_engine()
    levels = engine.levels
    prompts_and_outputs = [(10, 1000), (3000, 20), (5000, 300), (9000, 5)]
    requests = [ReplayRequest(0.0, [5] * n, out, i, 0) for i, (n, out) in enumerate(prompts_and_outputs)]
    finals = [n + out for n, out in prompts_and_outputs]
    softmax = sum(levels.bytes(0, t) for t in finals)

    def bound(policy):
        return memory_bound(levels, parse_policy(policy, levels), requests, budget=10**9)

    assert bound("softmax") == {"bytes_vs_softmax": pytest.approx(1.0), "capacity_vs_softmax": pytest.approx(1.0)}
    for level in (1, 3, 4):
        expected = softmax / sum(levels.bytes(level, t) for t in finals)
        assert bound(f"static:{level}")["capacity_vs_softmax"] == pytest.approx(expected)
    caps = [1, 1, 2, 2]  # < 2K, 2K-4K, 4K-8K, >= 8K of 4 layers
    assert bound("length-caps")["capacity_vs_softmax"] == pytest.approx(softmax / sum(levels.bytes(k, t) for k, t in zip(caps, finals)))
    assert bound("memory:max-level=3")["capacity_vs_softmax"] == pytest.approx(bound("static:3")["capacity_vs_softmax"])
    short = [ReplayRequest(0.0, [5] * 4, 2, 0, 0)]
    assert memory_bound(levels, parse_policy("static:4", levels), short, budget=10**9)["capacity_vs_softmax"] < 1


def test_replay_profiles_engine_steps_per_policy(tmp_path):
    trace = [TraceRequest(i * 0.01, 12, 3) for i in range(4)]
    requests = augment(trace, torch.arange(3, 128), seed=0, max_prompt=100)
    result = run_replay(lambda policy: tiny_engine(policy)[1], requests, ["softmax", "static:50%", "softmax"], out_dir=tmp_path,
                        profile_steps=3, profile_from=2)  # fmt: skip
    assert list(result["policies"]) == ["softmax", "static:50%", "softmax#2"]  # the repeat is a control run
    assert result["policies"]["softmax#2"]["completed"] == 4
    for name in ("profile_softmax.txt", "profile_static-50pct.txt", "profile_softmax-run2.txt"):
        text = (tmp_path / name).read_text()
        assert "engine steps under torch.profiler" in text and "aten::" in text


def test_writing_a_profile_delays_no_request(tmp_path, monkeypatch):
    """The profile's table takes seconds to build on a GPU; the replay's clock stands still meanwhile."""
    import time

    import linearize.serve.replay as replay_module

    write = replay_module._write_profile

    def slow_write(*args, **kwargs):
        write(*args, **kwargs)
        time.sleep(1.5)

    monkeypatch.setattr(replay_module, "_write_profile", slow_write)
    requests = augment([TraceRequest(i * 0.05, 12, 8) for i in range(3)], torch.arange(3, 128), seed=0, max_prompt=100)
    out = tmp_path / "profile.txt"
    records, timeline = replay_module.replay_engine(tiny_engine("softmax")[1], requests, profile_steps=2, profile_from=1,
                                                    profile_out=out, progress=False)  # fmt: skip
    assert "engine steps under torch.profiler" in out.read_text()
    assert all(r.finish is not None and len(r.token_times) == 8 for r in records)
    stamps = [s["t"] for s in timeline]
    assert max(b - a for a, b in zip(stamps, stamps[1:])) < 1.0  # no step carries the 1.5 s write
    assert max(r.finish - r.arrival for r in records) < 1.5


@pytest.mark.slow
def test_replay_command_writes_a_report(tmp_path):
    """`linearize replay` on a saved tiny family and a Mooncake trace: report and plots, nothing lost."""
    from linearize.cli import main
    from linearize.convert import convert
    from linearize.hub import build_tiny_llama, build_tiny_tokenizer
    from linearize.spec import ConversionSpec

    model = build_tiny_llama(0, num_hidden_layers=4)
    convert(model, ConversionSpec.from_dict({"attention": "dsla", "order": [2, 0, 3, 1]}))
    model.save_pretrained(tmp_path / "tiny")
    build_tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i * 100, "input_length": 20 + i, "output_length": 3}) for i in range(6)) + "\n")
    assert main(["replay", "--model", str(tmp_path / "tiny"), "--trace", str(trace), "--policies", "softmax,memory",
                 "--kv-budget", "300000", "--device", "cpu", "--out", str(tmp_path / "out")]) == 0  # fmt: skip
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report["policies"]) == {"softmax", "memory"}
    assert all(m["lost"] == 0 and m["completed"] == 6 for m in report["policies"].values())
    assert (tmp_path / "out" / "latency_cdf.png").exists()


def test_each_policy_releases_its_engine_before_the_next_starts():
    """A policy's pools must be gone before the next policy builds its own: on a GPU both at once need
    twice the memory, and the next policy's steps would run short of it."""
    import gc
    import weakref

    gc.collect()
    engines = []

    def factory(policy):
        alive = [ref for ref in engines if ref() is not None]
        assert not alive, f"{len(alive)} earlier engine(s) still alive when policy {policy} starts"
        engine = tiny_engine(policy)[1]
        engines.append(weakref.ref(engine))
        return engine

    requests = augment([TraceRequest(i * 0.01, 12, 3) for i in range(3)], torch.arange(3, 128), seed=0, max_prompt=100)
    result = run_replay(factory, requests, ["softmax", "static:50%", "softmax"])
    assert len(engines) == 3 and all(p["completed"] == 3 for p in result["policies"].values())


def _summary(mean: float, p99: float | None = None, lost: int = 0) -> dict:
    return {"normalized_latency_s": {"mean": mean, "p99": p99 or 2 * mean}, "ttft_s": {"mean": 10 * mean}, "lost": lost}


def test_runs_of_a_policy_are_reported_together():
    """Means, ranges and the ratio over each policy's runs; a policy is apart from softmax only when
    every run of it is faster (or slower) than every softmax run."""
    policies = {"softmax": _summary(0.20), "memory": _summary(0.10), "length-caps": _summary(0.22), "static:25%": _summary(0.5),
                "softmax#2": _summary(0.25), "memory#2": _summary(0.12, lost=1), "length-caps#2": _summary(0.30)}  # fmt: skip
    across = across_runs(policies)
    assert list(across) == ["softmax", "memory", "length-caps", "static:25%"]
    assert across["softmax"]["runs"] == 2 and across["softmax"]["normalized_latency_mean_s"] == pytest.approx(0.225)
    memory = across["memory"]
    assert (memory["normalized_latency_min_s"], memory["normalized_latency_max_s"], memory["lost"]) == (0.10, 0.12, 1)
    assert memory["speedup_vs_softmax"] == pytest.approx(0.225 / 0.11) and memory["apart_from_softmax"] is True
    assert across["length-caps"]["apart_from_softmax"] is False  # 0.22-0.30 overlaps softmax's 0.20-0.25
    assert across["static:25%"]["runs"] == 1 and across["static:25%"]["apart_from_softmax"] is None  # one run: no range
    assert across["softmax"]["apart_from_softmax"] is None
    assert across_runs({"softmax": _summary(0.2), "memory": _summary(0.1)}) == {}  # every policy once: nothing to add
    assert (base_policy("softmax#12"), base_policy("static:25%"), base_policy("a#b")) == ("softmax", "static:25%", "a#b")


def test_repeats_replay_the_policy_list_in_turn(tmp_path):
    settings = ReplaySettings(policies="softmax,memory", repeats=2)
    assert settings.run_list() == ["softmax", "memory", "softmax", "memory"]
    requests = augment([TraceRequest(i * 0.02, 14, 3) for i in range(4)], torch.arange(3, 128), seed=0, max_prompt=100)
    result = run_replay(lambda policy: tiny_engine(policy)[1], requests, settings.run_list(), out_dir=tmp_path)
    assert list(result["policies"]) == ["softmax", "memory", "softmax#2", "memory#2"]
    assert {p: a["runs"] for p, a in result["across_runs"].items()} == {"softmax": 2, "memory": 2}
    assert result["across_runs"]["memory"]["apart_from_softmax"] in (True, False)
    assert "Across runs" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["across_runs"]["softmax"]["lost"] == 0
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        ReplaySettings(repeats=0)
    with pytest.raises(ValueError, match="repeated runs are in process only"):
        ReplaySettings(url="http://localhost:8000", repeats=2)


def _report(rate: float, means: dict[str, float], **across) -> dict:
    policies = {p: {**_summary(m), "speedup_vs_softmax": means["softmax"] / m} for p, m in means.items()}
    result = {"settings": {"model": "m", "rate_scale": rate, "requests": 7}, "policies": policies}
    if across:
        result["across_runs"] = across
    return result


def test_a_sweep_reports_each_policy_against_the_rate():
    """Rates in order; per policy one entry per rate with its mean, range and ratio to softmax (the
    runs together where a rate's replay repeated the policies); the table has a row per rate."""
    two_runs = across_runs({"softmax": _summary(0.4), "memory": _summary(0.1), "softmax#2": _summary(0.6), "memory#2": _summary(0.3)})
    sweep = sweep_report({2.0: _report(2.0, {"softmax": 0.2, "memory": 0.1}), 6.0: _report(6.0, {"softmax": 0.5, "memory": 0.2}, **two_runs)})
    assert sweep["rate_scales"] == [2.0, 6.0] and sweep["settings"] == {"model": "m", "requests": 7}
    memory = sweep["policies"]["memory"]
    assert [e["rate_scale"] for e in memory] == [2.0, 6.0]
    assert memory[0]["normalized_latency_mean_s"] == 0.1 and memory[0]["speedup_vs_softmax"] == pytest.approx(2.0)
    assert memory[0]["runs"] == 1 and memory[0]["normalized_latency_min_s"] == memory[0]["normalized_latency_max_s"] == 0.1
    assert memory[1]["runs"] == 2 and memory[1]["normalized_latency_mean_s"] == pytest.approx(0.2)  # the runs' mean, not the report's
    assert (memory[1]["normalized_latency_min_s"], memory[1]["normalized_latency_max_s"]) == (0.1, 0.3)
    assert memory[1]["speedup_vs_softmax"] == pytest.approx(0.5 / 0.2)
    table = sweep_markdown(sweep)
    assert "| 2 | 200.0 | 100.0 | 2.00x | 400 | 200 | 0 |" in table
    assert "| 6 | 500.0 | 200.0 | 2.50x |" in table
    with pytest.raises(ValueError, match="at least one replay"):
        sweep_report({})
    bounded = _report(2.0, {"softmax": 0.2, "memory": 0.1})
    bounded["policies"]["memory"]["memory_bound"] = {"capacity_vs_softmax": 1.32, "bytes_vs_softmax": 1 / 1.32}
    assert "Memory bound (the same at every rate" in sweep_markdown(sweep_report({2.0: bounded}))
    assert "): memory 1.32x." in sweep_markdown(sweep_report({2.0: bounded}))
    assert "Memory bound" not in table


def test_rate_scales_parse_and_bad_ones_are_named():
    assert ReplaySettings(rate_scales="2,3,4.5").rate_list() == [2.0, 3.0, 4.5]
    assert ReplaySettings(rate_scale=8).rate_list() == [8.0]
    for bad, part in (("2,x", "'x'"), ("2,2", "'2'"), ("0", "'0'"), ("3,-1", "'-1'")):
        with pytest.raises(ValueError, match=f"rate-scales '{bad}': {part} is not a new number > 0"):
            ReplaySettings(rate_scales=bad)
    with pytest.raises(ValueError, match="rate-scale 8 and rate-scales '2,3': give one"):
        ReplaySettings(rate_scale=8, rate_scales="2,3")


def test_replay_command_sweeps_the_rate(tmp_path):
    """`linearize replay --rate-scales A,B`: a report per rate in OUT/rate-X/, and the sweep's report
    and plot in OUT, every request accounted for at every rate (a memory policy with its own marks)."""
    from linearize.cli import main

    assert main(["replay", "--model", "random:tiny", "--device", "cpu", "--kv-budget", "64MiB", "--trace", "azure-code", "--start", "588",
                 "--requests", "3", "--max-prompt", "64", "--rate-scales", "10,40", "--policies", "memory:high=1.0:max-level=2",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    for rate in ("10", "40"):
        report = json.loads((tmp_path / f"rate-{rate}" / "report.json").read_text())
        assert report["settings"]["rate_scale"] == float(rate)
        assert all((m["completed"], m["lost"]) == (3, 0) for m in report["policies"].values())
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["rate_scales"] == [10.0, 40.0] and list(sweep["policies"]) == ["memory:high=1.0:max-level=2"]
    assert [e["rate_scale"] for e in sweep["policies"]["memory:high=1.0:max-level=2"]] == [10.0, 40.0]
    assert sweep["memory_bound"]["memory:high=1.0:max-level=2"] > 0  # each in-process report gives its policy's bound
    assert (tmp_path / "latency_vs_rate.png").stat().st_size > 0 and "| 40 |" in (tmp_path / "sweep.md").read_text()


def test_the_memory_bound_script_bounds_a_window_without_replaying_it(tmp_path):
    """scripts/memory_bound.py: the replay's requests of a window (prompts capped as the replay caps them)
    and each policy's bound, the same numbers memory_bound gives on those requests."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "memory_bound.py"
    subprocess.run([sys.executable, str(script), str(tmp_path), "--model", "random:tiny", "--requests", "12", "--max-prompt", "3000",
                    "--policies", "length-caps,static:100%"], check=True, capture_output=True)  # fmt: skip
    result = json.loads((tmp_path / "memory_bound.json").read_text())
    assert result["requests"] == 12 and result["max_prompt"] == 3000 and sum(result["prompts_by_length_cap"].values()) == 12
    assert result["policies"]["softmax"]["capacity_vs_softmax"] == pytest.approx(1.0)
    from linearize.serve.levels import LevelMemory
    from linearize.serve.random_family import dsla_spec, random_config
    from linearize.spec import ConversionSpec

    levels = LevelMemory.from_spec(ConversionSpec.from_dict(dsla_spec(4)), random_config("random:tiny"), 2)
    trace = load_trace(TRACES / "azure_llm_2023_conv.csv")[:12]
    requests = augment(trace, torch.arange(3, 4099), max_prompt=3000)
    expected = memory_bound(levels, parse_policy("static:100%", levels), requests, budget=1 << 30)
    assert result["policies"]["static:100%"]["capacity_vs_softmax"] == pytest.approx(expected["capacity_vs_softmax"])
    assert "| length-caps |" in (tmp_path / "memory_bound.md").read_text()
    demand = result["demand_at_rate_scale_1"]  # the window's arrival span and tokens asked for
    span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
    assert demand["span_s"] == pytest.approx(span) and demand["output_tokens"] == sum(r.output_tokens for r in requests)
    assert demand["output_tokens_per_s"] == pytest.approx(demand["output_tokens"] / span)
    assert demand["prompt_tokens"] == sum(len(r.prompt) for r in requests)
