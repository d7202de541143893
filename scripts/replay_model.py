"""A trace replay on a model of the engine's steps (``linearize.serve.simulate``): the engine's own
scheduling and policies on a virtual clock, each step costing what a replay measured on the GPU
says it costs. For choosing the windows, rates and budgets worth replaying on the GPU, and for
seeing why a measured ratio is what it is; not a measurement.

    python scripts/replay_model.py OUT --costs REPORT [REPORT ...] [--model smollm2-135m-dsla-chained]
        [--kv-budget 256MiB] [--max-level 15] [--trace azure-conv] [--start 0] [--requests 100]
        [--max-prompt 8192] [--policies softmax,length-caps] [--rates 0.75,1,1.25] [--horizon 600]
        [--costs-as softmax]

REPORT: ``linearize replay`` reports (report.json or .json.gz), each holding its policies' timelines;
every policy is costed from its own replay in the first report that has one (``--costs-as P``: a
policy no report replayed is costed as P). The requests are those ``linearize replay`` makes of the window
(``scripts/memory_bound.py``'s stand-in prompts: only their lengths count). Writes OUT/replay_model.json
and OUT/replay_model.md: per rate and policy the mean, p50 and p99 of the latency per output token,
TTFT, throughput and mean running requests, and each policy's mean against softmax's.
"""

from __future__ import annotations

import argparse
import functools
import json
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


def plot(rows: list[dict], policies: list[str], path: Path, title: str) -> None:
    """Mean latency per output token against the rate scale (model lines, measured points), and each
    policy's mean against softmax's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for i, policy in enumerate(policies):
        mine = [r for r in rows if r["policy"] == policy]
        rates = [r["rate_scale"] for r in mine]
        color = f"C{i}"
        ax.plot(rates, [1e3 * r["normalized_latency_s"]["mean"] for r in mine], "-", color=color, label=f"{policy} (model)")
        seen = [r for r in mine if "measured" in r]
        if seen:
            ax.plot([r["rate_scale"] for r in seen], [1e3 * r["measured"]["normalized_latency_mean_s"] for r in seen], "o", color=color,
                    label=f"{policy} (measured)")  # fmt: skip
        if policy != "softmax":
            bx.plot(rates, [r["speedup_vs_softmax"] or 0 for r in mine], "-", color=color, label=f"{policy} (model)")
            if seen:
                bx.plot([r["rate_scale"] for r in seen], [r["measured"]["speedup_vs_softmax"] for r in seen], "o", color=color,
                        label=f"{policy} (measured)")  # fmt: skip
    bx.axhline(2.29, color="gray", ls=":", label="2.29x (DSLA-Serve, length caps)")
    ax.set(xlabel="rate scale", ylabel="mean latency per output token (ms)", yscale="log", title=title)
    bx.set(xlabel="rate scale", ylabel="mean vs softmax (x)", title="against softmax")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--costs", type=Path, nargs="+", required=True,
                        help="replay reports (report.json or report.json.gz); each policy is costed from the first holding its timeline")
    parser.add_argument("--costs-as", default=None, metavar="POLICY",
                        help="cost the policies no report holds a timeline of as this policy (e.g. softmax: what a policy would give if its steps cost what softmax's do)")
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
    parser.add_argument("--measured", type=Path, default=None,
                        help="a replay sweep's sweep.json on the same window: its measured means beside the model's, and in the plot")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rates = [float(r) for r in args.rates.split(",")]
    if not policies or any(r <= 0 for r in rates):
        parser.error(f"needs policies and positive rates, got {args.policies!r} and {args.rates!r}")
    @functools.cache
    def fitted(policy: str) -> tuple[StepCosts, str] | None:
        """The policy's step costs from the first report holding its timeline, and that report."""
        for report in args.costs:
            try:
                return StepCosts.from_report(report, policy), str(report)
            except ValueError:
                continue
        return None

    costs, sources = {}, {}
    for policy in policies:
        found = fitted(policy)
        if found is None and args.costs_as and fitted(args.costs_as) is not None:
            found = fitted(args.costs_as)[0], f"{fitted(args.costs_as)[1]}, as {args.costs_as}"
        if found is None:
            parser.error(f"no report among {[str(r) for r in args.costs]} holds a timeline of policy {policy!r}"
                         + (f" or of --costs-as {args.costs_as!r}" if args.costs_as else "; --costs-as POLICY costs it as a policy one does"))
        costs[policy], sources[policy] = found

    replay = ReplaySettings(trace=args.trace, start=args.start, requests=args.requests, max_prompt=args.max_prompt)
    trace = load_trace(replay.trace_path())[args.start : args.start + args.requests]
    if not trace:
        raise SystemExit(f"start {args.start} is past the trace's end")
    levels, config = family_levels(args.model, args.dtype_bytes)
    requests = augment(trace, torch.arange(4096) % config.vocab_size, turns_mean=replay.turns_mean,
                       max_prompt=max(1, prompt_cap(trace, args.max_prompt, config.max_position_embeddings)),
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
    measured = {}
    if args.measured is not None:
        sweep = json.loads(args.measured.read_text())
        measured = {(m["rate_scale"], p): m for p, runs in sweep["policies"].items() for m in runs}
        for row in rows:
            m = measured.get((row["rate_scale"], row["policy"]))
            if m is not None:
                row["measured"] = {"normalized_latency_mean_s": m["normalized_latency_mean_s"], "speedup_vs_softmax": m["speedup_vs_softmax"],
                                   "model_over_measured": row["normalized_latency_s"]["mean"] / m["normalized_latency_mean_s"]}  # fmt: skip
    result = {"model": args.model, "trace": args.trace, "start": args.start, "requests": len(requests), "kv_budget": args.kv_budget,
              "costs_from": sources, "rows": rows}  # fmt: skip
    lines = [f"# Replay on a model of the engine's steps\n\n{args.model}, {args.trace} requests {args.start}..{args.start + len(requests) - 1}, "
             f"KV budget {args.kv_budget}; each policy's step costs fitted on its replay in " + ", ".join(f"`{v}` ({k})" for k, v in sources.items())
             + ". Simulated, not measured.\n",
             "| rate | policy | ms/token mean | p50 | p99 | vs softmax | TTFT mean s | out tok/s | mean running | lost |"
             + (" measured ms/token | measured vs softmax |" if measured else ""),
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if measured else "")]  # fmt: skip
    for r in rows:
        n = r["normalized_latency_s"]
        vs = f"{r['speedup_vs_softmax']:.2f}x" if r["speedup_vs_softmax"] else ""
        m = r.get("measured")
        extra = (f" {1e3 * m['normalized_latency_mean_s']:.2f} | {m['speedup_vs_softmax']:.2f}x |" if m else " | |") if measured else ""
        lines.append(f"| {r['rate_scale']:g} | {r['policy']} | {1e3 * n['mean']:.2f} | {1e3 * n['p50']:.2f} | {1e3 * n['p99']:.1f} | {vs} | "
                     f"{r['ttft_s']['mean']:.2f} | {r['output_throughput'] or 0:.0f} | {r['mean_running']:.2f} | {r['lost']} |{extra}")  # fmt: skip
    lines.append("\nStep costs (s): " + "; ".join(f"{p}: " + ", ".join(f"{k} {v:.3g}" for k, v in c.__dict__.items()) for p, c in costs.items()))
    markdown = "\n".join(lines) + "\n"
    write_results(args.out, "replay_model", result, markdown, indent=1)
    plot(rows, policies, args.out / "replay_model.png", f"{args.model}, requests {args.start}..{args.start + len(requests) - 1}")
    print(markdown)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
