"""What every converted attention kind shares.

Each converted module takes the place of a decoder layer's ``self_attn`` and reuses the teacher's
q/k/v/o projections (the same nn.Linear objects, not copies). ``ConvertedAttention`` does what every
kind shares: project, RoPE, padding mask, reading/writing this layer's state in the cache, the generic
diagnostic modes. A kind's subclass (one file per kind: softmax.py, hybrid.py, lola.py, dsla.py) adds
its parameters and maps each of its modes to an op call; ``KindOptions`` is the base of a kind's own
spec fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import cache_argument, fast_decoding, state_layer
from ..ops.feature_maps import hedgehog_pair
from ..ops.rope import apply_rope
from ..ops.softmax import sinks_attention, zero_attention
from ..ops.states import BatchState, KVState

logger = logging.getLogger(__name__)

N_SINKS = 8
GENERIC_MODES = ("sinks_only", "none", "teacher")
"""Modes every converted layer supports: the HedgeCATs component diagnostics (sinks_only, none) and
'teacher' (the layer runs the teacher's original attention with plain KV; its new parameters stay,
inactive: nested conversions and run-time conversion switch layers this way)."""
STATE_BYTES = 4
"""Recurrent states are kept in float32 (the memory formulas count them at this size)."""


class SpecError(ValueError):
    """A bad conversion spec value (message names the value and the valid choices)."""


class KindOptions:
    """Base of a kind's own spec fields (a dataclass per kind, validated in ``__post_init__``)."""

    def check_head_dim(self, head_dim: int) -> None:
        """Raise a ValueError when these options cannot serve heads of ``head_dim`` (default: any)."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """Everything the package knows about one attention kind, in one record.

    Registered once in ``linearize.layers.registry.KINDS``; the spec, conversion, mode lists, memory
    formula, ablations and diagnostics all look it up there."""

    name: str
    """The spec's ``attention`` value."""
    layer: type
    """The ConvertedAttention subclass that runs it."""
    options: type
    """Its own spec fields: a KindOptions dataclass (fields a kind lacks are errors, not ignored)."""
    state: type
    """The BatchState its mode 'hybrid' keeps in the cache."""
    modes: tuple[str, ...]
    """Its own component modes ('hybrid' first); every layer also has GENERIC_MODES."""
    ablation_modes: tuple[str, ...]
    """The modes ``linearize ablate`` runs by default."""
    memory: Callable[[Any, Any, int], tuple[int, int]]
    """(options, model config, KV bytes per element) -> (bytes per token, fixed bytes) one request holds."""
    diagnostics: tuple[str, ...] = ()
    """Diagnostic plots that apply (names from ``linearize.eval.plots.DIAGNOSTICS``)."""
    description: str = ""

    def make_options(self, values: dict[str, Any] | None = None):
        """The kind's options from field values (unknown fields raise SpecError naming the valid ones)."""
        values = dict(values or {})
        fields = self.options.field_names()
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise SpecError(f"field(s) {unknown} do not apply to attention {self.name!r}; "
                            f"its fields: {', '.join(fields) or 'none'}")
        return self.options(**values)


def has_two_gates(module: nn.Module) -> bool:
    """Layers with a history and a recent gate (DSLA's ``log_gates``): gate similarity and gate plots apply."""
    return callable(getattr(module, "log_gates", None))


