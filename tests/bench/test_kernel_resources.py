"""scripts/kernel_resources.py: the Triton kernels a converted layer launches, compiled for an H200
on a machine without a GPU, with their registers and spills as ptxas reports them."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kernel_resources.py"


def _ptxas() -> Path | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.exists() else None


needs_ptxas = pytest.mark.skipif(_ptxas() is None, reason="needs Triton with its CUDA tools (ptxas, cuobjdump)")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True)


@needs_ptxas
def test_the_layers_kernels_compile_for_sm90_and_report_their_registers(tmp_path):
    """Every kernel LoLA's prefill and decode steps launch at SmolLM2's shape, compiled through the
    layer's own code: the selection, the read, the decode step's errors and commit kernels (and the
    RoPE kernel), each with registers within the hardware's 255, its spills and its SASS counted.
    DSLA's prefill kernels compile each autotuned tile choice that fits, none of the Llama-sized."""
    done = _run(str(tmp_path), "--shape", "smollm2-135m", "--kinds", "lola,dsla", "--prefill", "128", "--batches", "2",
                "--set", "fused_lola.PREFILL_READ_QUERIES=32")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "kernel_resources.json").read_text())
    assert result["arch"] == 90 and result["shape"] == "smollm2-135m"
    rows = result["kernels"]
    lola = {(r["phase"], r["kernel"]) for r in rows if r["kind"] == "lola"}
    assert {("prefill", "lola_select_kernel"), ("prefill", "lola_read_kernel"), ("decode", "lola_errors_kernel"),
            ("decode", "lola_commit_kernel")} <= lola  # fmt: skip
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["spills"] >= 0 and r["sass"]["instructions"] > 0
    assert result["settings"] == {"fused_lola.PREFILL_READ_QUERIES": 32}
    assert next(r for r in rows if r["kernel"] == "lola_read_kernel")["constexprs"]["BQ"] == 32  # the constant set reached the launch
    select = next(r for r in rows if r["kernel"] == "lola_select_kernel")
    assert select["num_warps"] == 8 and select["constexprs"]["F"] == 128 and select["constexprs"]["DV"] == 64
    assert select["sass"]["mma"] > 0  # the errors' products on the tensor cores
    states = [r for r in rows if r["kernel"] == "dsla_states" and r["phase"] == "prefill"]
    assert len(states) > 1 and len({r["tiles"] for r in states}) == len(states)  # every tile choice, once
    assert all(int(r["tiles"].split("BV=")[1].split(",")[0]) <= 64 for r in states)  # those wider than DV pruned
    assert "| lola | prefill | 1 | `lola_select_kernel` |" in (tmp_path / "kernel_resources.md").read_text()


@needs_ptxas
def test_capped_registers_reach_ptxas(tmp_path):
    """A tile choice with a register cap (the DSLA kernels' fifth field) compiles within it."""
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('kr', {str(SCRIPT)!r})\n"
        "kr = importlib.util.module_from_spec(spec); spec.loader.exec_module(kr)\n"
        "from linearize.ops import fused_dsla\n"
        "fused_dsla.STATE_TILES = ((32, 64, 4, 2), (32, 64, 4, 2, 96))\n"
        "fused_dsla.OUTPUT_TILES = ((32, 64, 4, 2),)\n"
        f"kr.main([{str(tmp_path)!r}, '--shape', 'smollm2-135m', '--kinds', 'dsla', '--prefill', '128', '--batches', '1'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    states = {r["tiles"]: r for r in json.loads((tmp_path / "kernel_resources.json").read_text())["kernels"] if r["kernel"] == "dsla_states"}
    capped = next(r for tiles, r in states.items() if "maxnreg=96" in tiles)
    assert capped["registers"] <= 96 < max(r["registers"] for r in states.values())


