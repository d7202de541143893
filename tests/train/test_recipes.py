"""Every recipe end to end on a tiny model (CPU): stages, adapter, reload, resume, data parallel."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import linearize
from linearize.api import load_model
from linearize.convert import convert, converted_layers, inference_form, new_parameters, set_mode
from linearize.spec import ConversionSpec, SpecError
from linearize.train.config import ConfigError
from linearize.train.finetune import FinetuneObjective, ssd_schedule
from linearize.train.recipes import load_recipe, recipe_names, run

from .conftest import tiny_overrides

RECIPES = ["dsla", "dsla-chained", "hedgecats", "inference-hybrid", "lola", "lolcats", "ssd"]


def test_the_recipes_are_all_there():
    assert recipe_names() == RECIPES


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_end_to_end_on_a_tiny_model(name, tiny_model_dir, tiny_corpus, tmp_path):
    extra = {"finetune.epochs": 2, "finetune.max_steps": None, "data.max_train_sequences": 8} if name == "ssd" else {}
    if name in ("dsla", "dsla-chained"):
        extra["spec.layers"] = [0, 2] if name == "dsla" else "all"
        extra.pop("spec.window", None)
    if name == "lola":  # a cache and chunks the 48-token rows can exercise
        extra |= {"spec.sparse_cache": 4, "spec.chunk": 4, "data.seq_len": 48}
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **extra)
    if name.startswith("dsla"):
        overrides.pop("spec.window")
    config = load_recipe(name, overrides)
    summary = run(config)
    run_dir = tmp_path / config.name
    assert (run_dir / "summary.json").is_file() and (run_dir / "metrics.jsonl").is_file()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stages = {r["stage"] for r in records}
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
    assert summary["heldout_loss"] > 0 and summary["teacher_heldout_loss"] > 0
    for stage, info in summary["stages"].items():
        assert info["tokens"] > 0 and info["seconds"] > 0, stage
    if name == "dsla-chained":
        order = summary["stages"]["chained"]["order"]
        assert sorted(order) == [0, 1, 2] and summary["spec"]["order"] == order
        assert {f"chained-{k:02d}-layer{layer:02d}" for k, layer in enumerate(order, 1)} <= stages
        report = summary["stages"]["chained"]["sensitivity"]  # held-out loss and recall probes, weighted
        assert report["recall_weight"] == config.chained.recall_weight > 0
        rows = sorted(report["layers"], key=lambda r: (r["score"], r["layer"]))
        assert [r["layer"] for r in rows] == order
        assert all(r["score"] == pytest.approx(r["loss_increase"] + report["recall_weight"] * max(r["recall_increase"], 0)) for r in rows)
        for k in range(4):  # every prefix loads from the one checkpoint
            model, _ = linearize.load_model(summary["adapter"], active=k)
            modes = linearize.layer_modes(model)
            assert sorted(i for i, m in modes.items() if m != "teacher") == sorted(order[:k])
    if name == "ssd":
        assert summary["spec"]["options"]["window"] == ssd_schedule("b", 1)[1]
    if name == "lola":  # trained through the sparse cache, and read back with it
        assert summary["spec"]["attention"] == "lola" and summary["spec"]["options"]["sparse_cache"] == 4
    model, _ = linearize.load_model(summary["adapter"])
    assert model.config.linearize["attention"] == config.spec["attention"]
    if config.finetune.enabled:  # LoRA saved where the recipe trains one (inference-hybrid trains its feature maps alone)
        assert (tmp_path / config.name / "adapter" / "lora.safetensors").is_file() == (config.finetune.lora_rank > 0)
    if name == "inference-hybrid":  # its stage 2 ends on the best evaluation of the form it ships in
        stage = summary["stages"]["finetune"]
        assert stage["heldout_form"] == "inference" and stage["best_heldout_loss"] == pytest.approx(summary["heldout_loss"], rel=1e-5)


@pytest.mark.slow
def test_a_run_started_from_a_conversion_keeps_the_teachers_loss(tiny_model_dir, tiny_corpus, tmp_path):
    """``train --model ADAPTER``: the teacher's held-out loss is the loaded layers run as softmax
    (here a parent without LoRA: the teacher exactly), and the loaded conversion's own loss is
    recorded as where the run started (here LoLA trained from a transferred hybrid)."""
    parent = run(load_recipe("lolcats", tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{"finetune.enabled": False})))
    assert "started_from" not in parent
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, model=parent["adapter"], **{
        "transfer.enabled": False, "finetune.max_steps": 1, "spec.sparse_cache": 4, "spec.chunk": 4, "spec.sinks": 1})
    child = run(load_recipe("lola", overrides))
    assert child["started_from"] == parent["adapter"]
    # (the two differ by 1e-5 relative on this tiny model: compared tighter than that)
    assert child["teacher_heldout_loss"] == pytest.approx(parent["teacher_heldout_loss"], rel=1e-7)
    assert child["start_heldout_loss"] == pytest.approx(parent["heldout_loss"], rel=1e-7)  # the hybrid as loaded


@pytest.mark.slow
@pytest.mark.parametrize("stage2", ["recipe", "lora"])
def test_killed_run_resumes_to_the_same_final_weights(stage2, tiny_model_dir, tiny_corpus, tmp_path, monkeypatch):
    """recipe: stage 2 as lolcats ships it (its own parameters, the best evaluation kept); lora: the
    paper's LoRA on q/k/v/o."""
    lora = {"finetune.lora_rank": 8, "finetune.train_new_params": False, "finetune.keep_best": False} if stage2 == "lora" else {}
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{
        "transfer.max_steps": 4, "transfer.save_every": 1, "finetune.max_steps": 5, "finetune.save_every": 2,
        "finetune.eval_every": 2, **lora})
    straight = run(load_recipe("lolcats", {**overrides, "output_dir": str(tmp_path / "straight")}))

    crashed = {"done": False}
    original = FinetuneObjective.forward

    def crash_once(self, input_ids, **kwargs):
        if kwargs.get("step") == 3 and not crashed["done"]:
            crashed["done"] = True
            raise KeyboardInterrupt("simulated kill")
        return original(self, input_ids, **kwargs)

    monkeypatch.setattr(FinetuneObjective, "forward", crash_once)
    config = load_recipe("lolcats", {**overrides, "output_dir": str(tmp_path / "resumed")})
    with pytest.raises(KeyboardInterrupt):
        run(config)
    resumed = run(config, resume=True)
    files = ["adapter.safetensors", *(["lora.safetensors"] if stage2 == "lora" else [])]
    a = {k: v for f in files for k, v in load_file(os.path.join(straight["adapter"], f)).items()}
    b = {k: v for f in files for k, v in load_file(os.path.join(resumed["adapter"], f)).items()}
    assert a.keys() == b.keys() and os.path.exists(os.path.join(resumed["adapter"], "lora.safetensors")) == (stage2 == "lora")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["heldout_loss"] == straight["heldout_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lolcats", "dsla-chained"])
