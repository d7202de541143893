"""Stage objectives on a tiny model: teacher capture, transfer losses, window dropout, KL, schedules."""

from __future__ import annotations

import pytest
import torch

import linearize
from linearize.convert import converted_layers
from linearize.hub import build_tiny_llama
from linearize.train.finetune import FinetuneObjective, kl_to_teacher, ssd_schedule
from linearize.train.transfer import OBJECTIVE_FUNCTIONS, TransferObjective, capture_teacher

T = 12


def model_and_batch(spec, seed=0):
    model = build_tiny_llama(seed=seed, num_hidden_layers=3)
    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(seed))
    return linearize.convert(model, spec), ids


def test_capture_gives_each_layer_the_teachers_input_and_output():
    teacher = build_tiny_llama(seed=0, num_hidden_layers=3)
    outputs = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o[0])) for i, layer in enumerate(teacher.model.layers)]
    model, ids = model_and_batch({"attention": "hybrid", "window": 3})
    with torch.no_grad():
        teacher(ids)
    for h in hooks:
        h.remove()
    captured = capture_teacher(model, ids, None, [0, 1, 2])
    for i in range(3):
        torch.testing.assert_close(captured[i].teacher_output, outputs[i])
    assert all(m.mode == "hybrid" for m in converted_layers(model).values())  # modes restored


@torch.no_grad()
def test_objectives_vanish_when_the_window_covers_everything():
    """window >= T: the hybrid is exact softmax, so MSE is 0 and weight CE equals the teacher's entropy."""
    model, ids = model_and_batch({"attention": "hybrid", "window": T})
    captured = capture_teacher(model, ids, None, [0, 1, 2])
    for i, module in converted_layers(model).items():
        assert float(OBJECTIVE_FUNCTIONS["hybrid_mse"](module, captured[i])) < 1e-14
        q, k, _ = module.project(captured[i].hidden_states, captured[i].position_embeddings)
        from linearize.train.transfer import _teacher_probs

        p = _teacher_probs(module, q, k, None)
        entropy = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
        torch.testing.assert_close(OBJECTIVE_FUNCTIONS["weights"](module, captured[i]), entropy, atol=1e-5, rtol=1e-5)
        assert float(OBJECTIVE_FUNCTIONS["la_mse"](module, captured[i])) > 1e-12  # LA alone differs from softmax


@pytest.mark.parametrize("objectives", [{"hybrid_mse": 1000.0}, {"weights": 1.0, "la_mse": 10.0}, {"la_weights": 1.0}])
def test_transfer_trains_only_the_new_parameters(objectives):
    model, ids = model_and_batch({"attention": "hybrid", "window": 3})
    new = linearize.new_parameters(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name in new)
    loss, metrics = TransferObjective(model, [0, 1, 2], objectives)(ids)
    loss.backward()
    assert set(metrics) == set(objectives) and torch.isfinite(loss)
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and grads <= set(new)
    assert any("feature_map_q" in n for n in grads) and any("feature_map_k" in n for n in grads)


def test_dsla_transfer_includes_gate_similarity():
    model, ids = model_and_batch({"attention": "dsla", "layers": [1]})
    loss, metrics = TransferObjective(model, [1], {"output_mse": 1.0}, gate_similarity_weight=0.5)(ids)
    assert "gate_cosine" in metrics and 0.9 < metrics["gate_cosine"] <= 1.0  # both gates start data independent
    loss.backward()
    assert model.model.layers[1].self_attn.gate_recent.up.weight.grad is not None


@pytest.mark.parametrize(
    "spec,objectives,gate_weight",
    [
        ({"attention": "hybrid", "window": 3}, {"weights": 1.0, "hybrid_mse": 100.0}, 0.0),
        ({"attention": "dsla", "layers": [0, 2]}, {"output_mse": 1.0}, 0.5),
    ],
)
def test_layer_checkpointing_gives_the_same_loss_and_gradients(spec, objectives, gate_weight):
    """checkpoint_layers recomputes each layer's objective in backward: identical loss, metrics, grads."""
    results = []
    for checkpoint_layers in (False, True):
        model, ids = model_and_batch(spec)
        layers = sorted(converted_layers(model))
        new = linearize.new_parameters(model)
        for name, p in model.named_parameters():
            p.requires_grad_(name in new)
        loss, metrics = TransferObjective(model, layers, objectives, gate_weight, checkpoint_layers=checkpoint_layers)(ids)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics, grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    assert metrics_b == pytest.approx(metrics_a)
    assert grads_a and set(grads_b) == set(grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], msg=name)


@torch.no_grad()
def test_window_dropout_rows_run_linear_attention_over_all_positions():
    model, ids = model_and_batch({"attention": "hybrid", "window": 3})
    hybrid = model(ids).logits
    linearize.set_mode(model, "la_only")
    la_only = model(ids).logits
    linearize.set_mode(model, "hybrid")
    for module in converted_layers(model).values():
        module.window_dropout = torch.tensor([True, False])
    mixed = model(ids).logits
    torch.testing.assert_close(mixed[0], la_only[0])
    torch.testing.assert_close(mixed[1], hybrid[1])


def test_finetune_draws_are_deterministic_and_follow_the_schedule():
    model, ids = model_and_batch({"attention": "hybrid", "window": 3})
    objective = FinetuneObjective(model, ce_weight=1.0, kl_weight=0.0, kl_temperature=1.0, swa_dropout="a", seed=3)
    objective.on_epoch(0)
    assert objective.drop_probability == 0.9 and all(m.spec.window == 32 for m in converted_layers(model).values())
    objective._draw_window_dropout(64, step=5)
    first = [m.window_dropout.clone() for m in converted_layers(model).values()]
    objective._draw_window_dropout(64, step=5)
    assert all(torch.equal(a, m.window_dropout) for a, m in zip(first, converted_layers(model).values()))
    assert 0.75 < float(first[0].float().mean()) <= 1.0
    assert not torch.equal(first[0], first[1])  # one draw per layer
    assert [ssd_schedule("a", e) for e in range(5)] == [(0.9, 32), (0.75, 32), (0.5, 32), (0.5, 32), (0.5, 32)]
    assert [ssd_schedule("b", e)[1] for e in range(6)] == [4, 8, 16, 32, 64, 64]
    assert ssd_schedule("c", 7) == (0.5, 16)
    with pytest.raises(ValueError, match="valid: a, b, c"):
        ssd_schedule("d", 0)


@torch.no_grad()
def test_kl_to_teacher_is_zero_for_an_exact_student_and_positive_otherwise():
    model, ids = model_and_batch({"attention": "hybrid", "window": T})
    loss, metrics = FinetuneObjective(model, ce_weight=0.0, kl_weight=1.0, kl_temperature=2.0)(ids)
    assert metrics["kl"] < 1e-8
    model, ids = model_and_batch({"attention": "hybrid", "window": 2})
    _, metrics = FinetuneObjective(model, ce_weight=0.0, kl_weight=1.0, kl_temperature=2.0)(ids)
    assert metrics["kl"] > 1e-6
    a, b = torch.randn(4, 10), torch.randn(4, 10)
    assert float(kl_to_teacher(a, a, 1.0)) == pytest.approx(0.0, abs=1e-6) and float(kl_to_teacher(b, a, 1.0)) > 0
