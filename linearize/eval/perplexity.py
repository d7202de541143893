"""Perplexity of a long token stream with sliding windows, and perplexity vs context length.

    tokens = heldout_tokens(tokenizer, "wiki")                       # (N,) held-out documents + eos
    perplexity(model, tokens, context_length=1024, stride=512)      # {"loss", "ppl", "tokens", ...}
    rows = perplexity_by_length(model, tokens, [512, 1024, 2048])
    plot_perplexity_vs_length({"teacher": rows_t, "hybrid": rows_h}, "ppl.png")

Windows follow the Hugging Face perplexity guide: window k covers tokens [k * stride, k * stride +
context_length) (the last one cut at the end of the stream); the first window scores all its tokens,
each later one only the targets past the previous window's end (its last ``stride`` tokens), so a
scored token always sees at least ``context_length - stride`` tokens of context. Accounting is exact:
every target is scored at most once and ``tokens`` counts the scored targets. Target i (i >= 1) is
predicted from the logits at i - 1, so a target at a window's first position cannot be scored in it:
with ``stride < context_length`` every target 1..N-1 is scored exactly once (N - 1 tokens); with
``stride == context_length`` (disjoint windows) each window's first token is not scored.

Logits are computed only at the scored positions, in chunks (decoder hidden states -> the output
embedding), so long windows never hold a (batch, length, vocab) tensor. Windows of one batch are
right padded; the models are causal, so padding after a position cannot change it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..io import save_png
from ..data import heldout_tokens
from ..runtime import check_length, eval_mode, max_positions

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
_LOGIT_ROWS = 4096  # scored positions per output-embedding call


def sliding_windows(n_tokens: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_target) per window: tokens [begin, end) are fed, targets [first_target, end) scored."""
    windows, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + context_length, n_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            windows.append((begin, end, first))
        if end == n_tokens:
            return windows
        prev_end, begin = end, begin + stride


@torch.inference_mode()
def perplexity(
    model,
    token_ids: Tensor,
    *,
    context_length: int,
    stride: int | None = None,
    batch_size: int = 1,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Sliding-window perplexity of a 1D token stream (see the module docstring).

    ``stride`` None = ``context_length`` (disjoint windows). Returns loss (mean NLL in nats), ppl,
    tokens (targets scored), windows, context_length, stride.
    """
    stride = context_length if stride is None else stride
    if token_ids.dim() != 1 or token_ids.numel() < 2:
        raise ValueError(f"token_ids must be a 1D stream of at least 2 tokens, got shape {tuple(token_ids.shape)}")
    if context_length < 2:
        raise ValueError(f"context_length must be >= 2, got {context_length}")
    if not 1 <= stride <= context_length:
        raise ValueError(f"stride must lie in [1, context_length={context_length}], got {stride}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_length(model, context_length)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    tokens = token_ids.long().cpu()
    windows = sliding_windows(tokens.numel(), context_length, stride)
    nll, count = 0.0, 0
    with eval_mode(model):
        for start in tqdm(range(0, len(windows), batch_size), desc=f"perplexity @ {context_length}", unit="batch"):
            group = windows[start : start + batch_size]
            width = max(end - begin for begin, end, _ in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)  # (B, W), right padded
            targets = torch.full((len(group), width), -100, dtype=torch.long)  # targets[b, j] = token at window pos j + 1
            for row, (begin, end, first) in enumerate(group):
                ids[row, : end - begin] = tokens[begin:end]
                targets[row, first - begin - 1 : end - begin - 1] = tokens[first:end]
            hidden = decoder(input_ids=ids.to(device), use_cache=False).last_hidden_state  # (B, W, H)
            keep = targets != -100
            hidden, labels = hidden[keep.to(device)], targets[keep].to(device)  # (n, H), (n,)
            for i in range(0, labels.numel(), _LOGIT_ROWS):
                logits = head(hidden[i : i + _LOGIT_ROWS]).float()  # (n', V)
                nll += F.cross_entropy(logits, labels[i : i + _LOGIT_ROWS], reduction="sum").item()
            count += labels.numel()
    loss = nll / count
    logger.info("perplexity @ %d (stride %d): loss %.4f, ppl %.3f over %d tokens", context_length, stride, loss, math.exp(loss), count)
    return {"loss": loss, "ppl": math.exp(loss), "tokens": count, "windows": len(windows), "context_length": context_length, "stride": stride}


def perplexity_by_length(
    model,
    tokens: Tensor,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    *,
    stride: int | None = None,
    batch_size: int = 1,
    device: str | torch.device | None = None,
) -> list[dict[str, Any]]:
    """One perplexity row per context length (``stride`` None: disjoint windows of that length).

    A length the model cannot take (beyond max_position_embeddings) or the stream cannot fill is
    skipped: its row holds ``length`` and ``error`` (also logged) instead of the numbers.
    """
    rows = []
    for length in lengths:
        error = None
        if (limit := max_positions(model)) is not None and length > limit:
            error = f"context length {length} exceeds the model's max_position_embeddings ({limit})"
        elif length > tokens.numel():
            error = f"context length {length} exceeds the held-out stream ({tokens.numel()} tokens)"
        if error:
            logger.warning("skipping length %d: %s", length, error)
            rows.append({"length": length, "error": error})
            continue
        result = perplexity(model, tokens, context_length=length, stride=min(stride or length, length), batch_size=batch_size, device=device)
        rows.append({"length": length, **result})
    return rows


def plot_perplexity_vs_length(results: dict[str, list[dict[str, Any]]], path: str | Path, *, title: str = "held-out perplexity vs context length") -> None:
    """PNG: perplexity (log axis) against context length (log2 axis), one line per model name; skipped rows left out.
    A model named "teacher" is drawn in black; past ten models the line style changes, so no two lines look alike."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(6, 4.5) if len(results) <= 6 else (7.5, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = [f"C{i}" for i in range(10)]
    styles = ["-", "--", ":", "-."]
    others = 0
    for name, rows in results.items():
        ok = [r for r in rows if "ppl" in r]
        if name == "teacher":
            look = {"color": "black", "linewidth": 2.2}
        else:
            look = {"color": colors[others % 10], "linestyle": styles[(others // 10) % len(styles)]}
            others += 1
        ax.plot([r["length"] for r in ok], [r["ppl"] for r in ok], marker="o", label=name, **look)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="context length (tokens)", ylabel="perplexity (log scale)", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small" if len(results) > 6 else None)
    fig.tight_layout()
    save_png(fig, path)


__all__ = ["DEFAULT_LENGTHS", "heldout_tokens", "perplexity", "perplexity_by_length", "plot_perplexity_vs_length", "sliding_windows"]