def test_bad_kinds_and_an_interpreting_triton_are_refused(tmp_path):
    done = _run(str(tmp_path), "--kinds", "lola,nope")
    assert done.returncode == 2 and "nope" in done.stderr and "hybrid" in done.stderr
    for bad in ("fused_lola.NOPE=1", "nomodule.X=1", "fused_lola.PREFILL_READ_QUERIES=thirty"):
        done = _run(str(tmp_path), "--set", bad)
        assert done.returncode == 2 and bad in done.stderr and "MODULE.NAME=VALUE" in done.stderr
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert done.returncode == 2 and "TRITON_INTERPRET" in done.stderr
    assert not (tmp_path / "kernel_resources.json").exists()


@needs_ptxas
def test_the_one_kernel_step_compiles_for_sm90_and_replaces_the_two(tmp_path):
    """With ``ONE_KERNEL_ROWS`` 0 a LoLA decode step launches ``lola_step_kernel`` alone (errors and
    commit in one program per (row, query head)), and it compiles for sm_90 at SmolLM2's shape with
    the stages and the register cap asked for (254 registers uncapped); ``--sass`` writes each
    kernel's SASS and its Triton GPU IR."""
    done = _run(str(tmp_path), "--shape", "smollm2-135m", "--kinds", "lola-state", "--prefill", "128", "--batches", "2",
                "--set", "fused_lola.ONE_KERNEL_ROWS=0", "--set", "fused_lola.STAGES=1", "--set", "fused_lola.MAX_REGISTERS=128",
                "--sass", str(tmp_path / "sass"))
    assert done.returncode == 0, done.stderr[-3000:]
    decode = [r for r in json.loads((tmp_path / "kernel_resources.json").read_text())["kernels"] if r["phase"] == "decode"]
    lola = [r for r in decode if r["kernel"].startswith("lola_")]
    assert [r["kernel"] for r in lola] == ["lola_step_kernel"] and lola[0]["num_stages"] == 1
    assert 0 < lola[0]["registers"] <= 128 and lola[0]["sass"]["mma"] > 0
    assert len(list((tmp_path / "sass").glob("*-lola_step_kernel.ttgir"))) == 1


def test_each_lola_step_tile_sets_the_step_and_the_first_is_the_default(monkeypatch):
    """scripts/lola_step_tiles.py: every tile has its own name and sets the step's constants (two
    kernels or one, blocks, warps, stages); its first tile is the module's defaults."""
    spec = importlib.util.spec_from_file_location("lola_step_tiles", SCRIPT.parent / "lola_step_tiles.py")
    tiles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiles)
    from linearize.ops import fused_lola

    names = ("ONE_KERNEL_ROWS", "ONE_KERNEL_WARPS", "BLOCK_ROWS", "BLOCK_VALUES", "WARPS", "COMMIT_WARPS", "STAGES", "SPLIT_STATE",
             "MAX_REGISTERS")
    for name in names:
        monkeypatch.setattr(fused_lola, name, getattr(fused_lola, name))  # restored after the test
    defaults = {name: getattr(fused_lola, name) for name in names}
    assert len({tiles.tile_name(t) for t in tiles.TILES}) == len(tiles.TILES)
    tiles.use_tile(tiles.TILES[0])
    assert {name: getattr(fused_lola, name) for name in names} == defaults
    one = next(t for t in tiles.TILES if t[0] == "one" and t[5] == 1 and not t[6])
    tiles.use_tile(one)
    assert fused_lola.one_kernel(1) and fused_lola.STAGES == 1 and not fused_lola.SPLIT_STATE
    assert tiles.tile_name(one).startswith("one-") and tiles.tile_name(one).endswith("-p1")
    capped = next(t for t in tiles.TILES if t[7] is not None)
    tiles.use_tile(capped)
    assert fused_lola.MAX_REGISTERS == capped[7] and tiles.tile_name(capped).endswith(f"-r{capped[7]}")
    tiles.use_tile(tiles.TILES[0])
    assert not fused_lola.one_kernel(10**6) and fused_lola.MAX_REGISTERS is None
