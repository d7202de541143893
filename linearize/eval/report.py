"""Evaluation suites, reports, model comparison and component ablations.

A suite (``quick`` or ``full``) runs held-out perplexity by context length, the synthetic
long-context tasks and the multiple-choice / LAMBADA tasks through lm-evaluation-harness, and
returns one JSON-able dict; ``to_markdown`` renders it. ``ablate`` runs a suite under each component
mode (hybrid, swa_only, la_only, sinks_only, none; LoLA: hybrid, no_state, no_sparse, window_only;
DSLA: hybrid, history_only, recent_only, sinks_only, none) and reports
Delta_LA = score(hybrid) - score(swa_only): a conversion whose Delta_LA is ~0 has not learned
linear attention, whatever its total score.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..convert import kept_modes, running_layers, set_mode
from ..layers.registry import KINDS
from ..data import DataConfig

logger = logging.getLogger(__name__)

HELDOUT_ROW = 64


@dataclass
class EvalSuite:
    """What one evaluation runs."""

    name: str = "quick"
    """Suite name (quick | full | custom)."""
    heldout_source: str = "wiki"
    """Held-out text for perplexity (a data source: wiki, essays, a local file, ...): the documents
    that source holds out under seed 0 and the default held-out fraction, i.e. exactly those the
    training recipes never see."""
    perplexity_lengths: list[int] = field(default_factory=lambda: [512, 1024])
    """Context lengths of the sliding-window perplexity."""
    perplexity_tokens: int | None = 16384
    """At most this many held-out tokens per length (None: all)."""
    synthetic_tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "passkey"])
    """Synthetic long-context tasks (RULER names + passkey)."""
    synthetic_lengths: list[int] = field(default_factory=lambda: [1024])
    """Target prompt lengths in the model's tokens."""
    synthetic_samples: dict[str, int] = field(default_factory=lambda: {"default": 10})
    """Samples per task and length: task name -> n, 'default' for the rest."""
    mc_tasks: list[str] = field(default_factory=lambda: ["copa", "piqa"])
    """lm-evaluation-harness tasks (local: piqa, winogrande, copa, openbook_qa, lambada_openai)."""
    mc_limit: int | None = 100
    """Documents per multiple-choice task (None: all)."""
    batch_size: int = 8
    """Batch size of generation and scoring."""
    seed: int = 0

    def samples(self, task: str) -> int:
        return self.synthetic_samples.get(task, self.synthetic_samples.get("default", 10))


SUITES: dict[str, EvalSuite] = {
    "quick": EvalSuite(),
    "full": EvalSuite(
        name="full",
        perplexity_lengths=[512, 1024, 2048, 4096, 8192],
        perplexity_tokens=None,
        synthetic_tasks=["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
                         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "passkey", "needle_recall"],
        synthetic_lengths=[1024, 2048, 4096, 8192],
        synthetic_samples={"niah_single_1": 100, "niah_single_2": 100, "niah_single_3": 100, "passkey": 100,
                           "needle_recall": 100, "default": 50},
        mc_tasks=["piqa", "winogrande", "copa", "openbook_qa", "lambada_openai"],
        mc_limit=None,
    ),
}


def get_suite(name: str, **changes) -> EvalSuite:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(SUITES)}")
    return dataclasses.replace(SUITES[name], **changes)


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
            logger.warning("multiple-choice tasks skipped: pass data_dir (e.g. ../shared/data/eval) to run them offline")
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


def ablate(
    model,
    tokenizer,
    suite: EvalSuite,
    *,
    modes: list[str] | None = None,
    data_dir: str | None = None,
    device=None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The suite under each component mode of the converted layers; modes restored afterwards.

    Layers running the teacher's attention (a nested family's layers beyond ``active``) are left as
    they are: the ablation is of the layers that run converted.
    ``on_update(results)``, if given, gets {mode: suite result so far} after each finished part."""
    layers = running_layers(model)
    if not layers:
        raise ValueError("ablate needs a converted model (no converted layers found, or all of them run the teacher)")
    kinds = {m.spec.attention for m in layers.values()}
    if modes is None:
        if len(kinds) != 1:
            raise ValueError(f"converted layers of several kinds ({', '.join(sorted(kinds))}): name the modes to ablate")
        modes = KINDS[kinds.pop()].ablation_modes  # each kind's default ablation modes
    modes = list(modes)
    for mode in modes:  # every mode must exist for every converted layer: fail before any evaluation
        for m in layers.values():
            m.check_mode(mode)
    results = {}
    with kept_modes(model):
        for mode in modes:
            set_mode(model, mode, layers=sorted(layers))
            logger.info("ablation: mode %s on layers %s", mode, sorted(layers))
            def update(partial: dict[str, Any], mode: str = mode) -> None:
                if on_update is not None:
                    on_update({**results, mode: partial})

            results[mode] = run_suite(model, tokenizer, suite, data_dir=data_dir, device=device, on_update=update)
    flat = {mode: headline(r) for mode, r in results.items()}
    delta = {}
    if "hybrid" in flat and "swa_only" in flat:
        delta = {k: flat["hybrid"][k] - flat["swa_only"][k] for k in flat["hybrid"] if k in flat["swa_only"]}
    return {"modes": modes, "results": results, "table": flat, "delta_la": delta}


# --- markdown ------------------------------------------------------------------------------------
def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(columns: dict[str, dict[str, float]], *, extra: dict[str, dict[str, float]] | None = None) -> str:
    """Rows = metrics, columns = models or modes (plus ``extra`` columns such as Delta_LA)."""
    cols = {**columns, **(extra or {})}
    metrics = list(dict.fromkeys(k for c in cols.values() for k in c))
    lines = ["| metric | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for metric in metrics:
        lines.append(f"| {metric} | " + " | ".join(_fmt(c.get(metric)) for c in cols.values()) + " |")
    return "\n".join(lines)


def to_markdown(title: str, result: dict[str, Any]) -> str:
    """A report of one suite result: headline table, perplexity rows, synthetic examples."""
    parts = [f"# {title}", "", f"suite: {result.get('suite')}, {result.get('seconds')} s", "", table({"value": headline(result)})]
    if result.get("mc_skipped"):
        parts += ["", f"Multiple-choice tasks skipped: {result['mc_skipped']}."]
    syn = result.get("synthetic", {})
    if syn:
        parts += ["", "## Synthetic tasks (string_match_all x100; passkey: exact first number)", "",
                  "| task | length | score | samples |", "|---|---|---|---|"]
        for task, by_length in syn.items():
            for length, row in by_length.items():
                parts.append(f"| {task} | {length} | {row['score']:.1f} | {row['n']} |")
    for row in result.get("perplexity", []):
        if "error" in row:
            parts += ["", f"perplexity at {row['length']}: skipped ({row['error']})"]
    return "\n".join(parts) + "\n"
