"""The model runner: one forward over rows that each carry their own memory and conversion level.

A serving batch mixes requests at different conversion levels: at layer i, the rows whose level
converts i run the layer's converted attention on their recurrent state, the others run softmax
attention on their own keys and values. The runner drives the decoder layers itself (norm,
attention split by rows, residual, MLP), so every row keeps its own per-layer state
(``Sequence.states``) between calls, and requests join and leave the batch between steps.

Rows of one call share their chunk length (all decodes: 1 token each; a prefill chunk: one row).
States are merged into a batch for each layer and split back after it (copies; left padding of KV
is trimmed again), which is exact and simple; slot-indexed pools are the faster layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..layers.base import ConvertedAttention, project_qkv
from ..modeling import decoder_layers
from ..ops.softmax import softmax_attention
from ..ops.states import BatchState, KVState
from .levels import LevelMemory

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention backends the serving runners let SDPA choose from (not cuDNN: it builds a graph for
every new key length)."""


@dataclass
class Sequence:
    """One request's memory: a state per decoder layer (KV or the converted layer's state), the
    number of tokens it has consumed, and its conversion level."""

    states: list[BatchState | None]
    level: int = 0
    position: int = 0

    @classmethod
    def empty(cls, num_layers: int, level: int = 0) -> "Sequence":
        return cls([None] * num_layers, level, 0)

    def nbytes_by_kind(self) -> tuple[int, int]:
        """(bytes of softmax keys and values, bytes of converted layers' states) this request holds;
        a KV state's validity mask is bookkeeping and not counted (as in the memory formulas)."""
        kv = state_bytes = 0
        for state in self.states:
            if isinstance(state, KVState):
                kv += sum(t.numel() * t.element_size() for t in (state.keys, state.values))
            elif state is not None:
                state_bytes += state.nbytes()
        return kv, state_bytes

    def nbytes(self) -> int:
        """Bytes of every tensor this request holds (what the memory formulas count)."""
        return sum(self.nbytes_by_kind())


def _trim(state: KVState) -> KVState:
    """Drop the left padding a merge added (this row's real tokens are its last ``valid.sum()``)."""
    n = int(state.valid.sum())
    if n == state.keys.shape[2]:
        return state
    return KVState(keys=state.keys[:, :, -n:], values=state.values[:, :, -n:], valid=state.valid[:, -n:])


