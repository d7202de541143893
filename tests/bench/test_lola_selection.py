"""scripts/lola_selection.py: LoLA's prefill selection timed per variant of kernel options, each
checked against the first variant's caches (here in Triton's interpreter, a check of the script)."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from linearize.ops import fused_decode, fused_lola, kernel_options

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lola_selection.py"


@pytest.mark.skipif(torch.cuda.is_available() or not fused_decode.interpreting(), reason="the CPU check runs Triton's interpreter")
def test_variants_are_timed_and_compared_with_the_first(tmp_path, monkeypatch):
    """Two variants (the defaults, then blocks of 16 candidates): both timed, the second keeping the
    first's caches and state, the options it set restored afterwards."""
    monkeypatch.setattr(fused_lola, "_prefill_kernels", fused_lola._prefill_kernels)  # the script wraps it
    monkeypatch.setattr(kernel_options, "_APPLIED", {})
    block = fused_lola.PREFILL_BLOCK_CACHE
    monkeypatch.setattr(sys, "argv", ["lola_selection.py", str(tmp_path), "--device", "cpu", "--length", "200", "--sparse", "24",
                                      "--variant", "defaults=defaults", "--variant", "c16=fused_lola.PREFILL_BLOCK_CACHE=16"])  # fmt: skip
    runpy.run_path(str(SCRIPT), run_name="__main__")
    report = json.loads((tmp_path / "lola_selection.json").read_text())
    assert report["chunks"] == 4 and list(report["variants"]) == ["defaults", "c16"]
    first, second = report["variants"]["defaults"], report["variants"]["c16"]
    assert first["options"] == [] and first["select_ms"] > 0 and first["whole_ms"] > 0
    assert second["options"] == ["fused_lola.PREFILL_BLOCK_CACHE=16"] and "error" not in second
    assert second["same_last_cache"] == 1.0 and second["same_chunk_caches"] == 1.0
    assert second["max_state_diff"] <= 1e-5
    assert fused_lola.PREFILL_BLOCK_CACHE == block
