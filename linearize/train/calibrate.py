"""Read-out calibration of LoLA layers: a linear-term weight per query head, fitted on held-out text.

A trained hybrid read as LoLA keeps ``window`` tokens, ``sparse_cache`` tokens chosen by self-recall
error and a linear state for the rest. The linear term is not rescaled by the softmax max (the
LoLCATs convention), so how much of the explicit entries it should be weighed against differs by
head: heads that average broadly over the past want it at full weight, heads that retrieve a few
tokens want it small (methods.md, LoLA read-out). ``calibrate_linear_weights`` picks, for every LoLA
layer and query head, the weight from a grid whose LoLA output is closest to the teacher's softmax
output of the same layer (relative squared error over the positions from ``skip`` on), on the
teacher's layer inputs of a held-out document, as attention transfer compares them. Nothing about
needles or any evaluation task enters: the text is a training source's held-out part.

The selection (what the sparse cache keeps) does not depend on the weight, and a head's output
depends only on its own weight, so one LoLA pass per grid value scores every head at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..spec import ConversionSpec

logger = logging.getLogger(__name__)


@dataclass
class CalibrationConfig:
    """What ``calibrate_linear_weights`` fits on (the ``linearize calibrate`` flags)."""

    source: str = "pysource"
    """Held-out text (a data source: pysource, wiki, essays, a local file or folder); its held-out
    documents, concatenated."""
    tokens: int = 2048
    """Length of the held-out sequence the layers read."""
    skip: int = 512
    """Positions before this are not scored (there every memory still holds everything exactly)."""
    grid: list[float] = field(default_factory=lambda: [0.0, 0.01, 0.03, 0.1, 0.3, 1.0])
    """Candidate weights of the linear term."""

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 2:
            raise ValueError(f"tokens must be an integer >= 2, got {self.tokens!r}")
        if not isinstance(self.skip, int) or not 0 <= self.skip < self.tokens:
            raise ValueError(f"skip must be an integer in [0, tokens={self.tokens}), got {self.skip!r}")
        if not self.grid or any(not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0 for w in self.grid):
            raise ValueError(f"grid must be non-empty numbers >= 0, got {self.grid!r}")


def lola_layers(model) -> dict[int, Any]:
    """The model's LoLA layers; ValueError when it has none."""
    from ..convert import converted_layers

    layers = {i: m for i, m in converted_layers(model).items() if m.spec.attention == "lola"}
    if not layers:
        raise ValueError("calibration fits LoLA layers; the model has none (read a trained hybrid as LoLA: "
                         "--attention lola --sparse-cache N)")
    return layers


def calibrate_linear_weights(model, input_ids, config: CalibrationConfig) -> dict[str, Any]:
    """Per LoLA layer and query head, the grid weight with the smallest relative squared error of
    the layer's LoLA output against its softmax output (see the module docstring), on ``input_ids``
    (1, T). Returns {"weights": {layer: [per head]}, "errors": {layer: (grid, heads) list},
    "uniform": {weight: mean error over layers and heads with that weight everywhere},
    "calibrated": the mean error with the chosen weights, "config": ...}. The model is not changed."""
    import torch
    from tqdm.auto import tqdm

    import numpy as np

    from ..teacher import capture_teacher

    layers = lola_layers(model)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] <= config.skip:
        raise ValueError(f"input_ids must be (1, T) with T > skip={config.skip}, got {tuple(input_ids.shape)}")
    with torch.no_grad():
        inputs = capture_teacher(model, input_ids, None, sorted(layers))
        errors = {i: _head_errors(module, inputs[i], config)
                  for i, module in tqdm(sorted(layers.items()), desc="calibrating LoLA read-out", unit="layer")}
    weights = {i: [float(config.grid[j]) for j in np.array(err).argmin(0)] for i, err in errors.items()}
    stacked = np.stack([np.array(errors[i]) for i in sorted(errors)])  # (layers, grid, Hq)
    uniform = {str(w): float(stacked[:, g].mean()) for g, w in enumerate(config.grid)}
    calibrated = float(stacked.min(1).mean())
    logger.info("calibrated read-out: mean relative error %.4f (best single weight %s: %.4f)", calibrated,
                min(uniform, key=uniform.get), min(uniform.values()))
    return {"weights": weights, "errors": errors, "uniform": uniform, "calibrated": calibrated,
            "layers": sorted(layers), "config": asdict(config)}


def _head_errors(module, inp, config: CalibrationConfig) -> list[list[float]]:
    """(grid, Hq) relative squared error of one layer's LoLA output, per grid weight and head."""
    from ..ops.softmax import softmax_attention

    p = module.project(inp.hidden_states, inp.position_embeddings)
    target, _ = softmax_attention(p.q.float(), p.k.float(), p.v.float(), scale=module.scaling)  # (1, Hq, T, Dv)
    target = target[0, :, config.skip :]
    scale = (target**2).mean((-1, -2)).clamp_min(1e-12)  # (Hq,)
    rows = []
    for w in config.grid:
        out, _ = module.lola(p, linear_weight=float(w))
        rows.append((((out[0, :, config.skip :].float() - target) ** 2).mean((-1, -2)) / scale).tolist())
    return rows


def apply_linear_weights(model, weights: dict[int, list[float]]) -> ConversionSpec:
    """Give each listed layer its per-head weights (spec overrides, trained parameters kept);
    returns the model's new spec."""
    from ..convert import convert
    from ..spec import ConversionSpec

    spec = ConversionSpec.from_dict(model.config.linearize)
    overrides = {k: dict(v) for k, v in spec.overrides.items()}
    for i, w in weights.items():
        overrides[int(i)] = {**overrides.get(int(i), {}), "linear_weight": [float(x) for x in w]}
    spec = spec.replace(overrides=overrides)
    convert(model, spec)
    return spec


def calibration_markdown(result: dict[str, Any], *, title: str) -> str:
    c = result["config"]
    lines = [f"# {title}", "",
             f"Held-out {c['source']}, {c['tokens']} tokens, scored from position {c['skip']}; grid {c['grid']}. "
             "Mean relative squared error of the LoLA layers' outputs against their softmax outputs:", "",
             "| read-out | error |", "|---|---:|"]
    for w, e in result["uniform"].items():
        lines.append(f"| weight {w} in every head | {e:.4f} |")
    lines += [f"| calibrated (a weight per head) | {result['calibrated']:.4f} |", "",
              "| layer | weights per query head |", "|---:|---|"]
    for i in result["layers"]:
        lines.append(f"| {i} | {', '.join(f'{w:g}' for w in result['weights'][i])} |")
    return "\n".join(lines) + "\n"


def plot_calibration(result: dict[str, Any], path: str | Path) -> None:
    """Heatmap of the chosen weights (layer x head, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    from ..io import save_png

    w = np.array([result["weights"][i] for i in result["layers"]], dtype=float)
    positive = w[w > 0]
    floor = positive.min() if positive.size else 1e-3
    fig, ax = plt.subplots(figsize=(6, 0.22 * len(result["layers"]) + 1.8))
    im = ax.imshow(np.where(w > 0, w, floor / 2), aspect="auto", cmap="viridis", norm=LogNorm(vmin=floor / 2, vmax=max(1.0, w.max())))
    ax.set_yticks(range(len(result["layers"])), [str(i) for i in result["layers"]], fontsize=6)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title("linear-term weight per head (0 shown at the bottom of the scale)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    save_png(fig, path)
    plt.close(fig)
