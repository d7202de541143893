"""The layer benchmark: its softmax baseline is exact, its roofline counts what it says, and it runs."""

import json

import pytest
import torch

from linearize.bench.layer import SoftmaxLayer, _positions, bench_layer, build_layer, layer_markdown, layer_shape, roofline, run_layer_bench
from linearize.bench.shapes import SHAPES, LayerShape
from linearize.layers.base import project_qkv
from linearize.ops import fused_decode

TINY = LayerShape(hidden=64, heads=4, kv_heads=2, head_dim=16)


def test_softmax_baseline_decode_matches_its_prefill():
    """Static-cache steps after a prefill give the prefill's own outputs at those positions."""
    model = build_layer(TINY, None, max_positions=64, device="cpu", dtype=torch.float32)
    layer = SoftmaxLayer(model.model.layers[0].self_attn, TINY)
    x = torch.randn(2, 12, TINY.hidden)
    full = layer.prefill(x, *_positions(model, x, 0))  # (2, 12, hidden)
    layer.fill(2, 8, 4, "cpu", torch.float32)
    _, k, v, _, _ = project_qkv(layer.attn, x[:, :8], _positions(model, x[:, :8], 0))
    layer.k_cache[:, :, :8], layer.v_cache[:, :, :8] = k, v  # the cache of the first 8 tokens
    steps = [layer.step(x[:, i : i + 1], *_positions(model, x[:, i : i + 1], i)) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 8:], rtol=1e-5, atol=1e-5)


def test_softmax_baseline_is_the_teachers_attention():
    model = build_layer(TINY, None, max_positions=64, device="cpu", dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 10, TINY.hidden)
    pe = _positions(model, x, 0)
    mask = torch.full((10, 10), float("-inf")).triu(1)[None, None]  # (1, 1, T, T) causal
    expected, _ = attn(x, position_embeddings=pe, attention_mask=mask)
    torch.testing.assert_close(SoftmaxLayer(attn, TINY).prefill(x, *pe), expected, rtol=1e-5, atol=1e-5)


