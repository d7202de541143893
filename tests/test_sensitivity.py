"""Layer sensitivity: attention entropy, measured loss increase, report and order (tiny CPU models)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import linearize
from linearize.convert import layer_modes
from linearize.hub import build_tiny_llama, build_tiny_tokenizer
from linearize.train.sensitivity import (
    attention_entropy,
    load_order,
    loss_increase,
    mean_next_token_loss,
    plot_sensitivity,
    recall_probes,
    save_order,
    sensitivity_report,
    spearman,
)

N_LAYERS = 4
VOCAB = 128


def tiny(seed: int = 0):
    return build_tiny_llama(seed=seed, num_hidden_layers=N_LAYERS)


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    total = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), total, dtype=torch.long)
    mask = torch.zeros(len(rows), total, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, total - len(r):], mask[i, total - len(r):] = r, 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def sharp_teacher(seed: int = 0):
    """A tiny model whose predictions depend strongly on peaked attention, with labels = its own argmax
    (teacher loss ~0.07): converting any layer to a 2-token window must raise the loss."""
    model = tiny(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
            layer.self_attn.o_proj.weight.mul_(20)
        model.model.norm.weight.mul_(200)
        ids = random_ids(4, 24, seed)
        labels = torch.cat([ids[:, :1], model(ids).logits.argmax(-1)[:, :-1]], 1)
    return model, [{"input_ids": ids, "labels": labels}]


# ----------------------------------------------------------------------------- entropy


@pytest.mark.parametrize("length", [1, 5, 17])
def test_entropy_uniform_attention_is_log_keys(length):
    model = tiny()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.zero_()  # all scores 0: uniform over seen keys
    assert attention_entropy(model, [random_ids(3, length)])[1] == pytest.approx(math.log(length), abs=1e-5)
    # left-padded rows see only their real tokens; the mean runs over sequences of every batch
    padded = left_pad([random_ids(1, 4)[0], random_ids(1, 9, seed=1)[0]])
    expected = (math.log(4) + math.log(9) + 3 * math.log(length)) / 5
    assert attention_entropy(model, [padded, random_ids(3, length)])[1] == pytest.approx(expected, abs=1e-5)


def test_entropy_matches_eager_attention_weights():
    """Reference: the last real query's row of the teacher's own (eager) attention probabilities."""
    model = tiny(seed=1)
    model.set_attn_implementation("eager")
    batch = left_pad([random_ids(1, 7)[0], random_ids(1, 12, seed=1)[0]])
    with torch.no_grad():
        attentions = model(**batch, output_attentions=True).attentions  # test only: per layer (B, H, T, T)
    expected = [torch.special.entr(a[:, :, -1].double()).sum(-1).mean().item() for a in attentions]
    assert attention_entropy(model, [batch]) == pytest.approx(expected, abs=1e-5)


def test_entropy_padding_invariance():
    model = tiny(seed=2)
    a, b = random_ids(1, 6)[0], random_ids(1, 11, seed=1)[0]
    alone = [attention_entropy(model, [row[None]]) for row in (a, b)]
    together = attention_entropy(model, [left_pad([a, b])])
    assert together == pytest.approx([(x + y) / 2 for x, y in zip(*alone)], abs=1e-5)
    right = {"input_ids": torch.cat([a, torch.zeros(5, dtype=torch.long)])[None], "attention_mask": torch.tensor([[1] * 6 + [0] * 5])}
    assert attention_entropy(model, [right]) == pytest.approx(alone[0], abs=1e-5)  # right padding: last real query


def test_entropy_reads_the_teacher_of_converted_layers():
    model = tiny()
    ids = random_ids(2, 16)
    teacher = attention_entropy(model, [ids])
    linearize.convert(model, {"attention": "softmax"})  # same computation, converted modules
    assert attention_entropy(model, [ids]) == pytest.approx(teacher, abs=1e-5)
    linearize.convert(model, {"attention": "hybrid", "window": 2, "layers": [0]})
    converted = attention_entropy(model, [ids])
    assert converted[0] == pytest.approx(teacher[0], abs=1e-6)  # layer 0's input is the same
    assert converted[1:] != pytest.approx(teacher[1:], abs=1e-6)  # later inputs change


# ----------------------------------------------------------------------------- loss increase


def test_loss_increase_softmax_is_zero():
    model = tiny()
    batches = [random_ids(2, 20), left_pad([random_ids(1, 8)[0], random_ids(1, 14, seed=1)[0]])]
    assert loss_increase(model, {"attention": "softmax"}, batches) == pytest.approx([0.0] * N_LAYERS, abs=1e-5)


def test_loss_increase_small_window_hybrid_is_positive():
    model, batches = sharp_teacher()
    assert mean_next_token_loss(model, batches) < 0.2
    increase = loss_increase(model, {"attention": "hybrid", "window": 2}, batches)
    assert len(increase) == N_LAYERS and all(d > 0.1 for d in increase)
    assert loss_increase(model, {"attention": "hybrid", "window": 2}, batches, layers=[-1, 1]) == pytest.approx(
        [increase[3], increase[1]], abs=1e-6
    )
    with pytest.raises(linearize.SpecError, match="out of range"):
        loss_increase(model, {"attention": "hybrid"}, batches, layers=[N_LAYERS])


def test_loss_increase_restores_the_model():
    model = tiny()
    spec = {"attention": "hybrid", "window": 4, "layers": [1, 3], "overrides": {3: {"mix": "gate", "learn_gate": True}}}
    linearize.convert(model, spec)
    linearize.set_mode(model, "swa_only", layers=[1])
    with torch.no_grad():  # "trained" new parameters
        for p in linearize.new_parameters(model).values():
            p.add_(torch.randn_like(p))
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config, modes = json.dumps(model.config.linearize, sort_keys=True), layer_modes(model)
    model.train()

    loss_increase(model, {"attention": "hybrid", "window": 2}, [random_ids(2, 12)])

    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(p is params[name] for name, p in model.named_parameters())  # optimizers stay valid
    assert json.dumps(model.config.linearize, sort_keys=True) == config and layer_modes(model) == modes
    assert all(m.training for m in model.modules())


def test_loss_increase_leaves_a_plain_model_plain():
    model = tiny()
    cls, config_cls = type(model), type(model.config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_increase(model, {"attention": "dsla"}, [random_ids(2, 12)], layers=[0])
    assert type(model) is cls and type(model.config) is config_cls and not hasattr(model.config, "linearize")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


# ----------------------------------------------------------------------------- report and order


@pytest.mark.parametrize(
    "x, y, rho",
    [
        ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
        ([1, 2, 3, 4], [4, 3, 2, 1], -1.0),
        ([1, 2, 2, 3], [1, 2, 3, 4], 0.9486832980505138),  # scipy.stats.spearmanr (ties: average ranks)
        ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3], 0.2051956704170308),
        ([1, 1, 1], [1, 2, 3], None),  # constant input: undefined
    ],
)
def test_spearman(x, y, rho):
    assert spearman(x, y) == (None if rho is None else pytest.approx(rho, abs=1e-12))


def test_report_order_and_round_trip(tmp_path):
    report = sensitivity_report([2.0, 1.0, 3.0, 0.5], [0.3, 0.1, 0.3, 0.1])
    assert report["order"] == [1, 3, 0, 2]  # ascending increase, ties by layer index
    assert report["layers"][2] == {"layer": 2, "entropy": 3.0, "loss_increase": 0.3}
    assert report["spearman"] == pytest.approx(spearman([2.0, 1.0, 3.0, 0.5], [0.3, 0.1, 0.3, 0.1]))
    assert sensitivity_report([1.0, 2.0], [0.2, 0.1], layers=[5, 7])["order"] == [7, 5]
    save_order(report, tmp_path / "order.json")
    assert load_order(tmp_path / "order.json") == [1, 3, 0, 2]
    assert json.loads((tmp_path / "order.json").read_text()) == report
    (tmp_path / "bad.json").write_text('{"order": "0,1"}')
    with pytest.raises(ValueError, match="no layer order"):
        load_order(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="differ in length"):
        sensitivity_report([1.0], [1.0, 2.0])


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    plot_sensitivity(sensitivity_report([2.0, 1.0, 3.0], [0.3, 0.1, 0.2]), tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loss_increase_ignores_a_nested_family_order():
    model = tiny()
    spec = {"attention": "softmax", "layers": [0, 2], "order": [2, 0], "active": 1, "overrides": {2: {"attention": "softmax"}}}
    assert loss_increase(model, spec, [random_ids(2, 10)], layers=[1, 2]) == pytest.approx([0.0, 0.0], abs=1e-5)


# ----------------------------------------------------------------------------- recall probes


def test_recall_probes_repeat_a_passage_after_a_gap_and_score_only_the_repeat():
    rows = torch.arange(5 * 20).view(5, 20)
    batches = recall_probes(rows, passage=4, batch_size=3)
    assert [b["input_ids"].shape for b in batches] == [(3, 20), (1, 20)]
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    for r in range(4):
        assert ids[r, :4].tolist() == rows[r, :4].tolist()  # the passage
        assert ids[r, 4:16].tolist() == rows[r + 1, :12].tolist()  # another row's text as the gap
        assert ids[r, 16:].tolist() == rows[r, :4].tolist()  # the passage again
        assert labels[r, :17].eq(-100).all()  # only the repeat after its first token is scored
        assert labels[r, 17:].tolist() == rows[r, 1:4].tolist()
    assert len(recall_probes(rows, passage=4, max_probes=2)[0]["input_ids"]) == 2


@pytest.mark.parametrize("passage, rows, match", [
    (1, (3, 20), "passage must be an integer in 2..9"), (10, (3, 20), "passage must be an integer in 2..9"),
    (4, (1, 20), "at least 2 rows"), ("4", (3, 20), "passage must be"),
])
def test_recall_probes_reject_bad_shapes(passage, rows, match):
    with pytest.raises(ValueError, match=match):
        recall_probes(torch.zeros(rows, dtype=torch.long), passage=passage)
    with pytest.raises(ValueError, match="integer tensor"):
        recall_probes(torch.zeros(3, 20), passage=4)


def test_report_orders_by_loss_plus_weighted_recall():
    entropy, increase, recall = [1.0, 2.0, 3.0], [0.01, 0.02, 0.03], [2.0, 0.0, -5.0]
    plain = sensitivity_report(entropy, increase, recall=recall)
    assert plain["order"] == [0, 1, 2] and plain["recall_weight"] == 0.0  # weight 0: the paper's order
    assert [r["recall_increase"] for r in plain["layers"]] == recall
    weighted = sensitivity_report(entropy, increase, [4, 5, 6], recall=recall, recall_weight=0.1)
    assert weighted["order"] == [5, 6, 4]  # layer 4 breaks recall; layer 6's negative recall earns nothing
    assert [r["score"] for r in weighted["layers"]] == pytest.approx([0.21, 0.02, 0.03])
    with pytest.raises(ValueError, match="recall_weight must be a finite number >= 0, got -1"):
        sensitivity_report(entropy, increase, recall=recall, recall_weight=-1)
    with pytest.raises(ValueError, match="needs the recall increases"):
        sensitivity_report(entropy, increase, recall_weight=0.5)
    with pytest.raises(ValueError, match=r"recall \(2\) and layers \(3\)"):
        sensitivity_report(entropy, increase, recall=[1.0, 2.0])


@pytest.mark.slow
def test_recall_probe_measures_recall_beyond_the_window_on_the_real_model():
    """The teacher copies a passage read ~400 tokens earlier; with every layer's attention cut to a
    16-token window it cannot, and the probe's loss rises by more than a nat."""
    from linearize.data import DataConfig, build_dataset
    from linearize.hub import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    model, tokenizer = linearize.load_model("smollm2-135m")
    rows = build_dataset(DataConfig(source="wiki", seq_len=512, max_documents=400), tokenizer).heldout[:3]
    probes = recall_probes(rows, passage=48, batch_size=2)
    first = [{"input_ids": b["input_ids"], "labels": torch.where(torch.arange(512) < 48, b["input_ids"], -100)} for b in probes]
    teacher, fresh = mean_next_token_loss(model, probes), mean_next_token_loss(model, first)
    assert teacher < fresh - 1.0  # the teacher recalls the passage
    linearize.convert(model, {"attention": "hybrid", "window": 16})
    linearize.set_mode(model, "swa_only")
    assert mean_next_token_loss(model, probes) > teacher + 1.0


