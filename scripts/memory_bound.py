"""The most each conversion policy can gain where memory bounds the batch, on a trace window, without replaying it.

    python scripts/memory_bound.py OUT [--model smollm2-135m-dsla-chained] [--trace azure-conv] [--start 0]
        [--requests 100] [--max-prompt 8192] [--policies length-caps,static:25%,static:50%,static:100%]

The requests are those ``linearize replay`` makes of the same window (its session augmentation, seed and
prompt cap; only their lengths count here, so the prompt text is a stand-in). For each policy, every
request at its final length (prompt + output) and at the level the policy gives it with memory full,
against every request at level 0: ``linearize.serve.replay.memory_bound``, the "memory bound" column of
every replay report. Bytes are the serving dtype's (bfloat16: 2 bytes; ``--dtype-bytes``). Also the window's
demand at the trace's own rate (``--rate-scale 1``): its arrival span and the output and prompt tokens per
second it asks for (``--rate-scale r`` asks r times as many), to set against a policy's saturated
throughput. Writes OUT/memory_bound.json and OUT/memory_bound.md.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from linearize.io import write_results
from linearize.serve.levels import LevelMemory
from linearize.serve.policy import LENGTH_CAPS, parse_policy
from linearize.serve.random_family import dsla_spec, is_random, random_config, random_shape
from linearize.serve.replay import augment, load_trace, memory_bound, prompt_cap
from linearize.serve.settings import ReplaySettings
from linearize.spec import ConversionSpec


def family_levels(model: str, dtype_bytes: int) -> tuple[LevelMemory, Any]:
    """(LevelMemory, model config) of a nested family: a random one from its shape, a saved one loaded on the CPU."""
    if is_random(model):
        config = random_config(model)
        spec = dsla_spec(random_shape(model).layers)
    else:
        from linearize.api import load_model

        loaded, _ = load_model(model, device="cpu")
        config, spec = loaded.config, loaded.config.linearize
    return LevelMemory.from_spec(ConversionSpec.from_dict(spec), config, dtype_bytes), config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="smollm2-135m-dsla-chained")
    parser.add_argument("--trace", default="azure-conv")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=8192)
    parser.add_argument("--policies", default="length-caps,static:25%,static:50%,static:100%")
    parser.add_argument("--dtype-bytes", type=int, default=2)
    args = parser.parse_args()

    replay = ReplaySettings(trace=args.trace, start=args.start, requests=args.requests, max_prompt=args.max_prompt)
    trace = load_trace(replay.trace_path())[args.start : args.start + args.requests]
    if not trace:
        raise SystemExit(f"start {args.start} is past the trace's end")
    levels, config = family_levels(args.model, args.dtype_bytes)
    max_prompt = max(1, prompt_cap(trace, args.max_prompt, config.max_position_embeddings))
    requests = augment(trace, torch.arange(3, 4099), turns_mean=replay.turns_mean, max_prompt=max_prompt, seed=replay.seed)
    prompts = [len(r.prompt) for r in requests]
    edges = [0] + [int(below) if below != float("inf") else None for below, _ in LENGTH_CAPS]
    classes = {f"{lo}-{hi or ''}": sum(1 for n in prompts if n >= lo and (hi is None or n < hi)) for lo, hi in zip(edges, edges[1:])}
    bounds = {}
    for policy in ["softmax", *[p.strip() for p in args.policies.split(",") if p.strip() and p.strip() != "softmax"]]:
        bounds[policy] = memory_bound(levels, parse_policy(policy, levels), requests, budget=1 << 30)
    span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
    outputs = sum(r.output_tokens for r in requests)
    demand = {"span_s": span, "output_tokens": outputs, "prompt_tokens": sum(prompts),
              "output_tokens_per_s": outputs / span if span > 0 else None, "prompt_tokens_per_s": sum(prompts) / span if span > 0 else None}
    result = {"model": args.model, "trace": args.trace, "start": args.start, "requests": len(requests), "max_prompt": max_prompt,
              "dtype_bytes": args.dtype_bytes, "prompt_mean": statistics.mean(prompts), "prompt_max": max(prompts),
              "prompts_by_length_cap": classes, "demand_at_rate_scale_1": demand, "policies": bounds}  # fmt: skip
    lines = [f"# Memory bound\n\n{args.model}, {args.trace} requests {args.start}..{args.start + len(requests) - 1}, prompts "
             f"capped at {max_prompt} tokens (mean {result['prompt_mean']:.0f}, at most {result['prompt_max']}; by length-caps' "
             "classes: " + ", ".join(f"{k} tokens {v}" for k, v in classes.items()) + f"), {args.dtype_bytes}-byte values.\n",
             "Each request at its final length (prompt + output) and at the level the policy gives it with memory full, against "
             "every request at level 0.\n", "| policy | bytes vs softmax | memory bound (requests held vs softmax) |", "|---|---:|---:|"]  # fmt: skip
    lines += [f"| {p} | {b['bytes_vs_softmax']:.3f} | {b['capacity_vs_softmax']:.2f}x |" for p, b in bounds.items()]
    if span > 0:
        lines.append(f"\nAt the trace's own rate (`--rate-scale 1`) the requests arrive over {span:.0f} s and ask for "
                     f"{demand['output_tokens_per_s']:.0f} output and {demand['prompt_tokens_per_s']:.0f} prompt tokens/s "
                     f"({outputs} and {sum(prompts)} in all); `--rate-scale r` asks r times as many per second.")
    markdown = "\n".join(lines) + "\n"
    write_results(args.out, "memory_bound", result, markdown, indent=1)
    print(markdown)


if __name__ == "__main__":
    main()