def test_bf16_mixed_precision_trains_float32_weights_under_autocast(name, tiny_model_dir, tiny_corpus, tmp_path):
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, dtype="bf16-mixed")
    if name.startswith("dsla"):
        overrides.pop("spec.window")
    summary = run(load_recipe(name, overrides))
    assert summary["autocast"] == "bfloat16" and summary["dtype"] == "float32"
    assert math.isfinite(summary["heldout_loss"])
    weights = load_file(os.path.join(summary["adapter"], "adapter.safetensors"))
    assert weights and all(t.dtype == torch.float32 for t in weights.values())


@pytest.mark.slow
def test_wall_time_budget_stops_a_stage_early_and_evaluates(tiny_model_dir, tiny_corpus, tmp_path):
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{
        "transfer.max_steps": 1000, "transfer.max_minutes": 1e-6, "transfer.eval_every": 500, "finetune.enabled": False})
    summary = run(load_recipe("lolcats", overrides))
    transfer = summary["stages"]["transfer"]
    # the first step (kernel warm-up) is not budgeted; the second spends the 60-microsecond budget
    assert transfer["steps"] == 2 and transfer["best_heldout_loss"] is not None
    assert 0 < transfer["warmup_seconds"] <= transfer["train_seconds"] <= transfer["seconds"]
    with pytest.raises(ConfigError, match="max_minutes"):
        load_recipe("lolcats", {"transfer.max_minutes": -1})


