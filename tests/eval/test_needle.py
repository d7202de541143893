"""The needle diagnostic: needle tokens found, LoLA's read-out recomputed exactly, the report written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import linearize
from linearize.cache import output_cache, state_layer
from linearize.convert import converted_layers
from linearize.eval.needle import needle_data, needle_markdown, needle_positions, plot_needle, read_out
from linearize.hub import build_tiny_llama
from tests.eval.test_synthetic import word_tokenizer


def lola_model(**options):
    spec = {"attention": "lola", "window": 4, "sparse_cache": 3, "chunk": 4} | options
    return linearize.convert(build_tiny_llama(seed=0), spec)


def test_needle_positions_cover_every_occurrence():
    tok = word_tokenizer()
    assert needle_positions(tok, "w3 w4 12345 w5 12345 w6", ["12345"]) == [2, 4]
    assert needle_positions(tok, "w3 w4 w5", ["w4", "w5"]) == [1, 2]
    with pytest.raises(ValueError, match="none of the references"):
        needle_positions(tok, "w3 w4", ["w9"])


@pytest.mark.parametrize("options", [{}, {"sinks": 1, "linear_weight": 0.25}, {"sinks": 1, "linear_weight": [0.5, 0.1, 1.0, 0.0], "linear_weight_tokens": 4}],
                         ids=["published", "sinks-weight", "per-head-weight-tokens"])
@pytest.mark.parametrize("mode", ["hybrid", "no_state", "no_sparse"])
def test_read_out_is_the_layers_own_output_for_the_last_query(options, mode):
    """After a chunked prefill of 21 tokens (window 4 + 3 slots: all three memories in use), the
    read recomputed from the final state equals what the layer fed its o_proj for the last token;
    its explicit weights and linear share sum to 1."""
    model = lola_model(**options)
    layers = converted_layers(model)
    for m in layers.values():
        m.set_mode(mode)
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(1))
    seen, last = {}, {}
    handles = []
    for i, m in layers.items():
        handles.append(m.o_proj.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, args[0][0, -1])))
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: last.__setitem__(i, (kwargs["hidden_states"][:, -1:],
                                                                tuple(x[:, -1:] for x in kwargs["position_embeddings"]))),
            with_kwargs=True))
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids, use_cache=True))
    for h in handles:
        h.remove()
    for i, m in layers.items():
        state = state_layer(cache, i).state
        assert int(state.sparse.valid.sum()) > 0 and float(state.linear.k_sum.abs().sum()) > 0
        r = read_out(m, state, *last[i])
        torch.testing.assert_close(r["output"].reshape(-1), seen[i].float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["weights"].sum(-1) + r["linear"], torch.ones(m.num_heads), rtol=1e-5, atol=1e-5)
        if mode == "no_state":
            assert float(r["linear"].abs().max()) == 0
        if mode == "no_sparse":
            assert bool((r["positions"][:, 4:] == -1).all())  # the cache's entries are not read


def test_read_out_refuses_a_mode_it_does_not_cover():
    model = lola_model()
    m = converted_layers(model)[0]
    m.set_mode("teacher")
    with pytest.raises(ValueError, match="mode 'teacher'"):
        read_out(m, None, torch.zeros(1, 1, 64), (torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)))


@pytest.mark.slow
def test_needle_data_on_a_tiny_model(tmp_path):
    model, tok = lola_model(sinks=1), word_tokenizer()
    data = needle_data(model, tok, "passkey", 128, samples=2)
    layers, heads = len(data["layers"]), converted_layers(model)[0].num_heads
    assert len(data["samples"]) == 2 and 0 <= data["accuracy"] <= 100
    for name in ("in_cache", "mass", "linear", "teacher"):
        x = np.array(data["mean"][name], dtype=float)
        assert x.shape == (layers, heads) and (x >= -1e-6).all() and (x <= 1 + 1e-6).all()
    for r in data["samples"]:
        assert r["needle_positions"] and max(r["needle_positions"]) < r["tokens"]
        assert all(g is None or g <= 1e-6 for row in r["gap"] for g in row)
    text = needle_markdown(data, title="tiny")
    assert "| layer | head | teacher mass |" in text and text.count("\n| ") >= 2 + 8
    plot_needle(data, tmp_path / "needle.png")
    assert (tmp_path / "needle.png").stat().st_size > 0


def test_needle_data_needs_lola_layers():
    model = linearize.convert(build_tiny_llama(seed=0), {"attention": "hybrid", "window": 4})
    with pytest.raises(ValueError, match="reads LoLA layers"):
        needle_data(model, word_tokenizer(), "passkey", 128, samples=1)
