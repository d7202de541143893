"""Bad input, through every command and the Python API: exit code 2 and one line naming the bad value,
no traceback, nothing loaded first; the API raises ValueError / FileNotFoundError with the same words."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import linearize
from linearize import hub, names
from linearize.cli import main
from linearize.hub import build_tiny_llama
from tests.train.conftest import tiny_tokenizer

NOT_UTF8 = b"caf\xe9".decode("utf-8", "surrogateescape")  # what argv holds for bytes that are not UTF-8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model with a tokenizer, a converted nested family, an adapter, and broken copies of each."""
    root = tmp_path_factory.mktemp("bad-input")
    tiny = root / "tiny"
    build_tiny_llama(seed=0, num_hidden_layers=3).save_pretrained(tiny)
    tiny_tokenizer().save_pretrained(tiny)

    truncated = root / "truncated"
    build_tiny_llama(seed=0, num_hidden_layers=3).save_pretrained(truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    model, _ = linearize.load_model(str(tiny))
    linearize.convert(model, {"attention": "hybrid", "window": 4})
    adapter = root / "adapter"
    linearize.save_adapter(model, adapter, base_model=str(tiny))
    corrupt_adapter = root / "corrupt-adapter"
    linearize.save_adapter(model, corrupt_adapter, base_model=str(tiny))
    (corrupt_adapter / "adapter.safetensors").write_bytes(b"not a safetensors file")
    orphan = root / "orphan-adapter"
    linearize.save_adapter(model, orphan, base_model="no-such-base-model")

    family = root / "family"
    model, _ = linearize.load_model(str(tiny))
    linearize.convert(model, {"attention": "dsla", "order": [2, 0, 1]})
    model.save_pretrained(family)
    tiny_tokenizer().save_pretrained(family)

    (root / "bad.yaml").write_text("attention: [hybrid\n  window: 3\n")
    (root / "far-override.yaml").write_text("attention: hybrid\noverrides: {99: {window: 8}}\n")
    (root / "a-file").write_text("not a directory")
    (root / "not-json.json").write_text("{ not json")
    (root / "full").mkdir()
    (root / "full" / "keep.txt").write_text("someone's work")
    names = ("tiny", "truncated", "adapter", "corrupt-adapter", "orphan-adapter", "family", "bad.yaml", "far-override.yaml",
             "a-file", "not-json.json", "full")
    return {name.replace("-", "_").replace(".", "_").removesuffix("_json"): str(root / name) for name in names}


@pytest.fixture
def offline(monkeypatch):
    """No network: hub ids must fail at once (nothing may try the hub)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(names, "_hub_reachable", lambda: False)


def run(args: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of the command line, in process."""
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, *expected: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in expected:
        assert text in err, err


# One row per bad input: (command line with {placeholders} from `files`, texts the error line must hold).
CASES = {
    # unknown names
    "info-unknown-name": (["info", "no-such-model"], ["'no-such-model'", "smollm2-135m", "smollm2-135m-lolcats"]),
    "info-missing-dir": (["info", "missing/dir/model"], ["model directory 'missing/dir/model' does not exist"]),
    "convert-unknown-model": (["convert", "--model", "no-such-model", "--out", "{tmp}/o"], ["'no-such-model'"]),
    "generate-unknown-model": (["generate", "--model", "no-such-model"], ["'no-such-model'"]),
    "demo-unknown-conversion": (["demo", "--conversion", "no-such-conv"], ["'no-such-conv'", "smollm2-135m-lolcats"]),
    "compare-unknown-model": (["compare", "{tiny}", "no-such-model"], ["'no-such-model'"]),
    "ablate-unknown-model": (["ablate", "--model", "no-such-model"], ["'no-such-model'"]),
    "bench-unknown-model": (["bench", "--model", "no-such-model"], ["'no-such-model'"]),
    "plots-unknown-model": (["plots", "--model", "no-such-model", "--out", "{tmp}/o"], ["'no-such-model'"]),
    "sensitivity-unknown-model": (["sensitivity", "--model", "no-such-model", "--out", "{tmp}/o"], ["'no-such-model'"]),
    "eval-unknown-model": (["eval", "--model", "no-such-model"], ["'no-such-model'"]),
    "adapter-unknown-base": (["info", "{orphan_adapter}"], ["its base model cannot be loaded", "'no-such-base-model'"]),
    "serve-unknown-model": (["serve", "--model", "no-such-model"], ["'no-such-model'", "smollm2-135m-dsla-chained"]),
    "serve-device-cuda": (["serve", "--model", "{family}", "--device", "cuda"], ["device 'cuda' is not available"]),
    "serve-port-0": (["serve", "--model", "{family}", "--port", "0"], ["port must be in 1..65535, got 0"]),
    "serve-port-text": (["serve", "--port", "http"], ["--port", "'http'"]),
    "replay-unknown-model": (["replay", "--model", "no-such-model"], ["'no-such-model'"]),
    "replay-out-below-a-file": (["replay", "--model", "{family}", "--out", "{a_file}/r"], ["is a file, not a directory"]),
    "replay-requests-text": (["replay", "--requests", "all"], ["--requests", "'all'"]),
    "train-unknown-recipe": (["train", "--recipe", "no-such-recipe"], ["unknown recipe 'no-such-recipe'", "lolcats"]),
    "eval-unknown-suite": (["eval", "--model", "{tiny}", "--suite", "huge"], ["unknown suite 'huge'", "quick, standard, full"]),
    "generate-unknown-mode": (["generate", "--model", "{tiny}", "--mode", "fast"], ["invalid choice: 'fast'", "la_only"]),
    "convert-unknown-attention": (["convert", "--model", "{tiny}", "--attention", "mamba", "--out", "{tmp}/o"], ["'mamba'", "dsla"]),
    "eval-unknown-device": (["eval", "--model", "{tiny}", "--device", "tpu"], ["'tpu'", "cpu"]),
    "unknown-command": (["deploy"], ["invalid choice: 'deploy'", "info"]),
    "unknown-flag": (["info", "{tiny}", "--colour"], ["unrecognized arguments: --colour"]),
    # out-of-range numbers
    "convert-layer-99": (["convert", "--model", "{tiny}", "--layers", "99", "--out", "{tmp}/o"], ["layer index 99 out of range", "0..2"]),
    "convert-override-99": (["convert", "--model", "{tiny}", "--spec", "{far_override_yaml}", "--out", "{tmp}/o"],
                            ["override for layer 99 out of range", "0..2"]),
    "convert-window-0": (["convert", "--model", "{tiny}", "--window", "0", "--out", "{tmp}/o"], ["window must be an integer >= 1, got 0"]),
    "generate-active-9": (["generate", "--model", "{family}", "--active", "9"], ["active must be an integer in 0..3"]),
    "generate-max-new-tokens-0": (["generate", "--max-new-tokens", "0"], ["--max-new-tokens", "got 0"]),
    "bench-prefill-0": (["bench", "--prefill-lengths", "0"], ["--prefill-lengths", "'0'"]),
    "bench-batch-size-0": (["bench", "--batch-size", "0"], ["--batch-size", "got 0"]),
    "bench-repeats-negative": (["bench", "--repeats", "-1"], ["--repeats", "got -1"]),
    "eval-samples-0": (["eval", "--samples", "0"], ["--samples", "got 0"]),
    "eval-lengths-0": (["eval", "--lengths", "1024,0"], ["--lengths", "'1024,0'"]),
    "eval-ppl-lengths-negative": (["eval", "--ppl-lengths", "-5"], ["--ppl-lengths", "'-5'"]),
    "sensitivity-seq-len-1": (["sensitivity", "--seq-len", "1", "--out", "{tmp}/o"], ["--seq-len", "got 1"]),
    "plots-tokens-0": (["plots", "--model", "{tiny}", "--tokens", "0", "--out", "{tmp}/o"], ["--tokens", "got 0"]),
    "demo-max-new-tokens-0": (["demo", "--max-new-tokens", "0"], ["--max-new-tokens", "got 0"]),
    "eval-device-cuda": (["eval", "--model", "{tiny}", "--device", "cuda"], ["device 'cuda' is not available", "cpu"]),
    # wrong types
    "convert-window-text": (["convert", "--model", "{tiny}", "--window", "wide", "--out", "{tmp}/o"], ["--window", "'wide'"]),
    "convert-layers-text": (["convert", "--model", "{tiny}", "--layers", "first", "--out", "{tmp}/o"], ["--layers", "'first'"]),
    "convert-overlap-text": (["convert", "--model", "{tiny}", "--overlap", "maybe", "--out", "{tmp}/o"], ["--overlap", "'maybe'"]),
    "bench-decode-steps-text": (["bench", "--decode-steps", "many"], ["--decode-steps", "'many'"]),
    "eval-mc-limit-text": (["eval", "--mc-limit", "all"], ["--mc-limit", "'all'"]),
    "plots-layer-text": (["plots", "--model", "{tiny}", "--layer", "middle", "--out", "{tmp}/o"], ["--layer", "'middle'"]),
    "generate-prompt-not-utf8": (["generate", "--model", "{tiny}", "--prompt", NOT_UTF8], ["--prompt is not valid UTF-8", "\\xe9"]),
    "generate-prompt-not-utf8-raw": (["generate", "--model", "{tiny}", "--no-chat", "--prompt", NOT_UTF8], ["--prompt is not valid UTF-8"]),
    "generate-prompt-empty-raw": (["generate", "--model", "{tiny}", "--no-chat", "--prompt", ""], ["prompt '' encodes to no tokens"]),
    "demo-prompt-not-utf8": (["demo", "--prompt", NOT_UTF8], ["--prompt is not valid UTF-8"]),
    "compare-reports-syntax": (["compare", "--reports", "report.json"], ["NAME=REPORT.json", "'report.json'"]),
    # missing and corrupt files
    "convert-spec-missing": (["convert", "--model", "{tiny}", "--spec", "missing.yaml", "--out", "{tmp}/o"], ["'missing.yaml' does not exist"]),
    "convert-spec-invalid-yaml": (["convert", "--model", "{tiny}", "--spec", "{bad_yaml}", "--out", "{tmp}/o"],
                                  ["is not valid YAML at line 2", "bad.yaml"]),
    "info-truncated-weights": (["info", "{truncated}"], ["cannot load the checkpoint in", "truncated"]),
    "info-corrupt-adapter": (["info", "{corrupt_adapter}"], ["adapter.safetensors cannot be read", "corrupt-adapter"]),
    "model-is-a-file": (["info", "{a_file}"], ["is a file, not a directory"]),
    "eval-data-dir-missing": (["eval", "--model", "{tiny}", "--data-dir", "missing-data"], ["--data-dir 'missing-data'"]),
    "compare-report-missing": (["compare", "--reports", "a=missing.json"], ["report 'missing.json' (for 'a') does not exist"]),
    "compare-report-not-json": (["compare", "--reports", "a={not_json}"], ["not-json.json", "is not JSON"]),
    "train-recipe-invalid-yaml": (["train", "--recipe", "{bad_yaml}"], ["recipe", "bad.yaml' is not valid YAML at line 2"]),
    "train-report-missing": (["train", "--report", "missing-run"], ["no summary.json in 'missing-run'"]),
    "train-compare-runs-missing": (["train", "--compare-runs", "missing-run"], ["no summary.json in 'missing-run'"]),
    # outputs that cannot be written
    "convert-out-below-a-file": (["convert", "--model", "{tiny}", "--out", "{a_file}/out"], ["a-file' is a file, not a directory"]),
    "convert-out-not-empty": (["convert", "--model", "{tiny}", "--out", "{full}"], ["exists and is not empty", "--force"]),
    "convert-adapter-out-not-empty": (["convert", "--model", "{tiny}", "--adapter", "--out", "{full}"], ["--force"]),
    "eval-out-below-a-file": (["eval", "--model", "{tiny}", "--out", "{a_file}/report"], ["is a file, not a directory"]),
    "bench-out-below-a-file": (["bench", "--model", "{tiny}", "--out", "{a_file}/bench"], ["is a file, not a directory"]),
    "plots-out-is-a-file": (["plots", "--model", "{tiny}", "--out", "{a_file}"], ["is a file, not a directory"]),
    "sensitivity-out-below-a-file": (["sensitivity", "--model", "{tiny}", "--out", "{a_file}/s"], ["is a file, not a directory"]),
    "compare-out-below-a-file": (["compare", "{tiny}", "--out", "{a_file}/c"], ["is a file, not a directory"]),
    "ablate-out-below-a-file": (["ablate", "--model", "{tiny}", "--out", "{a_file}/a"], ["is a file, not a directory"]),
    "train-out-below-a-file": (["train", "--compare-runs", "r", "--out", "{a_file}/t"], ["is a file, not a directory"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_every_command_one_line_exit_2(name, files, offline, tmp_path, capsys, monkeypatch):
    if name.endswith("-device-cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    args, expected = CASES[name]
    args = [a.format(tmp=tmp_path, **files) for a in args]
    loads_first = {"info-truncated-weights", "info-corrupt-adapter", "adapter-unknown-base", "convert-layer-99", "convert-override-99",
             "convert-window-0", "generate-active-9", "convert-unknown-attention", "generate-prompt-empty-raw"}
    if name not in loads_first:  # everything else is caught before any model loads
        monkeypatch.setattr("linearize.api.load_base_model", no_loading)
    assert_one_line(*run(args, capsys), *expected)


# ----------------------------------------------------------------------------- one test per case


def test_truncated_weights_and_corrupt_adapter_are_named(files, capsys):
    assert_one_line(*run(["info", files["truncated"]], capsys), "cannot load the checkpoint in", "incomplete metadata")
    assert_one_line(*run(["info", files["corrupt_adapter"]], capsys), "adapter.safetensors cannot be read")
    with pytest.raises(ValueError, match="cannot load the checkpoint in"):
        linearize.load_model(files["truncated"])
    with pytest.raises(ValueError, match="adapter.safetensors cannot be read"):
        linearize.load_model(files["corrupt_adapter"])


def test_invalid_yaml_spec_names_file_and_line(files, tmp_path, capsys):
    assert_one_line(*run(["convert", "--model", files["tiny"], "--spec", files["bad_yaml"], "--out", str(tmp_path / "o")], capsys),
                    "bad.yaml' is not valid YAML at line 2, column")
    with pytest.raises(ValueError, match="is not valid YAML at line 2"):
        linearize.ConversionSpec.from_file(files["bad_yaml"])


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "no-chat"])
def test_prompt_that_is_not_utf8(files, capsys, chat):
    args = ["generate", "--model", files["tiny"], "--prompt", NOT_UTF8] + ([] if chat else ["--no-chat"])
    assert_one_line(*run(args, capsys), "--prompt is not valid UTF-8 text: it holds b'\\xe9' at character 3")
    from linearize.generate import generate_text

    model, tokenizer = linearize.load_model(files["tiny"])
    with pytest.raises(ValueError, match="prompt is not valid UTF-8 text"):
        generate_text(model, tokenizer, NOT_UTF8, max_new_tokens=1, chat=chat)


def test_out_below_a_file(files, capsys):
    assert_one_line(*run(["convert", "--model", files["tiny"], "--out", files["a_file"] + "/out"], capsys),
                    "a-file' is a file, not a directory")
    model, _ = linearize.load_model(files["tiny"])
    linearize.convert(model, {"attention": "hybrid"})
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        linearize.save_adapter(model, files["a_file"] + "/adapter", base_model=files["tiny"])


def test_convert_into_a_non_empty_directory_needs_force(files, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    assert_one_line(*run(["convert", "--model", files["tiny"], "--out", str(full)], capsys), "--force")
    assert (full / "keep.txt").exists()
    assert main(["convert", "--model", files["tiny"], "--out", str(full), "--force"]) == 0
    assert not (full / "keep.txt").exists() and (full / "config.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", "--model", files["tiny"], "--out", str(empty)]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_without_cuda(files, capsys):
    assert_one_line(*run(["eval", "--model", files["tiny"], "--device", "cuda"], capsys), "device 'cuda' is not available")
    assert_one_line(*run(["bench", "--model", files["tiny"], "--device", "cuda"], capsys), "device 'cuda' is not available")
    with pytest.raises(ValueError, match="device 'cuda' is not available.*valid choices here: cpu"):
        linearize.load_model(files["tiny"], device="cuda")


def test_bench_lengths_and_batch_size_must_be_positive(files, capsys):
    for flag in ("--prefill-lengths", "--decode-contexts", "--batch-size", "--decode-steps", "--repeats"):
        code, err = run(["bench", "--model", files["tiny"], flag, "0"], capsys)
        assert_one_line(code, err, f"argument {flag}:", "0")
    from linearize.bench.efficiency import run_efficiency

    model, _ = linearize.load_model(files["tiny"])
    with pytest.raises(ValueError, match=r"prefill_lengths must be integers >= 1, got \[0\]"):
        run_efficiency(model, {"attention": "hybrid"}, prefill_lengths=[0])
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        run_efficiency(model, {"attention": "hybrid"}, batch_size=0)


def test_unknown_names_fail_at_once_offline(files, offline, capsys, monkeypatch):
    """No alias, shipped conversion or directory, and no network: fail without trying the hub, naming what exists."""
    monkeypatch.setattr(hub.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("tried to load"))
    monkeypatch.setattr(names, "snapshot_download", lambda *a, **k: (_ for _ in ()).throw(OSError("not in the local cache")))
    for args in (["info", "no-such-model"], ["demo", "--conversion", "no-such-conv"]):
        assert_one_line(*run(args, capsys), repr(args[-1]), "smollm2-135m", "smollm2-135m-dsla-chained", "cannot be reached")
    assert_one_line(*run(["info", files["orphan_adapter"]], capsys), "its base model cannot be loaded", "'no-such-base-model'")
    with pytest.raises(ValueError, match="'no-such-model'.*smollm2-135m-lolcats"):
        linearize.load_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="model directory './missing' does not exist"):
        linearize.load_model("./missing")


def test_hub_reachability_probe_answers_quickly(monkeypatch):
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    monkeypatch.setattr(names.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert names._hub_reachable.__wrapped__(timeout=1.0) is False


def test_mode_on_an_unconverted_model_is_an_error(files, capsys):
    assert_one_line(*run(["generate", "--model", files["tiny"], "--mode", "la_only", "--prompt", "w3 w4"], capsys),
                    "mode 'la_only' applies to converted layers")
    model, _ = linearize.load_model(files["tiny"])
    with pytest.raises(ValueError, match="mode 'la_only' applies to converted layers"):
        linearize.set_mode(model, "la_only")


@pytest.mark.slow  # lm-eval indexes its tasks to know the name is none of them (~15 s)
def test_unknown_mc_task_fails_before_anything_runs(files, capsys, monkeypatch):
    import linearize.eval.report as report

    monkeypatch.setattr(report, "DataConfig", lambda **kw: pytest.fail("perplexity ran before the task check"))
    args = ["eval", "--model", files["tiny"], "--mc-tasks", "bogus_task", "--tasks", "passkey", "--lengths", "64", "--samples", "1"]
    assert_one_line(*run(args, capsys), "unknown task(s) 'bogus_task'", "copa", "piqa")


def test_override_out_of_range_is_an_error(files, capsys, tmp_path):
    assert_one_line(*run(["convert", "--model", files["tiny"], "--spec", files["far_override_yaml"], "--out", str(tmp_path / "o")], capsys),
                    "override for layer 99 out of range: the model has 3 layers")
    model, _ = linearize.load_model(files["tiny"])
    with pytest.raises(ValueError, match="override for layer 99 out of range"):
        linearize.convert(model, {"attention": "hybrid", "overrides": {99: {"window": 8}}})


# ----------------------------------------------------------------------------- first contact


def test_help_argument_errors_and_unknown_names_import_nothing_heavy(monkeypatch):
    """--help, a command's --help, an argument error and (offline) an unknown model name answer
    without importing torch, transformers, lm-eval or peft (they load inside the commands)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = (
        "import sys\n"
        "from linearize.cli import main\n"
        "for args in (['--help'], ['convert', '--help'], ['eval', '--help'], ['replay', '--help'], ['bench', '--batch-size', '0']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert main(['info', 'no-such-model']) == 2\n"
        "print(sorted(m for m in ('torch', 'transformers', 'lm_eval', 'peft', 'safetensors', 'numpy') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert "--sparse-cache" in result.stdout and "argument --batch-size" in result.stderr
    assert "linearize info: error: Cannot load model 'no-such-model'" in result.stderr


def test_package_names_load_on_first_use():
    """`import linearize` defers its imports; its names and submodules are there when asked for, and
    `linearize.convert` stays the function although a submodule has that name."""
    import inspect

    from linearize import convert as imported

    assert inspect.isfunction(linearize.convert) and imported is linearize.convert
    assert inspect.ismodule(linearize.api) and linearize.api.load_model is linearize.load_model
    assert {"load_model", "convert", "ConversionSpec", "set_mode"} <= set(dir(linearize))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = linearize.nothing_here


def test_stored_flag_table_matches_the_spec_and_kinds():
    """The parser reads spec_flags.json; after a spec field changes, rewrite it with write_flag_table()."""
    from linearize.cli.spec_flags import TABLE_FILE, flag_table

    assert json.loads(TABLE_FILE.read_text()) == flag_table(), "stale: run linearize.cli.spec_flags.write_flag_table()"
