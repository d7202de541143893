"""Suites, reports, comparison and component ablations on a tiny model (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

import linearize
from linearize.cli import main
from linearize.eval.ablation import ablate
from linearize.eval.markdown import table, to_markdown
from linearize.eval.report import headline, run_suite
from linearize.eval.suite import get_suite
from linearize.hub import build_tiny_llama
from linearize.layers.registry import KINDS

from ..train.conftest import tiny_tokenizer


def tiny_suite(**changes):
    base = dict(perplexity_lengths=[32, 64], perplexity_tokens=400, synthetic_tasks=["passkey"], synthetic_lengths=[128],
                synthetic_samples={"default": 2}, mc_tasks=[], batch_size=2)
    return get_suite("quick", **(base | changes))


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny"
    build_tiny_llama(seed=0, num_hidden_layers=2, max_position_embeddings=2048).save_pretrained(path)  # the quick suite reads 1024 tokens
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 7 + j) % 120 + 3}" for j in range(80))}) + "\n" for i in range(40)))
    return str(path)


def test_suite_runs_and_renders(corpus):
    model, tok = build_tiny_llama(seed=0, num_hidden_layers=2), tiny_tokenizer()
    result = run_suite(model, tok, tiny_suite(heldout_source=corpus))
    flat = headline(result)
    assert set(flat) == {"ppl@32", "ppl@64", "passkey@128"}
    assert result["synthetic"]["passkey"][128]["n"] == 2 and 0 <= flat["passkey@128"] <= 100
    assert flat["ppl@32"] > 1
    assert "mc" not in result and "mc_skipped" not in result
    skipped = run_suite(model, tok, tiny_suite(heldout_source=corpus, perplexity_lengths=[], synthetic_tasks=[], mc_tasks=["copa"]))
    assert skipped["mc_skipped"] == "no data_dir given"
    markdown = to_markdown("tiny", result)
    assert "| ppl@32 |" in markdown and "| passkey | 128 |" in markdown


@pytest.mark.slow
def test_suite_reports_each_finished_part(corpus):
    """on_update sees the result grow part by part: perplexity, then each synthetic task and length."""
    model, tok = build_tiny_llama(seed=0, num_hidden_layers=2), tiny_tokenizer()
    updates = []
    result = run_suite(model, tok, tiny_suite(heldout_source=corpus, synthetic_lengths=[96, 128]), on_update=updates.append)
    assert [set(headline(u)) for u in updates] == [
        {"ppl@32", "ppl@64"},
        {"ppl@32", "ppl@64", "passkey@96"},
        {"ppl@32", "ppl@64", "passkey@96", "passkey@128"},
    ]
    assert headline(updates[-1]) == headline(result)


@pytest.mark.slow
def test_cli_eval_stopped_midway_leaves_a_partial_report(tmp_path, model_dir, corpus, monkeypatch):
    """A run killed after its first synthetic length keeps what it measured; a finished run removes it."""
    import linearize.eval.synthetic as synthetic

    real = synthetic.run_synthetic
    calls = []

    def dies_on_second_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as when the machine is taken back mid-run
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, "run_synthetic", dies_on_second_call)
    out = tmp_path / "ev"
    argv = ["eval", "--model", str(model_dir), "--tasks", "passkey", "--lengths", "96,128", "--samples", "1",
            "--ppl-lengths", "32", "--ppl-source", corpus, "--mc-tasks", "none", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        main(argv + ["--data-dir", str(tmp_path)])
    partial = json.loads((out / "report.partial.json").read_text())
    assert partial["partial"] is True and set(partial["synthetic"]["passkey"]) == {"96"}
    assert partial["perplexity"][0]["length"] == 32
    assert "passkey" in (out / "report.partial.md").read_text() and not (out / "report.json").exists()
    monkeypatch.setattr(synthetic, "run_synthetic", real)
    assert main(argv) == 0
    assert (out / "report.json").exists() and not (out / "report.partial.json").exists() and not (out / "report.partial.md").exists()


@pytest.mark.slow
def test_ablation_reports_every_mode_and_delta_la(corpus):
    model, tok = build_tiny_llama(seed=0, num_hidden_layers=2), tiny_tokenizer()
    linearize.convert(model, {"attention": "hybrid", "window": 4})
    linearize.set_mode(model, "la_only", layers=[1])
    out = ablate(model, tok, tiny_suite(heldout_source=corpus, synthetic_tasks=[]))
    assert out["modes"] == list(KINDS["hybrid"].ablation_modes)
    assert set(out["table"]) == set(KINDS["hybrid"].ablation_modes)
    assert out["delta_la"]["ppl@32"] == pytest.approx(out["table"]["hybrid"]["ppl@32"] - out["table"]["swa_only"]["ppl@32"])
    assert out["table"]["none"]["ppl@32"] != out["table"]["hybrid"]["ppl@32"]
    assert linearize.layer_modes(model) == {0: "hybrid", 1: "la_only"}  # restored
    md = table(out["table"], extra={"Delta_LA": out["delta_la"]})
    assert md.splitlines()[0] == "| metric | hybrid | swa_only | la_only | sinks_only | none | Delta_LA |"
    linearize.convert(model, {"attention": "lola", "window": 4, "sparse_cache": 2})
    assert ablate(model, tok, tiny_suite(heldout_source=corpus, synthetic_tasks=[]))["modes"] == list(KINDS["lola"].ablation_modes)


@pytest.mark.slow
def test_dsla_ablation_reads_each_state_alone(corpus):
    """DSLA's default ablation: history_only / recent_only are the layer with gamma fixed to 1 / 0."""
    model, tok = build_tiny_llama(seed=0, num_hidden_layers=2), tiny_tokenizer()
    linearize.convert(model, {"attention": "dsla", "layers": [1]})
    layer = model.model.layers[1].self_attn
    with torch.no_grad():
        layer.gamma_logit.fill_(0.3)
    ids = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = {}
        for mode, logit in (("history_only", 50.0), ("recent_only", -50.0), ("hybrid", 0.3)):
            linearize.set_mode(model, mode)
            outputs[mode] = model(ids).logits
            linearize.set_mode(model, "hybrid")
            layer.gamma_logit.fill_(logit)  # sigmoid(+-50) is 1 / 0 in float32
            torch.testing.assert_close(model(ids).logits, outputs[mode])
            layer.gamma_logit.fill_(0.3)
    assert not torch.allclose(outputs["history_only"], outputs["recent_only"])
    out = ablate(model, tok, tiny_suite(heldout_source=corpus, synthetic_tasks=[]))
    assert out["modes"] == list(KINDS["dsla"].ablation_modes) and set(out["table"]) == set(KINDS["dsla"].ablation_modes)
    assert out["delta_la"] == {}  # no swa_only mode: Delta_LA is a hybrid-layer diagnostic
    with pytest.raises(ValueError, match="unknown mode 'swa_only' for layer 1 \\(dsla\\); valid modes: hybrid, history_only"):
        ablate(model, tok, tiny_suite(heldout_source=corpus, synthetic_tasks=[]), modes=["hybrid", "swa_only"])


