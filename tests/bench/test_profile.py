"""Decode step profiles on a tiny model: what is counted, the report, the CLI. No timed assertions."""

import json

import linearize
from linearize.bench.profile import profile_decode, profile_markdown
from linearize.cli import main
from linearize.hub import build_tiny_llama


def test_both_sides_are_profiled_per_step_and_reported(tmp_path):
    model = build_tiny_llama(num_hidden_layers=2)
    out = profile_decode(model, {"attention": "hybrid", "window": 4}, context=12, batch_size=2, steps=2, out_dir=tmp_path)
    teacher, converted = out["teacher"], out["converted"]
    for side in (teacher, converted):
        assert side["context"] == 12 and side["batch_size"] == 2 and side["launches_per_step"] > 0
        assert side["device_ms_per_step"] > 0 and 0 < len(side["top"]) <= 25
        assert abs(sum(r["share"] for r in side["top"]) - 1) < 0.5  # the top rows hold most of the time
    names = lambda side: {r["name"] for r in side["top"]}  # noqa: E731
    assert any("baddbmm" in n for n in names(converted)) and not any("baddbmm" in n for n in names(teacher))  # the linear state
    assert linearize.layer_modes(model) == {0: "hybrid", 1: "hybrid"}  # the teacher's profile left the modes
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["converted"]["batch_size"] == 2 and "### converted: top kernels" in (tmp_path / "profile.md").read_text()
    assert "| teacher |" in profile_markdown(out)


def test_cli_profile(tmp_path, capsys):
    path = tmp_path / "tiny"
    build_tiny_llama(num_hidden_layers=2).save_pretrained(path)
    assert main(["bench", "--profile", "--model", str(path), "--attention", "dsla", "--decode-contexts", "8", "--out", str(tmp_path / "p")]) == 0
    assert "Decode step profile: batch 1 at 8 tokens" in capsys.readouterr().out and (tmp_path / "p" / "profile.json").is_file()
    assert main(["bench", "--profile", "--layer", "smollm2-135m", "--attention", "hybrid", "--prefill-lengths", "32", "--decode-contexts",
                 "none", "--repeats", "1", "--out", str(tmp_path / "l")]) == 0  # fmt: skip
    assert "### prefill kernels: hybrid window 64" in (tmp_path / "l" / "layer.md").read_text()
