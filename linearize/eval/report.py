"""Running an evaluation suite and reading its results.

A suite (``linearize.eval.suite``: ``quick`` or ``full``) runs held-out perplexity by context
length, the synthetic long-context tasks and the multiple-choice / LAMBADA tasks through
lm-evaluation-harness; ``run_suite`` returns one JSON-able dict, ``headline`` its main numbers and
``merge_results`` joins partial reports. ``linearize.eval.markdown`` renders results and
``linearize.eval.ablation`` runs a suite under each component mode.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable

import torch

from ..data import DataConfig
from .suite import EvalSuite

logger = logging.getLogger(__name__)

HELDOUT_ROW = 64


def run_suite(
    model,
    tokenizer,
    suite: EvalSuite,
    *,
    data_dir: str | None = None,
    device=None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every part of ``suite`` on ``model`` as it is (its current modes).

    ``on_update(result)``, if given, is called with the result so far after each finished part
    (perplexity, each synthetic task and length, the multiple-choice tasks), so that a run stopped
    midway still leaves what it measured (``linearize eval --out`` writes it as report.partial.*).
    """
    from .perplexity import heldout_tokens, perplexity_by_length
    from .synthetic import check_lengths, run_synthetic

    start = time.perf_counter()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    result: dict[str, Any] = {"suite": suite.name}

    def update() -> None:
        if on_update is not None:
            on_update(copy.deepcopy({**result, "seconds": round(time.perf_counter() - start, 2)}))  # a snapshot

    if suite.synthetic_tasks:
        check_lengths(model, suite.synthetic_lengths)  # a bad length fails before anything runs
    if suite.mc_tasks and data_dir is not None:
        from .harness import resolve_tasks

        resolve_tasks(suite.mc_tasks, data_dir=data_dir)  # an unknown task fails before anything runs
    if suite.perplexity_lengths:
        data = DataConfig(source=suite.heldout_source, seq_len=HELDOUT_ROW)  # the split is by document: any row length
        tokens = heldout_tokens(tokenizer, data, max_tokens=suite.perplexity_tokens)
        result["perplexity"] = perplexity_by_length(model, tokens, suite.perplexity_lengths, batch_size=1, device=device)
        update()
    if suite.synthetic_tasks:
        synthetic: dict[str, Any] = {}
        result["synthetic"] = synthetic
        for task in suite.synthetic_tasks:
            for length in suite.synthetic_lengths:
                part = run_synthetic(model, tokenizer, [task], [length], suite.samples(task),
                                     seed=suite.seed, batch_size=suite.batch_size, device=device, examples=2)
                synthetic.setdefault(task, {}).update(part[task])
                update()
    if suite.mc_tasks:
        if data_dir is None:
            logger.warning("multiple-choice tasks skipped: pass data_dir (e.g. linearize.data.EVAL_DATA) to run them offline")
            result["mc_skipped"] = "no data_dir given"
        else:
            from .harness import evaluate_tasks

            result["mc"] = evaluate_tasks(model, tokenizer, suite.mc_tasks, data_dir=data_dir, limit=suite.mc_limit,
                                          batch_size=suite.batch_size, device=device)
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def headline(result: dict[str, Any]) -> dict[str, float]:
    """Flat metric -> value of a suite result (higher is better except ppl)."""
    out: dict[str, float] = {}
    for row in result.get("perplexity", []):
        if "ppl" in row:
            out[f"ppl@{row['length']}"] = row["ppl"]
    for task, by_length in result.get("synthetic", {}).items():
        for length, row in by_length.items():
            out[f"{task}@{length}"] = row["score"]
    for task, row in result.get("mc", {}).items():
        for metric in ("acc", "acc_norm"):
            if row.get(metric) is not None:
                out[f"{task} {metric}"] = 100 * row[metric]
        if row.get("perplexity") is not None:
            out[f"{task} ppl"] = row["perplexity"]
    return out


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One suite result from several (pieces of a suite run apart, partial reports of runs that died):
    perplexity rows by length, synthetic scores by (task, length), multiple-choice rows by task; where
    two parts measured the same thing, the later part wins."""
    perplexity: dict[int, dict[str, Any]] = {}
    synthetic: dict[str, dict[Any, dict[str, Any]]] = {}
    mc: dict[str, dict[str, Any]] = {}
    for part in parts:
        for row in part.get("perplexity", []):
            perplexity[row["length"]] = row
        for task, by_length in part.get("synthetic", {}).items():
            synthetic.setdefault(task, {}).update(by_length)
        mc.update(part.get("mc", {}))
    merged: dict[str, Any] = {"suite": "merged", "parts": len(parts)}
    if perplexity:
        merged["perplexity"] = [perplexity[k] for k in sorted(perplexity)]
    if synthetic:
        merged["synthetic"] = {t: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for t, v in synthetic.items()}
    if mc:
        merged["mc"] = mc
    return merged


