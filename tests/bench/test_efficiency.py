"""Efficiency benchmark on a tiny model: result shape, memory measured vs formula, reports. No timed assertions."""

import json

import pytest

import linearize
from linearize.bench.efficiency import benchmark, plot_efficiency, run_efficiency, to_markdown
from linearize.memory import running_request_memory
from linearize.hub import build_tiny_llama

LENGTHS, CONTEXTS, WINDOW = [16, 32, 64], [16, 32], 8


@pytest.fixture(scope="module")
def result():
    model = build_tiny_llama()
    return benchmark(model, {"attention": "hybrid", "window": WINDOW}, prefill_lengths=LENGTHS, decode_contexts=CONTEXTS,
                     decode_steps=3, warmup=1, repeats=2)  # fmt: skip


def test_result_keys_and_shapes(result):
    json.dumps(result)  # JSON-able
    assert {"model", "device", "dtype", "spec", "settings", "teacher", "converted", "ratios"} <= set(result)
    assert result["spec"]["options"]["window"] == WINDOW
    for name in ("teacher", "converted"):
        assert [r["length"] for r in result[name]["prefill"]] == LENGTHS
        assert [r["context"] for r in result[name]["decode"]] == CONTEXTS
        assert [r["context"] for r in result[name]["memory"]] == sorted(set(LENGTHS) | set(CONTEXTS))
        assert all(r["median_s"] > 0 and r["tokens_per_s"] > 0 for r in result[name]["prefill"] + result[name]["decode"])
    assert [len(result["ratios"][k]) for k in ("prefill", "decode", "memory")] == [3, 2, 3]


def test_memory_teacher_linear_converted_flat(result):
    teacher, converted = result["teacher"]["memory"], result["converted"]["memory"]
    per_token = teacher[0]["measured_bytes"] // teacher[0]["context"]
    assert per_token == 2 * 2 * 2 * 16 * 4  # layers x (k, v) x KV heads x head dim x float32
    for r in teacher:
        assert r["measured_bytes"] == r["formula_bytes"] == per_token * r["context"]
    assert len({r["measured_bytes"] for r in converted}) == 1 and len({r["formula_bytes"] for r in converted}) == 1
    for r in converted:  # the window slots also keep validity and positions: a few bytes each
        assert r["formula_bytes"] <= r["measured_bytes"] <= r["formula_bytes"] + 2 * 16 * WINDOW


