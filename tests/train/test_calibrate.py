"""LoLA read-out calibration: per-head weights chosen by output error, applied through the spec, saved."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import linearize
from linearize.api import save_adapter
from linearize.convert import converted_layers
from linearize.hub import build_tiny_llama
from linearize.layers.base import SpecError
from linearize.train.calibrate import (
    CalibrationConfig,
    apply_linear_weights,
    calibrate_linear_weights,
    calibration_markdown,
    plot_calibration,
)

IDS = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
CONFIG = CalibrationConfig(tokens=48, skip=16, grid=[0.0, 0.1, 1.0])


def lola_model():
    model = linearize.convert(build_tiny_llama(seed=0), {"attention": "lola", "window": 4, "sparse_cache": 6, "sinks": 1, "chunk": 4})
    model.config.linearize_base_model = "tiny"
    return model


def test_calibration_picks_the_grid_weight_with_the_smallest_error_per_head():
    model = lola_model()
    result = calibrate_linear_weights(model, IDS, CONFIG)
    heads = converted_layers(model)[0].num_heads
    assert result["layers"] == sorted(converted_layers(model))
    for i in result["layers"]:
        err = np.array(result["errors"][i])
        assert err.shape == (3, heads) and (err >= 0).all()
        assert result["weights"][i] == [CONFIG.grid[j] for j in err.argmin(0)]
    # the chosen weights are no worse than any one weight everywhere
    assert result["calibrated"] <= min(result["uniform"].values()) + 1e-12
    assert all(m.options.linear_weight == 1.0 for m in converted_layers(model).values())  # the model is not changed


def test_applied_weights_are_each_layers_read_and_are_saved_in_the_adapters_spec(tmp_path):
    """After apply_linear_weights every layer reads with its own per-head weights: a head's output
    equals that of a model with the head's weight in every head; the adapter's spec carries them."""
    model = lola_model()
    result = calibrate_linear_weights(model, IDS, CONFIG)
    spec = apply_linear_weights(model, result["weights"])
    for i, m in converted_layers(model).items():
        assert m.options.linear_weight == result["weights"][i]
        assert spec.overrides[i]["linear_weight"] == result["weights"][i]
    x = torch.randn(1, 20, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    pe = model.model.rotary_emb(x, torch.arange(20)[None])
    layer = converted_layers(model)[1]
    with torch.no_grad():
        mixed = layer.attend(layer.project(x, pe), x, None, None)[0]
        for h, w in enumerate(result["weights"][1]):
            layer.options.linear_weight = w
            torch.testing.assert_close(mixed[:, h], layer.attend(layer.project(x, pe), x, None, None)[0][:, h])
    save_adapter(model, tmp_path / "cal", spec=spec.to_dict(), extra={"calibration": {"calibrated": result["calibrated"]}})
    saved = json.loads((tmp_path / "cal" / "linearize_adapter.json").read_text())
    assert saved["spec"]["overrides"]["0"]["linear_weight"] == result["weights"][0]


def test_chained_calibration_scores_each_layer_on_the_inputs_the_calibrated_layers_below_give_it():
    """With chained inputs the first layer is scored as with the teacher's; layer 1 reads what a
    model with layer 0 calibrated (and layer 1 as the teacher) feeds it, against the teacher's
    output of layer 1 on the teacher's inputs. The model's modes and options are put back."""
    from linearize.ops.softmax import softmax_attention
    from linearize.teacher import capture_teacher

    chained = CalibrationConfig(tokens=48, skip=16, grid=[0.0, 0.1, 1.0], inputs="chained")
    model = lola_model()
    plain = calibrate_linear_weights(model, IDS, CONFIG)
    result = calibrate_linear_weights(model, IDS, chained)
    np.testing.assert_allclose(result["errors"][0], plain["errors"][0], rtol=1e-6)
    assert result["weights"][0] == plain["weights"][0]
    assert all(m.mode == "hybrid" and m.options.linear_weight == 1.0 for m in converted_layers(model).values())

    layers = converted_layers(model)
    with torch.no_grad():
        teacher = capture_teacher(model, IDS, None, [1])[1]
        t = layers[1].project(teacher.hidden_states, teacher.position_embeddings)
        target = softmax_attention(t.q.float(), t.k.float(), t.v.float(), scale=layers[1].scaling)[0][0, :, 16:]
        seen = {}
        hook = layers[1].register_forward_pre_hook(lambda m, a, k: seen.update(x=k["hidden_states"]), with_kwargs=True)
        layers[0].options.linear_weight = result["weights"][0]
        layers[1].mode = "teacher"
        model(input_ids=IDS, use_cache=False)
        hook.remove()
        layers[1].mode = "hybrid"
        p = layers[1].project(seen["x"], teacher.position_embeddings)
        for g, w in enumerate(chained.grid):
            out = layers[1].lola(p, linear_weight=w)[0][0, :, 16:].float()
            expect = ((out - target) ** 2).mean((-1, -2)) / (target**2).mean((-1, -2))
            np.testing.assert_allclose(result["errors"][1][g], expect.numpy(), rtol=1e-5)
    assert not np.allclose(result["errors"][1], plain["errors"][1])  # the drifted inputs do change the scores
    assert "layers below calibrated" in calibration_markdown(result, title="tiny")


def test_recall_probe_calibration_scores_only_the_repeat_over_every_probe():
    """text 'recall-probes': a batch of sequences, each head's error the mean over the batch of the
    repeat's positions only (tokens - passage + 1 on); changing the text before the repeat's scored
    positions changes the scores only through what those positions read."""
    from linearize.ops.softmax import softmax_attention
    from linearize.teacher import capture_teacher

    config = CalibrationConfig(tokens=48, grid=[0.0, 1.0], text="recall-probes", probes=2, passage=8)
    assert config.scored() == slice(41, None)
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(5))
    ids[:, 40:] = ids[:, :8]
    model = lola_model()
    result = calibrate_linear_weights(model, ids, config)
    layer = converted_layers(model)[1]
    with torch.no_grad():
        inp = capture_teacher(model, ids, None, [1])[1]
        p = layer.project(inp.hidden_states, inp.position_embeddings)
        target = softmax_attention(p.q.float(), p.k.float(), p.v.float(), scale=layer.scaling)[0][:, :, 41:]
        for g, w in enumerate(config.grid):
            out = layer.lola(p, linear_weight=w)[0][:, :, 41:].float()
            expect = ((out - target) ** 2).mean((0, -1, -2)) / (target**2).mean((0, -1, -2))
            np.testing.assert_allclose(result["errors"][1][g], expect.numpy(), rtol=1e-5)
    assert "2 recall probes of 48 tokens (a 8-token passage" in calibration_markdown(result, title="tiny")


def test_calibration_inputs_are_the_heldout_stream_or_probes_built_from_its_rows(monkeypatch):
    """The probes' layout over the held-out stream (the stream itself is the data pipeline's, tested
    with it; here a known stream stands in so every token's place can be checked)."""
    import linearize.data
    from linearize.train.calibrate import calibration_inputs

    stream = torch.arange(1000, 1000 + 5 * 48)
    monkeypatch.setattr(linearize.data, "heldout_tokens", lambda tokenizer, data, max_tokens=None: stream[:max_tokens])
    plain = calibration_inputs(None, CalibrationConfig(tokens=48, skip=16))
    probes = calibration_inputs(None, CalibrationConfig(tokens=48, text="recall-probes", probes=3, passage=8))
    with pytest.raises(ValueError, match="fewer than the 7 x 48"):
        calibration_inputs(None, CalibrationConfig(tokens=48, text="recall-probes", probes=6, passage=8))
    assert torch.equal(plain, stream[:48][None])
    rows = stream[: 4 * 48].view(4, 48)
    assert probes.shape == (3, 48)
    for r in range(3):
        assert torch.equal(probes[r, :8], rows[r, :8]) and torch.equal(probes[r, 40:], rows[r, :8])
        assert torch.equal(probes[r, 8:40], rows[r + 1, :32])


