"""Converted attention modules.

Each module takes the place of a decoder layer's ``self_attn`` and reuses the teacher's q/k/v/o
projections (the same nn.Linear objects, not copies). ``ConvertedAttention`` does what every kind
shares: project, RoPE, padding mask, reading/writing this layer's state in the cache, the generic
diagnostic modes. Subclasses add their parameters and map each supported mode to an op call.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..cache import cache_argument, state_layer
from ..ops.common import repeat_kv
from ..ops.dsla import dsla_attention, init_gate_bias
from ..ops.hybrid import hybrid_attention
from ..ops.lola import lola_attention
from ..ops.softmax import sinks_attention, softmax_attention, zero_attention
from ..ops.states import BatchState, DslaState, HybridState, KVState, LolaState
from ..spec import LayerSpec
from .feature_map import build_feature_map

logger = logging.getLogger(__name__)

N_SINKS = 8
GENERIC_MODES = ("sinks_only", "none", "teacher")
"""Modes every converted layer supports: the HedgeCATs component diagnostics (sinks_only, none) and
'teacher' (the layer runs the teacher's original attention with plain KV; its new parameters stay,
inactive: nested conversions and run-time conversion switch layers this way)."""



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


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """'auto' -> 'fla' on CUDA when flash-linear-attention is installed, else 'torch'."""
    if kernel != "auto":
        return kernel
    if device.type == "cuda" and importlib.util.find_spec("fla") is not None:
        return "fla"
    return "torch"


class ConvertedAttention(nn.Module):
    """Shared part of every converted attention kind; subclasses define ``attend_modes``."""

    def __init__(self, teacher: nn.Module, spec: LayerSpec, layer_idx: int, config) -> None:
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

    # --- modes -------------------------------------------------------------------------------
    def attend_modes(self) -> dict[str, Attend]:
        """Kind-specific modes: name -> fn(projection, x, valid, state) -> (out, state)."""
        raise NotImplementedError

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

    def _attend(self, p: Projection, x, valid, state):
        if self.mode == "sinks_only":
            return sinks_attention(p.q, p.k, p.v, n_sinks=N_SINKS, valid=valid, state=_expect(state, KVState, self), scale=self.scaling)
        if self.mode == "none":
            return zero_attention(p.q, p.v), None
        return self.attend_modes()[self.mode](p, x, valid, state)

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
        proj = self.project(hidden_states, position_embeddings)
        valid = key_padding_from_mask(attention_mask, t)
        cache = cache_argument(kwargs)
        slot = state_layer(cache, self.layer_idx) if cache is not None else None
        out, state = self._attend(proj, hidden_states, valid, slot.state if slot is not None else None)
        if slot is not None:
            slot.store(state, t)
        out = out.transpose(1, 2).reshape(b, t, -1).to(hidden_states.dtype)  # (B, T, Hq * D)
        return self.o_proj(out), None

    def project(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> Projection:
        """q (B, Hq, T, D), k and v (B, Hkv, T, D), RoPE applied to q and k; the feature maps'
        inputs q_lin, k_lin (before RoPE when the spec's ``linear_rope`` is false)."""
        b, t, _ = hidden_states.shape
        q_pre = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k_pre = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
        if self.spec.linear_rope:
            return Projection(q, k, v, q, k)
        return Projection(q, k, v, q_pre, k_pre)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, attention={self.spec.attention}, mode={self.mode}"


def _expect(state: BatchState | None, kind: type, module: ConvertedAttention):
    if state is not None and not isinstance(state, kind):
        raise ValueError(
            f"layer {module.layer_idx} in mode {module.mode!r} needs a {kind.__name__} but the cache holds a "
            f"{type(state).__name__}: modes that keep different states cannot be switched mid-sequence; start a new cache"
        )
    return state


class SoftmaxAttention(ConvertedAttention):
    """The teacher's causal softmax, re-implemented over a KVState (reference and diagnostics host)."""

    def attend_modes(self):
        def softmax(p, x, valid, state):
            return softmax_attention(p.q, p.k, p.v, valid=valid, state=_expect(state, KVState, self), scale=self.scaling)

        return {"hybrid": softmax}


class HybridAttention(ConvertedAttention):
    """Sliding-window softmax + linear attention in one head (LoLCATs); LoLA reads on top of it.

    Parameters: feature maps for q and k (untied), the joint mix's per-head window factor logit
    theta (f = sigmoid(theta)), and for the gate mix an optional learned per-head gate logit.
    The same parameters serve 'hybrid' and 'lola' layers, so a trained hybrid can be read with LoLA.
    """

    def __init__(self, teacher, spec, layer_idx, config):
        super().__init__(teacher, spec, layer_idx, config)
        features = spec.features(self.head_dim)
        self.feature_map_q = build_feature_map(spec.feature_map, self.num_heads, self.head_dim, features, seed=2 * layer_idx)
        self.feature_map_k = build_feature_map(spec.feature_map, self.num_heads, self.head_dim, features, seed=2 * layer_idx + 1)
        self.window_factor_logit = nn.Parameter(torch.full((self.num_heads,), float(spec.window_factor_init)))
        gate_logit = torch.logit(torch.full((self.num_heads,), float(spec.gate_init)), eps=1e-6)
        if spec.learn_gate:
            self.gate_logit = nn.Parameter(gate_logit)
        else:
            self.register_buffer("gate_logit", gate_logit, persistent=False)
        self.window_dropout: Tensor | None = None
        """(B,) bool or None: rows that run linear attention over all positions instead of the hybrid
        (scheduled sliding-window dropout while training; only without a cache)."""

    def window_factor(self) -> Tensor:
        return torch.sigmoid(self.window_factor_logit.float())

    def _attend(self, p, x, valid, state):
        drop = self.window_dropout
        if drop is None or self.mode != "hybrid" or self.spec.attention != "hybrid" or not bool(drop.any()):
            return super()._attend(p, x, valid, state)
        if state is not None:
            raise ValueError("window dropout is a training setting: it cannot run with a cache")
        modes = self.attend_modes()
        out = None
        for rows, mode in ((~drop, "hybrid"), (drop, "la_only")):
            idx = rows.to(p.q.device).nonzero().flatten()
            if idx.numel() == 0:
                continue
            sub_valid = valid[idx] if valid is not None else None
            o, _ = modes[mode](p.map(lambda t, idx=idx: t[idx]), x[idx], sub_valid, None)  # (b, Hq, T, Dv)
            out = (o.new_zeros(p.q.shape[0], *o.shape[1:]) if out is None else out).index_copy(0, idx, o)
        return out, None

    def gate(self) -> Tensor:
        return torch.sigmoid(self.gate_logit.float())

    @staticmethod
    def linear_inputs(p: Projection) -> dict[str, Tensor]:
        """The hybrid ops' q_lin/k_lin keyword arguments: empty when the feature maps see q and k."""
        return {"q_lin": p.q_lin, "k_lin": p.k_lin} if p.separate else {}

    def attend_modes(self):
        if self.spec.attention == "lola":
            return {
                "hybrid": self._lola(read_state=True, read_sparse=True),
                "no_state": self._lola(read_state=False, read_sparse=True),
                "no_sparse": self._lola(read_state=True, read_sparse=False),
                "window_only": self._lola(read_state=False, read_sparse=False),
            }
        return {"hybrid": self._hybrid("both"), "swa_only": self._hybrid("window"), "la_only": self._hybrid("linear")}

    def _hybrid(self, branches: str) -> Attend:
        def attend(p, x, valid, state):
            return hybrid_attention(
                p.q, p.k, p.v,
                phi_q=self.feature_map_q, phi_k=self.feature_map_k,
                window=self.spec.window, mix=self.spec.mix, overlap=self.spec.overlap,
                window_factor=self.window_factor(), gate=self.gate(), branches=branches,
                valid=valid, state=_expect(state, HybridState, self), scale=self.scaling,
                backend=resolve_kernel(self.spec.kernel, p.q.device),
                **self.linear_inputs(p),
            )

        return attend

    def _lola(self, *, read_state: bool, read_sparse: bool) -> Attend:
        def attend(p, x, valid, state):
            return lola_attention(
                p.q, p.k, p.v,
                phi_q=self.feature_map_q, phi_k=self.feature_map_k,
                window=self.spec.window, sparse=self.spec.sparse_cache, window_factor=self.window_factor(),
                chunk=self.spec.chunk, valid=valid, state=_expect(state, LolaState, self), scale=self.scaling,
                read_state=read_state, read_sparse=read_sparse,
                sinks=self.spec.sinks, linear_weight=float(self.spec.linear_weight),
                **self.linear_inputs(p),
            )

        return attend


class LowRankGate(nn.Module):
    """GLA-style data-dependent gate: log alpha = logsigmoid(x W1 W2 + b) / 16, per key dimension."""

    def __init__(self, hidden: int, rank: int, out: int, init_value: float):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, out, bias=True)
        nn.init.normal_(self.down.weight, std=hidden**-0.5)
        nn.init.zeros_(self.up.weight)  # starts data independent, at init_value
        nn.init.constant_(self.up.bias, init_gate_bias(init_value))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, hidden) -> (B, T, out), in float32
        x = x.to(self.down.weight.dtype)  # the new parameters stay float32 in a bf16 model
        return F.logsigmoid(self.up(self.down(x)).float()) / 16.0


