"""Stage objectives on a tiny model: teacher capture, transfer losses, window dropout, KL, schedules."""

from __future__ import annotations

import pytest
import torch

import linearize
from linearize.convert import converted_layers
from linearize.hub import build_tiny_llama
from linearize.teacher import capture_teacher
from linearize.train.finetune import FinetuneObjective, as_teacher, kl_to_teacher, ssd_schedule
from linearize.train.transfer import OBJECTIVE_FUNCTIONS, TransferObjective

T = 12
EPS = torch.finfo(torch.float32).eps


def kl_rounding(teacher_logits, temperature: float) -> float:
    """Bound on what float32 rounding alone makes of ``kl_to_teacher`` for identical distributions.

    Each log-softmax rounds at about eps * |log p|, and that error enters the KL to first order
    (sum_i p_i * error_i, scaled by T^2): the KL of an exact student is not 0 but up to this much.
    It depends on the logits, not on the thread count or the order of any reduction.
    """
    log_p = torch.log_softmax(teacher_logits.double() / temperature, dim=-1)
    return float(4 * EPS * temperature**2 * log_p.abs().max())


def mse_rounding(target) -> float:
    """Bound on the MSE that float32 rounding (16 eps relative) leaves between two evaluations of ``target``."""
    return float((16 * EPS) ** 2 * target.double().pow(2).mean())


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
        teacher = captured[i].teacher_output
        assert float(OBJECTIVE_FUNCTIONS["hybrid_mse"](module, captured[i])) < mse_rounding(teacher)
        q, k, _ = module.project(captured[i].hidden_states, captured[i].position_embeddings)[:3]
        from linearize.teacher import teacher_probs

        p = teacher_probs(module, q, k, None)
        entropy = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
        torch.testing.assert_close(OBJECTIVE_FUNCTIONS["weights"](module, captured[i]), entropy, atol=1e-5, rtol=1e-5)
        assert float(OBJECTIVE_FUNCTIONS["la_mse"](module, captured[i])) > 1e6 * mse_rounding(teacher)  # LA alone differs from softmax


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
    assert objective.drop_probability == 0.9 and all(m.options.window == 32 for m in converted_layers(model).values())
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
    student = model(ids).logits
    with as_teacher(model):
        teacher = model(ids).logits
    torch.testing.assert_close(student, teacher)  # the teacher runs SDPA, the student its own softmax: float32 rounding
    floor = kl_rounding(teacher, 2.0)
    assert metrics["kl"] < floor
    model, ids = model_and_batch({"attention": "hybrid", "window": 2})
    _, metrics = FinetuneObjective(model, ce_weight=0.0, kl_weight=1.0, kl_temperature=2.0)(ids)
    assert metrics["kl"] > 2 * floor
    a, b = torch.randn(4, 10), torch.randn(4, 10)
    assert float(kl_to_teacher(a, a, 1.0)) == pytest.approx(0.0, abs=1e-6) and float(kl_to_teacher(b, a, 1.0)) > 0


def test_offset_position_ids_are_deterministic_per_row_and_off_at_zero():
    from linearize.train.positions import offset_position_ids

    assert offset_position_ids(2, 5, 0, seed=0, step=0) is None
    a = offset_position_ids(4, 6, 100, seed=1, step=3)
    assert a.shape == (4, 6) and torch.equal(a, offset_position_ids(4, 6, 100, seed=1, step=3))
    assert torch.equal(a - a[:, :1], torch.arange(6).expand(4, 6))  # consecutive within a row
    assert 0 <= int(a[:, 0].min()) and int(a[:, 0].max()) <= 100
    assert not torch.equal(a, offset_position_ids(4, 6, 100, seed=1, step=4))
    assert not torch.equal(a, offset_position_ids(4, 6, 100, seed=1, step=3, rank=1))
    with pytest.raises(ValueError, match="max_offset"):
        offset_position_ids(1, 2, -1, seed=0, step=0)


@pytest.mark.parametrize("linear_rope", [True, False])
def test_position_offsets_reach_the_converted_layers_but_not_the_targets(linear_rope):
    """Shifted positions leave the teacher's layer outputs unchanged (RoPE is relative), an exact
    window still matches them (loss ~0: teacher and student see the same positions), and a RoPE'd
    linear part sees the shift (its loss moves) while a linear part before RoPE does not."""
    model, ids = model_and_batch({"attention": "hybrid", "window": 3, "linear_rope": linear_rope})
    shifted = torch.arange(T)[None].expand(2, T) + torch.tensor([[500], [37]])
    with torch.no_grad():
        plain = capture_teacher(model, ids, None, [0, 1, 2])
        moved = capture_teacher(model, ids, None, [0, 1, 2], position_ids=shifted)
        for i in range(3):
            torch.testing.assert_close(moved[i].teacher_output, plain[i].teacher_output, atol=1e-4, rtol=1e-4)
        objective = TransferObjective(model, [0, 1, 2], {"hybrid_mse": 1.0}, position_offset=1000, seed=0)
        objective.eval()  # held-out: no offset
        base, _ = objective(ids)
        objective.train()
        loss, _ = objective(ids, step=5)
    change = abs(float(loss) / float(base) - 1)
    if linear_rope:
        assert change > 1e-4
    else:  # RoPE enters only through the (relative) window scores: the loss is shift invariant
        assert change < 1e-5
    exact, ids = model_and_batch({"attention": "hybrid", "window": T})
    objective = TransferObjective(exact, [0, 1, 2], {"hybrid_mse": 1.0}, position_offset=1000, seed=0).train()
    with torch.no_grad():
        targets = capture_teacher(exact, ids, None, [0, 1, 2])
        assert float(objective(ids, step=5)[0]) < sum(mse_rounding(targets[i].teacher_output) for i in range(3))


def test_finetune_objective_with_offsets_matches_teacher_when_nothing_is_converted_in_effect():
    """An exact window (window >= T) with KL to the teacher: the student and the teacher see the same
    shifted positions, so the KL stays 0 under offsets."""
    model, ids = model_and_batch({"attention": "hybrid", "window": T})
    objective = FinetuneObjective(model, ce_weight=0.0, kl_weight=1.0, kl_temperature=1.0, position_offset=4000).train()
    with torch.no_grad():
        _, metrics = objective(ids, step=3)
        with as_teacher(model):
            teacher = model(ids).logits
    assert metrics["kl"] < kl_rounding(teacher, 1.0)