def test_ablate_refuses_an_unconverted_model_and_unknown_suite():
    with pytest.raises(ValueError, match="needs a converted model"):
        ablate(build_tiny_llama(), tiny_tokenizer(), tiny_suite())
    with pytest.raises(ValueError, match="unknown suite 'huge'; valid suites: quick, standard, full"):
        get_suite("huge")


@pytest.mark.slow
def test_cli_eval_compare_ablate_bench(tmp_path, model_dir, corpus, capsys):
    converted = tmp_path / "hybrid"
    assert main(["convert", "--model", str(model_dir), "--attention", "hybrid", "--window", "4", "--out", str(converted)]) == 0
    common = ["--tasks", "passkey", "--lengths", "128", "--samples", "1", "--mc-tasks", "none"]
    assert main(["eval", "--model", str(model_dir), *common, "--out", str(tmp_path / "ev")]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "ev" / "report.json").read_text())["synthetic"]["passkey"]["128"]["n"] == 1
    assert main(["compare", str(model_dir), str(converted), *common, "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare.md").read_text().count("|") > 6 and (tmp_path / "cmp" / "perplexity_vs_length.png").is_file()
    assert main(["ablate", "--model", str(converted), "--modes", "hybrid,swa_only", *common, "--out", str(tmp_path / "abl")]) == 0
    assert "Delta_LA" in (tmp_path / "abl" / "ablation.md").read_text()
    assert main(["bench", "--model", str(model_dir), "--attention", "hybrid", "--window", "4", "--prefill-lengths", "16,32",
                 "--decode-contexts", "16", "--decode-steps", "2", "--repeats", "1", "--out", str(tmp_path / "bench")]) == 0
    assert {p.name for p in (tmp_path / "bench").iterdir()} == {"efficiency.json", "efficiency.md", "efficiency.png"}
    capsys.readouterr()
    assert main(["eval", "--model", str(model_dir), "--suite", "huge"]) == 2
    assert "unknown suite 'huge'" in capsys.readouterr().err
    assert main(["eval", "--model", str(model_dir), "--tasks", "needle", "--lengths", "128"]) == 2
    assert "needle" in capsys.readouterr().err
    assert main(["eval", "--model", str(model_dir), "--tasks", "passkey", "--lengths", "100000"]) == 2
    assert "100000" in capsys.readouterr().err
    torch.set_num_threads(torch.get_num_threads())


@pytest.mark.slow
def test_cli_eval_spec_flags_convert_a_trained_model_keeping_its_spec(tmp_path, model_dir, corpus, capsys):
    converted = tmp_path / "hybrid"
    assert main(["convert", "--model", str(model_dir), "--attention", "hybrid", "--window", "8", "--out", str(converted)]) == 0
    assert main(["eval", "--model", str(converted), "--attention", "lola", "--sparse-cache", "4", "--tasks", "passkey",
                 "--lengths", "128", "--samples", "1", "--mc-tasks", "none", "--out", str(tmp_path / "ev")]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert report["synthetic"]["passkey"]["128"]["n"] == 1
    model, _ = linearize.load_model(str(converted))
    from linearize.cli import build_parser, load_converted

    args = build_parser().parse_args(["eval", "--model", str(converted), "--attention", "lola", "--sparse-cache", "4"])
    model, _ = load_converted(args)
    assert model.config.linearize["options"]["window"] == 8 and model.config.linearize["options"]["sparse_cache"] == 4


@pytest.mark.slow
def test_cli_plots_for_a_lola_conversion(tmp_path, model_dir, corpus, capsys):
    assert main(["plots", "--model", str(model_dir), "--attention", "lola", "--window", "4", "--sparse-cache", "2",
                 "--source", corpus, "--tokens", "48", "--layer", "1", "--out", str(tmp_path / "plots")]) == 0, capsys.readouterr().err
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["attention_mass_layer1.png", "self_recall_layer1.png"]


def test_merge_results_later_parts_win_and_nothing_is_lost():
    from linearize.eval.report import headline, merge_results

    core_partial = {"perplexity": [{"length": 512, "ppl": 10.0}, {"length": 1024, "ppl": 9.0}],
                    "synthetic": {"passkey": {"1024": {"score": 50.0, "n": 2}}}}
    core_rerun = {"synthetic": {"passkey": {"1024": {"score": 0.0, "n": 100}, "2048": {"score": 0.0, "n": 100}}}}
    mc = {"mc": {"copa": {"acc": 0.6, "acc_norm": 0.5, "n": 100}}}
    merged = merge_results([core_partial, core_rerun, mc])
    assert headline(merged) == {"ppl@512": 10.0, "ppl@1024": 9.0, "passkey@1024": 0.0, "passkey@2048": 0.0,
                                "copa acc": 60.0, "copa acc_norm": 50.0}
    assert merged["synthetic"]["passkey"]["1024"]["n"] == 100


def test_cli_compare_from_saved_reports(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"perplexity": [{"length": 128, "ppl": 12.5}], "synthetic": {"passkey": {"128": {"score": 100.0, "n": 3}}}}))
    b.write_text(json.dumps({"synthetic": {"passkey": {"128": {"score": 0.0, "n": 3}}}}))
    assert main(["compare", "--reports", f"teacher={a}", f"converted={a},{b}", "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| passkey@128 | 100.00 | 0.00 |" in table and "| ppl@128 | 12.50 | 12.50 |" in table
    assert (tmp_path / "cmp" / "perplexity_vs_length.png").is_file()
    assert (tmp_path / "cmp" / "tasks.png").stat().st_size > 0
    capsys.readouterr()
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"perplexity": [{"length": 128, "ppl": 12.5}]}))
    assert main(["compare", "--reports", f"teacher={c}", "--out", str(tmp_path / "no-tasks")]) == 0
    assert not (tmp_path / "no-tasks" / "tasks.png").exists()  # no synthetic scores: no empty plot
    assert main(["compare", "--reports", "teacher"]) == 2
    assert "NAME=REPORT.json" in capsys.readouterr().err
    assert main(["compare", "--reports", f"x={tmp_path / 'missing.json'}"]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["compare"]) == 2
    assert "name the models" in capsys.readouterr().err


