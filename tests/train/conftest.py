"""A tiny Llama with a word-level tokenizer and a small text corpus: recipes run on them on CPU."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from linearize.hub import build_tiny_llama

VOCAB = 128


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>")
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-teacher")
    build_tiny_llama(seed=0, num_hidden_layers=3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> str:
    """Documents of patterned word sequences, one per paragraph."""
    rng = random.Random(0)
    docs = []
    for _ in range(60):
        start = rng.randrange(3, VOCAB)
        docs.append(" ".join(f"w{3 + (start + 7 * j + rng.randrange(3)) % (VOCAB - 3)}" for j in range(rng.randrange(40, 90))))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(docs))
    return str(path)


def tiny_overrides(model_dir: str, corpus: str, out_dir, **extra) -> dict:
    """Scale a recipe down to the tiny model: short sequences, a few steps, small batches."""
    base = {
        "model": model_dir,
        "output_dir": str(out_dir),
        "data.source": corpus,
        "data.txt_split": "\n\n",
        "data.seq_len": 48,
        "data.heldout_sequences": 4,
        "data.cache": False,
        "spec.window": 4,
        "transfer.max_steps": 3,
        "transfer.optim.batch_size": 4,
        "transfer.eval_every": 2,
        "finetune.max_steps": 3,
        "finetune.optim.batch_size": 4,
        "finetune.eval_every": 2,
        "chained.max_steps": 2,
        "chained.optim.batch_size": 4,
        "chained.sensitivity_batches": 1,
        "chained.recall_passage": 8,  # recall probes: a gap of 32 in the 48-token rows
        "log_every": 1,
    }
    return base | extra