def test_bad_recipe_and_override_errors_list_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown recipe 'lolcat'; valid recipes: dsla, dsla-chained, hedgecats"):
        load_recipe("lolcat")
    with pytest.raises(ConfigError, match="unknown override 'transfer.optim.learning_rate'.*valid: lr, weight_decay"):
        load_recipe("lolcats", {"transfer.optim.learning_rate": 1.0})
    with pytest.raises(ConfigError, match="unknown transfer objective 'mse'; valid choices: weights, la_weights"):
        load_recipe("lolcats", {"transfer.objectives": {"mse": 1.0}})
    with pytest.raises(ConfigError, match="unknown swa_dropout 'd'; valid choices: none, a, b, c"):
        load_recipe("ssd", {"finetune.swa_dropout": "d"})
    with pytest.raises(ConfigError, match="spec: window must be an integer >= 1"):
        load_recipe("lolcats", {"spec.window": 0})


def test_cli_train_list_and_bad_override(capsys):
    from linearize.cli import main

    assert main(["train", "--list"]) == 0
    assert "lolcats" in capsys.readouterr().out
    assert main(["train", "--recipe", "lolcats", "--transfer.optim.lrr", "1"]) == 2
    assert "unknown override 'transfer.optim.lrr'" in capsys.readouterr().err


