"""System-scale families with random weights (``--model random:NAME``): a Llama of a named shape,
every layer converted to DSLA with the nested family's default options (the ``dsla-chained``
recipe's spec), untrained, in the order 0..n-1. For timing and memory only: quality is not measured.

- Built directly on the target device in its serving dtype (bfloat16 on CUDA, float32 on CPU),
  under a ``torch.device`` context, so the weights are materialised once; seeded.
- Tokenizer: a word-level one over the model's ids (``<unk>``, ``<s>``, ``</s>``, then ``w3`` ..
  ``w{vocab-1}``; no download), so the server streams text and takes text prompts such as
  ``"w5 w17"``. Replay prompts for these families are seeded random token ids (``random_tokens``),
  sent as token ids.

No torch at import: the command line lists the names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "random:"


@dataclass(frozen=True)
class RandomShape:
    """The shape of a random Llama."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    tie_embeddings: bool = False


SHAPES = {
    "tiny": RandomShape(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128, max_positions=16384, tie_embeddings=True),
    "llama2-7b": RandomShape(layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000, max_positions=4096),
}
"""Named shapes (``--model random:NAME``): ``tiny`` for tests; ``llama2-7b`` (Llama-2-7B's shape)."""


def is_random(name: str | None) -> bool:
    return str(name or "").startswith(PREFIX)


def random_shape(name: str) -> RandomShape:
    """The shape of ``random:NAME`` (ValueError naming the value and the valid names)."""
    key = str(name).removeprefix(PREFIX)
    if not is_random(name) or key not in SHAPES:
        raise ValueError(f"unknown random family {name!r}; valid: {', '.join(PREFIX + k for k in SHAPES)}")
    return SHAPES[key]


def dsla_spec(num_layers: int) -> dict:
    """The nested family's default DSLA spec (the dsla-chained recipe's) with the order 0..n-1."""
    from ..checks import read_yaml

    recipe = read_yaml(Path(__file__).resolve().parent.parent / "recipes" / "dsla-chained.yaml", "recipe")
    return {**recipe["spec"], "order": list(range(num_layers))}


def random_config(name: str):
    """The transformers LlamaConfig of ``random:NAME`` (no weights)."""
    from transformers import LlamaConfig

    shape = random_shape(name)
    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       head_dim=shape.hidden // shape.heads, max_position_embeddings=shape.max_positions, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=shape.tie_embeddings, bos_token_id=1, eos_token_id=2,
                       pad_token_id=None)  # fmt: skip


def build_random_family(name: str, device, *, seed: int = 0):
    """(model, tokenizer) of ``random:NAME`` on ``device`` (bfloat16 on CUDA, float32 otherwise),
    in eval mode, identical for identical seed."""
    import contextlib

    import torch
    from transformers import LlamaForCausalLM

    from ..convert import convert

    shape = random_shape(name)
    config = random_config(name)
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with rng, contextlib.ExitStack() as stack:
        torch.set_default_dtype(dtype)  # parameters are created in the serving dtype: no second copy
        stack.callback(torch.set_default_dtype, previous)
        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM(config)
        # outside the device context: the new layers draw their seeded initialisation from CPU
        # generators, then move to the teacher's device
        convert(model, dsla_spec(shape.layers))
    model.config.linearize_base_model = name
    logger.info("built %s: %d parameters, %s on %s", name, sum(p.numel() for p in model.parameters()), dtype, device)
    return model.eval(), word_tokenizer(shape.vocab)


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` ids: '<unk>', '<s>', '</s>', then 'w3' .. 'w{vocab-1}';
    eos '</s>', with the tiny test model's chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ..hub import TINY_CHAT_TEMPLATE

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def random_tokens(vocab: int, n: int = 1 << 16, *, seed: int = 0):
    """A seeded stream of ``n`` token ids in 3..vocab-1 (no special tokens): prompts for a random family."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=generator)
