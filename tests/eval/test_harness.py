"""lm-evaluation-harness on our models: local multiple-choice / LAMBADA tasks, the `linearize` model type.

Runs the real SmolLM2-135M-Instruct on CPU with small limits on the evaluation data shipped in the
package (linearize/data/eval); skips without its GGUF or lm-eval. One torch thread: on a shared 2-core machine two threads run these
small batches up to 5x slower than one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # lm-eval runs on the real model

pytest.importorskip("lm_eval", reason="lm-eval not installed (pip install lm-eval)")

import linearize  # noqa: E402
from linearize.data import EVAL_DATA  # noqa: E402
from linearize.eval import harness  # noqa: E402
from linearize.eval.harness import LOCAL_TASKS, evaluate_tasks  # noqa: E402
from linearize.hub import find_smollm2_gguf  # noqa: E402

SANITY_LIMIT = 50  # COPA and PIQA, checked above chance
LIMIT = 10  # the other tasks


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return EVAL_DATA


def _smollm2():
    try:
        find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    return linearize.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2():
    return _smollm2()


@pytest.fixture(scope="module")
def teacher_results(smollm2, data_dir):
    model, tokenizer = smollm2
    results = evaluate_tasks(model, tokenizer, ["copa", "piqa"], data_dir=data_dir, limit=SANITY_LIMIT, batch_size=16)
    others = [t for t in LOCAL_TASKS if t not in results]
    results |= evaluate_tasks(model, tokenizer, others, data_dir=data_dir, limit=LIMIT, batch_size=16)
    print("\nSmolLM2-135M-Instruct (teacher):", json.dumps(results, indent=1))
    return results


@pytest.mark.parametrize("task", list(LOCAL_TASKS))
def test_local_task_runs(teacher_results, task):
    row = teacher_results[task]
    assert row["n"] == (SANITY_LIMIT if task in ("copa", "piqa") else LIMIT)
    assert 0.0 <= row["acc"] <= 1.0 and 0.0 <= row["acc_stderr"] <= 0.5
    if task in ("piqa", "copa", "openbook_qa"):
        assert 0.0 <= row["acc_norm"] <= 1.0
    if task == "lambada_openai":
        assert row["perplexity"] > 1.0


@pytest.mark.parametrize("task", ["copa", "piqa"])
def test_teacher_above_chance(teacher_results, task):
    assert teacher_results[task]["acc"] > 0.5, teacher_results[task]


def test_model_type_registered():
    from lm_eval.api.registry import get_model

    assert get_model("linearize") is harness.LinearizeLM
    assert get_model("hf").__name__ == "HFLM"  # registering ours does not hide the built-in types


def test_converted_model_runs(data_dir):
    model, tokenizer = _smollm2()  # a fresh copy: convert changes the model in place
    linearize.convert(model, {"attention": "hybrid", "window": 16})
    row = evaluate_tasks(model, tokenizer, ["copa"], data_dir=data_dir, limit=LIMIT, batch_size=16)["copa"]
    assert row["n"] == LIMIT and 0.0 <= row["acc"] <= 1.0


def test_missing_file(smollm2, tmp_path):
    model, tokenizer = smollm2
    (tmp_path / "piqa_valid.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b"}\n')
    with pytest.raises(FileNotFoundError, match="piqa_valid_labels.lst"):
        evaluate_tasks(model, tokenizer, ["piqa"], data_dir=tmp_path, limit=1)
    with pytest.raises(FileNotFoundError, match="winogrande.jsonl"):
        evaluate_tasks(model, tokenizer, ["winogrande"], data_dir=tmp_path, limit=1)


def test_local_task_needs_data_dir(smollm2):
    with pytest.raises(ValueError, match="data_dir"):
        evaluate_tasks(*smollm2, ["local_copa"], data_dir=None, limit=1)


def test_unknown_task(data_dir):
    with pytest.raises(ValueError, match="local tasks .*piqa, winogrande, copa, openbook_qa, lambada_openai"):
        evaluate_tasks(None, None, ["no_such_task_xyz"], data_dir=data_dir, limit=1)


def test_cli(data_dir):
    """`python -m linearize.eval.harness` is lm-eval's CLI with `--model linearize` and our tasks on the shipped data."""
    _smollm2()
    cmd = [
        sys.executable, "-m", "linearize.eval.harness", "--model", "linearize", "--model_args", "pretrained=smollm2-135m",
        "--tasks", "local_copa", "--limit", "2", "--device", "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2], env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "local_copa" in out.stdout and "acc" in out.stdout
