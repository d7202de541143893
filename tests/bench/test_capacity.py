"""Throughput at equal memory on a tiny model: bytes per request, the batch that fits, reports. No timed assertions."""

import json

import pytest
import torch

import linearize
from linearize.bench.capacity import capacity_markdown, largest_batch, request_bytes, run_capacity, working_bytes_per_row
from linearize.cli import main
from linearize.hub import build_tiny_llama


def test_each_side_runs_the_largest_batch_its_requests_fit(tmp_path):
    """The teacher's request holds its keys and values for every token, the conversion's a fixed
    state: in the same budget the conversion runs a larger batch; the position limit (64) is lifted
    to the context and said so; the reports are written."""
    model = build_tiny_llama(max_position_embeddings=64)
    out = run_capacity(model, {"attention": "hybrid", "window": 4}, context=96, steps=2, memory_bytes=2**20, max_batch=20,
                       out_dir=tmp_path)  # fmt: skip
    teacher, converted = out["teacher"], out["converted"]
    max_length = 96 + 2 + 2 + 2  # context, warm-up steps, timed steps, margin
    kv = 2 * 2 * (2 * max_length * 16 * 4)  # layers x (keys, values) x (KV heads x tokens x head dim x float32)
    assert teacher["bytes_per_request"] == kv + 128 * 4 + working_bytes_per_row(model)  # + the row's logits
    assert teacher["batch_size"] == 2**20 // teacher["bytes_per_request"] == 18
    assert converted["bytes_per_request"] < teacher["bytes_per_request"] / 1.9
    assert converted["fits"] == 2**20 // converted["bytes_per_request"] > 20 and converted["batch_size"] == 20  # capped by max_batch
    assert out["throughput_ratio"] == converted["tokens_per_s"] / teacher["tokens_per_s"] > 0
    assert out["settings"]["position_limit_lifted_from"] == 64 and model.config.max_position_embeddings == max_length
    saved = json.loads((tmp_path / "capacity.json").read_text())
    md = (tmp_path / "capacity.md").read_text()
    assert saved["converted"]["batch_size"] == 20 and "position limit lifted from 64" in md
    per_row = f"| {converted['step_s'] * 1e3:.2f} | {converted['step_s'] * 1e6 / 20:.1f} | {converted['tokens_per_s']:.0f} |"
    assert "| us per row |" in md and per_row in md  # the step's time over its 20 rows
    assert teacher["softmax_path"] == "matmul" and converted["softmax_path"] is None  # on the CPU; flash-decoding on CUDA
    assert "| teacher (matmul) |" in md and "| converted |" in md
    assert linearize.layer_modes(model) == {0: "hybrid", 1: "hybrid"}  # the teacher's measurement left the modes


def test_a_request_that_does_not_fit_is_reported_and_bad_settings_named():
    model = linearize.convert(build_tiny_llama(), {"attention": "dsla"})
    out = run_capacity(model, None, context=16, steps=1, memory_bytes=1000)
    assert "does not fit in 1000 bytes" in out["teacher"]["error"] and "throughput_ratio" not in out
    assert "does not fit" in capacity_markdown(out)
    assert request_bytes(model, 20) == request_bytes(model, 400)  # DSLA: fixed states
    teacher = build_tiny_llama()
    assert request_bytes(teacher, 400) - request_bytes(teacher, 20) == 380 * 2 * 2 * 2 * 16 * 4  # tokens x layers x (k, v) x heads x dim x 4
    with pytest.raises(ValueError, match="not converted"):
        run_capacity(build_tiny_llama(), None, context=16, memory_bytes=2**20)
    with pytest.raises(ValueError, match=r"memory_fraction must lie in \(0, 1\], got 1.5"):
        run_capacity(model, None, context=16, memory_fraction=1.5)
    with pytest.raises(ValueError, match="give memory_bytes"):
        run_capacity(model, None, context=16)


def test_cli_capacity(tmp_path, capsys):
    path = tmp_path / "tiny"
    build_tiny_llama(num_hidden_layers=2).save_pretrained(path)
    assert main(["bench", "--capacity", "32", "--model", str(path), "--attention", "hybrid", "--window", "4", "--memory-gib", "0.001",
                 "--decode-steps", "2", "--max-batch", "8", "--out", str(tmp_path / "cap")]) == 0  # fmt: skip
    assert "Converted / teacher tokens/s" in capsys.readouterr().out and (tmp_path / "cap" / "capacity.json").is_file()
    assert main(["bench", "--compile", "--model", str(path), "--attention", "hybrid"]) == 2
    assert "--compile applies to static decoding" in capsys.readouterr().err
    assert main(["bench", "--stack", "llama3-8b", "--attention", "hybrid"]) == 2
    assert "--stack and --memory-gib go with --capacity" in capsys.readouterr().err