def head_sizes(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a model config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, config.num_key_value_heads, head_dim



class Projection(NamedTuple):
    """A layer's projected inputs: q (B, Hq, T, D), k and v (B, Hkv, T, D), RoPE applied to q and k;
    q_lin and k_lin are what the linear part's feature maps see: the same tensors as q and k, or
    q and k before RoPE when the spec's ``linear_rope`` is false."""

    q: Tensor
    k: Tensor
    v: Tensor
    q_lin: Tensor
    k_lin: Tensor

    @property
    def separate(self) -> bool:
        """Whether the feature maps see other tensors than the softmax (q_lin is not q)."""
        return self.q_lin is not self.q

    def map(self, fn: Callable[[Tensor], Tensor]) -> "Projection":
        """``fn`` applied to every tensor; q_lin/k_lin stay the same objects as q/k when they were."""
        q, k, v = fn(self.q), fn(self.k), fn(self.v)
        if not self.separate:
            return Projection(q, k, v, q, k)
        return Projection(q, k, v, fn(self.q_lin), fn(self.k_lin))


Attend = Callable[[Projection, Tensor, Tensor | None, BatchState | None], tuple[Tensor, BatchState | None]]


def key_padding_from_mask(attention_mask: Tensor | None, query_length: int) -> Tensor | None:
    """(B, T) bool of real tokens among the current ``query_length`` positions, from the mask the
    model passes to its attention layers: None (no padding), a 2D (B, KV) padding mask, or a 4D
    (B, 1, Q, KV) bool / additive float mask whose last query row is a real token or padding that
    sees every earlier key: either way its row marks exactly the non-padding keys."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -query_length:].bool()
    if attention_mask.dim() == 4:
        row = attention_mask[:, 0, -1, -query_length:]  # (B, T)
        return row if row.dtype == torch.bool else row == 0
    raise ValueError(f"unsupported attention mask of shape {tuple(attention_mask.shape)}; expected 2D or 4D")


KERNELS = ("auto", "torch", "fla")


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """'auto' -> 'fla' on CUDA when flash-linear-attention is installed, else 'torch'."""
    if kernel != "auto":
        return kernel
    if device.type == "cuda" and importlib.util.find_spec("fla") is not None:
        return "fla"
    return "torch"


FUSED_QKV = "fused_qkv"
"""The attribute under which a static decoder lends an attention module its q/k/v weights stacked,
(weight, bias or None, (q, k, v) output sizes), for the duration of a step (``linearize.decoding``)."""


def qkv_heads(attn: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, Hq, T, D), k and v (B, Hkv, T, D) before RoPE: the three projections, or one matmul over
    the stacked weights when a static decoder lends them (``FUSED_QKV``)."""
    b, t, _ = hidden_states.shape
    d = attn.head_dim
    fused = attn.__dict__.get(FUSED_QKV)
    if fused is not None:
        q, k, v = F.linear(hidden_states, fused[0], fused[1]).split(fused[2], dim=-1)
    else:
        q, k, v = attn.q_proj(hidden_states), attn.k_proj(hidden_states), attn.v_proj(hidden_states)
    return tuple(x.view(b, t, -1, d).transpose(1, 2) for x in (q, k, v))  # type: ignore[return-value]


def project_qkv(attn: nn.Module, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor]):
    """(q, k, v, q_pre, k_pre) of an attention module with ``q_proj``/``k_proj``/``v_proj`` and
    ``head_dim`` (the teacher's or a converted one): q (B, Hq, T, D), k and v (B, Hkv, T, D), RoPE
    applied to q and k (one kernel each on the GPU at inference: ``ops.rope``); q_pre and k_pre
    before RoPE."""
    q_pre, k_pre, v = qkv_heads(attn, hidden_states)
    q, k = apply_rope(q_pre, k_pre, *position_embeddings)
    return q, k, v, q_pre, k_pre


