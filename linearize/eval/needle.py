"""Where a needle is lost: LoLA's memory and read-out checked head by head on a synthetic task.

For each sample of a synthetic task (``linearize.eval.synthetic``) at one length, the converted
model reads the prompt exactly as generation does (one forward with a cache: LoLA's chunked
prefill), and for every LoLA layer and query head this module reports, for the prompt's last query
(the one that predicts the answer's first token):

- ``in_cache``: the share of the needle's tokens (every token of every occurrence of the answer in
  the prompt) that the sparse cache holds after the prefill;
- ``mass``: the share of the query's attention (window + sparse cache + linear state, one shared
  denominator, as the layer reads it) that goes to those cached needle tokens;
- ``linear``: the share that goes to the linear state;
- ``gap``: the best cached needle token's score minus the query's largest explicit score (<= 0;
  None when no needle token is cached): how far the needle sits below what the query prefers;
- ``teacher``: the teacher's softmax mass on the needle tokens (its own layer inputs).

The read-out is recomputed from the layer's final LoLA state with the layer's own weights and
options; ``read_out`` returns the output it implies, which equals the layer's own output for that
query (the tests check it), so the numbers describe what the model computed.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..cache import output_cache, state_layer
from ..convert import converted_layers
from ..io import save_png
from ..layers.base import ConvertedAttention
from ..ops.common import head_weights, repeat_kv, safe_divide
from ..ops.lola import length_factor, state_tokens
from ..ops.states import LolaState
from ..teacher import capture_teacher
from .plots import LOLA_READS
from .synthetic import Sample, _eos_ids, _predict, generate_samples, score

logger = logging.getLogger(__name__)

FIELDS = ("in_cache", "mass", "linear", "gap", "teacher")


def needle_positions(tokenizer, prompt: str, references: Sequence[str]) -> list[int]:
    """Token indices of ``tokenizer(prompt)`` that overlap any occurrence of any reference string."""
    enc = tokenizer(prompt, return_offsets_mapping=True, verbose=False)
    spans = []
    for ref in references:
        start = prompt.find(ref)
        while ref and start >= 0:
            spans.append((start, start + len(ref)))
            start = prompt.find(ref, start + 1)
    if not spans:
        raise ValueError(f"none of the references {list(references)!r} occurs in the prompt")
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and any(a < e and b > s for s, e in spans)]


@torch.no_grad()
def read_out(module: ConvertedAttention, state: LolaState, hidden: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    """The LoLA read of one query (``hidden`` (1, 1, hidden), its position embeddings) against the
    layer's final ``state`` (first row), as the layer computes it in its mode. Returns float32
    ``output`` (Hq, Dv), ``weights`` (Hq, N) of the explicit entries, ``positions`` (Hq, N) of
    those entries (-1: empty), ``linear`` (Hq,) the linear state's share, ``scores`` (Hq, N) masked
    logits and ``max`` (Hq,) their maximum."""
    if module.mode not in LOLA_READS:
        raise ValueError(f"layer {module.layer_idx} runs mode {module.mode!r}; the needle read-out covers {', '.join(LOLA_READS)}")
    read_state, read_sparse = LOLA_READS[module.mode]
    options = module.options
    p = module.project(hidden, position_embeddings)
    q = p.q.float()[0, :, -1]  # (Hq, D)
    win, cache, lin = state.window, state.sparse, state.linear
    n_rep = q.shape[0] // win.keys.shape[1]
    keys = torch.cat([repeat_kv(win.keys[:1], n_rep)[0], cache.keys[0]], dim=1)  # (Hq, eta+L, D)
    values = torch.cat([repeat_kv(win.values[:1], n_rep)[0], cache.values[0]], dim=1)  # (Hq, eta+L, Dv)
    ok = torch.cat([win.valid[0].expand(q.shape[0], -1), cache.valid[0] & read_sparse], dim=1)  # (Hq, eta+L)
    positions = torch.cat([win.positions[0].expand(q.shape[0], -1), cache.positions[0]], dim=1).masked_fill(~ok, -1)
    scores = ((keys @ q[:, :, None])[..., 0] * module.scaling).masked_fill(~ok, -torch.inf)  # (Hq, eta+L)
    m = scores.amax(-1)  # (Hq,)
    num_w = module.window_factor().float().to(q.device)[:, None] * torch.exp(scores - m[:, None])  # (Hq, eta+L)
    num = (num_w[:, None, :] @ values)[:, 0]  # (Hq, Dv)
    den = num_w.sum(-1)
    linear = torch.zeros_like(den)
    if read_state:
        weight = head_weights(options.linear_weight, q.shape[0], q.device)[:, None]  # (Hq, 1)
        if options.linear_weight_tokens:
            weight = weight * length_factor(state_tokens(state)[0], options.linear_weight_tokens)[:, None]
        q_phi = module.feature_map_q(p.q_lin[:1, :, -1:]).float()[0, :, 0] * weight  # (Hq, F)
        num = num + (q_phi[:, None, :] @ lin.kv[0])[:, 0]
        linear = (q_phi * lin.k_sum[0]).sum(-1)
        den = den + linear
    return {"output": safe_divide(num, den), "weights": num_w / den[:, None], "positions": positions, "linear": linear / den,
            "scores": scores, "max": m}


@torch.no_grad()
def needle_sample(model, tokenizer, sample: Sample) -> dict[str, Any]:
    """Per LoLA layer and head (see the module docstring) for one sample, plus its prediction and score."""
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer(sample.prompt, verbose=False)["input_ids"]], device=device)  # (1, T)
    needle = needle_positions(tokenizer, sample.prompt, sample.references)
    layers = {i: m for i, m in converted_layers(model).items() if m.spec.attention == "lola"}
    if not layers:
        raise ValueError("the needle diagnostic reads LoLA layers; the model has none "
                         "(read a trained hybrid as LoLA: --attention lola --sparse-cache N)")
    last: dict[int, tuple[Tensor, tuple[Tensor, Tensor]]] = {}

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        last[module.layer_idx] = (hidden[:, -1:], (cos[:, -1:], sin[:, -1:]))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers.values()]
    try:
        cache = output_cache(model(input_ids=ids, use_cache=True))
    finally:
        for h in handles:
            h.remove()
    teacher = capture_teacher(model, ids, None, sorted(layers))
    needle_t = torch.tensor(needle, device=device)
    rows: dict[str, list[list[float | None]]] = {name: [] for name in FIELDS}
    for i, module in sorted(layers.items()):
        state = state_layer(cache, i).state
        r = read_out(module, state, *last[i])
        is_needle = torch.isin(r["positions"], needle_t)  # (Hq, N)
        cached = torch.isin(state.sparse.positions[0], needle_t) & state.sparse.valid[0]  # (Hq, L)
        best = r["scores"].masked_fill(~is_needle, -torch.inf).amax(-1)  # (Hq,)
        rows["in_cache"].append((cached.sum(-1).float() / len(needle)).tolist())
        rows["mass"].append((r["weights"] * is_needle).sum(-1).tolist())
        rows["linear"].append(r["linear"].tolist())
        rows["gap"].append([float(g) if torch.isfinite(g) else None for g in best - r["max"]])
        p = module.project(teacher[i].hidden_states, teacher[i].position_embeddings)
        k, q = p.k.float(), p.q.float()[0, :, -1]  # (1, Hkv, T, D), the last query (Hq, D)
        probs = torch.softmax((repeat_kv(k, q.shape[0] // k.shape[1])[0] @ q[:, :, None])[..., 0] * module.scaling, dim=-1)  # (Hq, T)
        rows["teacher"].append(probs[:, needle_t].sum(-1).tolist())
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    prediction = _predict(model, tokenizer, [sample], batch_size=1, device=device, eos=eos, pad=pad)[0]
    return {"index": sample.index, "tokens": ids.shape[1], "needle_positions": needle, "prediction": prediction,
            "score": score(sample, prediction), "layers": sorted(layers), **rows}


def needle_data(model, tokenizer, task: str, length: int, *, samples: int = 4, seed: int = 0) -> dict[str, Any]:
    """``needle_sample`` on ``samples`` prompts of ``task`` at ``length`` tokens, and the means over
    them (``mean[field]`` (layers, heads); gap over the samples where a needle token was cached)."""
    runs = [needle_sample(model, tokenizer, s) for s in generate_samples(task, tokenizer, length, samples, seed=seed)]
    mean = {}
    for name in FIELDS:
        x = np.array([[[np.nan if v is None else v for v in head] for head in r[name]] for r in runs], dtype=float)
        with warnings.catch_warnings():  # all-NaN columns: heads with no cached needle token
            warnings.simplefilter("ignore", RuntimeWarning)
            mean[name] = np.where(np.isnan(x).all(0), None, np.nanmean(x, axis=0)).tolist()
    options = [converted_layers(model)[i].options for i in runs[0]["layers"]]
    lola, weights = options[0], [o.linear_weight for o in options]
    return {"task": task, "length": length, "samples": runs, "layers": runs[0]["layers"], "mean": mean,
            "accuracy": float(np.mean([r["score"] for r in runs])),  # the task's score, 0-100
            "options": {"window": lola.window, "sparse_cache": lola.sparse_cache, "sinks": lola.sinks,
                        "linear_weight": weights[0] if all(w == weights[0] for w in weights) else "per layer", "chunk": lola.chunk}}


def retrieval_heads(data: dict[str, Any], top: int = 8) -> list[dict[str, Any]]:
    """The ``top`` (layer, head) pairs by the teacher's mass on the needle, with what LoLA did there."""
    teacher = np.array(data["mean"]["teacher"], dtype=float)  # (layers, heads)
    order = np.argsort(-teacher, axis=None)[:top]
    out = []
    for flat in order:
        li, h = divmod(int(flat), teacher.shape[1])
        out.append({"layer": data["layers"][li], "head": h, **{name: data["mean"][name][li][h] for name in FIELDS}})
    return out


