"""The embedded default model, SmolLM2-135M-Instruct, converted for real (CPU; skips without the GGUF)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

import linearize
import linearize.cache
from linearize.cache import cache_kwargs
from linearize.hub import find_smollm2_gguf
from linearize.memory import layer_memory
from linearize.ops import cpu_kernels

pytestmark = pytest.mark.slow  # the real model


@pytest.fixture(scope="module")
def smollm2():
    try:
        find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    model, tokenizer = linearize.load_model("smollm2-135m")
    return model, tokenizer


@pytest.mark.parametrize(
    "spec",
    [
        {"attention": "hybrid", "window": 16},
        {"attention": "lola", "window": 8, "sparse_cache": 8, "chunk": 1},
        {"attention": "dsla", "layers": list(range(0, 30, 3))},
    ],
    ids=["hybrid", "lola", "dsla"],
)
@torch.no_grad()
def test_real_model_decode_matches_full_forward(smollm2, spec):
    model, tokenizer = smollm2
    linearize.convert(model, spec)
    try:
        batch = tokenizer(["The quick brown fox jumps over the lazy dog, again and again, until", "Paris is the capital of"],
                          return_tensors="pt", padding=True)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        full = model(ids, attention_mask=mask, position_ids=pos).logits
        cache = DynamicCache()
        split = ids.shape[1] - 4
        logits = [model(ids[:, :split], attention_mask=mask[:, :split], position_ids=pos[:, :split], **cache_kwargs(cache)).logits]
        for t in range(split, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=pos[:, t : t + 1], **cache_kwargs(cache)).logits)
        stepped = torch.cat(logits, dim=1)
        real = mask.bool()
        torch.testing.assert_close(stepped[real], full[real], atol=1e-3, rtol=1e-3)  # 30 float32 layers
    finally:
        linearize.convert(model, {"layers": []})


@torch.no_grad()
@pytest.mark.parametrize("name", ["smollm2-135m-lolcats", "smollm2-135m-dsla-chained"])
@torch.no_grad()
def test_shipped_conversions_decode_through_the_cpu_kernels_as_through_the_reference_ops(smollm2, name):
    """The trained conversions (weights held exactly in bfloat16: the kernels' bfloat16 reads) decode
    past the window through the CPU kernels with the reference ops' logits."""
    if cpu_kernels.library() is None:
        pytest.skip("the CPU kernels are off or cannot be built here")
    model, _ = linearize.load_model(name)
    ids = torch.randint(3, model.config.vocab_size, (1, 84), generator=torch.Generator().manual_seed(0))

    def decode():
        cache = DynamicCache()
        logits = [model(ids[:, :70], **cache_kwargs(cache)).logits[:, -1:]]
        logits += [model(ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(70, ids.shape[1])]
        return torch.cat(logits, dim=1), cache

    fast, cache = decode()
    with linearize.cache.reference_decoding():
        ref, _ = decode()
    torch.testing.assert_close(fast, ref, atol=1e-3, rtol=1e-3)  # 30 float32 layers
    ds = cache.layers[0].decode_state
    assert ds.kernel_args is not None and ds.kernel_weights.bf16


def test_real_model_memory_per_layer(smollm2):
    model, _ = smollm2
    teacher = layer_memory(None, model.config, dtype_bytes=4)
    assert teacher.per_token == 2 * 3 * 64 * 4  # K and V, 3 KV heads, head dim 64, float32
    hybrid = layer_memory(linearize.LayerSpec("hybrid", {"window": 64}), model.config)
    assert hybrid.per_token == 0 and hybrid.fixed == 64 * 2 * 3 * 64 * 4 + 9 * 128 * 65 * 4


def test_demo_runs_end_to_end():
    try:
        find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    result = subprocess.run([sys.executable, "-m", "linearize.cli", "demo", "--max-new-tokens", "6"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TEACHER" in result.stdout and "CONVERTED" in result.stdout and "memory held" in result.stdout


def test_generated_text_streams_piece_by_piece(smollm2):
    from linearize.generate import generate_text

    model, tokenizer = smollm2
    pieces: list[str] = []
    result = generate_text(model, tokenizer, "Name a colour.", max_new_tokens=6, on_text=pieces.append)
    assert pieces and "".join(pieces).strip() == result.text


def test_cli_generate_and_info_on_the_real_model(smollm2, capsys):
    import json

    from linearize.cli import main

    assert main(["generate", "--model", "smollm2-135m", "--prompt", "Name a colour.", "--max-new-tokens", "4",
                 "--attention", "hybrid", "--window", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == 4 and result["tokens_per_second"] > 0 and result["text"]
    by_layer = {int(k): v for k, v in result["memory_by_layer"].items()}
    assert len(by_layer) == 30 and len(set(by_layer.values())) == 1  # every layer holds the same fixed state
    assert main(["info", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "layers         30" in out and "KV bytes/token" in out


@pytest.mark.parametrize("name", list(linearize.api.SHIPPED))
@torch.no_grad()
def test_shipped_conversions_load_offline_and_stay_close_to_the_teacher_on_short_text(smollm2, name):
    """Every shipped conversion loads by name (bf16-stored adapter, float32 model; LoLA on top of
    the shipped lolcats it was trained from); the joint-mix hybrids and LoLA, on text within their
    window, predict much like their teacher."""
    teacher, tokenizer = smollm2
    model, _ = linearize.load_model(name)
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.linearize["attention"] in ("hybrid", "dsla", "lola")
    ids = tokenizer("The Amazon rainforest covers much of the Amazon basin of South America.", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert torch.isfinite(logits).all()
    spec = model.config.linearize
    if name.endswith("inference-hybrid"):  # its linear part, trained alone over every token, reads every token beside the window
        assert spec["options"]["overlap"] and spec["options"]["mix"] == "gate"
    if spec["attention"] == "lola" or (spec["attention"] == "hybrid" and spec["options"]["mix"] == "joint"):
        # short text: inside the 64-token window (not inference-hybrid: its gate mix always gives the
        # linear branch half the weight)
        agree = (logits.argmax(-1) == teacher(ids).logits.argmax(-1)).float().mean()
        assert agree > 0.5, f"{name}: next-token argmax agrees with the teacher on only {agree:.0%} of positions"


@pytest.mark.parametrize("name", ["smollm2-135m-lolcats", "smollm2-135m-hedgecats"])
@torch.no_grad()
def test_shipped_joint_hybrids_are_the_teacher_within_their_window(smollm2, name):
    """lolcats and hedgecats ship without LoRA: their second stage trained only the feature maps and
    window factors, so the teacher's q/k/v/o are untouched and, on text that fits in the 64-token
    window (no token is old enough for the linear part), the conversion computes the teacher's own
    logits; past the window it does not."""
    teacher, tokenizer = smollm2
    model, _ = linearize.load_model(name)
    assert not (linearize.api.shipped_path(name) / "lora.safetensors").exists()
    short = tokenizer("The Amazon rainforest covers much of the Amazon basin of South America.", return_tensors="pt").input_ids
    assert short.shape[1] <= 64
    torch.testing.assert_close(model(short).logits, teacher(short).logits, atol=2e-4, rtol=1e-4)
    long = tokenizer(" ".join(["The river carried the boat past the old mill and the bridge."] * 12), return_tensors="pt").input_ids
    assert long.shape[1] > 100
    assert (model(long).logits[0, 80:] - teacher(long).logits[0, 80:]).abs().max() > 1e-2


def test_cli_calibrate_writes_an_adapter_that_reads_with_the_chosen_weights(smollm2, tmp_path):
    """`linearize calibrate` on the real model (a short held-out text, chained inputs): the adapter
    it writes loads with one weight per layer and query head, each from the grid, as its report says."""
    import json

    from linearize.cli import main
    from linearize.convert import converted_layers

    out = tmp_path / "cal"
    assert main(["calibrate", "--model", "smollm2-135m", "--attention", "lola", "--window", "16", "--sparse-cache", "16",
                 "--sinks", "2", "--chunk", "16", "--layers", "0,1", "--tokens", "96", "--skip", "48", "--grid", "0,1",
                 "--inputs", "chained", "--out", str(out)]) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert report["config"]["inputs"] == "chained" and report["layers"] == [0, 1]
    model, _ = linearize.load_model(str(out))
    layers = converted_layers(model)
    assert sorted(layers) == [0, 1]
    for i, m in layers.items():
        assert m.options.linear_weight == report["weights"][str(i)] and len(m.options.linear_weight) == m.num_heads
        assert set(m.options.linear_weight) <= {0.0, 1.0}
    assert (out / "calibration.png").stat().st_size > 0


def test_static_decoder_gives_generates_text_for_the_shipped_conversions():
    """The shipped lolcats and dsla-chained (15 layers converted, 15 softmax) answer a chat prompt with
    the same greedy text through the static decoder as through model.generate(), streamed alike."""
    from linearize.generate import generate_text

    try:
        find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    for name in ("smollm2-135m-lolcats", "smollm2-135m-dsla-chained"):
        model, tokenizer = linearize.load_model(name)
        pieces: list[str] = []
        static = generate_text(model, tokenizer, "Name three colours.", max_new_tokens=12, decoder="static", on_text=pieces.append)
        reference = generate_text(model, tokenizer, "Name three colours.", max_new_tokens=12, decoder="generate")
        assert static.decoder == "static" and static.text == reference.text and static.new_tokens == reference.new_tokens
        assert "".join(pieces).strip() == static.text