def test_overrides_read_exponent_floats_as_yaml_1_2_does(tmp_path):
    from linearize.checks import load_yaml
    from linearize.cli.commands import parse_overrides

    # PyYAML's YAML 1.1 resolver returns '1e-3' as a string; the recipe check then rejected it
    overrides = parse_overrides(["--finetune.optim.lr", "1e-3", "--transfer.optim.lr=2E+0", "--finetune.max_steps=12", "--name=1e3x"])
    assert overrides == {"finetune.optim.lr": 0.001, "transfer.optim.lr": 2.0, "finetune.max_steps": 12, "name": "1e3x"}
    assert type(overrides["finetune.max_steps"]) is int
    config = load_recipe("inference-hybrid", overrides)
    assert config.finetune.optim.lr == 0.001 and config.transfer.optim.lr == 2.0
    assert load_yaml("[1, .5, -3.0e-2, 7_0, true, abc, 1e-3x]") == [1, 0.5, -0.03, 70, True, "abc", "1e-3x"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("finetune:\n  optim: {lr: 5e-4}\n")
    assert load_recipe(str(recipe)).finetune.optim.lr == 0.0005


@pytest.mark.slow
def test_two_process_data_parallel_matches_one_process(tiny_model_dir, tiny_corpus, tmp_path):
    """torchrun, 2 CPU processes on gloo, same global batch and seed: same weights, and the same held-out
    curve (each rank scores half of the same held-out sequences), as 1 process."""
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{"transfer.max_steps": 2, "finetune.max_steps": 2,
                                                                         "transfer.eval_every": 1, "finetune.eval_every": 1})
    args = [f"--{k}={json.dumps(v)}" for k, v in overrides.items() if k != "output_dir"]
    common = ["-m", "linearize.cli", "train", "--recipe", "lolcats", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *common, f"--output_dir={tmp_path / 'one'}"], capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533", *common,
                          f"--output_dir={tmp_path / 'two'}"], capture_output=True, text=True, env=env, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "smollm2-135m-lolcats" / "summary.json").read_text())
    assert summary["world_size"] == 2
    # stage 2 as the recipe ships it trains the conversion's own parameters (no LoRA file)
    assert not (tmp_path / "one" / "smollm2-135m-lolcats" / "adapter" / "lora.safetensors").exists()
    a = load_file(str(tmp_path / "one" / "smollm2-135m-lolcats" / "adapter" / "adapter.safetensors"))
    b = load_file(str(tmp_path / "two" / "smollm2-135m-lolcats" / "adapter" / "adapter.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)

    def curve(run):
        lines = (tmp_path / run / "smollm2-135m-lolcats" / "metrics.jsonl").read_text().splitlines()
        return [(r["stage"], r["step"], r["tokens"], r["heldout_loss"]) for r in map(json.loads, lines) if "heldout_loss" in r]

    one_curve, two_curve = curve("one"), curve("two")
    assert [c[:3] for c in one_curve] == [c[:3] for c in two_curve] and len(one_curve) == 4
    torch.testing.assert_close(torch.tensor([c[3] for c in two_curve]), torch.tensor([c[3] for c in one_curve]), atol=1e-5, rtol=1e-5)
    one_summary = json.loads((tmp_path / "one" / "smollm2-135m-lolcats" / "summary.json").read_text())
    for key in ("teacher_heldout_loss", "heldout_loss"):
        assert abs(summary[key] - one_summary[key]) < 1e-5, (key, summary[key], one_summary[key])
    assert summary["stages"]["finetune"]["tokens_per_s"] > 0

    from linearize.cli import main

    runs = [str(tmp_path / run / "smollm2-135m-lolcats") for run in ("one", "two")]
    assert main(["train", "--compare-runs", *runs, "--out", str(tmp_path / "cmp")]) == 0
    report = json.loads((tmp_path / "cmp" / "runs.json").read_text())
    (pair,) = report["pairs"]
    assert pair["kind"] == "same seed" and pair["points"] == 4 and pair["max_abs"] < 1e-5
    assert {s["stage"] for s in report["scaling"]} == {"transfer", "finetune"} and all(s["world_size"] == 2 for s in report["scaling"])
    assert "scaling efficiency" in (tmp_path / "cmp" / "runs.md").read_text()
    assert (tmp_path / "cmp" / "runs.png").stat().st_size > 1000


@pytest.mark.slow
def test_cli_sensitivity_writes_order_and_plot(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    from linearize.cli import main

    out = tmp_path / "sens"
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in open(tiny_corpus).read().split("\n\n")))
    assert main(["sensitivity", "--model", tiny_model_dir, "--source", str(docs), "--seq-len", "24", "--batches", "2",
                 "--batch-size", "2", "--attention", "hybrid", "--window", "2", "--out", str(out)]) == 0, capsys.readouterr().err
    report = json.loads((out / "sensitivity.json").read_text())
    assert sorted(report["order"]) == [0, 1, 2] and len(report["layers"]) == 3
    assert (out / "sensitivity.png").stat().st_size > 1000


def test_training_table_from_run_summaries(tmp_path):
    from linearize.train.report import load_summaries, training_table

    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "name": "smollm2-135m-x", "world_size": 1, "teacher_heldout_loss": 2.0, "heldout_loss": 2.5,
        "teacher_heldout_ppl": 7.389, "heldout_ppl": 12.18,
        "stages": {"transfer": {"tokens": 1000, "seconds": 1.5}, "finetune": {"tokens": 2000, "seconds": 3.0}}}))
    table = training_table(load_summaries([run]))
    assert "| smollm2-135m-x | 1,000 / - / 2,000 | 1.5 / - / 3.0 | 1 | 2.0000 | 2.5000 | 7.39 | 12.18 | 1.65 |" in table
    with pytest.raises(FileNotFoundError, match="no summary.json"):
        load_summaries([tmp_path / "missing"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bf16-mixed"])
def test_lora_stage_changes_the_model_it_evaluates(dtype, tiny_model_dir, tiny_corpus, tmp_path):
    """The fine-tuning stage's held-out loss must move as LoRA trains (the evaluated model is the one
    being trained), and the reloaded adapter must reproduce the stage's final model."""
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{
        "finetune.max_steps": 4, "finetune.eval_every": 1, "finetune.optim.lr": 0.01, "dtype": dtype,
        "finetune.lora_rank": 8, "finetune.train_new_params": False})  # the paper's stage 2: LoRA alone
    config = load_recipe("lolcats", overrides)
    run(config)
    records = [json.loads(line) for line in (tmp_path / config.name / "metrics.jsonl").read_text().splitlines()]
    heldout = [r["heldout_loss"] for r in records if r["stage"] == "finetune" and "heldout_loss" in r]
    assert len(heldout) == 4 and len(set(heldout)) == 4, heldout


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bf16-mixed"])
def test_stage_evaluation_matches_the_reloaded_adapter(dtype, tiny_model_dir, tiny_corpus, tmp_path):
    """The held-out loss a stage reports at its end is that of the model it saves."""
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{
        "transfer.max_steps": 4, "transfer.eval_every": 4, "transfer.eval_batches": 1000, "transfer.optim.lr": 0.05,
        "finetune.enabled": False, "dtype": dtype})
    config = load_recipe("lolcats", overrides)
    summary = run(config)
    records = [json.loads(line) for line in (tmp_path / config.name / "metrics.jsonl").read_text().splitlines()]
    last = [r["heldout_loss"] for r in records if r["stage"] == "transfer" and "heldout_loss" in r][-1]
    assert last == pytest.approx(summary["heldout_loss"], rel=2e-2 if dtype == "bf16-mixed" else 1e-5)


