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


def test_config_and_spec_reject_bad_values():
    with pytest.raises(ValueError, match="skip"):
        CalibrationConfig(tokens=16, skip=16)
    with pytest.raises(ValueError, match="grid"):
        CalibrationConfig(grid=[0.1, -1.0])
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