def test_config_and_spec_reject_bad_values():
    with pytest.raises(ValueError, match="skip"):
        CalibrationConfig(tokens=16, skip=16)
    with pytest.raises(ValueError, match="grid"):
        CalibrationConfig(grid=[0.1, -1.0])
    with pytest.raises(ValueError, match="inputs must be one of teacher, chained, got 'student'"):
        CalibrationConfig(inputs="student")
    with pytest.raises(ValueError, match="text must be one of heldout, recall-probes, got 'needles'"):
        CalibrationConfig(text="needles")
    with pytest.raises(ValueError, match=r"passage must be an integer in 2..23 \(tokens=48\), got 30"):
        CalibrationConfig(tokens=48, text="recall-probes", passage=30)
    with pytest.raises(ValueError, match="source 'teacher' is sampled"):
        from linearize.train.calibrate import calibration_inputs

        calibration_inputs(None, CalibrationConfig(source="teacher"))
    with pytest.raises(ValueError, match="probes must be an integer >= 1, got 0"):
        CalibrationConfig(probes=0)
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, tokens=48\)"):
        calibrate_linear_weights(lola_model(), IDS[:, :40], CONFIG)
    with pytest.raises(SpecError, match="linear_weight"):
        linearize.convert(build_tiny_llama(seed=0), {"attention": "lola", "sparse_cache": 2, "linear_weight": [0.5, -1]})
    with pytest.raises(ValueError, match="reads|fits LoLA layers"):
        calibrate_linear_weights(linearize.convert(build_tiny_llama(seed=0), {"attention": "hybrid", "window": 4}), IDS, CONFIG)


def test_markdown_and_plot(tmp_path):
    model = lola_model()
    result = calibrate_linear_weights(model, IDS, CONFIG)
    text = calibration_markdown(result, title="tiny")
    assert "| calibrated (a weight per head) |" in text and text.count("| weight ") == 3
    plot_calibration(result, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0
