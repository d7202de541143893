"""Text generation with the model's cache, reporting speed and the memory a request holds."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .cache import cache_nbytes, output_cache
from .checks import check_text


DECODERS = ("auto", "static", "generate")
"""How ``generate_text`` decodes: "static" (``linearize.decoding.StaticDecoder``: static buffers, each
step one CUDA graph replay on CUDA), "generate" (``model.generate()`` with the model's cache), "auto"
(static on CUDA where every layer has a static decode step in its mode, else generate: on CPU the
cache path's fused C kernels decode faster than the static step's PyTorch operations)."""


@dataclass
class GenerationResult:
    text: str
    context_tokens: int  # prompt + generated tokens the cache has seen
    new_tokens: int
    seconds: float
    memory_bytes: int  # KV + state bytes the request holds at the end
    memory_by_layer: dict[int, int] = field(default_factory=dict)
    decoder: str = "generate"  # "static" or "generate": how the tokens were decoded

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows -> (input_ids, attention_mask), both (B, P), padded on the left for generation."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    check_text("prompt", prompt)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens: give some text (or use the chat template)")
    return ids


def text_streamer(tokenizer, on_text: Callable[[str], None]):
    """A transformers streamer handing ``on_text`` the new text of the answer as tokens are generated
    (whole words where the tokenizer needs the next token to finish one; the prompt is skipped)."""
    from transformers import TextStreamer

    class _Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                on_text(text)

    return _Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def eos_token_ids(model, tokenizer=None) -> frozenset[int]:
    """The ids that end a generation: the model's generation config's, else its config's, else the
    tokenizer's (when given); none when none of them names one."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return frozenset() if eos is None else frozenset(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def _static_generate(model, tokenizer, input_ids, max_new_tokens: int, streamer) -> tuple[list[int], dict[int, int]]:
    """Greedy tokens (up to and including an end-of-sequence token) from a StaticDecoder, and the bytes
    each layer's static memory holds."""
    from .decoding import StaticDecoder

    eos = eos_token_ids(model, tokenizer)
    decoder = StaticDecoder(model, batch_size=1, max_length=input_ids.shape[1] + max_new_tokens)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # the prompt: skipped
    token = decoder.prefill(input_ids)
    new = []
    while True:
        new.append(int(token[0]))
        if streamer is not None:
            streamer.put(torch.tensor([new[-1]]))
        if new[-1] in eos or len(new) == max_new_tokens:
            break
        token = decoder.step()
    if streamer is not None:
        streamer.end()
    return new, decoder.nbytes_by_layer()


@torch.inference_mode()
def generate_text(model, tokenizer, prompt: str, *, max_new_tokens: int = 64, chat: bool = True,
                  on_text: Callable[[str], None] | None = None, decoder: str = "auto") -> GenerationResult:
    """Greedy generation of one prompt; memory is what the request holds after the last token.
    ``on_text``: called with each new piece of the answer as it is generated. ``decoder``: one of
    ``DECODERS`` (both decoders give the same tokens: the static one is the fast path)."""
    from .checks import check_choice
    from .decoding import static_decoding_supported

    check_choice("decoder", decoder, DECODERS)
    device = next(model.parameters()).device
    static = decoder == "static" or (decoder == "auto" and device.type == "cuda" and static_decoding_supported(model))
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    input_ids = torch.tensor([ids], device=device)
    streamer = None if on_text is None else text_streamer(tokenizer, on_text)
    start = time.perf_counter()
    if static:
        new, by_layer = _static_generate(model, tokenizer, input_ids, max_new_tokens, streamer)
        seconds = time.perf_counter() - start
        return GenerationResult(
            text=tokenizer.decode(new, skip_special_tokens=True).strip(), context_tokens=len(ids) + len(new), new_tokens=len(new),
            seconds=seconds, memory_bytes=sum(by_layer.values()), memory_by_layer=by_layer, decoder="static",
        )  # fmt: skip
    out = model.generate(
        input_ids,
        streamer=streamer,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    seconds = time.perf_counter() - start
    new = out.sequences[0, input_ids.shape[1]:]
    by_layer = cache_nbytes(output_cache(out))
    return GenerationResult(
        text=tokenizer.decode(new, skip_special_tokens=True).strip(),
        context_tokens=int(out.sequences.shape[1]),
        new_tokens=int(new.numel()),
        seconds=seconds,
        memory_bytes=sum(by_layer.values()),
        memory_by_layer=by_layer,
    )