def needle_markdown(data: dict[str, Any], *, title: str) -> str:
    """The samples' predictions and the retrieval heads (by the teacher's mass) in a table."""
    o = data["options"]
    lines = [f"# {title}", "",
             f"LoLA window {o['window']}, sparse cache {o['sparse_cache']}, sinks {o['sinks']}, linear weight "
             f"{o['linear_weight']}, chunk {o['chunk']}; accuracy {data['accuracy']:.0f}% on {len(data['samples'])} samples.", "",
             "| sample | tokens | needle tokens | score | prediction |", "|---:|---:|---:|---:|---|"]
    for r in data["samples"]:
        lines.append(f"| {r['index']} | {r['tokens']} | {len(r['needle_positions'])} | {r['score']:.0f} | {r['prediction'][:60]!r} |")
    lines += ["", "Retrieval heads (the teacher's largest mass on the needle from the last query), means over the samples:", "",
              "| layer | head | teacher mass | LoLA mass | linear share | needle in cache | best needle score - max |",
              "|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, digits=3):
        return "" if x is None else f"{x:.{digits}f}"

    for h in retrieval_heads(data):
        lines.append(f"| {h['layer']} | {h['head']} | {f(h['teacher'])} | {f(h['mass'])} | {f(h['linear'])} | {f(h['in_cache'], 2)} "
                     f"| {f(h['gap'], 2)} |")
    return "\n".join(lines) + "\n"


def plot_needle(data: dict[str, Any], path: str | Path) -> None:
    """Three heatmaps (layer x head): the teacher's mass on the needle, LoLA's, and the share of the
    needle's tokens in the sparse cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("teacher", "teacher: attention mass on the needle"), ("mass", "LoLA: attention mass on the needle"),
              ("in_cache", "needle tokens in the sparse cache"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.22 * len(data["layers"]) + 2.2), sharey=True)
    grids = {name: np.array([[np.nan if v is None else v for v in row] for row in data["mean"][name]], dtype=float) for name, _ in panels}
    top = max(1e-6, float(np.nanmax(grids["teacher"])), float(np.nanmax(grids["mass"])))  # one scale for both masses
    for ax, (name, title) in zip(axes, panels):
        im = ax.imshow(grids[name], aspect="auto", cmap="viridis", vmin=0, vmax=1 if name == "in_cache" else top)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("query head")
        fig.colorbar(im, ax=ax, fraction=0.046)
    axes[0].set_yticks(range(len(data["layers"])), [str(i) for i in data["layers"]], fontsize=6)
    axes[0].set_ylabel("layer")
    o = data["options"]
    fig.suptitle(f"{data['task']} at {data['length']} tokens, {len(data['samples'])} samples, accuracy {data['accuracy']:.0f}%; "
                 f"window {o['window']}, sparse {o['sparse_cache']}, sinks {o['sinks']}, linear weight {o['linear_weight']}, "
                 f"chunk {o['chunk']}", fontsize=10)
    save_png(fig, path)
    plt.close(fig)
