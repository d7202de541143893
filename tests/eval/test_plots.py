"""Diagnostic plots: data shapes and invariants of SRE maps, attention mass and DSLA gates; PNGs written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import linearize
from linearize.convert import converted_layers
from linearize.eval.plots import (
    attention_mass_data,
    diagnostic_plots,
    dsla_gate_data,
    lola_attention_weights,
    plot_attention_mass,
    plot_dsla_gates,
    plot_self_recall,
    self_recall_data,
)
from linearize.hub import build_tiny_llama
from linearize.ops.common import repeat_kv
from linearize.ops.lola import lola_attention_reference, self_recall_error
from linearize.ops.states import LinearState
from linearize.teacher import capture_teacher
from tests.train.conftest import tiny_tokenizer

T, W, L = 24, 4, 3
IDS = torch.randint(3, 128, (T,), generator=torch.Generator().manual_seed(0))
SPECS = {
    "hybrid": {"attention": "hybrid", "window": W},
    "lola": {"attention": "lola", "window": W, "sparse_cache": L},
    "dsla": {"attention": "dsla"},
}


def converted(kind: str, **spec):
    return linearize.convert(build_tiny_llama(), SPECS[kind] | spec)


@pytest.mark.slow
@pytest.mark.parametrize("linear_rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("kind", ["hybrid", "lola"])
def test_self_recall_zeros_exactly_where_held(kind, linear_rope):
    data = self_recall_data(converted(kind, linear_rope=linear_rope), IDS, layer=1, head=1)
    json.dumps(data, allow_nan=False)
    w, lam = data["window"], data["sparse"]
    assert (w, lam) == (W, L if kind == "lola" else W)
    mem = data["memories"]
    assert set(mem) == {"linear", "window_linear", "lola"} and len(data["sparse_positions"]) == T
    for rows in mem.values():
        assert [len(r) for r in rows] == list(range(1, T + 1))
    for t in range(T):
        lin, win, lola = (np.array(mem[n][t]) for n in ("linear", "window_linear", "lola"))
        # one token in a linear state is recalled exactly (readout = phi.phi v / phi.phi = v)
        assert (lin > 0).all() if t >= 1 else lin[0] < 1e-5
        assert (win[max(0, t - w + 1) :] == 0).all()
        if t >= w + 1:  # at least two tokens written
            assert (win[: t - w + 1] > 0).all()
        held = set(range(max(0, t - w + 1), t + 1)) | set(data["sparse_positions"][t])
        assert len(held) == min(t + 1, w + lam)  # the first lam evicted tokens fill the cache
        assert all(lola[i] == 0 for i in held)
        if t >= w + lam + 1:
            assert all(lola[i] > 0 for i in range(t + 1) if i not in held)
    assert data["mean"]["lola"] <= data["mean"]["window_linear"] <= data["mean"]["linear"]


def test_self_recall_cache_matches_reference_and_empty_state():
    model = converted("lola")
    module = converted_layers(model)[0]
    data = self_recall_data(model, IDS, layer=0, head=2)
    inp = capture_teacher(model, IDS[None], None, [0])[0]
    q, k, v = module.project(inp.hidden_states, inp.position_embeddings)[:3]
    _, final = lola_attention_reference(
        q, k, v, phi_q=module.feature_map_q, phi_k=module.feature_map_k, window=W, sparse=L,
        window_factor=module.window_factor(), scale=module.scaling,
    )
    pos = final.sparse.positions[0, 2]
    assert data["sparse_positions"][-1] == sorted(pos[pos >= 0].tolist())
    # an empty state recalls nothing: SRE = ||v||
    k_phi = module.feature_map_k(repeat_kv(k, 2))[0, 2]
    v_h = repeat_kv(v, 2)[0, 2]
    empty = LinearState(torch.zeros(k_phi.shape[-1], v_h.shape[-1]), torch.zeros(k_phi.shape[-1]))
    torch.testing.assert_close(self_recall_error(k_phi, v_h, empty), v_h.norm(dim=-1))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hybrid", "no_state", "no_sparse", "window_only"])
def test_lola_weights_reproduce_the_op(mode):
    model = converted("lola")
    module = converted_layers(model)[1]
    inp = capture_teacher(model, IDS[None], None, [1])[1]
    q, k, v = module.project(inp.hidden_states, inp.position_embeddings)[:3]
    read_state, read_sparse = mode in ("hybrid", "no_sparse"), mode in ("hybrid", "no_state")
    w, in_cache = lola_attention_weights(module, q, k, v, window=W, sparse=L, read_state=read_state, read_sparse=read_sparse)
    out, _ = lola_attention_reference(
        q, k, v, phi_q=module.feature_map_q, phi_k=module.feature_map_k, window=W, sparse=L,
        window_factor=module.window_factor(), scale=module.scaling, read_state=read_state, read_sparse=read_sparse,
    )
    torch.testing.assert_close(w @ repeat_kv(v, 2), out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, T))
    assert in_cache.sum(-1).max() == L and not w.triu(1).any()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hybrid", "no_sparse"])
def test_lola_weights_and_sre_with_feature_maps_before_rope(mode):
    """linear_rope false: the weights and the self-recall maps follow the op run with q_lin/k_lin
    (the layer's q/k before RoPE): the cache is chosen by phi(k_lin)'s recall error, the linear
    weights are phi(q_lin) . phi(k_lin); without the linear inputs the helper refuses."""
    model = converted("lola", linear_rope=False)
    module = converted_layers(model)[1]
    inp = capture_teacher(model, IDS[None], None, [1])[1]
    q, k, v, q_lin, k_lin = module.project(inp.hidden_states, inp.position_embeddings)
    assert not torch.equal(q_lin, q)
    read_state, read_sparse = True, mode == "hybrid"
    w, in_cache = lola_attention_weights(module, q, k, v, window=W, sparse=L, read_state=read_state,
                                         read_sparse=read_sparse, q_lin=q_lin, k_lin=k_lin)
    out, final = lola_attention_reference(
        q, k, v, phi_q=module.feature_map_q, phi_k=module.feature_map_k, window=W, sparse=L,
        window_factor=module.window_factor(), scale=module.scaling, read_state=read_state, read_sparse=read_sparse,
        q_lin=q_lin, k_lin=k_lin,
    )
    torch.testing.assert_close(w @ repeat_kv(v, 2), out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, T))
    assert in_cache.sum(-1).max() == L and not w.triu(1).any()
    with pytest.raises(ValueError, match="linear_rope false"):
        lola_attention_weights(module, q, k, v, window=W, sparse=L)
    data = self_recall_data(model, IDS, layer=1, head=2)
    pos = final.sparse.positions[0, 2]
    assert data["sparse_positions"][-1] == sorted(pos[pos >= 0].tolist())
    # the linear-attention map recalls through phi(k_lin): one token written is recalled exactly, and
    # the first row equals the SRE of token 0 against a state holding it
    k_phi = module.feature_map_k(repeat_kv(k_lin, 2))[0, 2]
    v_h = repeat_kv(v, 2)[0, 2]
    state = LinearState(torch.outer(k_phi[0], v_h[0]) + torch.outer(k_phi[1], v_h[1]), k_phi[0] + k_phi[1])
    np.testing.assert_allclose(data["memories"]["linear"][1], self_recall_error(k_phi[:2], v_h[:2], state).tolist(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("linear_rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("kind", ["hybrid", "lola"])
def test_attention_mass_splits_and_sums(kind, linear_rope):
    data = attention_mass_data(converted(kind, linear_rope=linear_rope), IDS, queries=5)
    json.dumps(data, allow_nan=False)
    assert data["layer"] == 1 and data["queries"] == 5 and data["distance"] == list(range(T))
    teacher, conv = np.array(data["teacher"]), np.array(data["converted"])
    assert teacher.shape == conv.shape == (T,) and (teacher >= 0).all()
    assert teacher.sum() == pytest.approx(1, abs=1e-5) and conv.sum() == pytest.approx(1, abs=1e-5)
    assert set(data["parts"]) == ({"window", "sparse", "state"} if kind == "lola" else {"window", "linear"})
    np.testing.assert_allclose(sum(np.array(p) for p in data["parts"].values()), conv, atol=1e-6)
    assert not np.any(data["parts"]["window"][W:]) and not np.any(np.array(list(data["parts"].values()))[1:, :W])


@pytest.mark.parametrize("kind,spec", [("hybrid", {"window": T}), ("lola", {"sparse_cache": T}),
                                       ("lola", {"sparse_cache": T, "linear_rope": False})])
def test_attention_mass_exact_when_everything_is_held(kind, spec):
    data = attention_mass_data(converted(kind, **spec), IDS, layer=0)
    np.testing.assert_allclose(data["converted"], data["teacher"], atol=1e-5)


def test_attention_mass_modes():
    model = converted("hybrid")
    linearize.set_mode(model, "swa_only")
    data = attention_mass_data(model, IDS, layer=0, queries=T)
    assert data["mode"] == "swa_only" and not np.any(data["parts"]["linear"])
    linearize.set_mode(model, "la_only")
    assert attention_mass_data(model, IDS, layer=0)["parts"]["window"][0] > 0  # LA reads window keys too


def test_dsla_mass_and_gates():
    model = converted("dsla")
    data = attention_mass_data(model, IDS)
    json.dumps(data, allow_nan=False)
    assert 0 <= data["gamma"] <= 1 and sum(data["teacher"]) == pytest.approx(1, abs=1e-5)
    hist, rec = np.array(data["decay"]["history"]), np.array(data["decay"]["recent"])
    assert hist[0] == rec[0] == 1 and (np.diff(hist) <= 0).all() and (hist >= rec).all()
    np.testing.assert_allclose(rec[:5], 0.9 ** np.arange(5), rtol=1e-4)  # untrained: data independent gates
    assert data["half_life"] == {"history": None, "recent": 7}
    gates = dsla_gate_data(model, IDS)["layers"]
    json.dumps(gates, allow_nan=False)
    assert [r["layer"] for r in gates] == [0, 1]
    for r in gates:
        assert 0 <= r["gamma"] <= 1
        assert r["history_gate"] == pytest.approx(0.999, abs=1e-5) and r["recent_gate"] == pytest.approx(0.9, abs=1e-5)
        assert r["history_half_life"] == pytest.approx(692.8, rel=1e-2)


def test_bad_layers_raise():
    with pytest.raises(ValueError, match="self_recall diagnostic"):
        self_recall_data(converted("dsla"), IDS)
    with pytest.raises(ValueError, match="not a converted"):
        attention_mass_data(converted("hybrid", layers=[1]), IDS, layer=0)
    with pytest.raises(ValueError, match="DSLA"):
        dsla_gate_data(converted("lola"), IDS)


@pytest.mark.parametrize(
    "kind,files",
    [
        ("hybrid", {"self_recall_layer1.png", "attention_mass_layer1.png"}),
        ("lola", {"self_recall_layer1.png", "attention_mass_layer1.png"}),
        ("dsla", {"attention_mass_layer1.png", "dsla_gates.png"}),
    ],
)
@pytest.mark.slow
def test_diagnostic_plots_write_pngs(kind, files, tmp_path):
    text = " ".join(f"w{i}" for i in IDS.tolist())
    paths = diagnostic_plots(converted(kind), tiny_tokenizer(), text, tmp_path)
    assert {p.name for p in paths} == files == {p.name for p in tmp_path.iterdir()}
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


@pytest.mark.slow
def test_plot_functions_write(tmp_path):
    model = converted("lola")
    plot_self_recall(self_recall_data(model, IDS[None].repeat(2, 1), layer=-1), tmp_path / "a.png")
    plot_attention_mass(attention_mass_data(model, IDS[None].repeat(2, 1)), tmp_path / "b.png")
    plot_dsla_gates(dsla_gate_data(converted("dsla"), IDS), tmp_path / "c.png")
    assert all((tmp_path / f"{n}.png").stat().st_size > 1000 for n in "abc")