@dataclass
class Runner:
    """Runs a nested family (its ``order`` in ``levels``) row by row at each row's level."""

    model: torch.nn.Module
    levels: LevelMemory
    _layers: list = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._layers = list(decoder_layers(self.model))
        for i in self.levels.order:
            if not isinstance(self._layers[i].self_attn, ConvertedAttention):
                raise ValueError(f"layer {i} is in the conversion order but is not converted")

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def new_sequence(self, level: int = 0) -> Sequence:
        return Sequence.empty(self.num_layers, self.levels.check_level(level))

    def release(self, seq: Sequence | None) -> None:
        """Nothing to give back: a sequence's states are its own tensors, freed with it."""

    def close(self) -> None:
        """Nothing held beyond the sequences."""

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], ids: Tensor) -> Tensor:
        """Feed ``ids`` (B, T) to the B sequences (row b continues ``seqs[b]``); returns the logits of
        each row's last position (B, vocab), float32. Every sequence's states and position advance."""
        check_rows(seqs, ids)
        converted_rows = [self.levels.converted_layers(s.level) for s in seqs]

        def attention(i: int, attn, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            out = torch.empty_like(h)
            for converted, rows in zip((True, False), split_rows(converted_rows, i)):
                for part in _by_state(rows, seqs, i):
                    idx = on_device(part, ids.device)
                    o = self._attention(attn, h[idx], (cos[idx], sin[idx]), [seqs[r] for r in part], i, converted)
                    out.index_copy_(0, idx, o)
            return out

        return decoder_forward(self.model, self._layers, seqs, ids, next_positions(seqs, ids), attention)

    def _attention(self, attn, h: Tensor, pe: tuple[Tensor, Tensor], seqs: list[Sequence], i: int, converted: bool) -> Tensor:
        states = [s.states[i] for s in seqs]
        state = None if states[0] is None else type(states[0]).merge(states)
        b, t, _ = h.shape
        if converted:
            p = attn.project(h, pe)
            o, new = attn.attend(p, h, None, state, mode="hybrid")
        else:
            q, k, v, _, _ = project_qkv(attn, h, pe)
            o, new = softmax_attention(q, k, v, state=state, scale=attn.scaling)
        parts = new.split([1] * b)
        for s, part in zip(seqs, parts):
            s.states[i] = _trim(part) if isinstance(part, KVState) else part
        return attn.o_proj(o.transpose(1, 2).reshape(b, t, -1).to(h.dtype))


MASK_ALIGN = 16
"""Attention masks are laid out with rows of a multiple of this many elements (what SDPA's
memory-efficient kernel wants; it copies and pads other masks on every call)."""


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``allowed`` (..., L) bool, -inf elsewhere, in ``dtype``, its rows padded in memory to a
    multiple of MASK_ALIGN: SDPA's memory-efficient kernel takes it as it is (a boolean mask, or an
    unaligned one, is converted and padded again by every layer's call)."""
    length = allowed.shape[-1]
    aligned = -(-length // MASK_ALIGN) * MASK_ALIGN
    m = allowed.new_full((*allowed.shape[:-1], aligned), float("-inf"), dtype=dtype)[..., :length]
    return m.masked_fill_(allowed, 0.0)


def on_device(values, device, dtype=torch.long) -> Tensor:
    """``torch.tensor(values)`` on ``device`` without making the host wait: on CUDA copied from pinned
    memory without blocking (a copy from pageable memory waits for all the device's queued work, which
    would undo the overlap of a step's decode and prefill launches)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def check_rows(seqs, ids: Tensor) -> None:
    """ValueError unless ``ids`` is (rows, tokens) with one row per sequence."""
    if ids.dim() != 2 or ids.shape[0] != len(seqs):
        raise ValueError(f"ids must be (rows, tokens) with one row per sequence; got {tuple(ids.shape)} for {len(seqs)} sequences")


def split_rows(converted_rows: list[set[int] | frozenset[int]], i: int) -> tuple[list[int], list[int]]:
    """(rows whose level converts layer i, rows that run it as softmax)."""
    return ([r for r, c in enumerate(converted_rows) if i in c], [r for r, c in enumerate(converted_rows) if i not in c])


def next_positions(seqs, ids: Tensor) -> Tensor:
    """(B, T) positions of ``ids`` (B, T): row b continues ``seqs[b]`` from ``seqs[b].position``."""
    start = on_device([s.position for s in seqs], ids.device)  # (B,)
    return start[:, None] + torch.arange(ids.shape[1], device=ids.device)


def decoder_forward(model, layers, seqs, ids: Tensor, positions: Tensor, attention, last: Tensor | None = None) -> Tensor:
    """The decoder stack both runners drive: embed ``ids`` (B, T) at ``positions`` (B, T; see
    ``next_positions``), then per layer norm, ``attention(i, self_attn, h, cos, sin)`` (its output
    after o_proj, (B, T, hidden); the runner's own row grouping and memory), residual and MLP; advance
    every sequence's position by T. Returns each row's last-position logits (B, vocab), float32, or
    those at position ``last`` (a one-element device tensor: a padded chunk's last token)."""
    base = model.model
    t = ids.shape[1]
    x = base.embed_tokens(ids)  # (B, T, hidden)
    cos, sin = base.rotary_emb(x, positions)
    for i, layer in enumerate(layers):
        x = x + attention(i, layer.self_attn, rms_norm(layer.input_layernorm, x), cos, sin)
        x = x + layer.mlp(rms_norm(layer.post_attention_layernorm, x))
    for s in seqs:
        s.position += t
    x = x[:, -1] if last is None else x.index_select(1, last.reshape(1)).squeeze(1)
    return model.lm_head(rms_norm(base.norm, x)).float()  # (B, vocab)


def rms_norm(norm, x: Tensor) -> Tensor:
    """``norm(x)``; for a Llama RMSNorm on CUDA through torch's fused RMSNorm kernel (one launch where
    the module runs six: float32 cast, square, mean, rsqrt, scale, cast back), then the module's own
    weight multiply, in the same order and dtypes as the module (the normalised rows are computed in
    float32 and cast to x's dtype before the weight)."""
    if x.is_cuda and type(norm) is LlamaRMSNorm:
        return norm.weight * F.rms_norm(x, (x.shape[-1],), eps=norm.variance_epsilon)
    return norm(x)


def _by_state(rows: list[int], seqs: list[Sequence], i: int) -> list[list[int]]:
    """Rows split into those with and without a state at layer i (a first chunk has none)."""
    fresh = [r for r in rows if seqs[r].states[i] is None]
    held = [r for r in rows if seqs[r].states[i] is not None]
    return [part for part in (fresh, held) if part]