@pytest.mark.slow
def test_stage_two_without_lora_trains_only_the_conversion(tiny_model_dir, tiny_corpus, tmp_path):
    """finetune.lora_rank 0: no LoRA, the feature maps train end to end, the teacher's weights stay."""
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{
        "transfer.enabled": False, "finetune.lora_rank": 0, "finetune.train_new_params": True, "finetune.optim.lr": 0.01})
    config = load_recipe("inference-hybrid", overrides)
    summary = run(config)
    adapter = tmp_path / config.name / "adapter"
    meta = json.loads((adapter / "linearize_adapter.json").read_text())
    assert not (adapter / "lora.safetensors").exists() and "lora" not in meta
    assert summary["stages"]["finetune"]["steps"] == 3
    trained, _ = load_model(str(adapter))
    untrained = convert(load_model(tiny_model_dir)[0], ConversionSpec.from_dict(meta["spec"]))  # new parameters as initialised
    new, initial = new_parameters(trained), new_parameters(untrained)
    assert any(not torch.equal(p, initial[n]) for n, p in new.items()), "stage 2 left the feature maps as they were initialised"
    teacher = dict(untrained.named_parameters())
    for n, p in trained.named_parameters():
        if n not in new:
            assert torch.equal(p, teacher[n]), f"{n} changed: stage 2 without LoRA must leave the teacher's weights"
    with pytest.raises(ConfigError, match="lora_rank 0 .* trains nothing unless finetune.train_new_params"):
        load_recipe("inference-hybrid", {"finetune.lora_rank": 0, "finetune.train_new_params": False})
    with pytest.raises(ConfigError, match="lora_rank must be an integer >= 0, got -1"):
        load_recipe("inference-hybrid", {"finetune.lora_rank": -1, "finetune.train_new_params": True})


@pytest.mark.slow
def test_stage_two_can_fit_the_gates_alone(tiny_model_dir, tiny_corpus, tmp_path):
    """finetune.new_params [gate_logit] (the gate mix with learn_gate): only each head's g trains, with
    the window on; the feature maps and the teacher's weights stay as they were."""
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{
        "transfer.enabled": False, "finetune.lora_rank": 0, "finetune.train_new_params": True, "finetune.new_params": ["gate_logit"],
        "finetune.mode": "hybrid", "finetune.heldout_form": "training", "finetune.optim.lr": 0.05, "spec.learn_gate": True})
    config = load_recipe("inference-hybrid", overrides)
    run(config)
    meta = json.loads((tmp_path / config.name / "adapter" / "linearize_adapter.json").read_text())
    assert meta["spec"]["options"]["learn_gate"] is True
    trained, _ = load_model(str(tmp_path / config.name / "adapter"))
    untrained = convert(load_model(tiny_model_dir)[0], ConversionSpec.from_dict(meta["spec"]))
    new, initial = new_parameters(trained), new_parameters(untrained)
    gates = [n for n in new if n.endswith("gate_logit")]
    assert gates and all(not torch.equal(new[n], initial[n]) for n in gates), "the gates did not train"
    for n, p in trained.named_parameters():
        if n not in gates:
            assert torch.equal(p, dict(untrained.named_parameters())[n]), f"{n} changed: only the gates train"
    with pytest.raises(ConfigError, match="needs finetune.train_new_params true"):
        load_recipe("lolcats", {"finetune.lora_rank": 8, "finetune.train_new_params": False, "finetune.new_params": ["gate_logit"]})
    bad = load_recipe("inference-hybrid", {**overrides, "finetune.new_params": ["no_such_param"], "output_dir": str(tmp_path / "bad")})
    with pytest.raises(ConfigError, match="'no_such_param' names none of the conversion's parameters; valid: .*gate_logit"):
        run(bad)


def test_inference_form_runs_the_layers_as_they_ship_and_puts_them_back(tiny_model_dir):
    """Inside inference_form, a model training its linear part alone computes what the shipped
    adapter (hybrid mode, inference_spec applied) computes; after it, the training form is back."""
    spec = ConversionSpec.from_dict({"attention": "hybrid", "window": 4, "mix": "gate", "overlap": False, "linear_rope": False})
    model = convert(load_model(tiny_model_dir)[0], spec)
    for p in new_parameters(model).values():  # move the maps off their initialisation
        torch.nn.init.normal_(p, std=0.3)
    shipped = load_model(tiny_model_dir)[0]
    convert(shipped, spec.replace(overlap=True))
    shipped.load_state_dict(model.state_dict())
    set_mode(model, "la_only")
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        training = model(ids).logits
        with inference_form(model, {"overlap": True}) as layers:
            inside = model(ids).logits
            assert all(m.mode == "hybrid" and m.options.overlap for m in layers.values())
        after = model(ids).logits
        expected = shipped(ids).logits
    torch.testing.assert_close(inside, expected, rtol=0, atol=0)
    assert not torch.allclose(training, expected, atol=1e-3), "la_only and the shipped hybrid must differ for the test to mean anything"
    torch.testing.assert_close(after, training, rtol=0, atol=0)
    assert all(m.mode == "la_only" and not m.options.overlap for m in converted_layers(model).values())
    with pytest.raises(SpecError, match=r"\['attention'\] change which module runs"):
        with inference_form(model, {"attention": "lola"}):
            pass