@pytest.mark.slow
def test_ablation_of_a_nested_family_leaves_its_teacher_layers_alone(tmp_path, corpus):
    """With active=1 of order [1, 0], layer 0 runs the teacher: every mode is applied to layer 1 only,
    and the CLI takes --active on a saved conversion (merged into the model's own spec)."""
    model, tok = build_tiny_llama(seed=0, num_hidden_layers=2), tiny_tokenizer()
    linearize.convert(model, {"attention": "dsla", "order": [1, 0], "active": 1})
    assert linearize.layer_modes(model) == {0: "teacher", 1: "hybrid"}
    seen = []

    def watch(results):
        seen.append(linearize.layer_modes(model))

    out = ablate(model, tok, tiny_suite(heldout_source=corpus, synthetic_tasks=[]), modes=["hybrid", "none"], on_update=watch)
    assert {0: "teacher", 1: "none"} in seen and all(modes[0] == "teacher" for modes in seen)
    assert out["table"]["none"]["ppl@32"] != out["table"]["hybrid"]["ppl@32"]
    assert linearize.layer_modes(model) == {0: "teacher", 1: "hybrid"}  # restored
    linearize.set_active(model, 0)
    with pytest.raises(ValueError, match="all of them run the teacher"):
        ablate(model, tok, tiny_suite(heldout_source=corpus, synthetic_tasks=[]))

    path = tmp_path / "nested"
    linearize.set_active(model, 2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    argv = ["ablate", "--model", str(path), "--modes", "none", "--tasks", "", "--ppl-lengths", "32", "--ppl-source", corpus,
            "--mc-tasks", "none"]
    assert main(argv + ["--active", "1", "--out", str(tmp_path / "a1")]) == 0
    assert main(argv + ["--out", str(tmp_path / "a2")]) == 0
    one = json.loads((tmp_path / "a1" / "ablation.json").read_text())["table"]["none"]["ppl@32"]
    two = json.loads((tmp_path / "a2" / "ablation.json").read_text())["table"]["none"]["ppl@32"]
    assert one != two  # --active 1 ablates one layer, the saved active=2 both
    assert main(["eval", "--model", str(path), "--active", "1", "--tasks", "", "--ppl-lengths", "32", "--ppl-source", corpus,
                 "--mc-tasks", "none", "--out", str(tmp_path / "e1")]) == 0