def test_markdown_and_plot(result, tmp_path):
    md = to_markdown(result)
    for part in ("prefill", "decode", "memory"):
        for r in result["ratios"][part]:
            assert f"| {r['ratio']:.3g} |" in md
    assert "converted / teacher" in md and "| 64 |" in md
    assert f"converted: hybrid (window {WINDOW}), layers all" in md.splitlines()[0]
    path = tmp_path / "eff.png"
    plot_efficiency(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_run_efficiency_writes_reports_and_measures_a_converted_model(tmp_path):
    model = linearize.convert(build_tiny_llama(), {"attention": "dsla", "layers": [1]})
    with pytest.raises(ValueError, match="not converted"):
        run_efficiency(build_tiny_llama(), None)
    out = run_efficiency(model, None, prefill_lengths=[16], decode_contexts=[16], decode_steps=2, warmup=1, repeats=1, out_dir=tmp_path / "eff")
    assert {p.name for p in (tmp_path / "eff").iterdir()} == {"efficiency.json", "efficiency.md", "efficiency.png"}
    assert json.loads((tmp_path / "eff" / "efficiency.json").read_text())["ratios"] == out["ratios"]
    teacher, converted = out["teacher"]["memory"][0], out["converted"]["memory"][0]  # layer 0 KV, layer 1 DSLA states
    assert teacher["measured_bytes"] == teacher["formula_bytes"]
    assert converted["formula_bytes"] == running_request_memory(model, 16) and converted["measured_bytes"] == converted["formula_bytes"]
    assert linearize.layer_modes(model) == {1: "hybrid"}  # the teacher measurement left the modes as they were


def test_static_decode_measures_both_sides_on_static_buffers(tmp_path):
    """--graphs: the teacher and the conversion both decode through StaticDecoder (eagerly on CPU)."""
    model = linearize.convert(build_tiny_llama(), {"attention": "hybrid", "window": 4, "layers": [1]})
    out = run_efficiency(model, None, prefill_lengths=[16], decode_contexts=[16, 32], batch_size=3, decode_steps=2, warmup=1,
                         repeats=1, static_decode=True)  # fmt: skip
    assert out["settings"]["static_decode"] and [r["context"] for r in out["ratios"]["decode"]] == [16, 32]
    assert {r["decoder"] for r in out["teacher"]["decode"] + out["converted"]["decode"]} == {"static-matmul"}  # softmax layers on the CPU
    assert all(r["batch_size"] == 3 and r["tokens_per_s"] > 0 for r in out["teacher"]["decode"] + out["converted"]["decode"])
    assert "StaticDecoder" in to_markdown(out)
    model = linearize.convert(build_tiny_llama(), {"attention": "hybrid", "window": 4})
    linearize.set_mode(model, "sinks_only")
    with pytest.raises(ValueError, match="no static decode step"):
        run_efficiency(model, None, prefill_lengths=[16], decode_contexts=[16], decode_steps=2, static_decode=True)


def test_lengths_beyond_the_limit_raise_before_measuring():
    model = build_tiny_llama()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        benchmark(model, {"window": 4}, prefill_lengths=[16], decode_contexts=[510], decode_steps=4)
    assert not linearize.layer_modes(model)  # checked before converting: the model is left as it was


def test_decode_speed_table_reports_every_model_and_context(tmp_path):
    """The decode-speed table: every (model, context) measured, ratios to the first model, reports written."""
    from linearize.bench.efficiency import run_decode_speed, speed_markdown

    teacher_dir, converted_dir = tmp_path / "teacher", tmp_path / "converted"
    build_tiny_llama().save_pretrained(teacher_dir)
    model = build_tiny_llama()
    linearize.convert(model, {"attention": "hybrid", "window": 4})
    model.save_pretrained(converted_dir)
    names = [str(teacher_dir), str(converted_dir)]
    result = run_decode_speed(names, [8, 16], steps=2, out_dir=tmp_path / "out")
    json.dumps(result)
    assert [(r["model"], r["context"]) for r in result["rows"]] == [(n, c) for c in (8, 16) for n in names]
    assert all(r["tokens_per_s"] > 0 and r["prefill_s"] > 0 for r in result["rows"])
    assert [r["ratio"] for r in result["rows"] if r["model"] == names[0]] == [1.0, 1.0]
    assert [r["converted_layers"] for r in result["rows"]][:2] == [0, 2] and result["threads"] >= 1
    markdown = speed_markdown(result)
    assert "| 8 tok/s | x | 16 tok/s | x |" in markdown and names[1] in markdown
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"speed.json", "speed.md", "speed.png"}
    # the reference's floor step after a few tokens, in the same rounds, and the bound it sets per context
    assert [f["context"] for f in result["floor"]] == [8, 16] and [f["floor_context"] for f in result["floor"]] == [8, 16]
    reference = {r["context"]: r["decode_s"] for r in result["rows"] if r["model"] == names[0]}
    assert all(f["bound"] == pytest.approx(reference[f["context"]] / f["decode_s"]) for f in result["floor"])
    assert "| bound x |" in markdown
    assert "floor" not in speed_markdown({**result, "floor": []}).lower()


def test_decode_speed_rejects_a_bad_floor_context():
    from linearize.bench.efficiency import decode_speed

    with pytest.raises(ValueError, match="floor_context"):
        decode_speed(["unused"], [8], floor_context=0)
