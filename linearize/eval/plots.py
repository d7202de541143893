"""Diagnostic plots of a converted model: what its memories forget and where its attention goes.

Each plot is a data function (JSON-able dict of lists) and a drawing function (PNG). Every data
function runs the converted layers on the *teacher's* layer inputs (``capture_teacher``, as in
attention transfer), so teacher and converted layer see identical inputs; sequences are unpadded.

- ``self_recall_data`` / ``plot_self_recall``: self-recall error (methods.md, LoLA) of every past
  token against three memories of one head, at every time step: pure linear attention, window +
  linear, LoLA (window + sparse cache chosen by SRE + state; per-token steps, chunk 1).
- ``attention_mass_data`` / ``plot_attention_mass``: mean attention weight per key distance of the
  last queries, teacher vs converted layer, the converted mass split by memory (window / sparse
  cache / linear state). For DSLA: the teacher's mass and the effective decay per key distance of
  each gated state (the product of its gates, times gamma or 1 - gamma).
- ``dsla_gate_data`` / ``plot_dsla_gates``: gamma and the mean gate values of every DSLA layer.
- ``diagnostic_plots``: all that applies to a model, written to a folder.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..convert import converted_layers
from ..io import save_png
from ..layers.base import ConvertedAttention, Projection, has_two_gates
from ..layers.lola import LolaAttention
from ..layers.registry import KINDS
from ..modeling import decoder_layers
from ..ops.common import gqa_groups, repeat_kv
from ..ops.lola import lola_attention, self_recall_error
from ..ops.states import LinearState, LolaState
from ..teacher import LayerInput, capture_teacher, teacher_probs

logger = logging.getLogger(__name__)

Ids = Tensor | Sequence[int] | Sequence[Sequence[int]]
HYBRID_BRANCHES = {"hybrid": "both", "swa_only": "window", "la_only": "linear"}
LOLA_READS = {"hybrid": (True, True), "no_state": (False, True), "no_sparse": (True, False), "window_only": (False, False)}
"""LoLA mode -> (read_state, read_sparse)."""
DIAGNOSTICS = ("self_recall", "attention_mass", "gates")
"""Diagnostics a kind may declare (``AttentionKind.diagnostics``): self_recall (its layers hold a
window + linear state that LoLA's memory can be simulated on), attention_mass (per-layer attention
by key distance), gates (DSLA's gate values over all its layers)."""
PART_COLORS = {"window": "tab:blue", "sparse": "tab:orange", "linear": "tab:green", "state": "tab:green"}


# ----------------------------------------------------------------------------- inputs


def _ids(input_ids: Ids, device: torch.device) -> Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (T,) or (B, T) with T >= 1, got shape {tuple(ids.shape)}")
    return ids


def _with_diagnostic(model, diagnostic: str) -> dict[int, ConvertedAttention]:
    """The converted layers whose kind declares ``diagnostic``."""
    return {i: m for i, m in converted_layers(model).items() if diagnostic in m.spec.kind.diagnostics}


def _pick_layer(model, layer: int | None, diagnostic: str = "attention_mass") -> tuple[int, ConvertedAttention]:
    """(index, module) of ``layer`` (negative counts from the end), or the middle converted layer
    whose kind declares ``diagnostic``."""
    layers = _with_diagnostic(model, diagnostic)
    names = "/".join(name for name, kind in KINDS.items() if diagnostic in kind.diagnostics)
    if not layers:
        raise ValueError(f"the model has no converted layer with the {diagnostic} diagnostic (kinds: {names})")
    n = len(decoder_layers(model))
    index = sorted(layers)[len(layers) // 2] if layer is None else layer % n if -n <= layer < n else layer
    if layer is not None and index not in layers:
        raise ValueError(f"layer {layer} is not a converted {names} layer; those are {sorted(layers)}")
    return index, layers[index]


def _layer_inputs(model, input_ids: Ids, layers: list[int]) -> dict[int, LayerInput]:
    return capture_teacher(model, _ids(input_ids, next(model.parameters()).device), None, layers)


def _projection(module: ConvertedAttention, inp: LayerInput) -> Projection:
    """The layer's float32 projection: q (B, Hq, T, D), k and v (B, Hkv, T, D) with RoPE, and the
    feature maps' inputs, as the layer computes them."""
    return module.project(inp.hidden_states, inp.position_embeddings).map(Tensor.float)


# ----------------------------------------------------------------------------- LoLA step by step


def _linear_inputs(module: ConvertedAttention, q_lin: Tensor | None, k_lin: Tensor | None) -> dict[str, Tensor]:
    """The lola op's q_lin/k_lin keywords; a layer whose feature maps see q/k before RoPE
    (``linear_rope`` false) must be given them: its RoPE'd q/k would give another memory."""
    if (q_lin is None) != (k_lin is None):
        raise ValueError("q_lin and k_lin go together: give both (the feature maps' inputs) or neither")
    if q_lin is None and module.separate_linear_inputs:
        raise ValueError(f"layer {module.layer_idx} has linear_rope false: its feature maps see q/k before RoPE; "
                         "pass them as q_lin/k_lin (e.g. from module.project(...).q_lin/.k_lin)")
    return {} if q_lin is None else {"q_lin": q_lin, "k_lin": k_lin}


def _lola_states(
    module: ConvertedAttention, q: Tensor, k: Tensor, v: Tensor, window: int, sparse: int,
    q_lin: Tensor | None = None, k_lin: Tensor | None = None,
) -> Iterator[LolaState]:
    """The LoLA memory after each token (per-token steps: chunk 1, exactly the decoding rule).
    ``q_lin`` / ``k_lin``: the feature maps' inputs when they are not q / k (``linear_rope`` false)."""
    lin = _linear_inputs(module, q_lin, k_lin)
    state = None
    for t in range(q.shape[2]):
        step = slice(t, t + 1)
        _, state = lola_attention(
            q[:, :, step], k[:, :, step], v[:, :, step], phi_q=module.feature_map_q, phi_k=module.feature_map_k,
            window=window, sparse=sparse, window_factor=module.window_factor(), chunk=1, state=state, scale=module.scaling,
            **{name: x[:, :, step] for name, x in lin.items()},
        )
        yield state


def lola_attention_weights(
    module: ConvertedAttention, q: Tensor, k: Tensor, v: Tensor, *, window: int, sparse: int,
    read_state: bool = True, read_sparse: bool = True, q_lin: Tensor | None = None, k_lin: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(B, Hq, T, T) weights of LoLA decoding token by token (chunk 1) and the (B, Hq, T, T) mask of
    the keys each query finds in the sparse cache. ``v`` is needed because the cache is chosen by
    self-recall error; the output equals ``weights @ v`` (GQA-repeated). Unpadded rows only.
    ``q_lin`` / ``k_lin``: the feature maps' inputs (q/k before RoPE), required for a layer whose
    spec has ``linear_rope`` false; the softmax weights always score the RoPE'd q / k."""
    b, hq, t, _ = q.shape
    lin = _linear_inputs(module, q_lin, k_lin)
    q_feat, k_feat = lin.get("q_lin", q), lin.get("k_lin", k)
    in_cache = torch.zeros(b, hq, t, t, dtype=torch.bool, device=q.device)
    for i, st in enumerate(_lola_states(module, q, k, v, window, sparse, q_lin, k_lin)):
        pos = st.sparse.positions  # (B, Hq, L), -1 where empty
        slots = torch.zeros(b, hq, t + 1, device=q.device).scatter_(-1, pos.masked_fill(pos < 0, t), 1.0)
        in_cache[:, :, i] = slots[..., :t].bool()
    kr = repeat_kv(k, gqa_groups(q, k))
    dist = torch.arange(t, device=q.device)[:, None] - torch.arange(t, device=q.device)[None, :]  # (T, T)
    band = (dist >= 0) & (dist < window)
    explicit = band | (in_cache & read_sparse)  # (B, Hq, T, T)
    written = (dist >= 0) & ~band & ~in_cache  # tokens in the linear state
    scores = (q @ kr.transpose(-1, -2) * module.scaling).masked_fill(~explicit, -torch.inf)
    m = scores.amax(-1, keepdim=True)  # shared max over window U cache
    f = module.window_factor().to(q.device).view(1, hq, 1, 1)
    num = f * torch.exp(scores - m)
    if read_state:  # LoLCATs convention: the linear term is not rescaled by exp(-m)
        kf = repeat_kv(k_feat, gqa_groups(q, k))
        num = num + (module.feature_map_q(q_feat).float() @ module.feature_map_k(kf).float().transpose(-1, -2)) * written
    return num / num.sum(-1, keepdim=True), in_cache


# ----------------------------------------------------------------------------- 1. self-recall error


@torch.no_grad()
def self_recall_data(
    model, input_ids: Ids, *, layer: int | None = None, head: int = 0, window: int | None = None, sparse: int | None = None,
) -> dict[str, Any]:
    """SRE of every past token (k_i, v_i), i <= t, against three memories of one head as they stand
    after token t, on the first row of ``input_ids``:

    - ``linear``: pure linear attention, every token written into (H, s) as it arrives;
    - ``window_linear``: tokens enter (H, s) when they leave a window of ``window``;
    - ``lola``: LoLA with ``window`` and ``sparse`` (its cache kept by SRE, the rest written).

    Held tokens (window, sparse cache) are recalled exactly: their SRE is 0. ``memories[name][t]``
    lists positions 0..t; ``sparse_positions[t]`` is LoLA's cache after token t. Defaults: the
    layer's window; LoLA layers their own sparse budget, hybrid layers sparse = window.
    Features: the layer's own feature_map_k on its feature-map keys (RoPE'd, or before RoPE when the
    spec's ``linear_rope`` is false), GQA-repeated.
    """
    index, module = _pick_layer(model, layer, "self_recall")
    window = module.options.window if window is None else window
    sparse = getattr(module.options, "sparse_cache", window) if sparse is None else sparse
    if not 0 <= head < module.num_heads:
        raise ValueError(f"head {head} out of range: the layer has {module.num_heads} query heads")
    q, k, v, q_lin, k_lin = (x[:1] for x in _projection(module, _layer_inputs(model, input_ids, [index])[index]))
    n_rep = gqa_groups(q, k)
    k_phi = module.feature_map_k(repeat_kv(k_lin, n_rep)).float()[0, head]  # (T, F)
    v_h = repeat_kv(v, n_rep)[0, head]  # (T, Dv)
    kv, z = (k_phi[:, :, None] * v_h[:, None, :]).cumsum(0), k_phi.cumsum(0)  # state holding tokens 0..s

    def sre(t: int, s: int) -> Tensor:  # tokens 0..t against the state of tokens 0..s (s < 0: empty)
        state = LinearState(kv[s], z[s]) if s >= 0 else LinearState(torch.zeros_like(kv[0]), torch.zeros_like(z[0]))
        return self_recall_error(k_phi[: t + 1], v_h[: t + 1], state)

    rows: dict[str, list[list[float]]] = {"linear": [], "window_linear": [], "lola": []}
    cached: list[list[int]] = []
    lin = (q_lin, k_lin) if module.separate_linear_inputs else (None, None)
    for t, st in enumerate(_lola_states(module, q, k, v, window, sparse, *lin)):
        rows["linear"].append(sre(t, t).tolist())
        rows["window_linear"].append(sre(t, t - window).index_fill(0, torch.arange(max(0, t - window + 1), t + 1, device=q.device), 0.0).tolist())
        err = self_recall_error(k_phi[: t + 1], v_h[: t + 1], LinearState(st.linear.kv[0, head], st.linear.k_sum[0, head]))
        pos = st.sparse.positions[0, head]
        held = torch.cat([st.window.positions[0], pos])
        rows["lola"].append(err.index_fill(0, held[held >= 0], 0.0).tolist())
        cached.append(sorted(pos[pos >= 0].tolist()))
    means = {name: float(np.mean(np.concatenate(r))) for name, r in rows.items()}
    return {
        "layer": index, "head": head, "kind": module.spec.attention, "window": window, "sparse": sparse,
        "tokens": q.shape[2], "memories": rows, "sparse_positions": cached, "mean": means,
        "value_norm": float(v_h.norm(dim=-1).mean()),
    }


def plot_self_recall(data: dict[str, Any], path: str | Path) -> None:
    """Three heatmaps side by side (x: time t, y: KV position i <= t), one log colour scale; black:
    held exactly (window / sparse cache), white: not seen yet."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    t_len, w = data["tokens"], data["window"]
    idx = np.arange(t_len)
    band = (idx[:, None] - idx[None, :] >= 0) & (idx[:, None] - idx[None, :] < w)  # [t, i]
    cache = np.zeros((t_len, t_len), bool)
    for t, pos in enumerate(data["sparse_positions"]):
        cache[t, pos] = True
    held = {"linear": np.zeros_like(band), "window_linear": band, "lola": band | cache}
    mats = {}
    for name, rows in data["memories"].items():
        m = np.full((t_len, t_len), np.nan)
        for t, row in enumerate(rows):
            m[t, : t + 1] = row
        mats[name] = m
    lost = np.concatenate([m[~held[n] & ~np.isnan(m)] for n, m in mats.items()])
    lost = lost[lost > 0]
    vmin, vmax = (np.percentile(lost, 1), lost.max()) if lost.size else (1e-3, 1.0)
    vmax = max(vmax, vmin * 1.01)
    cmap = colormaps["viridis"].with_extremes(under="black", bad="white")
    titles = {
        "linear": "linear attention (all tokens in the state)",
        "window_linear": f"window {w} + linear",
        "lola": f"LoLA: window {w} + sparse cache {data['sparse']} + linear",
    }
    fig = Figure(figsize=(16, 5.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3, sharey=True)
    for ax, (name, m) in zip(axes, mats.items()):
        shown = np.where(held[name] & ~np.isnan(m), vmin / 2, np.clip(m, vmin, vmax))  # held -> 'under'
        im = ax.imshow(shown.T, origin="lower", aspect="auto", cmap=cmap, norm=LogNorm(vmin, vmax), interpolation="nearest")
        ax.set_title(f"{titles[name]}\nmean SRE {data['mean'][name]:.3g}", fontsize=10)
        ax.set_xlabel("time t (tokens seen)")
    axes[0].set_ylabel("KV position i")
    fig.colorbar(im, ax=list(axes), extend="min", fraction=0.025, pad=0.01).set_label("SRE (log scale; black: held exactly)")
    fig.suptitle(
        f"Self-recall error ||H^T phi(k) / phi(k)^T s - v|| of past tokens, layer {data['layer']} head {data['head']} "
        f"({data['kind']} conversion; mean ||v|| = {data['value_norm']:.3g}: SRE near it = nothing recalled)"
    )
    save_png(fig, path)


# ----------------------------------------------------------------------------- 2. attention mass


def _by_distance(w: Tensor, queries: int) -> Tensor:
    """w (B, H, T, T) -> (T,): mean over rows, heads and the last ``queries`` queries of the weight
    on the key at each distance d = t - i (0 where d > t)."""
    t = w.shape[-1]
    qpos = torch.arange(t - queries, t, device=w.device)  # (Q,)
    key = qpos[:, None] - torch.arange(t, device=w.device)[None, :]  # (Q, T): key index at distance d
    vals = w[:, :, t - queries :].gather(-1, key.clamp(min=0).expand(*w.shape[:2], -1, -1))
    return (vals * (key >= 0)).mean(dim=(0, 1, 2))


def _decay_by_distance(log_gate: Tensor, queries: int) -> Tensor:
    """log_gate (B, H, T, D) -> (T,): mean over rows, heads, key dims and the last queries of
    prod_{s=i+1..t} alpha_s for the key i at distance d = t - i (over queries with d <= t)."""
    c = log_gate.float().cumsum(2)  # (B, H, T, D)
    t = c.shape[2]
    total, count = torch.zeros(t, device=c.device), torch.zeros(t, device=c.device)
    for qt in range(t - queries, t):
        decay = torch.exp(c[:, :, qt : qt + 1] - c[:, :, : qt + 1]).mean(dim=(0, 1, 3)).flip(0)  # (qt + 1,) by distance
        total[: qt + 1] += decay
        count[: qt + 1] += 1
    return total / count.clamp(min=1)


def _half_life(decay: list[float]) -> int | None:
    return next((d for d, x in enumerate(decay) if x < 0.5), None)


@torch.no_grad()
def attention_mass_data(model, input_ids: Ids, *, layer: int | None = None, queries: int | None = None) -> dict[str, Any]:
    """Mean attention weight per key distance d = t - i over heads, rows and the last ``queries``
    queries (default T // 8), for the teacher (softmax probabilities) and one converted layer.

    hybrid: ``hybrid_attention_weights`` in the layer's mode, split into ``parts`` window (d < w) and
    linear (older keys). lola: LoLA decoding weights in its mode, split into window, sparse (cached
    keys) and state (keys written to the linear state). ``parts`` sum to ``converted``.
    dsla: no normalised weights; ``decay`` holds each state's mean product of gates between a key
    at distance d and the query (1 at d = 0), ``gamma`` the history weight, ``half_life`` the first
    distance where a decay falls below 1/2 (None: not within the sequence).
    """
    index, module = _pick_layer(model, layer)
    inp = _layer_inputs(model, input_ids, [index])[index]
    proj = _projection(module, inp)
    q, k, v = proj[:3]
    t = q.shape[2]
    queries = max(1, t // 8) if queries is None else min(max(1, queries), t)
    kind, mode = module.spec.attention, module.mode
    out: dict[str, Any] = {
        "layer": index, "kind": kind, "mode": mode, "tokens": t, "queries": queries, "distance": list(range(t)),
        "teacher": _by_distance(teacher_probs(module, q, k, None), queries).tolist(),
    }
    if has_two_gates(module):
        log_h, log_r = module.log_gates(inp.hidden_states)
        decay = {"history": _decay_by_distance(log_h, queries).tolist(), "recent": _decay_by_distance(log_r, queries).tolist()}
        return out | {"gamma": float(module.gamma().mean()), "decay": decay, "half_life": {n: _half_life(d) for n, d in decay.items()}}

    window = module.options.window
    dist = torch.arange(t, device=q.device)[:, None] - torch.arange(t, device=q.device)[None, :]
    band = (dist >= 0) & (dist < window)
    lola = isinstance(module, LolaAttention)
    if mode not in (LOLA_READS if lola else HYBRID_BRANCHES):
        logger.warning("attention_mass_data: layer %d is in mode %r; showing its 'hybrid' weights", index, mode)
    sparse = module.options.sparse_cache if lola else 0
    if lola:
        read_state, read_sparse = LOLA_READS.get(mode, (True, True))
        w, in_cache = lola_attention_weights(
            module, q, k, v, window=window, sparse=sparse, read_state=read_state, read_sparse=read_sparse,
            **module.linear_inputs(proj),
        )
        parts = {"window": w * band, "sparse": w * (in_cache & ~band), "state": w * (~band & ~in_cache)}
    else:
        w = module.attention_weights(proj, None, HYBRID_BRANCHES.get(mode, "both")).float()
        parts = {"window": w * band, "linear": w * ~band}
    return out | {
        "window": window, "sparse": sparse,
        "converted": _by_distance(w, queries).tolist(),
        "parts": {name: _by_distance(p, queries).tolist() for name, p in parts.items()},
    }


def _buckets(t: int, window: int) -> list[int]:
    """Bucket edges over distances: 0, 1, 2, 4, 8, ... plus the window edge, ending at t."""
    edges = {0, window, t} | {2**i for i in range(int(math.log2(max(t, 1))) + 1)}
    return sorted(e for e in edges if e <= t)


def _bucket_sums(x: list[float], edges: list[int]) -> list[float]:
    return [float(sum(x[a:b])) for a, b in zip(edges, edges[1:])]


def _bucket_label(a: int, b: int) -> str:
    return str(a) if b == a + 1 else f"{a}-{b - 1}"


def plot_attention_mass(data: dict[str, Any], path: str | Path) -> None:
    """Left: mass per key distance (log-log), teacher vs converted (and its parts). Right: the mass
    per distance bucket, teacher vs the converted layer stacked by memory; DSLA: the effective decay
    per key distance of each state, weighted by gamma / 1 - gamma."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    t_len = data["tokens"]
    d1 = np.arange(t_len) + 1  # distance + 1 on log axes

    def positive(x: list[float]) -> np.ndarray:  # zeros left out of log axes (not clipped to the bottom)
        x = np.array(x, dtype=float)
        return np.where(x > 0, x, np.nan)

    fig = Figure(figsize=(14, 5))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    left.axvspan(t_len - data["queries"] + 1, t_len, color="0.9", label="key 0 (attention sink) lies here")
    left.loglog(d1, positive(data["teacher"]), color="black", lw=1.2, label="teacher (softmax)")
    where = f"mean over heads and the last {data['queries']} queries"
    if data["kind"] == "dsla":
        g = data["gamma"]
        hist, rec = np.array(data["decay"]["history"]), np.array(data["decay"]["recent"])
        life = {n: f"> {t_len - 1}" if h is None else h for n, h in data["half_life"].items()}
        right.semilogx(d1, g * hist, label=f"gamma x history decay (half-life {life['history']})")
        right.semilogx(d1, (1 - g) * rec, label=f"(1 - gamma) x recent decay (half-life {life['recent']})")
        right.semilogx(d1, g * hist + (1 - g) * rec, color="black", ls="--", label="sum: weight a key gets before q.k")
        right.set(xlabel="key distance t - i + 1", ylabel="(1 -) gamma x product of gates (mean over heads, dims)", ylim=(0, 1.02),
                  title=f"DSLA effective decay per key distance (gamma {g:.3f})")
        right.legend(fontsize=8)
    else:
        w = data["window"]
        for name, part in data["parts"].items():
            left.loglog(d1, positive(part), color=PART_COLORS[name], lw=1, label=f"converted: {name}")
        left.axvline(w + 0.5, color="gray", ls="--", lw=0.8)
        edges = _buckets(t_len, w)
        x = np.arange(len(edges) - 1)
        right.bar(x - 0.2, _bucket_sums(data["teacher"], edges), 0.4, color="black", label="teacher")
        bottom = np.zeros(len(x))
        for name, part in data["parts"].items():
            s = np.array(_bucket_sums(part, edges))
            right.bar(x + 0.2, s, 0.4, bottom=bottom, color=PART_COLORS[name], label=f"converted: {name}")
            bottom += s
        if w in edges:
            right.axvline(edges.index(w) - 0.5, color="gray", ls="--", lw=0.8)
        right.set_xticks(x, [_bucket_label(a, b) for a, b in zip(edges, edges[1:])], rotation=45, fontsize=8)
        share = {n: sum(data[n][:w]) for n in ("teacher", "converted")}
        right.set(xlabel="key distance t - i (bucket; dashed: window edge)", ylabel="attention mass",
                  title=f"mass by distance bucket (within window: teacher {share['teacher']:.2f}, converted {share['converted']:.2f})")
        right.legend(fontsize=8)
    left.set_ylim(bottom=np.nanmin(positive(data["teacher"])) / 10)  # a near-empty part does not stretch the axis
    left.set(xlabel="key distance t - i + 1", ylabel="mean attention weight", title=f"attention per key distance ({where})")
    left.legend(fontsize=8)
    edge = "" if data["kind"] == "dsla" else "; dashed: window edge"
    fig.suptitle(f"Attention mass by key distance, layer {data['layer']} ({data['kind']} in mode {data['mode']}, {t_len} tokens{edge})")
    fig.tight_layout()
    save_png(fig, path)


# ----------------------------------------------------------------------------- 3. DSLA gates


@torch.no_grad()
def dsla_gate_data(model, input_ids: Ids) -> dict[str, Any]:
    """Per converted DSLA layer: gamma (history weight), the mean history / recent gate values over
    tokens, heads and key dims on ``input_ids``, and the half-lives log(1/2) / mean log gate."""
    layers = _with_diagnostic(model, "gates")
    if not layers:
        raise ValueError("the model has no converted layer with gates (DSLA)")
    inputs = _layer_inputs(model, input_ids, sorted(layers))
    rows = []
    for i in sorted(layers):
        gates = dict(zip(("history", "recent"), layers[i].log_gates(inputs[i].hidden_states)))
        row: dict[str, Any] = {"layer": i, "gamma": float(layers[i].gamma().mean())}
        for name, g in gates.items():
            mean_log = float(g.double().mean())
            row[f"{name}_gate"] = float(g.double().exp().mean())
            row[f"{name}_half_life"] = math.log(0.5) / mean_log if mean_log < 0 else None
        rows.append(row)
    return {"layers": rows}


def plot_dsla_gates(data: dict[str, Any], path: str | Path) -> None:
    """Left: gamma per DSLA layer (bars, 0..1). Right: mean gate values per layer (logit axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = data["layers"]
    x = np.arange(len(rows))
    labels = [str(r["layer"]) for r in rows]
    fig = Figure(figsize=(max(8, 0.35 * len(rows) + 6), 4.5))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    left.bar(x, [r["gamma"] for r in rows], color="tab:purple")
    left.axhline(0.5, color="gray", ls="--", lw=0.8)
    left.set_xticks(x, labels, fontsize=8)
    left.set(ylim=(0, 1), xlabel="layer", ylabel="gamma (weight of the history state)", title="DSLA gamma per layer (dashed: init)")
    for name, color in (("history", "tab:blue"), ("recent", "tab:orange")):
        right.plot(x, [r[f"{name}_gate"] for r in rows], "o-", color=color, label=f"{name} gate")
    right.set_yscale("logit")
    right.set_xticks(x, labels, fontsize=8)
    right.set(xlabel="layer", ylabel="mean gate value alpha (logit axis)", title="mean gate values (1 = no forgetting)")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


# ----------------------------------------------------------------------------- 4. all of them


def diagnostic_plots(model, tokenizer, text_or_ids: str | Ids, out_dir: str | Path, *, layer: int | None = None) -> list[Path]:
    """Write the plots that apply to ``model``'s converted layers into ``out_dir``; returns the paths.

    ``layer`` (default: the middle converted layer whose kind declares attention_mass: hybrid, lola,
    dsla) gets attention_mass_layer{L}.png and, when its kind declares self_recall (hybrid, lola: LoLA
    with the layer's own budgets, a hybrid's with sparse = window), self_recall_layer{L}.png; any
    layer with gates (DSLA) adds dsla_gates.png.
    """
    ids = tokenizer(text_or_ids, return_tensors="pt")["input_ids"] if isinstance(text_or_ids, str) else text_or_ids
    index, module = _pick_layer(model, layer)
    out = Path(out_dir)
    paths = []
    if "self_recall" in module.spec.kind.diagnostics:
        paths.append(out / f"self_recall_layer{index}.png")
        plot_self_recall(self_recall_data(model, ids, layer=index), paths[-1])
    paths.append(out / f"attention_mass_layer{index}.png")
    plot_attention_mass(attention_mass_data(model, ids, layer=index), paths[-1])
    if _with_diagnostic(model, "gates"):
        paths.append(out / "dsla_gates.png")
        plot_dsla_gates(dsla_gate_data(model, ids), paths[-1])
    logger.info("wrote %s", ", ".join(map(str, paths)))
    return paths


__all__ = [
    "attention_mass_data",
    "diagnostic_plots",
    "dsla_gate_data",
    "lola_attention_weights",
    "plot_attention_mass",
    "plot_dsla_gates",
    "plot_self_recall",
    "self_recall_data",
]