def test_capacity_profiles_each_side_at_its_batch(tmp_path, capsys):
    """--capacity --profile: each side's step is profiled at the batch it was timed at, and capacity.md
    lists its kernels (on the CPU: operators)."""
    path = tmp_path / "tiny"
    build_tiny_llama(num_hidden_layers=2).save_pretrained(path)
    assert main(["bench", "--capacity", "32", "--profile", "--model", str(path), "--attention", "dsla", "--memory-gib", "0.001",
                 "--decode-steps", "2", "--max-batch", "6", "--out", str(tmp_path / "cap")]) == 0  # fmt: skip
    saved = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    for side in ("teacher", "converted"):
        prof = saved[side]["profile"]
        assert prof["batch_size"] == saved[side]["batch_size"] and prof["launches_per_step"] > 0 and prof["top"]
    assert saved["converted"]["batch_size"] == 6 and saved["settings"]["profile"] is True
    md = (tmp_path / "cap" / "capacity.md").read_text()
    assert "### teacher: one step at batch" in md and "### converted: one step at batch 6 without CUDA graphs" in md
    assert "| kernel | calls / step |" in md
    assert "profile" not in run_capacity(build_tiny_llama(), {"attention": "dsla"}, context=16, steps=1, memory_bytes=2**20)["teacher"]


def test_random_models_are_built_in_the_asked_dtype_and_seeded():
    a, b = build_tiny_llama(3, dtype=torch.bfloat16), build_tiny_llama(3, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert {p.dtype for p in build_tiny_llama(3).parameters()} == {torch.float32}


def _fits_up_to(limit: int, tried: list[int]):
    def attempt(batch: int) -> str:
        tried.append(batch)
        if batch > limit:
            e = torch.OutOfMemoryError(f"CUDA out of memory at {batch}\nsecond line")
            e.stage = "prefill"
            raise e
        return f"ran {batch}"

    return attempt


@pytest.mark.parametrize(
    ("start", "limit", "tolerance", "expected", "tries"),
    [
        (224, 500, 1 / 64, 224, [224]),  # the budget's batch runs: no search
        (224, 171, 1 / 64, 171, [224, 196, 171, 183, 177, 174, 172]),  # 7/8 until one runs, then halves to within 2
        (224, 171, 1 / 8, 171, [224, 196, 171, 183]),  # within 21 of 171
        (14, 11, 1 / 64, 11, [14, 12, 10, 11]),  # 12 failed, 10 ran: 11 tried
        (14, 10, 1 / 64, 10, [14, 12, 10, 11]),
        (2, 1, 1 / 64, 1, [2, 1]),
    ],
)
def test_largest_batch_searches_down_then_between_what_ran_and_what_did_not(start, limit, tolerance, expected, tries):
    tried: list[int] = []
    batch, result, attempts = largest_batch(_fits_up_to(limit, tried), start, tolerance=tolerance)
    assert (batch, result, tried) == (expected, f"ran {expected}", tries)
    assert [a["batch"] for a in attempts] == tries and [a["ran"] for a in attempts] == [b <= limit for b in tries]
    failed = [a for a in attempts if not a["ran"]]
    assert all(a["stage"] == "prefill" and a["error"] == f"CUDA out of memory at {a['batch']}" for a in failed)
    assert all("attempt" in a["where"][-1] for a in failed)  # the frame it was raised in


def test_largest_batch_raises_when_one_row_does_not_fit_and_names_bad_settings():
    with pytest.raises(torch.OutOfMemoryError, match="at 1"):
        largest_batch(_fits_up_to(0, []), 3)
    with pytest.raises(ValueError, match="start must be an integer >= 1"):
        largest_batch(_fits_up_to(5, []), 0)
    with pytest.raises(ValueError, match="retry must lie in"):
        largest_batch(_fits_up_to(5, []), 4, retry=1.0)


def test_capacity_markdown_names_the_batches_that_ran_out_of_memory():
    settings = {"budget_bytes": 2**30, "context": 8, "compile": False, "steps": 2, "position_limit_lifted_from": None}
    row = {"bytes_per_request": 2**20, "batch_size": 10, "step_s": 0.02, "tokens_per_s": 500}
    result = {"model": "m", "device": "d", "dtype": "bfloat16", "settings": settings, "throughput_ratio": 1.0,
              "teacher": {**row, "side": "teacher", "attempts": [{"batch": 12, "ran": False, "stage": "prefill"}, {"batch": 10, "ran": True}]},
              "converted": {**row, "side": "converted", "attempts": [{"batch": 10, "ran": True}]}}  # fmt: skip
    md = capacity_markdown(result)
    assert "teacher: batches tried 12 (out of memory in its prefill), 10" in md and "converted: batches tried" not in md