def test_roofline_counts():
    model = build_layer(TINY, {"attention": "hybrid", "window": 8}, max_positions=64, device="cpu", dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    args = dict(batch=2, elem=2)
    soft = [roofline("softmax", None, model.config, TINY, phase="decode", length=n, **args)["bytes"] for n in (1000, 2000)]
    conv = [roofline("hybrid", attn.options, model.config, TINY, phase="decode", length=n, **args)["bytes"] for n in (1000, 2000)]
    assert soft[1] - soft[0] == 2 * 2 * 2 * TINY.kv_heads * 1000 * TINY.head_dim  # K and V, bf16, batch 2, 1000 more tokens
    assert conv[0] == conv[1]  # a fixed state: the same bytes at every context
    long = roofline("softmax", None, model.config, TINY, phase="prefill", length=1 << 16, **args)
    assert long["bound"] == "compute"  # the causal square dominates at 64K


def test_bench_layer_runs_and_reports(tmp_path):
    specs = [{"attention": "hybrid", "window": 8}, {"attention": "lola", "window": 8, "sparse_cache": 8, "chunk": 8}]
    results = run_layer_bench(TINY, specs, prefill_lengths=[16], decode_contexts=[24], batch_sizes=[1, 2], warmup=1, repeats=1,
                              decode_steps=2, device="cpu", out_dir=tmp_path)  # fmt: skip
    assert [r["spec"]["attention"] for r in results] == ["hybrid", "lola"]
    for result in results:
        assert [(r["phase"], r["batch_size"], r["length"]) for r in result["rows"]] == [
            ("prefill", 1, 16), ("prefill", 2, 16), ("decode", 1, 24), ("decode", 2, 24)]
        for row in result["rows"]:
            assert row["softmax_backend"] in row["softmax_backends"] and row["ratio"] > 0
            assert row["converted_roofline"]["roofline_s"] > 0
    assert json.loads((tmp_path / "layer.json").read_text())[0]["rows"]
    assert "| hybrid window 8 torch | 2 | 16 |" in (tmp_path / "layer.md").read_text()
    assert (tmp_path / "layer.png").stat().st_size > 0
    assert layer_markdown(results) == (tmp_path / "layer.md").read_text()
    assert all(r["autotuned"] == fused_decode.autotuned_choices() for r in results)


def test_the_report_lists_the_autotuners_choices():
    """A layer report lists what the autotuner chose per kernel and key, once across results of one
    process (each result holds every choice made so far), and nothing where there were none."""
    base = {"shape_name": "tiny", "shape": {}, "device": "gpu", "dtype": "bfloat16", "rows": [], "spec": {"attention": "dsla"}}
    first = {"kernel": "dsla_states", "key": {"T": 32768, "F": 256}, "dtypes": ["torch.bfloat16"],
             "config": {"BK": 32, "BV": 128, "num_warps": 8, "num_stages": 2, "maxnreg": 128}}  # fmt: skip
    second = {**first, "key": {"T": 131072, "F": 256}, "config": {**first["config"], "BK": 64, "maxnreg": None}}
    md = layer_markdown([{**base, "autotuned": [first]}, {**base, "autotuned": [first, second]}])
    assert "### autotuner's choices" in md
    assert md.count("| dsla_states | T=32768, F=256 | torch.bfloat16 | BK 32, BV 128, num_warps 8, num_stages 2, maxnreg 128 |") == 1
    assert "| dsla_states | T=131072, F=256 | torch.bfloat16 | BK 64, BV 128, num_warps 8, num_stages 2 |" in md
    assert "autotuner" not in layer_markdown([{**base, "autotuned": []}])


def test_compiled_decode_steps_run_with_and_without_the_fused_kernels(tmp_path):
    """compile=True times both sides' compiled decode steps; with the fused kernels on (Triton's
    interpreter here) the torch step is timed beside them; a kind without a static step is named."""
    from linearize.ops import fused_decode

    kw = dict(prefill_lengths=[], decode_contexts=[24], batch_sizes=[2], warmup=1, repeats=1, decode_steps=2, device="cpu", compile=True)
    result = bench_layer(TINY, {"attention": "dsla"}, **kw)
    (row,) = result["rows"]
    assert result["settings"]["compile"] and row["converted_s"] > 0 and "converted_unfused_s" not in row and not row["converted_graph"]
    if fused_decode.triton_available() and fused_decode.interpreting():
        with fused_decode.use_fused(True):
            (row,) = bench_layer(TINY, {"attention": "hybrid", "window": 8}, **kw)["rows"]
        assert row["converted_unfused_s"] > 0 and row["converted_s"] > 0
    with pytest.raises(ValueError, match="attention 'softmax' has none"):
        bench_layer(TINY, {"attention": "softmax"}, **kw)


def test_bad_layer_inputs_name_the_value():
    with pytest.raises(ValueError, match="no-such-shape.*llama3-8b"):
        layer_shape("no-such-shape")
    with pytest.raises(ValueError, match=r"prefill lengths must be positive integers, got \[0\]"):
        bench_layer(TINY, {"attention": "hybrid"}, prefill_lengths=[0], device="cpu")
    assert set(SHAPES) == {"smollm2-135m", "llama3-8b"}
    with pytest.raises(ValueError, match="graphs=True needs a CUDA device; got cpu"):
        bench_layer(TINY, {"attention": "hybrid"}, device="cpu", graphs=True)


def test_cli_layer_bench_runs_every_kind(tmp_path, capsys, monkeypatch):
    """Every kind at its defaults, with a kernel option set for the run and recorded in each result."""
    from linearize.cli import main
    from linearize.ops import fused_lola, kernel_options

    monkeypatch.setattr(fused_lola, "STAGES", fused_lola.STAGES)  # restored after the test
    monkeypatch.setattr(kernel_options, "_APPLIED", {})
    assert main(["bench", "--layer", "smollm2-135m", "--prefill-lengths", "64", "--decode-contexts", "none", "--repeats", "1",
                 "--kernel-option", "fused_lola.STAGES=2", "--out", str(tmp_path)]) == 0  # fmt: skip
    results = json.loads((tmp_path / "layer.json").read_text())
    assert [r["spec"]["attention"] for r in results] == ["hybrid", "dsla", "lola"]
    assert fused_lola.STAGES == 2 and all(r["kernel_options"] == {"fused_lola.STAGES": 2} for r in results)
    assert "| lola window 64 sparse_cache 256 | 1 | 64 |" in capsys.readouterr().out


def test_cli_layer_bench_rejects_an_unknown_shape(capsys):
    from linearize.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--layer", "gpt-9"])
    assert exit_info.value.code == 2
    assert "gpt-9" in capsys.readouterr().err


@pytest.mark.skipif(not (fused_decode.triton_available() and fused_decode.interpreting()), reason="runs the Triton kernels in the interpreter")
def test_fused_prefill_is_timed_beside_the_exact_prefill():
    """With the fused kernels on (Triton's interpreter here) a hybrid prefill row also times the
    exact prefill it replaces, and the table names it."""
    with fused_decode.use_fused(True):
        result = bench_layer(TINY, {"attention": "hybrid", "window": 8}, prefill_lengths=[32], decode_contexts=[], batch_sizes=[1],
                             warmup=0, repeats=1, device="cpu")  # fmt: skip
    (row,) = result["rows"]
    assert row["converted_s"] > 0 and row["converted_unfused_s"] > 0
    assert "exact form" in layer_markdown([result])


def test_prefill_profile_lists_each_sides_kernels(tmp_path):
    """profile=True keeps both sides' profiles per prefill row (decode rows have none) and the table
    lists the converted prefill's kernels; the DSLA prefill's own ops are among them."""
    result = bench_layer(TINY, {"attention": "dsla"}, prefill_lengths=[16], decode_contexts=[24], batch_sizes=[1], warmup=1,
                         repeats=2, decode_steps=2, device="cpu", profile=True)  # fmt: skip
    prefill, decode = result["rows"]
    assert "profile" not in decode and result["settings"]["profile"]
    soft, conv = prefill["profile"]["softmax"], prefill["profile"]["converted"]
    for side in (soft, conv):
        assert side["steps"] == 2 and side["launches_per_step"] > 0 and side["device_ms_per_step"] > 0 and side["top"]
    assert conv["launches_per_step"] > soft["launches_per_step"]  # feature maps, gates and two states against one SDPA
    assert any("scaled_dot_product" in r["name"] or "sdpa" in r["name"] for r in soft["top"])
    table = layer_markdown([result])
    assert "### prefill kernels: dsla torch, batch 1, length 16" in table and "| kernel | calls / call |" in table
    assert "### prefill kernels" not in layer_markdown([bench_layer(TINY, {"attention": "dsla"}, prefill_lengths=[16], decode_contexts=[],
                                                                    warmup=0, repeats=1, device="cpu")])  # fmt: skip


def test_cli_bench_rejects_a_bad_kernel_option_before_loading(capsys):
    from linearize.cli import main

    code = main(["bench", "--layer", "smollm2-135m", "--kernel-option", "fused_lola.STAGES=three"])
    assert code == 2
    assert "fused_lola.STAGES=three" in capsys.readouterr().err
