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
    rows, and the down projection as a float32 GEMM before the kernel: every grouping the same numbers
    as the first at its block of rows, every block and the GEMM's gates close to the first; the module's constants restored; an unknown shape named with the valid ones."""
    before = fused_decode.DSLA_GATE_HEADS, fused_decode.DSLA_INPUT_ROWS
    monkeypatch.setattr(sys, "argv", ["dsla_inputs_bench.py", str(tmp_path), "--shapes", "smollm2-135m", "--batches", "19",
                                      "--gate-heads", "1,4,9", "--rows", "16,32", "--gemm"])  # fmt: skip
    runpy.run_path(str(SCRIPT), run_name="__main__")
    rows = json.loads((tmp_path / "dsla_inputs.json").read_text())["rows"]
    assert [(r["rows"], r["gate_heads"], r["used"]) for r in rows] == [(16, 1, 1), (16, 4, 3), (16, 9, 9), (16, "gemm", 1),
                                                                       (32, 1, 1), (32, 4, 3), (32, 9, 9), (32, "gemm", 1)]  # fmt: skip
    assert all(r["exact"] for r in rows if r["gate_heads"] != "gemm") and all(r["max_diff"] < 1e-5 for r in rows)
    assert rows[0]["max_diff"] == 0.0
    assert (fused_decode.DSLA_GATE_HEADS, fused_decode.DSLA_INPUT_ROWS) == before
    monkeypatch.setattr(sys, "argv", ["dsla_inputs_bench.py", str(tmp_path / "bad"), "--shapes", "gpt2"])
    with pytest.raises(SystemExit, match=r"unknown shape\(s\) \['gpt2'\]; choose from \['llama3-8b', 'smollm2-135m'\]"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert not (tmp_path / "bad").exists()