class ConvertedAttention(nn.Module):
    """Shared part of every converted attention kind; subclasses define ``attend_modes``.

    ``spec`` is the layer's LayerSpec (``spec.attention`` names the kind, ``spec.options`` holds the
    kind's own fields)."""

    separate_linear_inputs = False
    """Whether the linear part's feature maps see q/k before RoPE (kinds with a ``linear_rope`` option)."""

    def __init__(self, teacher: nn.Module, spec, layer_idx: int, config) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = teacher.q_proj, teacher.k_proj, teacher.v_proj, teacher.o_proj
        object.__setattr__(self, "teacher", teacher)  # kept outside the module tree: no duplicate weights
        self.layer_idx = layer_idx
        self.head_dim = teacher.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = teacher.scaling
        self.spec = spec
        self.mode = "hybrid"

    @property
    def options(self):
        """This layer's kind-specific spec fields (``spec.options``)."""
        return self.spec.options

    # --- modes -------------------------------------------------------------------------------
    def attend_modes(self) -> dict[str, Attend]:
        """Kind-specific modes: name -> fn(projection, x, valid, state) -> (out, state)."""
        raise NotImplementedError

    def attention_weights(self, p: Projection, valid: Tensor | None, branches: str = "both") -> Tensor:
        """(B, Hq, T, T) normalised attention weights, for kinds that have them (see ``has_weights``)."""
        raise NotImplementedError(f"attention {self.spec.attention!r} has no normalised attention weights")

    @property
    def has_weights(self) -> bool:
        """Whether ``attention_weights`` exists for this kind (weight-transfer objectives need it)."""
        return type(self).attention_weights is not ConvertedAttention.attention_weights

    def modes(self) -> tuple[str, ...]:
        return tuple(self.attend_modes()) + GENERIC_MODES

    def check_mode(self, mode: str) -> None:
        """ValueError naming ``mode``, this layer and its valid modes, unless this layer has ``mode``."""
        if mode not in self.modes():
            raise ValueError(f"unknown mode {mode!r} for layer {self.layer_idx} ({self.spec.attention}); "
                             f"valid modes: {', '.join(self.modes())}")

    def set_mode(self, mode: str) -> None:
        self.check_mode(mode)
        self.mode = mode

    def attend(self, p: Projection, x: Tensor, valid: Tensor | None, state: BatchState | None, mode: str | None = None):
        """(output (B, Hq, T, Dv), new state) of ``mode`` (default: the layer's own) on projected inputs
        ``p`` of hidden states ``x`` (B, T, hidden), continuing ``state``. Runners that drive layers
        row by row (the serving engine) call this; ``forward`` calls it too. Not for mode 'teacher'
        (the teacher's own module keeps its KV in a transformers cache)."""
        mode = self.mode if mode is None else mode
        if mode == "teacher":
            raise ValueError(f"layer {self.layer_idx}: attend() runs a converted mode; mode 'teacher' runs the teacher's own module")
        if mode == "sinks_only":
            return sinks_attention(p.q, p.k, p.v, n_sinks=N_SINKS, valid=valid, state=expect_state(state, KVState, self), scale=self.scaling)
        if mode == "none":
            return zero_attention(p.q, p.v), None
        self.check_mode(mode)
        return self.attend_modes()[mode](p, x, valid, state)

    def decode_step(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor], slot) -> Tensor | None:
        """One new real token per row (``x`` (B, 1, hidden)) on the per-token decode path: its output
        (B, Hq, 1, Dv), with ``slot`` (the layer's StateCacheLayer) advanced in place; None where this
        kind or mode has no such path (the reference ops then run; nothing is computed or changed
        before None). The layer projects the token itself, so it skips what its path does not read
        (e.g. RoPE when the linear part sees q/k before it). Only called without gradients."""
        return None

    def has_static_decoding(self) -> bool:
        """Whether ``static_decoding`` applies to this layer in its current mode."""
        return False

    def static_decoding(self, slot, batch: int, device, dtype, clock=None) -> bool:
        """Put ``slot``'s state (``batch`` rows) in the decode form ``decode_step`` updates in place
        with no host reads (every index a device tensor, no shape that changes with the step), so
        that a whole decode step can be captured once in a CUDA graph and replayed; False where this
        kind or mode has no such form (``has_static_decoding``; nothing is changed then). ``clock``
        (an ``ops.states.DecodeClock`` its owner advances once per step): kinds that count tokens
        read it instead of counting their own."""
        if not self.has_static_decoding():
            return False
        slot.advance(self.static_decode_state(slot, batch, device, dtype, clock), 0)
        return True

    def static_decode_state(self, slot, batch: int, device, dtype, clock=None):
        """The static decode form of ``slot``'s state (empty when it has none), for kinds with
        ``has_static_decoding``; ``clock`` as in ``static_decoding``."""
        raise NotImplementedError(f"attention {self.spec.attention!r} has no static decode state")

    # --- forward -----------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        if self.mode == "teacher":  # the cache reaches the teacher under the name the decoder layer gave it
            return self.teacher(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        b, t, _ = hidden_states.shape
        valid = key_padding_from_mask(attention_mask, t)
        cache = cache_argument(kwargs)
        slot = state_layer(cache, self.layer_idx) if cache is not None else None
        out = None
        if slot is not None and t == 1 and fast_decoding() and not torch.is_grad_enabled() and (valid is None or bool(valid.all())):
            out = self.decode_step(hidden_states, position_embeddings, slot)
        if out is None:
            proj = self.project(hidden_states, position_embeddings, rotated=self.reads_rotated(self.mode))
            out, state = self.attend(proj, hidden_states, valid, slot.state if slot is not None else None)
            if slot is not None:
                slot.store(state, t)
        out = out.transpose(1, 2).reshape(b, t, -1).to(hidden_states.dtype)  # (B, T, Hq * D)
        return self.o_proj(out), None

    def reads_rotated(self, mode: str) -> bool:
        """Whether ``mode``'s attention reads q and k after RoPE (``Projection.q``/``k``); a kind
        whose mode reads only the feature maps' inputs q_lin/k_lin before RoPE returns False, and
        ``forward`` then skips RoPE."""
        return True

    def project(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], rotated: bool = True) -> Projection:
        """q (B, Hq, T, D), k and v (B, Hkv, T, D), RoPE applied to q and k; the feature maps'
        inputs q_lin, k_lin (before RoPE when ``separate_linear_inputs``). ``rotated=False`` (only
        for a caller that reads q_lin/k_lin alone, see ``reads_rotated``): q and k are
        ``project_linear``'s q_lin and k_lin, so RoPE is skipped where the feature maps see q/k before it."""
        if not rotated:
            q, k, v = self.project_linear(hidden_states, position_embeddings)
            return Projection(q, k, v, q, k)
        q, k, v, q_pre, k_pre = project_qkv(self, hidden_states, position_embeddings)
        if self.separate_linear_inputs:
            return Projection(q, k, v, q_pre, k_pre)
        return Projection(q, k, v, q, k)

    def project_linear(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(q_lin (B, Hq, T, D), k_lin (B, Hkv, T, D), v (B, Hkv, T, D)): what a purely linear kind
        reads (``project``'s q_lin, k_lin and v), without RoPE when the feature maps see q/k before it."""
        if not self.separate_linear_inputs:
            p = self.project(hidden_states, position_embeddings)
            return p.q_lin, p.k_lin, p.v
        return qkv_heads(self, hidden_states)  # (B, Hq, T, D), (B, Hkv, T, D) x 2

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, attention={self.spec.attention}, mode={self.mode}"


_SPLIT_PATHS: dict[tuple[str, ...], tuple[tuple[tuple[str, ...], str], ...]] = {}


def tensors_at(module: nn.Module, paths: tuple[str, ...]) -> tuple[Tensor, ...]:
    """The parameters (or buffers) of ``module`` at dotted ``paths`` ("gate_history.down.weight"),
    read from the modules' own dicts: nn.Module's attribute lookup costs about a microsecond a name,
    and the decode path reads its weights every token."""
    split = _SPLIT_PATHS.get(paths)
    if split is None:
        split = _SPLIT_PATHS[paths] = tuple((tuple(p.split(".")[:-1]), p.rpartition(".")[2]) for p in paths)
    out = []
    for names, last in split:
        m = module
        for name in names:
            sub = m._modules.get(name)
            m = sub if sub is not None else getattr(m, name)  # getattr: a submodule held some other way
        t = m._parameters.get(last)
        out.append(t if t is not None else m._buffers[last] if last in m._buffers else getattr(m, last))
    return tuple(out)


_FROZEN: list[bool] = []


@contextlib.contextmanager
def frozen_derived() -> Iterator[None]:
    """Within the block, a compiled step reads the values ``derived`` keeps (built by an eager call
    before it) as they are, as inputs of its graph, instead of building them inside the graph every
    call: for decoding with weights that do not change (the static decoder's steps), where stacking
    the feature maps' and gates' weights again every token costs a few kernels per layer."""
    _FROZEN.append(True)
    try:
        yield
    finally:
        _FROZEN.pop()


def derived(module: nn.Module, name: str, sources: tuple[Tensor, ...], build: Callable[[], Any]) -> Any:
    """``build()``, kept on ``module`` under ``name`` until one of ``sources`` (the parameters it is
    made of) changes: another tensor, other storage (a new dtype or device, ``.data`` replaced) or an
    in-place update (its version counter). The decode path reads weights it would otherwise rebuild
    every token (fused feature-map and gate weights, sigmoids of logits) this way; training updates
    are seen at the next call. Inference tensors (parameters of a model loaded under
    ``torch.inference_mode``) keep no version counter: nothing trains them, so their storage is the key.
    Inside ``torch.compile`` the value is built in the graph (storage and versions are not traced),
    unless ``frozen_derived`` is on and a value is kept: then that value, unchecked."""
    if torch.compiler.is_compiling():
        kept = getattr(module, "_derived", None) if _FROZEN else None
        hit = kept.get(name) if kept is not None else None
        return build() if hit is None else hit[1]
    store = module.__dict__.setdefault("_derived", {})
    hit = store.get(name)
    if hit is not None and len(hit[0]) == len(sources):
        for t, (known, pointer, version) in zip(sources, hit[0]):
            if t is not known or t.data_ptr() != pointer or (version is not None and t._version != version):
                break
        else:
            return hit[1]
    value = build()
    store[name] = (tuple((t, t.data_ptr(), None if t.is_inference() else t._version) for t in sources), value)
    return value


def _hedgehog_weights(phi_q: nn.Module, phi_k: nn.Module, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The two maps' weights stacked for ``token_features``: (2 Hq, D, f) and biases (2 Hq, 1, f),
    queries' first."""
    weight = torch.cat((phi_q.weight, phi_k.weight)).to(dtype).contiguous()  # (2 Hq, D, f)
    bias = torch.cat((phi_q.bias, phi_k.bias))[:, None].to(dtype).contiguous()  # (2 Hq, 1, f)
    return weight, bias


def token_features(module: nn.Module, phi_q: nn.Module, phi_k: nn.Module, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """The feature maps of one token: ``phi_q(q)`` and ``phi_k(repeat_kv(k))`` as (B, Hq, F) each, for
    q (B, Hq, 1, D) and k (B, Hkv, 1, D) (k's features for every query head of its KV head).

    Two learned Hedgehog maps run as one batched projection and one softmax over both
    (``hedgehog_pair``), from weights stacked once (``derived``) and k's grouped view (no repeated
    copy of its heads); any other maps are called as they are."""
    from .feature_map import HedgehogFeatureMap

    b, hq, _, d = q.shape
    hkv = k.shape[1]
    n_rep = hq // hkv
    if not (isinstance(phi_q, HedgehogFeatureMap) and isinstance(phi_k, HedgehogFeatureMap)):
        qf = phi_q(q).reshape(b, hq, -1)  # (B, Hq, F)
        kf = (phi_k(k.repeat_interleave(n_rep, dim=1)) if n_rep > 1 else phi_k(k)).reshape(b, hq, -1)  # (B, Hq, F)
        return qf, kf
    weight, bias = stacked_hedgehog(module, phi_q, phi_k, q.dtype)
    return hedgehog_pair(q.reshape(b, hq, d), k.reshape(b, hkv, d), weight, bias)


def stacked_hedgehog(module: nn.Module, phi_q: nn.Module, phi_k: nn.Module, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``module``'s two Hedgehog maps stacked (``_hedgehog_weights``, kept between tokens: ``derived``),
    in ``dtype``: what a decode step's features are made from."""
    weight, bias = derived(module, "hedgehog", (phi_q.weight, phi_q.bias, phi_k.weight, phi_k.bias),
                           lambda: _hedgehog_weights(phi_q, phi_k, dtype))  # fmt: skip
    if weight.dtype != dtype:
        weight, bias = weight.to(dtype), bias.to(dtype)
    return weight, bias


def expect_state(state: BatchState | None, kind: type, module: ConvertedAttention):
    if state is not None and not isinstance(state, kind):
        raise ValueError(
            f"layer {module.layer_idx} in mode {module.mode!r} needs a {kind.__name__} but the cache holds a "
            f"{type(state).__name__}: modes that keep different states cannot be switched mid-sequence; start a new cache"
        )
    return state
