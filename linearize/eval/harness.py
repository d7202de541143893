"""Multiple choice and LAMBADA through EleutherAI lm-evaluation-harness (lm-eval 0.4.x).

Importing this module registers the harness model type ``linearize``: ``pretrained`` is anything
``linearize.load_model`` reads (alias, checkpoint or adapter dir, hub id), with optional ``active``
(nested families), ``mode`` (``linearize.set_mode``) and ``dtype``; the rest goes to lm-eval's HFLM.
lm-eval has no plugin hook for model types, so the command line runs through this module, which
registers the type and adds our local task folder (``tasks/``) to ``--include_path``::

    python -m linearize.eval.harness --model linearize --model_args pretrained=smollm2-135m,mode=la_only \\
        --tasks local_copa,local_piqa --device cpu --limit 50

(any other ``lm-eval`` arguments and subcommands work). The local tasks (``local_piqa``,
``local_winogrande``, ``local_copa``, ``local_openbook_qa``, ``local_lambada_openai``) read their
files from the copy shipped in the package (``linearize.data.EVAL_DATA``; sources and licences in
its SOURCES.md); ``--data_dir DIR``, short for ``--metadata '{"data_dir": "DIR"}'``, reads another
copy. Any task lm-eval knows works where a network exists.

From Python: ``evaluate_tasks(model, tokenizer, ["copa", "piqa"], limit=50)``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.huggingface import HFLM

from ..data import EVAL_DATA

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).parent / "tasks"
# Our name -> the local task's name in the harness (tasks/*.yaml).
LOCAL_TASKS = {name: f"local_{name}" for name in ("piqa", "winogrande", "copa", "openbook_qa", "lambada_openai")}
# Our spelling -> the harness's, for the same benchmark from the dataset hubs (no data_dir).
HUB_NAMES = {"openbook_qa": "openbookqa"}
METRICS = ("acc", "acc_norm", "perplexity")


class LinearizeLM(HFLM):
    """HFLM around a model from ``linearize.load_model`` (``--model linearize``)."""

    def __init__(
        self,
        pretrained: str,
        active: int | None = None,
        mode: str | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        batch_size: int | str = 1,
        **kwargs: Any,
    ) -> None:
        import linearize

        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        model, tokenizer = linearize.load_model(
            str(pretrained),
            dtype=dtype if isinstance(dtype, torch.dtype) else None,
            device=_device(device),
            active=None if active is None else int(active),
        )
        if tokenizer is None:
            raise ValueError(f"{pretrained!r} has no tokenizer; lm-eval needs one")
        if mode is not None:
            linearize.set_mode(model, str(mode))
        model.eval()
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)


def _device(device: str | torch.device | None) -> torch.device:
    """The requested device, or CUDA when available else CPU (lm-eval's CLI defaults to cuda:0)."""
    if device is not None and (not str(device).startswith("cuda") or torch.cuda.is_available()):
        return torch.device(device)
    if device is not None:
        logger.warning("device %s requested but CUDA is not available: using cpu", device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# Idempotent: running this file as __main__ imports it a second time.
if "linearize" not in model_registry:
    register_model("linearize")(LinearizeLM)


def resolve_tasks(tasks: list[str], *, data_dir: str | Path | None = EVAL_DATA):
    """({harness name: our name}, the lm-eval TaskManager that knows them) of ``tasks`` (names as in
    ``evaluate_tasks``); ValueError naming the unknown ones and the valid local tasks."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError(f"no tasks given; local tasks: {', '.join(LOCAL_TASKS)}")
    names = {}  # harness name -> our name
    for task in tasks:
        if task in LOCAL_TASKS and data_dir is not None:
            names[LOCAL_TASKS[task]] = task
        else:
            names[HUB_NAMES.get(task, task)] = task
    local = all(name in LOCAL_TASKS.values() for name in names)
    metadata = {"data_dir": str(data_dir)} if data_dir is not None else {}
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=not local, metadata=metadata)
    unknown = [task for name, task in names.items() if not manager.match_tasks([name])]
    if unknown:
        raise ValueError(
            f"unknown task(s) {', '.join(map(repr, unknown))}: local tasks (with data_dir): {', '.join(LOCAL_TASKS)}; "
            "or a task lm-eval knows (`lm-eval ls tasks`)"
        )
    return names, manager


def evaluate_tasks(
    model,
    tokenizer,
    tasks: list[str],
    *,
    data_dir: str | Path | None = EVAL_DATA,
    limit: int | None = None,
    batch_size: int | str = 1,
    device: str | torch.device | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 0,
) -> dict[str, dict[str, Any]]:
    """Run harness tasks on an in-memory model; returns ``{task: {acc, acc_norm, perplexity, ..., n}}``.

    ``tasks``: our local names (``piqa``, ``winogrande``, ``copa``, ``openbook_qa``,
    ``lambada_openai``; read from ``data_dir``, by default the copy shipped in the package; with
    ``data_dir=None`` the harness's own task of that benchmark from the dataset hubs), the ``local_*`` names, or any task / group lm-eval knows.
    Metrics are the harness's (acc, acc_norm where the task defines it, perplexity for LAMBADA), with
    ``<metric>_stderr``: closed form for accuracies, the harness's bootstrap only when
    ``bootstrap_iters > 0``; ``n`` is the number of documents scored (``limit``: the first ``limit``).
    ``device``: moves the model there first (otherwise it stays where it is). Like lm-eval, this seeds
    the Python / numpy / torch random generators.
    """
    from lm_eval import simple_evaluate

    names, manager = resolve_tasks(tasks, data_dir=data_dir)
    if device is not None:
        model.to(device)
    was_training = model.training
    model.eval()
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = simple_evaluate(
            model=lm,
            tasks=list(names),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
        )
    finally:
        model.train(was_training)
    return {names.get(task, task): _summary(metrics, out["n-samples"].get(task)) for task, metrics in out["results"].items()}


def _summary(metrics: dict[str, Any], n_samples: dict | None) -> dict[str, Any]:
    """The harness's ``{"acc,none": ..., "acc_stderr,none": ...}`` as ``{"acc": ..., "acc_stderr": ..., "n": ...}``."""
    row = {key.split(",")[0]: value for key, value in metrics.items() if key != "sample_len" and not isinstance(value, str)}
    n = (n_samples or {}).get("effective")
    row["n"] = n
    for metric in ("acc", "acc_norm"):
        if metric in row and row.get(f"{metric}_stderr") is None and n and n > 1:
            p = row[metric]
            row[f"{metric}_stderr"] = math.sqrt(p * (1 - p) / (n - 1))
    return row


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``linearize`` model type, our task folder and ``--data_dir``."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if "--data_dir" in args:  # lm-eval merges repeated --metadata flags
        i = args.index("--data_dir")
        args[i : i + 2] = ["--metadata", json.dumps({"data_dir": args[i + 1]})]
    elif "--tasks" in args and "--metadata" not in args:  # the local tasks read the shipped copy
        args += ["--metadata", json.dumps({"data_dir": str(EVAL_DATA)})]
    if args and args[0] not in ("-h", "--help") and "--include_path" not in args:
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm-eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
