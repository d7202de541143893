"""Greedy decoding on static buffers, captured once as a CUDA graph (the gpt-fast pattern).

    decoder = StaticDecoder(model, batch_size=8, max_length=4096)
    tokens = decoder.generate(input_ids, max_new_tokens=256)     # (B, 256)

A decode step reads and writes only buffers allocated before the first token: the step's token and
position, every layer's memory, the next token. So the same kernels run at every token, and on CUDA
the whole step (embedding, RoPE, every layer, final norm, lm_head, argmax) is captured once after
two eager warm-up steps and replayed per token: no Python, no kernel launches on the host.

Each layer's memory:
- softmax (an unconverted attention layer, or a converted one in mode 'teacher'): keys and values
  in (B, Hkv, max_length, D) buffers. A step writes its slot, then, where the fused kernels run
  (CUDA) and the prompt has no padding, reads each row's keys up to its slot with the
  flash-decoding kernel (``ops.softmax.slot_attention``, the buffers read as a pool of one slot per
  row; ``ops.softmax.DECODE_FLASH``); otherwise it attends over the whole buffer with the slots
  after its position masked, as gpt-fast does (its cost that of ``max_length`` tokens), query heads
  reading their KV head's keys through a grouped matmul (no repeated KV heads).
  ``StaticDecoder.softmax_path`` says which.
- converted: the layer's per-token decode path (``decode_step``) on its state in static form
  (``ConvertedAttention.static_decoding``: every index a device tensor), updated in place. Layers
  without one (the diagnostic modes sinks_only and none) raise: they decode through ``model.generate()``.

Where a layer's q/k/v projections (and its MLP's gate and up projections) are plain linear layers,
the step runs them as one matmul over their weights stacked once at prefill (``fused_weights``;
``fuse_projections=False`` keeps them apart): fewer, larger kernels, which is what a step at batch 1
is bound by. A decoder therefore decodes with the weights the model had at its last prefill.

The prompt is prefilled by the model's own forward (its fast prefill paths), then each layer's
memory is moved into the static buffers. Prompts of different lengths come left-padded with their
attention mask (each row continues from its own length); a single prompt row is repeated to the batch. Decoding matches the model's forward on the whole sequence
(tested); it takes no gradients and changes no weights.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache

from .cache import StateCacheLayer, cache_kwargs, state_layer
from .checks import check_int
from .layers.base import FUSED_QKV, ConvertedAttention, frozen_derived, project_qkv
from .modeling import decoder_layers
from .ops import fused_decode
from .ops import softmax as softmax_ops
from .ops.states import BatchState, DecodeClock
from .runtime import check_length

logger = logging.getLogger(__name__)

WARMUP_STEPS = 2
"""Eager steps before the CUDA graph is captured (they allocate what the step needs and let the
kernels pick their configurations); they are real steps: their tokens are kept."""


@dataclass
class _SoftmaxMemory:
    """A softmax layer's keys and values in static buffers (B, Hkv, max_length, D)."""

    keys: Tensor
    values: Tensor

    def step(self, attn: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, slot: Tensor, blocked: Tensor | None,
             flash: tuple[Tensor, Tensor] | None = None) -> Tensor:  # fmt: skip
        """The layer's attention output (B, 1, hidden) for ``h`` (B, 1, hidden) written at buffer
        ``slot`` (1,); ``blocked`` (B, 1, 1, max_length) marks the slots a row does not read (after
        ``slot``, and its prompt's padding). ``flash``: (rows (B,), lengths (B,)) to read each row's
        first ``lengths`` slots with the flash-decoding kernel instead (no padding; ``blocked`` None)."""
        q, k, v, _, _ = project_qkv(attn, h, (cos, sin))  # (B, Hq, 1, D), (B, Hkv, 1, D) x 2
        self.keys.index_copy_(2, slot, k.to(self.keys.dtype))
        self.values.index_copy_(2, slot, v.to(self.values.dtype))
        b, hkv, _, d = self.keys.shape
        hq = q.shape[1]
        if flash is not None:
            o = softmax_ops.slot_attention(q[:, :, 0].to(self.keys.dtype), self.keys, self.values, *flash, attn.scaling)  # (B, Hq, Dv)
            return attn.o_proj(o.reshape(b, 1, -1).to(h.dtype))
        scores = torch.matmul(q.reshape(b, hkv, hq // hkv, d).to(self.keys.dtype), self.keys.transpose(-1, -2))  # (B, Hkv, n_rep, L)
        weights = (scores.float() * attn.scaling).masked_fill_(blocked, float("-inf")).softmax(dim=-1)
        o = torch.matmul(weights.to(self.values.dtype), self.values)  # (B, Hkv, n_rep, D)
        return attn.o_proj(o.reshape(b, 1, hq * d).to(h.dtype))


class StaticSlot:
    """What a converted layer's ``decode_step`` reads of its cache slot, for static decoding: the
    decode state, and an ``advance`` that counts nothing (no Python value changes from step to step,
    so a compiled step is not recompiled and a replayed one misses nothing)."""

    def __init__(self, decode_state) -> None:
        self.decode_state = decode_state

    def advance(self, decode_state, new_positions: int) -> None:
        return None


def _softmax_layer(attn: nn.Module) -> bool:
    """Whether the layer's attention runs softmax over plain keys and values (the teacher's, a
    converted layer in mode 'teacher', or the 'softmax' kind)."""
    return not isinstance(attn, ConvertedAttention) or attn.mode == "teacher" or (attn.spec.attention, attn.mode) == ("softmax", "hybrid")


def _prefilled_kv(cache, i: int) -> tuple[Tensor, Tensor]:
    """Layer i's keys and values (B, Hkv, T, D) after the prefill: a transformers cache layer's, or
    the KVState of the 'softmax' kind (a prompt has no padding: every slot is real)."""
    layer = cache.layers[i]
    if isinstance(layer, StateCacheLayer):
        return layer.state.keys, layer.state.values
    return layer.keys, layer.values


class StaticDecoder:
    """Greedy decoding of ``batch_size`` rows up to ``max_length`` tokens (prompt included), every
    step on static buffers; ``graphs`` (default: on CUDA) captures the step as a CUDA graph;
    ``compile``: the step goes through ``torch.compile`` first (fused elementwise kernels: norms,
    RoPE, state updates), compiled during the second warm-up step (the first runs eagerly and keeps
    the weights the layers stack, e.g. both feature maps' and gates': the compiled step reads them
    as they are, ``layers.base.frozen_derived``, instead of stacking them again every token). ``fuse_projections``: q/k/v and
    gate/up each as one matmul over weights stacked at prefill (a copy of those weights: about two
    thirds of a Llama's; turn it off where memory, not launches, bounds the step)."""

    def __init__(self, model, *, batch_size: int, max_length: int, graphs: bool | None = None, compile: bool = False,
                 fuse_projections: bool = True) -> None:
        check_int("batch_size", batch_size, 1)
        check_int("max_length", max_length, 2)
        check_length(model, max_length)
        self.model = model
        self.batch_size, self.max_length = batch_size, max_length
        self.device = next(model.parameters()).device
        if graphs is None:
            graphs = self.device.type == "cuda"
        if graphs and self.device.type != "cuda":
            raise ValueError(f"graphs=True needs a CUDA device; the model is on {self.device}")
        self.graphs = graphs
        self.compiled = compile
        self.fuse_projections = fuse_projections
        # the compiled step takes the decoder as its argument: a bound method kept on the decoder would
        # make a reference cycle, and a dropped decoder would hold its buffers until the cycle collector ran
        self._compiled_step = torch.compile(_decode_step, dynamic=False) if compile else None
        self.layers = list(decoder_layers(model))
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if not _static_layer(attn):
                raise ValueError(f"layer {i} ({attn.spec.attention}, mode {attn.mode!r}) has no static decode step; "
                                 "decode it with model.generate() (kinds with one: hybrid, dsla and lola, in their attention modes)")
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)  # (B, 1) the step's input
        self.position = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # (B,) each row's position (RoPE)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # the buffer slot the step writes (all rows)
        self.slots = torch.arange(max_length, device=self.device)
        self.rows = torch.arange(batch_size, device=self.device)  # each row its own slot of the softmax buffers (flash-decoding)
        self.flash = False  # whether the softmax layers read their buffers with the flash-decoding kernel (set at prefill)
        self._masked = False  # whether a softmax layer reads its buffers through the masked matmul (set at prefill)
        self.clock = DecodeClock(self.device)  # the tokens decoded since the prefill, read by the layers' static states
        self.padding = torch.zeros(batch_size, max_length, dtype=torch.bool, device=self.device)  # (B, L) prompt padding
        self.logits = torch.zeros(batch_size, model.config.vocab_size, device=self.device, dtype=model.dtype)
        """(B, vocab) in the model's dtype: the logits the last token came from (prefill's or the last
        step's). An uncompiled step's lm_head writes them here itself (``_head``): at a large batch a
        copy of them, let alone one in float32, is a pass over the largest activation of the step."""
        self.memory: list[_SoftmaxMemory | StaticSlot] = []
        self.fused: list[FusedWeights] = []
        self.length = 0
        self._steps = 0
        self._graph = None

    # --- prefill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Run the prompts ``input_ids`` (B or 1, T; one row is repeated to the batch) through the
        model, move every layer's memory into static buffers; returns the first new token (B,).
        ``attention_mask`` (B, T; 1 real, 0 padding): prompts of different lengths, padded on the
        left (each row then continues from its own length)."""
        if input_ids.dim() != 2 or input_ids.shape[0] not in (1, self.batch_size):
            raise ValueError(f"input_ids must be (1 or {self.batch_size}, tokens); got {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if not 1 <= t < self.max_length:
            raise ValueError(f"the prompt has {t} tokens; it must have 1 to {self.max_length - 1} (max_length {self.max_length})")
        ids = input_ids.to(self.device)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(self.device).long()
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; expected that of input_ids {tuple(ids.shape)}")
        if not bool((mask[:, 1:] >= mask[:, :-1]).all() & (mask[:, -1] == 1).all()):
            raise ValueError("attention_mask must pad on the left (each row: zeros, then ones, ending in a real token)")
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
        self.flash = softmax_ops.DECODE_FLASH and fused_decode.enabled(self.logits) and bool(mask.all())
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                         **cache_kwargs(cache))  # fmt: skip
        repeat = self.batch_size if ids.shape[0] == 1 and self.batch_size > 1 else 1
        dtype = self.model.dtype
        self.memory = []
        self.clock.reset()
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if _softmax_layer(attn):
                keys, values = _prefilled_kv(cache, i)
                shape = (self.batch_size, keys.shape[1], self.max_length, keys.shape[-1])
                mem = _SoftmaxMemory(keys.new_zeros(shape, dtype=dtype), values.new_zeros(shape, dtype=dtype))
                mem.keys[:, :, :t] = keys
                mem.values[:, :, :t] = values
            else:
                mem = StateCacheLayer()
                prefilled = state_layer(cache, i)
                state = prefilled.state
                mem.store(state.select([0] * repeat) if repeat > 1 else state, t)
                if not attn.static_decoding(mem, self.batch_size, self.device, dtype, clock=self.clock):
                    raise ValueError(f"layer {i} ({attn.spec.attention}) has no static decode step in mode {attn.mode!r}")
                mem = StaticSlot(mem.decode_state)
            self.memory.append(mem)
        self._masked = not self.flash and any(isinstance(mem, _SoftmaxMemory) for mem in self.memory)
        self.fused = [fused_weights(layer) if self.fuse_projections else FusedWeights() for layer in self.layers]
        self.length, self._steps, self._graph = t, 0, None
        self.logits.copy_(out.logits[:, -1].expand(self.batch_size, -1))
        self.token.copy_(self.logits.argmax(dim=-1, keepdim=True))
        self.position.copy_(mask.sum(dim=1).expand(self.batch_size))
        self.slot.fill_(t)
        self.padding.zero_()
        self.padding[:, :t] = (mask == 0).expand(self.batch_size, -1)
        return self.token[:, 0].clone()

    # --- the step ----------------------------------------------------------------------------
    def _step(self) -> None:
        """Feed ``token`` at ``position``; write the next token into ``token`` and advance ``position``."""
        base = self.model.model
        x = base.embed_tokens(self.token)  # (B, 1, hidden)
        cos, sin = base.rotary_emb(x, self.position.clone().view(self.batch_size, 1))  # a copy, not a view of a buffer the step changes
        flash = (self.rows, (self.slot + 1).expand(self.batch_size).contiguous()) if self.flash else None  # each row's keys: slots 0 .. slot
        blocked = None  # the slots each row does not read, for softmax layers on the masked matmul only: (B, L), a pass of its own
        if self._masked:
            blocked = ((self.slots > self.slot) | self.padding).view(self.batch_size, 1, 1, self.max_length)  # (B, 1, 1, L)
        for layer, mem, fused in zip(self.layers, self.memory, self.fused):
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            if isinstance(mem, _SoftmaxMemory):
                a = mem.step(attn, h, cos, sin, self.slot, blocked, flash)
            else:
                o = attn.decode_step(h, (cos, sin), mem)  # (B, Hq, 1, D)
                a = attn.o_proj(o.transpose(1, 2).reshape(self.batch_size, 1, -1).to(h.dtype))
            x = x + a
            x = x + fused.mlp(layer.mlp, layer.post_attention_layernorm(x))
        self._head(base.norm(x)[:, 0])
        self.token.copy_(self.logits.argmax(dim=-1, keepdim=True))
        self.position.add_(1)
        self.slot.add_(1)
        self.clock.advance()

    def _head(self, h: Tensor) -> None:
        """``logits`` = lm_head(h) for the final hidden states ``h`` (B, hidden): a plain linear head
        without a bias in the logits' dtype writes them in place (one GEMM, no copy) outside
        ``torch.compile``; any other head (or a compiled step) is applied and its output copied."""
        head = self.model.lm_head
        if type(head) is torch.nn.Linear and head.bias is None and h.dtype == head.weight.dtype == self.logits.dtype \
                and not torch.compiler.is_compiling():  # fmt: skip
            torch.mm(h, head.weight.t(), out=self.logits)
        else:
            self.logits.copy_(head(h))

    @torch.inference_mode()
    def step(self) -> Tensor:
        """One token for every row: the next token (B,) after feeding the current one."""
        if not self.memory:
            raise RuntimeError("prefill a prompt before decoding")
        if self.length >= self.max_length:
            raise RuntimeError(f"max_length {self.max_length} reached; make a decoder with a larger max_length")
        if self._graph is not None:
            self._graph.replay()
        else:
            with lent_projections(self.layers, self.fused), frozen_derived():
                if self.graphs and self._steps >= WARMUP_STEPS:
                    self._capture()
                    self._graph.replay()
                elif self.compiled and self._steps == 0:
                    self._step()  # eager: keeps the stacked weights the compiled step then reads as inputs
                elif self.compiled and self._steps == 1:
                    self._first_compiled_step()
                else:
                    self._run_step()
        self._steps += 1
        self.length += 1
        return self.token[:, 0].clone()

    def _first_compiled_step(self) -> None:
        """The first step, which compiles: where the compiler fails (the step has not run then), the
        decoder logs why and goes on with the step uncompiled (still captured as a graph on CUDA)."""
        from torch._dynamo.exc import BackendCompilerFailed

        try:
            self._run_step()
        except BackendCompilerFailed as err:
            logger.warning("torch.compile failed on the decode step (batch %d): %s; decoding uncompiled",
                           self.batch_size, str(err).splitlines()[0][:300])  # fmt: skip
            self.compiled, self._compiled_step = False, None
            self._step()

    def _run_step(self) -> None:
        """The step, compiled or not."""
        if self._compiled_step is None:
            self._step()
        else:
            self._compiled_step(self)

    def _capture(self) -> None:
        """Record one step (nothing runs: the warm-up steps were real ones)."""
        self._graph = cuda_graph(self._run_step, self.device, warmup=0)
        logger.info("decode step captured as a CUDA graph (batch %d, max_length %d)", self.batch_size, self.max_length)

    @property
    def softmax_path(self) -> str | None:
        """How the softmax layers read their buffers since the last prefill: "flash-decoding" or
        "matmul" (the scores' GEMM and a masked softmax over the whole buffer); None without softmax
        layers (or before a prefill)."""
        if not any(isinstance(m, _SoftmaxMemory) for m in self.memory):
            return None
        return "flash-decoding" if self.flash else "matmul"

    def nbytes_by_layer(self) -> dict[int, int]:
        """Bytes of every layer's memory (the static buffers: softmax layers' keys and values for
        ``max_length`` tokens, converted layers' decode states)."""
        def nbytes(value) -> int:
            if isinstance(value, Tensor):
                return value.numel() * value.element_size()
            return value.nbytes() if isinstance(value, BatchState) else 0

        return {i: sum(nbytes(v) for v in vars(mem if isinstance(mem, _SoftmaxMemory) else mem.decode_state).values())
                for i, mem in enumerate(self.memory)}  # fmt: skip

    @torch.inference_mode()
    def generate(self, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None) -> Tensor:
        """Prefill ``input_ids`` (``attention_mask``: as ``prefill``) and decode greedily: the
        ``max_new_tokens`` new tokens (B, n)."""
        check_int("max_new_tokens", max_new_tokens, 1)
        if input_ids.shape[-1] + max_new_tokens > self.max_length:
            raise ValueError(f"{input_ids.shape[-1]} prompt tokens + {max_new_tokens} new exceed max_length {self.max_length}")
        out = [self.prefill(input_ids, attention_mask)]
        for _ in range(max_new_tokens - 1):
            out.append(self.step())
        return torch.stack(out, dim=1)


@dataclass
class FusedWeights:
    """One decoder layer's projections stacked for a decode step: q/k/v as (weight, bias, sizes) and
    the MLP's gate and up as one weight; None where the layer's modules are not plain linear layers
    (e.g. LoRA adapters not merged), which then run as they are."""

    qkv: tuple[Tensor, Tensor | None, tuple[int, int, int]] | None = None
    gate_up: Tensor | None = None

    def mlp(self, mlp: nn.Module, x: Tensor) -> Tensor:
        """The layer's MLP on ``x``: down(act(gate x) * up x), gate and up as one matmul when stacked."""
        if self.gate_up is None:
            return mlp(x)
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)


def _plain(*modules) -> bool:
    return all(type(m) is nn.Linear for m in modules)


@torch.no_grad()
def fused_weights(layer: nn.Module) -> FusedWeights:
    """The stacked projections of a Llama-style decoder layer (copies of its current weights)."""
    attn, mlp = layer.self_attn, layer.mlp
    out = FusedWeights()
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if _plain(*projections) and len({p.bias is None for p in projections}) == 1:
        bias = None if projections[0].bias is None else torch.cat([p.bias for p in projections])
        out.qkv = (torch.cat([p.weight for p in projections]), bias, tuple(p.out_features for p in projections))
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if _plain(gate, up) and gate.bias is None and up.bias is None and gate.out_features == up.out_features and hasattr(mlp, "act_fn"):
        out.gate_up = torch.cat([gate.weight, up.weight])
    return out


@contextlib.contextmanager
def lent_projections(layers: list[nn.Module], fused: list[FusedWeights]) -> Iterator[None]:
    """Within the block, each layer's attention projects q/k/v through its stacked weights
    (``linearize.layers.base.FUSED_QKV``); the attribute is removed after, whatever happens."""
    lent = []
    try:
        for layer, f in zip(layers, fused):
            if f.qkv is not None:
                layer.self_attn.__dict__[FUSED_QKV] = f.qkv
                lent.append(layer.self_attn)
        yield
    finally:
        for attn in lent:
            attn.__dict__.pop(FUSED_QKV, None)


def _decode_step(decoder: StaticDecoder) -> None:
    """``decoder``'s step, as a function of the decoder (what ``torch.compile`` compiles)."""
    decoder._step()


def cuda_graph(fn: Callable[[], object], device: torch.device, *, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` (no arguments: it reads and writes static buffers) recorded as a CUDA graph after
    ``warmup`` calls, on a side stream as capture needs (the warm-up calls run; the recorded one does
    not). ``graph.replay()`` runs its kernels again."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _static_layer(attn: nn.Module) -> bool:
    return _softmax_layer(attn) or attn.has_static_decoding()


def static_decoding_supported(model) -> bool:
    """Whether every layer of ``model`` can decode on static buffers (``StaticDecoder``) in its current mode."""
    return all(_static_layer(layer.self_attn) for layer in decoder_layers(model))