class DslaAttention(ConvertedAttention):
    """Dual-state gated linear attention (DSLA): a slow history state and a fast recent state that
    share the write and differ in forgetting, mixed by a learned gamma = sigmoid(theta) in [0, 1].

    q and k pass through the spec's feature map (learned Hedgehog by default, as in LoLCATs) and each
    state's read is normalised (divided by q z), so the layer starts as a decayed normalised linear
    attention of the teacher's q/k/v. With feature_map 'identity' it is the paper's raw form: q and
    k as they are, no normaliser."""

    def __init__(self, teacher, spec, layer_idx, config):
        super().__init__(teacher, spec, layer_idx, config)
        hidden = config.hidden_size
        self.normalize = spec.dsla_normalized
        self.features = spec.features(self.head_dim)
        if self.normalize:
            self.feature_map_q = build_feature_map(spec.feature_map, self.num_heads, self.head_dim, self.features, seed=2 * layer_idx)
            self.feature_map_k = build_feature_map(spec.feature_map, self.num_heads, self.head_dim, self.features, seed=2 * layer_idx + 1)
        width = self.num_heads * self.features
        self.gate_history = LowRankGate(hidden, spec.dsla_gate_rank, width, spec.dsla_history_gate)
        self.gate_recent = LowRankGate(hidden, spec.dsla_gate_rank, width, spec.dsla_recent_gate)
        self.gamma_logit = nn.Parameter(torch.zeros(()))

    def gamma(self) -> Tensor:
        return torch.sigmoid(self.gamma_logit.float())

    def log_gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, hidden) -> two (B, Hq, T, F) log-gates (F: features per head)."""
        b, t, _ = x.shape

        def heads(g: Tensor) -> Tensor:
            return g.view(b, t, self.num_heads, self.features).transpose(1, 2)

        return heads(self.gate_history(x)), heads(self.gate_recent(x))

    def attend_modes(self):
        """hybrid: both states mixed by gamma; history_only / recent_only: read one state alone
        (gamma fixed to 1 / 0; both states are still written, so modes can switch at run time)."""
        return {
            "hybrid": self._dsla(None),
            "history_only": self._dsla(1.0),
            "recent_only": self._dsla(0.0),
        }

    def _dsla(self, fixed_gamma: float | None) -> Attend:
        def dsla(p, x, valid, state):
            q, k, v = p.q_lin, p.k_lin, p.v  # linear attention only: q/k before RoPE unless linear_rope
            log_h, log_r = self.log_gates(x)
            gamma = self.gamma() if fixed_gamma is None else torch.full((), fixed_gamma, device=q.device)
            scale = self.scaling
            if self.normalize:  # feature maps are per query head: repeat the kv heads first
                n_rep = q.shape[1] // k.shape[1]
                q, k = self.feature_map_q(q), self.feature_map_k(repeat_kv(k, n_rep))
                v, scale = repeat_kv(v, n_rep), 1.0  # the normaliser cancels any scale
            return dsla_attention(
                q, k, v, log_h, log_r, gamma,
                valid=valid, state=_expect(state, DslaState, self), scale=scale,
                backend=resolve_kernel(self.spec.kernel, q.device), normalize=self.normalize, chunk=self.spec.chunk,
            )

        return dsla


ATTENTION_CLASSES: dict[str, type[ConvertedAttention]] = {
    "softmax": SoftmaxAttention,
    "hybrid": HybridAttention,
    "lola": HybridAttention,
    "dsla": DslaAttention,
}
"""Attention kind (ConversionSpec.attention) -> module class."""