def test_cli_sensitivity_with_recall_probes(tmp_path, capsys):
    """`linearize sensitivity --recall-weight` on a tiny model and a text file: every layer gets a
    recall increase, the order follows the weighted score, and the plot has its second panel."""
    from linearize.cli import main

    model_dir, corpus = tmp_path / "tiny", tmp_path / "corpus"
    tiny().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    corpus.mkdir()
    for d in range(40):  # one document per file
        (corpus / f"{d:02d}.txt").write_text(" ".join(f"w{(7 * d + j) % 100}" for j in range(60)))
    out = tmp_path / "out"
    assert main(["sensitivity", "--model", str(model_dir), "--source", str(corpus), "--seq-len", "32", "--batches", "1",
                 "--batch-size", "2", "--attention", "hybrid", "--window", "2", "--recall-weight", "0.5",
                 "--recall-passage", "8", "--out", str(out)]) == 0
    report = json.loads((out / "sensitivity.json").read_text())
    assert report["recall_weight"] == 0.5 and len(report["layers"]) == N_LAYERS
    assert all(math.isfinite(r["recall_increase"]) for r in report["layers"])
    assert report["order"] == [r["layer"] for r in sorted(report["layers"], key=lambda r: (r["score"], r["layer"]))]
    assert (out / "sensitivity.png").stat().st_size > 0
    assert "recall increase" in capsys.readouterr().out
    assert main(["sensitivity", "--model", str(model_dir), "--seq-len", "32", "--recall-weight", "1", "--recall-passage", "16", "--out", str(out)]) == 2
    assert "--recall-passage 16 leaves no gap in rows of --seq-len 32: use a passage below 16" in capsys.readouterr().err
