"""A trace replay on a model of the engine's steps (``linearize.serve.simulate``): the engine's own
scheduling and policies on a virtual clock, each step costing what a replay measured on the GPU
says it costs. For choosing the windows, rates and budgets worth replaying on the GPU, and for
seeing why a measured ratio is what it is; not a measurement.

    python scripts/replay_model.py OUT --costs REPORT [--model smollm2-135m-dsla-chained]
        [--kv-budget 256MiB] [--max-level 15] [--trace azure-conv] [--start 0] [--requests 100]
        [--max-prompt 8192] [--policies softmax,length-caps] [--rates 0.75,1,1.25] [--horizon 600]

REPORT: a ``linearize replay`` report.json(.gz) holding each policy's timeline; every policy is
costed from its own replay there. The requests are those ``linearize replay`` makes of the window
(``scripts/memory_bound.py``'s stand-in prompts: only their lengths count). Writes OUT/replay_model.json
and OUT/replay_model.md: per rate and policy the mean, p50 and p99 of the latency per output token,
TTFT, throughput and mean running requests, and each policy's mean against softmax's.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from linearize.io import write_results
from linearize.serve.engine import EngineConfig
from linearize.serve.policy import parse_policy
from linearize.serve.replay import augment, load_trace, prompt_cap
from linearize.serve.settings import ReplaySettings, parse_bytes
from linearize.serve.simulate import StepCosts, simulate_replay, simulated_summary

from memory_bound import family_levels  # scripts/ is this script's directory


def family_config(model: str):
    from linearize.serve.random_family import is_random, random_config

    if is_random(model):
        return random_config(model)
    from linearize.api import load_model

    return load_model(model, device="cpu")[0].config


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--costs", type=Path, required=True, help="a replay report (report.json or report.json.gz) with each policy's timeline")
    parser.add_argument("--model", default="smollm2-135m-dsla-chained")
    parser.add_argument("--kv-budget", default="256MiB")
    parser.add_argument("--max-level", type=int, default=None, help="the memory policy's highest level")
    parser.add_argument("--max-step-tokens", type=int, default=512)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--trace", default="azure-conv")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=8192)
    parser.add_argument("--policies", default="softmax,length-caps")
    parser.add_argument("--rates", default="1", help="comma-separated rate scales")
    parser.add_argument("--horizon", type=float, default=None, help="virtual seconds after which a replay stops (unfinished requests counted)")
    parser.add_argument("--dtype-bytes", type=int, default=2)
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rates = [float(r) for r in args.rates.split(",")]
    if not policies or any(r <= 0 for r in rates):
        parser.error(f"needs policies and positive rates, got {args.policies!r} and {args.rates!r}")
    costs = {p: StepCosts.from_report(args.costs, p) for p in policies}

    replay = ReplaySettings(trace=args.trace, start=args.start, requests=args.requests, max_prompt=args.max_prompt)
    trace = load_trace(replay.trace_path())[args.start : args.start + args.requests]
    if not trace:
        raise SystemExit(f"start {args.start} is past the trace's end")
    levels, positions = family_levels(args.model, args.dtype_bytes)
    config = family_config(args.model)
    requests = augment(trace, torch.arange(4096) % config.vocab_size, turns_mean=replay.turns_mean, max_prompt=max(1, prompt_cap(trace, args.max_prompt, positions)),
                       seed=replay.seed)  # fmt: skip
    engine_config = EngineConfig(kv_budget=int(parse_bytes(args.kv_budget)), max_step_tokens=args.max_step_tokens, max_running=args.max_running)
    rows = []
    for rate in tqdm(rates, desc="rates"):
        for policy in policies:
            records, timeline = simulate_replay(levels, config, engine_config, parse_policy(policy, levels, max_level=args.max_level), requests,
                                                costs[policy], rate_scale=rate, horizon_s=args.horizon)  # fmt: skip
            rows.append({"rate_scale": rate, "policy": policy, **simulated_summary(records, timeline, costs[policy])})
    for row in rows:
        base = next((r for r in rows if r["rate_scale"] == row["rate_scale"] and r["policy"] == "softmax"), None)
        mean = row["normalized_latency_s"]["mean"]
        row["speedup_vs_softmax"] = base["normalized_latency_s"]["mean"] / mean if base is not None and mean else None
    result = {"model": args.model, "trace": args.trace, "start": args.start, "requests": len(requests), "kv_budget": args.kv_budget,
              "costs_from": str(args.costs), "rows": rows}  # fmt: skip
    lines = [f"# Replay on a model of the engine's steps\n\n{args.model}, {args.trace} requests {args.start}..{args.start + len(requests) - 1}, "
             f"KV budget {args.kv_budget}; step costs fitted on `{args.costs}`. Simulated, not measured.\n",
             "| rate | policy | ms/token mean | p50 | p99 | vs softmax | TTFT mean s | out tok/s | mean running | lost |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        n = r["normalized_latency_s"]
        vs = f"{r['speedup_vs_softmax']:.2f}x" if r["speedup_vs_softmax"] else ""
        lines.append(f"| {r['rate_scale']:g} | {r['policy']} | {1e3 * n['mean']:.2f} | {1e3 * n['p50']:.2f} | {1e3 * n['p99']:.1f} | {vs} | "
                     f"{r['ttft_s']['mean']:.2f} | {r['output_throughput'] or 0:.0f} | {r['mean_running']:.2f} | {r['lost']} |")  # fmt: skip
    lines.append("\nStep costs (s): " + "; ".join(f"{p}: " + ", ".join(f"{k} {v:.3g}" for k, v in c.__dict__.items()) for p, c in costs.items()))
    markdown = "\n".join(lines) + "\n"
    write_results(args.out, "replay_model", result, markdown, indent=1)
    print(markdown)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
