"""The attention-kind registry: one record per kind, per-kind spec fields, the old flat format."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import linearize
from linearize.cli import main
from linearize.convert import MODES, converted_layers
from linearize.hub import build_tiny_llama
from linearize.layers.base import GENERIC_MODES, KindOptions
from linearize.layers.hybrid import HybridAttention
from linearize.layers.lola import LolaAttention
from linearize.layers.registry import KINDS, get_kind
from linearize.memory import layer_memory
from linearize.spec import LEGACY_DEFAULTS, ConversionSpec, SpecError


def tiny():
    return build_tiny_llama(seed=0, num_hidden_layers=3).eval()


@pytest.mark.parametrize("name", list(KINDS))
def test_each_record_matches_its_layer(name):
    kind = KINDS[name]
    assert issubclass(kind.options, KindOptions) and dataclasses.is_dataclass(kind.options)
    model = linearize.convert(tiny(), {"attention": name, "layers": [0]})
    module = converted_layers(model)[0]
    assert type(module) is kind.layer
    assert tuple(module.attend_modes()) == kind.modes and kind.modes[0] == "hybrid"
    assert set(kind.ablation_modes) <= set(kind.modes + GENERIC_MODES)
    assert set(kind.modes) <= set(MODES)
    per_token, fixed = kind.memory(module.options, model.config, 4)
    assert layer_memory(module.spec, model.config, 4).at(10) == per_token * 10 + fixed > 0


def test_unknown_kind_names_the_valid_ones():
    with pytest.raises(SpecError, match="unknown attention 'mamba'; valid choices: softmax, hybrid, lola, dsla"):
        get_kind("mamba")
    with pytest.raises(SpecError, match="valid choices: softmax, hybrid, lola, dsla"):
        ConversionSpec.from_dict({"attention": "mamba"})


@pytest.mark.parametrize("attention, field, value", [
    ("hybrid", "chunk", 8), ("hybrid", "sparse_cache", 4), ("dsla", "window", 64), ("lola", "mix", "gate"),
    ("lola", "kernel", "torch"), ("softmax", "feature_map", "relu"),
])
def test_a_field_the_kind_lacks_is_an_error(attention, field, value):
    with pytest.raises(SpecError, match=rf"\['{field}'\] do not apply to attention '{attention}'"):
        ConversionSpec.from_dict({"attention": attention, field: value})
    with pytest.raises(SpecError, match=f"override for layer 1: .*{field}"):
        ConversionSpec.from_dict({"attention": attention, "overrides": {1: {field: value}}})


def test_unknown_field_lists_the_valid_ones():
    with pytest.raises(SpecError, match=r"unknown spec field\(s\) \['windw'\]; valid fields: attention, .*window"):
        ConversionSpec.from_dict({"attention": "hybrid", "windw": 8})


def test_json_form_round_trips_and_nests_the_options():
    spec = ConversionSpec.from_dict({"attention": "lola", "window": 8, "sparse_cache": 4, "layers": [0, 2], "overrides": {2: {"window": 16}}})
    data = json.loads(spec.to_json())
    assert data["options"]["window"] == 8 and data["options"]["sparse_cache"] == 4 and "window" not in data
    assert ConversionSpec.from_dict(data) == spec
    assert spec.layer_spec(2, 3).options.window == 16 and spec.layer_spec(0, 3).options.window == 8


def test_old_flat_format_loads_and_drops_what_its_kind_ignored():
    old = {**LEGACY_DEFAULTS, "attention": "hybrid", "window": 16, "chunk": 32, "layers": "all", "overrides": {}}
    del old["linear_rope"]  # the first flat format had no linear_rope
    spec = ConversionSpec.from_dict(old)
    assert spec.options.window == 16 and not hasattr(spec.options, "chunk")
    dsla = ConversionSpec.from_dict({**old, "attention": "dsla", "chunk": 8, "dsla_gate_rank": 4})
    assert dsla.options.chunk == 8 and dsla.options.dsla_gate_rank == 4 and not hasattr(dsla.options, "window")


def test_switching_kind_keeps_the_shared_options():
    hybrid = ConversionSpec.from_dict({"attention": "hybrid", "window": 8, "mix": "gate", "feature_map": "relu", "linear_rope": False})
    lola = hybrid.replace(attention="lola", sparse_cache=4)
    assert (lola.options.window, lola.options.feature_map, lola.options.linear_rope, lola.options.sparse_cache) == (8, "relu", False, 4)
    with pytest.raises(SpecError, match="do not apply to attention 'lola'"):
        hybrid.replace(attention="lola", mix="gate")


def test_lola_is_its_own_layer_and_reads_a_trained_hybrids_parameters():
    model = linearize.convert(tiny(), {"attention": "hybrid", "window": 4})
    module = converted_layers(model)[0]
    assert type(module) is HybridAttention
    with torch.no_grad():
        module.window_factor_logit.fill_(1.5)
    linearize.convert(model, ConversionSpec.from_dict(model.config.linearize).replace(attention="lola", sparse_cache=2))
    lola = converted_layers(model)[0]
    assert isinstance(lola, LolaAttention) and not isinstance(lola, HybridAttention)
    assert torch.all(lola.window_factor_logit == 1.5)
    assert "gate_logit" not in dict(lola.named_buffers()) and not hasattr(lola, "window_dropout")


def test_cli_flag_the_kind_lacks_is_a_clear_error(tmp_path, capsys):
    code = main(["convert", "--model", str(tmp_path / "never-loaded"), "--attention", "hybrid", "--chunk", "8", "--out", str(tmp_path / "x")])
    assert code == 2
    err = capsys.readouterr().err
    assert "['chunk'] do not apply to attention 'hybrid'" in err and "hybrid's fields" in err