@pytest.mark.slow
def test_stage_two_selects_the_best_shipped_form(tiny_model_dir, tiny_corpus, tmp_path):
    """heldout_form inference + keep_best: stage 2 scores the model as it ships (its la_only loss
    logged beside), and the adapter it saves is the best of those evaluations."""
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{
        "transfer.enabled": False, "finetune.lora_rank": 0, "finetune.train_new_params": True, "finetune.optim.lr": 0.2,
        "finetune.max_steps": 6, "finetune.eval_every": 1, "finetune.eval_batches": 1000,
        "finetune.heldout_form": "inference", "finetune.keep_best": True})
    config = load_recipe("inference-hybrid", overrides)
    summary = run(config)
    records = [json.loads(line) for line in (tmp_path / config.name / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["stage"] == "finetune" and "heldout_loss" in r]
    assert len(evals) == 6
    assert all(abs(r["heldout_loss"] - r["heldout_loss_training_form"]) > 1e-5 for r in evals), "the two forms were not both scored"
    best = min(evals, key=lambda r: r["heldout_loss"])
    stage = summary["stages"]["finetune"]
    assert stage["heldout_form"] == "inference" and stage["best_step"] == best["step"]
    assert summary["heldout_loss"] == pytest.approx(best["heldout_loss"], rel=1e-5), "the saved adapter is not the best evaluation's"
    if best is not evals[-1]:
        assert summary["heldout_loss"] != pytest.approx(evals[-1]["heldout_loss"], rel=1e-7)
    with pytest.raises(ConfigError, match="unknown finetune heldout_form 'shipped'; valid choices: training, inference"):
        load_recipe("inference-hybrid", {"finetune.heldout_form": "shipped"})
    with pytest.raises(ConfigError, match=r"inference_spec changes \['attention'\]"):
        load_recipe("inference-hybrid", {"finetune.heldout_form": "inference", "inference_spec": {"attention": "lola"}})


def test_run_precision_context_sees_weight_updates():
    """Inside the run-wide bf16 autocast context, a forward after an optimiser step uses the new
    weights (autocast's cast cache would serve the old bf16 copy for the whole run)."""
    from linearize.train.recipes import precision

    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with precision(torch.device("cpu"), torch.bfloat16):
        before = layer(x)
        with torch.no_grad():
            layer.weight.add_(1.0)
        after = layer(x)
    assert before.dtype == torch.bfloat16
    assert not torch.allclose(before.float(), after.float()), "the forward did not see the weight update"


def test_recall_probe_passage_must_leave_a_gap_in_the_rows():
    with pytest.raises(ConfigError, match="chained.recall_passage 64 leaves no gap .* data.seq_len 128 tokens: use a passage below 64"):
        load_recipe("dsla-chained", {"data.seq_len": 128})
    with pytest.raises(ConfigError, match="recall_weight"):
        load_recipe("dsla-chained", {"chained.recall_weight": -0.1})
    assert load_recipe("dsla-chained", {"data.seq_len": 128, "chained.recall_weight": 0}).chained.recall_weight == 0


@pytest.mark.slow
def test_entropy_order_sorts_the_layers_by_attention_entropy(tiny_model_dir, tiny_corpus, tmp_path):
    overrides = tiny_overrides(tiny_model_dir, tiny_corpus, tmp_path, **{"chained.order_from": "entropy", "transfer.max_steps": 1})
    overrides.pop("spec.window")
    chained = run(load_recipe("dsla-chained", overrides))["stages"]["chained"]
    rows = chained["sensitivity"]["layers"]
    assert chained["order"] == [r["layer"] for r in sorted(rows, key=lambda r: (r["entropy"], r["layer"]))]
    assert sorted(chained["order"]) == [0, 1, 2]
