"""Sliding-window perplexity: exact token accounting, batching, exactness of a full-window hybrid, plots."""

import math

import pytest
import torch
import torch.nn.functional as F

import linearize
from linearize.eval.perplexity import heldout_tokens, perplexity, perplexity_by_length, plot_perplexity_vs_length, sliding_windows
from linearize.hub import build_tiny_llama
from linearize.data import DataConfig, build_dataset
from tests.train.conftest import tiny_tokenizer

N = 276  # 4 full windows of 64 + a partial one


def stream(n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_disjoint_windows_equal_direct_cross_entropy():
    model, tokens = build_tiny_llama(), stream()
    nll, count = 0.0, 0
    for start in range(0, N, 64):
        chunk = tokens[start : start + 64][None]
        logits = model(chunk).logits[0, :-1]
        nll += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    out = perplexity(model, tokens, context_length=64, stride=64, batch_size=2)
    assert out["tokens"] == count == N - 5 and out["windows"] == 5
    assert out["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-5)


@pytest.mark.parametrize("n,context,stride", [(N, 64, 16), (N, 64, 63), (100, 64, 50), (64, 64, 8), (10, 64, 16)])
def test_every_target_scored_exactly_once(n, context, stride):
    scored = torch.zeros(n, dtype=torch.long)
    for begin, end, first in sliding_windows(n, context, stride):
        assert begin < first < end <= begin + context  # each scored target is predicted inside its window
        scored[first:end] += 1
    assert scored[0] == 0 and bool((scored[1:] == 1).all())


@torch.no_grad()
def test_overlapping_windows_count_and_batching():
    model, tokens = build_tiny_llama(), stream()
    one = perplexity(model, tokens, context_length=64, stride=16, batch_size=1)
    many = perplexity(model, tokens, context_length=64, stride=16, batch_size=5)  # right-padded last window in a batch
    assert one["tokens"] == many["tokens"] == N - 1
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-5)


@torch.no_grad()
def test_hybrid_with_window_covering_the_context_is_the_teacher():
    model, tokens = build_tiny_llama(), stream()
    teacher = perplexity(model, tokens, context_length=64, stride=32, batch_size=3)
    linearize.convert(model, {"attention": "hybrid", "window": 64})
    hybrid = perplexity(model, tokens, context_length=64, stride=32, batch_size=3)
    assert hybrid["tokens"] == teacher["tokens"]
    assert hybrid["ppl"] == pytest.approx(teacher["ppl"], rel=1e-5)
    linearize.convert(model, {"attention": "hybrid", "window": 8})  # a short window changes it
    assert perplexity(model, tokens, context_length=64, stride=32)["ppl"] != pytest.approx(teacher["ppl"], rel=1e-5)


def test_lengths_beyond_the_model_limit(tmp_path):
    model, tokens = build_tiny_llama(), stream(700)  # max_position_embeddings 512
    with pytest.raises(ValueError, match="1024 exceeds the model's max_position_embeddings \\(512\\)"):
        perplexity(model, tokens, context_length=1024)
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, tokens, context_length=64, stride=65)
    rows = perplexity_by_length(model, tokens, [32, 64, 1024])
    assert [r["length"] for r in rows] == [32, 64, 1024]
    assert rows[0]["tokens"] == 700 - math.ceil(700 / 32) and rows[1]["ppl"] > 1
    assert "max_position_embeddings" in rows[2]["error"] and "ppl" not in rows[2]
    path = tmp_path / "plots" / "ppl.png"
    plot_perplexity_vs_length({"teacher": rows, "other": rows[:1]}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_heldout_tokens_are_the_heldout_rows(tmp_path):
    text = "\n\n".join(" ".join(f"w{3 + (7 * d + j) % 120}" for j in range(30 + d)) for d in range(20))
    (tmp_path / "corpus.txt").write_text(text)
    config = DataConfig(source=str(tmp_path / "corpus.txt"), txt_split="\n\n", seq_len=16, heldout_fraction=0.2, cache=False)
    tok = tiny_tokenizer()
    tokens = heldout_tokens(tok, config)
    assert tokens.dim() == 1 and torch.equal(tokens, build_dataset(config, tok).heldout.flatten())
    assert torch.equal(heldout_tokens(tok, config, max_tokens=20), tokens[:20])
