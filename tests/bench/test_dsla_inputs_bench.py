"""scripts/dsla_inputs_bench.py: DSLA's decode inputs kernel per gate-head grouping and block of
rows, each checked against the first (here in Triton's interpreter, a check of the script)."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from linearize.ops import fused_decode

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "dsla_inputs_bench.py"


@pytest.mark.skipif(torch.cuda.is_available() or not fused_decode.interpreting(), reason="the CPU check runs Triton's interpreter")
def test_every_grouping_is_checked_against_the_first(tmp_path, monkeypatch):
    """SmolLM2's 9 query heads in gate groups of 1, 3 (4 asked: 3 groups of 3) and 9, at two blocks of
    rows, the down projection in the gate programs and split over the hidden size in a kernel of its
    own, as a float32 GEMM before the kernel, and RoPE before the kernel and in it: every grouping the
    same numbers as the first at its block of rows and down projection, every other variant close to
    the first; the module's constants restored; an unknown shape and a negative step named."""
    names = "DSLA_GATE_HEADS", "DSLA_INPUT_ROWS", "DSLA_DOWN_SPLIT_ROWS", "DSLA_DOWN_STEPS"
    before = {n: getattr(fused_decode, n) for n in names}
    monkeypatch.setattr(sys, "argv", ["dsla_inputs_bench.py", str(tmp_path), "--shapes", "smollm2-135m", "--batches", "19",
                                      "--down-steps", "0,1", "--gate-heads", "1,4,9", "--rows", "16,32", "--gemm", "--rope"])  # fmt: skip
    runpy.run_path(str(SCRIPT), run_name="__main__")
    rows = json.loads((tmp_path / "dsla_inputs.json").read_text())["rows"]
    per_block = [(0, 1, 1), (0, 4, 3), (0, 9, 9), (1, 1, 1), (1, 4, 3), (1, 9, 9), (0, "gemm", 1), (1, "rope before", 1), (1, "rope in kernel", 1)]
    assert [(r["rows"], r["down_steps"], r["gate_heads"], r["used"]) for r in rows] == [(b, *v) for b in (16, 32) for v in per_block]
    assert all(r["exact"] for r in rows if isinstance(r["gate_heads"], int)) and all(r["max_diff"] < 1e-5 for r in rows)
    assert rows[0]["max_diff"] == 0.0
    assert {n: getattr(fused_decode, n) for n in names} == before
    monkeypatch.setattr(sys, "argv", ["dsla_inputs_bench.py", str(tmp_path / "bad"), "--shapes", "gpt2"])
    with pytest.raises(SystemExit, match=r"unknown shape\(s\) \['gpt2'\]; choose from \['llama3-8b', 'smollm2-135m'\]"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    monkeypatch.setattr(sys, "argv", ["dsla_inputs_bench.py", str(tmp_path / "bad"), "--down-steps", "0,-2"])
    with pytest.raises(SystemExit, match=r"--down-steps takes 0 or positive numbers of steps, got 0,-2"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert not (tmp_path / "bad").exists()
