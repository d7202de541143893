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

``inputs="chained"`` calibrates the layers in order, each on the inputs it gets in the model being
calibrated (the layers below it already read as LoLA with their chosen weights, those above as the
teacher), against the teacher's output of that layer on the teacher's inputs: a layer's weights then
also take up the error the layers below it leave, which per-layer errors on the teacher's inputs do
not see (a retrieval head fed drifted queries scores its needle below the window however well it
alone matches softmax).

``text="recall-probes"`` scores copies instead of all text: each sequence is a held-out passage, a
gap of other held-out text, and the passage again (``linearize.train.sensitivity.recall_probes``,
the probes that find recall-bearing layers), and only the repeat's positions are scored, where the
teacher reads the passage back from ``tokens - passage`` positions earlier. The error then weighs
what the read-out must keep from far back, not the local averaging that fills most positions.

The selection (what the sparse cache keeps) does not depend on the weight, and a head's output
depends only on its own weight, so one LoLA pass per grid value scores every head at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checks import check_int, is_int

if TYPE_CHECKING:
    from ..spec import ConversionSpec

logger = logging.getLogger(__name__)

CALIBRATION_INPUTS = ("teacher", "chained")
CALIBRATION_TEXTS = ("heldout", "recall-probes")


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
    inputs: str = "teacher"
    """What each layer reads while it is scored: 'teacher' (the teacher's layer inputs) or 'chained'
    (the inputs of the model being calibrated, layers below already calibrated; the target stays the
    teacher's output)."""
    text: str = "heldout"
    """What is scored: 'heldout' (one held-out sequence, positions from ``skip`` on) or
    'recall-probes' (``probes`` sequences of passage, gap, passage again; the repeat's positions
    only)."""
    probes: int = 4
    """Recall probes read (text 'recall-probes')."""
    passage: int = 64
    """Length of a recall probe's passage (text 'recall-probes')."""

    def __post_init__(self) -> None:
        check_int("tokens", self.tokens, 2)
        if self.text == "heldout" and (not is_int(self.skip) or not 0 <= self.skip < self.tokens):
            raise ValueError(f"skip must be an integer in [0, tokens={self.tokens}), got {self.skip!r}")
        if not self.grid or any(not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0 for w in self.grid):
            raise ValueError(f"grid must be non-empty numbers >= 0, got {self.grid!r}")
        if self.inputs not in CALIBRATION_INPUTS:
            raise ValueError(f"inputs must be one of {', '.join(CALIBRATION_INPUTS)}, got {self.inputs!r}")
        if self.text not in CALIBRATION_TEXTS:
            raise ValueError(f"text must be one of {', '.join(CALIBRATION_TEXTS)}, got {self.text!r}")
        check_int("probes", self.probes, 1)
        if self.text == "recall-probes" and (not is_int(self.passage) or not 2 <= self.passage <= (self.tokens - 1) // 2):
            raise ValueError(f"passage must be an integer in 2..{(self.tokens - 1) // 2} (tokens={self.tokens}), got {self.passage!r}")

    def scored(self) -> slice:
        """The positions whose error counts."""
        return slice(self.tokens - self.passage + 1, None) if self.text == "recall-probes" else slice(self.skip, None)


def calibration_inputs(tokenizer, config: CalibrationConfig):
    """The token ids ``calibrate_linear_weights`` reads, (B, tokens): the held-out stream of
    ``config.source`` (B = 1), or ``config.probes`` recall probes built from its held-out rows."""
    from .. import data
    from .sensitivity import recall_probes

    rows = 1 if config.text == "heldout" else config.probes + 1
    ids = data.heldout_tokens(tokenizer, data.DataConfig(source=config.source, seq_len=64), max_tokens=rows * config.tokens)
    if ids.numel() < rows * config.tokens:
        raise ValueError(f"the held-out part of {config.source!r} has {ids.numel()} tokens, fewer than the "
                         f"{rows} x {config.tokens} calibration needs (text {config.text!r})")
    ids = ids.view(rows, config.tokens)
    if config.text == "heldout":
        return ids
    return recall_probes(ids, passage=config.passage, batch_size=config.probes)[0]["input_ids"]


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
    the layer's LoLA output against the teacher's softmax output (see the module docstring), on
    ``input_ids`` (B, T) at ``config.scored()`` positions; layers in order, each on the inputs
    ``config.inputs`` names. Returns
    {"weights": {layer: [per head]}, "errors": {layer: (grid, heads) list}, "uniform": {weight: mean
    error over layers and heads with that weight in every head of the scored layer (with 'chained'
    inputs, the layers below read with their calibrated weights)},
    "calibrated": the mean error with the chosen weights, "config": ...}. The model is not changed."""
    import torch
    from tqdm.auto import tqdm

    import numpy as np

    from ..teacher import capture_teacher

    layers = lola_layers(model)
    if input_ids.dim() != 2 or input_ids.shape[1] != config.tokens:
        raise ValueError(f"input_ids must be (batch, tokens={config.tokens}), got {tuple(input_ids.shape)}")
    order = sorted(layers)
    with torch.no_grad():
        inputs = capture_teacher(model, input_ids, None, order)
        errors, weights = {}, {}
        for i in tqdm(order, desc="calibrating LoLA read-out", unit="layer"):
            own = _chained_input(model, input_ids, i, weights) if config.inputs == "chained" and weights else inputs[i]
            errors[i] = _head_errors(layers[i], own, inputs[i], config)
            weights[i] = [float(config.grid[j]) for j in np.array(errors[i]).argmin(0)]
    stacked = np.stack([np.array(errors[i]) for i in sorted(errors)])  # (layers, grid, Hq)
    uniform = {str(w): float(stacked[:, g].mean()) for g, w in enumerate(config.grid)}
    calibrated = float(stacked.min(1).mean())
    logger.info("calibrated read-out: mean relative error %.4f (best single weight %s: %.4f)", calibrated,
                min(uniform, key=uniform.get), min(uniform.values()))
    return {"weights": weights, "errors": errors, "uniform": uniform, "calibrated": calibrated,
            "layers": sorted(layers), "config": asdict(config)}


def _head_errors(module, inp, teacher_inp, config: CalibrationConfig) -> list[list[float]]:
    """(grid, Hq) relative squared error of one layer's LoLA output on ``inp`` against its softmax
    output on ``teacher_inp``, per grid weight and head."""
    from ..ops.softmax import softmax_attention

    t = module.project(teacher_inp.hidden_states, teacher_inp.position_embeddings)
    target, _ = softmax_attention(t.q.float(), t.k.float(), t.v.float(), scale=module.scaling)  # (1, Hq, T, Dv)
    target = target[:, :, config.scored()]
    scale = (target**2).mean((0, -1, -2)).clamp_min(1e-12)  # (Hq,)
    p = t if inp is teacher_inp else module.project(inp.hidden_states, inp.position_embeddings)
    rows = []
    for w in config.grid:
        out, _ = module.lola(p, linear_weight=float(w))
        rows.append((((out[:, :, config.scored()].float() - target) ** 2).mean((0, -1, -2)) / scale).tolist())
    return rows


class _Stop(Exception):
    """Ends a forward once the layer of interest has its inputs."""


def _chained_input(model, input_ids, layer: int, weights: dict[int, list[float]]):
    """Layer ``layer``'s inputs in the model read with the layers in ``weights`` as LoLA (mode
    'hybrid') with those per-head weights and every other converted layer as the teacher; the forward
    stops at ``layer``. Modes and options are put back after."""
    from ..convert import kept_modes
    from ..teacher import LayerInput

    captured = []

    def hook(module, args, kwargs):
        captured.append(LayerInput.from_call(args, kwargs))
        raise _Stop

    with kept_modes(model) as modules:
        saved = {i: m.options.linear_weight for i, m in modules.items() if i in weights}
        handle = modules[layer].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            for i, m in modules.items():
                m.mode = "hybrid" if i in weights else "teacher"
                if i in weights:
                    m.options.linear_weight = list(weights[i])
            model(input_ids=input_ids, use_cache=False)
        except _Stop:
            pass
        finally:
            handle.remove()
            for i, w in saved.items():
                modules[i].options.linear_weight = w
    if not captured:
        raise RuntimeError(f"layer {layer} was not reached by the forward")
    return captured[0]


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
    text = c.get("text", "heldout")
    scored = (f"{c['probes']} recall probes of {c['tokens']} tokens (a {c['passage']}-token passage, a gap, the passage "
              f"again), scored on the repeat" if text == "recall-probes" else
              f"{c['tokens']} tokens, scored from position {c['skip']}")
    lines = [f"# {title}", "",
             f"Held-out {c['source']}, {scored}; grid {c['grid']}; "
             f"inputs: {c.get('inputs', 'teacher')}. Mean relative squared error of the LoLA layers' outputs against "
             "the teacher's softmax outputs:", "",
             "| read-out | error |", "|---|---:|"]
    below = " (layers below calibrated)" if c.get("inputs") == "chained" else ""
    for w, e in result["uniform"].items():
        lines.append(f"| weight {w} in every head{below} | {e:.4f} |")
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
