"""The linearize command line on a tiny saved model (real files, real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import linearize
from linearize.cli import main
from linearize.hub import build_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_llama(seed=0, num_hidden_layers=3).save_pretrained(path)
    return str(path)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "linearize.cli", *args], capture_output=True, text=True, timeout=300)


def test_info_reports_layers_and_memory(tiny_dir, capsys):
    assert main(["info", tiny_dir, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] == 3 and info["new_parameters"] == 0
    assert [r["attention"] for r in info["per_layer"]] == ["teacher"] * 3
    assert info["per_layer"][0]["kv_bytes_per_token"] == 2 * 2 * 16 * 4  # K and V, 2 KV heads, dim 16, float32


def test_convert_from_flags_and_yaml_spec_then_info(tiny_dir, tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["convert", "--model", tiny_dir, "--attention", "hybrid", "--layers", "0,2", "--window", "8", "--out", str(out)]) == 0
    model, _ = linearize.load_model(str(out))
    assert model.config.linearize["layers"] == [0, 2] and model.config.linearize["options"]["window"] == 8
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [r["attention"] for r in info["per_layer"]] == ["hybrid", "teacher", "hybrid"]
    assert info["per_layer"][0]["kv_bytes_per_token"] == 0 and info["per_layer"][0]["state_bytes"] > 0
    assert info["new_parameters"] > 0

    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("attention: lola\nwindow: 4\nsparse_cache: 4\nlayers: [1]\n")
    adapter = tmp_path / "adapter"
    assert main(["convert", "--model", tiny_dir, "--spec", str(spec_file), "--window", "6", "--adapter", "--out", str(adapter)]) == 0
    meta = json.loads((adapter / "linearize_adapter.json").read_text())
    assert meta["spec"]["attention"] == "lola" and meta["spec"]["options"]["window"] == 6 and meta["base_model"] == tiny_dir


@pytest.mark.slow
def test_generate_prints_text_speed_and_memory(tiny_dir, tmp_path):
    tok_dir = tmp_path / "with_tokenizer"
    model, _ = linearize.load_model(tiny_dir)
    model.save_pretrained(tok_dir)
    # a real tokenizer is not available offline for the tiny model: the CLI must say so clearly
    result = run_cli("generate", "--model", str(tok_dir), "--prompt", "hi")
    assert result.returncode == 2 and "has no tokenizer" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attention", "mamba"], "unknown attention 'mamba'; valid choices: softmax, hybrid, lola, dsla"),
        (["--layers", "7"], "layer index 7 out of range: the model has 3 layers"),
        (["--window", "0"], "window must be an integer >= 1, got 0"),
        (["--attention", "lola", "--sparse-cache", "-3"], "sparse_cache must be an integer >= 0, got -3"),
        (["--feature-map", "cosine"], "unknown feature_map 'cosine'; valid choices: hedgehog, exp, relu, elu, identity"),
        (["--spec", "missing.yaml"], "spec file 'missing.yaml' does not exist"),
        (["--attention", "lola", "--recall", "cache"], "recall must be one of ('state', 'memory'), got 'cache'"),
    ],
    ids=["attention", "layer-index", "window", "sparse-budget", "feature-map", "spec-file", "lola-recall"],
)
def test_bad_input_exits_2_with_a_clear_message(tiny_dir, tmp_path, capsys, args, message):
    assert main(["convert", "--model", tiny_dir, "--out", str(tmp_path / "x"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_unknown_model_and_unsupported_architecture(tmp_path):
    result = run_cli("info", "no-such-model-anywhere")
    assert result.returncode == 2 and "no-such-model-anywhere" in result.stderr and "smollm2-135m" in result.stderr
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    result = run_cli("convert", "--model", str(tmp_path / "gpt2"), "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "unsupported architecture 'gpt2'" in result.stderr and "Traceback" not in result.stderr


def test_eval_list_flags_parse_or_name_the_bad_value(capsys):
    from linearize.cli import build_parser

    args = build_parser().parse_args(["eval", "--ppl-lengths", "none", "--lengths", "1024,2048"])
    assert args.ppl_lengths == [] and args.lengths == [1024, 2048]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["eval", "--ppl-lengths", "512,5x"])
    assert exit_info.value.code == 2
    assert "argument --ppl-lengths: expected comma-separated integers, got '512,5x'" in capsys.readouterr().err


def test_generate_flags_change_the_models_own_spec(tiny_dir, tmp_path, capsys):
    """--active picks a prefix of a saved nested family's order (the model's own spec), as in eval;
    an out-of-range prefix names the valid range. (The tiny model has no tokenizer, so a valid
    command stops at that, after the spec was applied.)"""
    family = tmp_path / "family"
    model, _ = linearize.load_model(tiny_dir)
    linearize.convert(model, {"attention": "dsla", "order": [2, 0, 1]})
    model.save_pretrained(family)
    assert main(["generate", "--model", str(family), "--active", "1", "--prompt", "hi"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert main(["generate", "--model", str(family), "--active", "9", "--prompt", "hi"]) == 2
    assert "active must be an integer in 0..3" in capsys.readouterr().err
