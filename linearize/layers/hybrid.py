"""hybrid: sliding-window softmax + linear attention in one head (LoLCATs; HedgeCATs' gate mix)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..checks import check_choice, check_int
from ..ops import cpu_kernels, fused_decode
from ..ops.common import accumulation_dtype
from ..ops.hybrid import HybridDecodeState, hybrid_attention, hybrid_attention_weights, hybrid_decode_step, hybrid_state_empty
from ..ops.states import HybridState
from .base import (KERNELS, STATE_BYTES, AttentionKind, Attend, ConvertedAttention, Projection, SpecError, derived, expect_state,
                   head_sizes, resolve_kernel, tensors_at, token_features)
from .feature_map import FeatureMapOptions, HedgehogFeatureMap, feature_map_pair

MIXES = ("joint", "gate")


@dataclass
class WindowOptions(FeatureMapOptions):
    """Spec fields of the kinds with a sliding window beside a linear part (hybrid, lola)."""

    window: int = 64
    """Sliding-window size w (hybrid) = LoLA's eta: the last w tokens up to and including t."""
    window_factor_init: float = -2.197
    """Initial logit theta of the joint mix's window factor f = sigmoid(theta) (~0.1, LoLCATs)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("window", self.window, 1, error=SpecError)


@dataclass
class HybridOptions(WindowOptions):
    """Spec fields of a hybrid layer."""

    overlap: bool = False
    """False: linear attention covers only tokens older than the window; True: all tokens."""
    mix: str = "joint"
    """joint: one shared softmax denominator with a learned per-head window factor (LoLCATs);
    gate: g * SWA + (1 - g) * LA, each branch normalised (HedgeCATs Eq. 3)."""
    gate_init: float = 0.5
    """Initial g of the gate mix."""
    learn_gate: bool = False
    """Learn g per head in the gate mix (else fixed at gate_init)."""
    kernel: str = "auto"
    """auto (fla on CUDA when installed, else torch) | torch | fla."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("mix", self.mix, MIXES, SpecError)
        check_choice("kernel", self.kernel, KERNELS, SpecError)
        if not 0.0 <= self.gate_init <= 1.0:
            raise SpecError(f"gate_init must lie in [0, 1], got {self.gate_init}")


class WindowedLinearAttention(ConvertedAttention):
    """Feature maps for q and k (untied) and the joint mix's per-head window factor logit theta
    (f = sigmoid(theta)): the parameters hybrid and LoLA layers share, so a trained hybrid can be
    read with LoLA. Its joint mix is non-overlapping unless a subclass says otherwise."""

    mix = "joint"
    overlap = False

    def __init__(self, teacher, spec, layer_idx, config):
        super().__init__(teacher, spec, layer_idx, config)
        self.feature_map_q, self.feature_map_k = feature_map_pair(self.options, self.num_heads, self.head_dim, layer_idx)
        self.window_factor_logit = nn.Parameter(torch.full((self.num_heads,), float(self.options.window_factor_init)))

    @property
    def separate_linear_inputs(self) -> bool:
        return not self.options.linear_rope

    @property
    def window(self) -> int:
        return self.options.window

    def window_factor(self) -> Tensor:
        return torch.sigmoid(self.window_factor_logit.float())

    def gate(self) -> Tensor | None:
        """The gate mix's g per head (None: the joint mix has none)."""
        return None

    def attention_weights(self, p: Projection, valid: Tensor | None, branches: str = "both") -> Tensor:
        """(B, Hq, T, T): the weight each query gives each key under this layer's hybrid (quadratic:
        for attention transfer and diagnostics at ~1K tokens)."""
        return hybrid_attention_weights(
            p.q, p.k, phi_q=self.feature_map_q, phi_k=self.feature_map_k, window=self.window, mix=self.mix,
            overlap=self.overlap, window_factor=self.window_factor(), gate=self.gate(), branches=branches,
            valid=valid, scale=self.scaling, **self.linear_inputs(p),
        )

    @staticmethod
    def linear_inputs(p: Projection) -> dict[str, Tensor]:
        """The hybrid/LoLA ops' q_lin/k_lin keyword arguments: empty when the feature maps see q and k."""
        return {"q_lin": p.q_lin, "k_lin": p.k_lin} if p.separate else {}


class HybridAttention(WindowedLinearAttention):
    """Sliding-window softmax + linear attention in one head (LoLCATs).

    Beyond the shared parameters: for the gate mix an optional learned per-head gate logit."""

    def __init__(self, teacher, spec, layer_idx, config):
        super().__init__(teacher, spec, layer_idx, config)
        gate_logit = torch.logit(torch.full((self.num_heads,), float(self.options.gate_init)), eps=1e-6)
        if self.options.learn_gate:
            self.gate_logit = nn.Parameter(gate_logit)
        else:
            self.register_buffer("gate_logit", gate_logit, persistent=False)
        self.window_dropout: Tensor | None = None
        """(B,) bool or None: rows that run linear attention over all positions instead of the hybrid
        (scheduled sliding-window dropout while training; only without a cache)."""

    @property
    def mix(self) -> str:
        return self.options.mix

    @property
    def overlap(self) -> bool:
        return self.options.overlap

    def gate(self) -> Tensor:
        return torch.sigmoid(self.gate_logit.float())

    def attend(self, p, x, valid, state, mode=None):
        drop = self.window_dropout
        if drop is None or (self.mode if mode is None else mode) != "hybrid" or not bool(drop.any()):
            return super().attend(p, x, valid, state, mode)
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

    def attend_modes(self):
        return {"hybrid": self._hybrid("both"), "swa_only": self._hybrid("window"), "la_only": self._hybrid("linear")}

    BRANCHES = {"hybrid": "both", "swa_only": "window", "la_only": "linear"}

    def decode_step(self, x, position_embeddings, slot):
        branches = self.BRANCHES.get(self.mode)
        if branches is None or (self.window_dropout is not None and bool(self.window_dropout.any())):
            return None
        static = isinstance(slot.decode_state, HybridDecodeState) and slot.decode_state.index is not None
        kernel = (x.device.type == "cpu" and x.dtype == torch.float32 and not static and not torch.compiler.is_compiling()
                  and not fused_decode.enabled(x))  # fmt: skip
        lib = cpu_kernels.library() if kernel else None
        if lib is not None:
            weights = self._kernel_weights()
            if weights is not None:
                return self._kernel_step(lib, weights, branches, x, position_embeddings, slot)
        p = self.project(x, position_embeddings)
        ds = self._decode_state(slot, p.k.shape[0], p.q.device, p.v.dtype)
        o = self.options
        qf, kf = token_features(self, self.feature_map_q, self.feature_map_k, p.q_lin, p.k_lin)  # (B, Hq, F) each
        out = hybrid_decode_step(ds, p.q, p.k, p.v, qf, kf, mix=o.mix, overlap=o.overlap, branches=branches,
                                 scale=self.scaling, k_lin=p.k_lin if p.separate else None, **self._mix_factor(ds.keys.dtype))  # fmt: skip
        slot.advance(ds, 1)
        return out

    def has_static_decoding(self) -> bool:
        return self.BRANCHES.get(self.mode) is not None and self.window_dropout is None

    def static_decode_state(self, slot, batch: int, device, dtype, clock=None) -> HybridDecodeState:
        return self._decode_state(slot, batch, device, dtype).make_static(clock)

    def _decode_state(self, slot, b: int, device, dtype) -> HybridDecodeState:
        """The slot's decode state, made from its state (empty before any token) before the first token."""
        ds = slot.decode_state
        if not isinstance(ds, HybridDecodeState):
            state = expect_state(slot.state, HybridState, self)
            if state is None:
                state = hybrid_state_empty(b, self.num_kv_heads, self.num_heads, self.window, self.head_dim, self.head_dim,
                                           self.options.features(self.head_dim), device=device, dtype=accumulation_dtype(dtype),
                                           linear_keys=self.separate_linear_inputs)  # fmt: skip
            ds = HybridDecodeState.from_state(state, self.feature_map_k, self.num_heads)
        return ds

    def _mix_factor(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """The mix's per-head factor as ``hybrid_decode_step`` takes it (kept between tokens)."""
        if self.options.mix == "joint":
            return {"window_factor": derived(self, "window_factor", (self.window_factor_logit,), lambda: self.window_factor().to(dtype))}
        return {"gate": derived(self, "gate", (self.gate_logit,), lambda: self.gate().to(dtype))}

    def _kernel_weights(self) -> cpu_kernels.Weights | None:
        """The CPU kernel's weights (the maps and the mix's factor), kept between tokens (``derived``);
        None where the kernel does not apply: feature maps other than Hedgehog, parameters other than
        float32."""
        if not isinstance(self._modules["feature_map_q"], HedgehogFeatureMap):
            return None
        joint = self.options.mix == "joint"
        sources = tensors_at(self, ("feature_map_q.weight", "feature_map_q.bias", "feature_map_k.weight", "feature_map_k.bias",
                                    "window_factor_logit" if joint else "gate_logit"))  # fmt: skip

        def build() -> cpu_kernels.Weights | None:
            if any(t.dtype != torch.float32 for t in sources):
                return None
            wq, bq, wk, bk = (t.contiguous() for t in sources[:4])
            return cpu_kernels.Weights(wq=wq, bq=bq, wk=wk, bk=bk, factor=(self.window_factor() if joint else self.gate()).contiguous())

        return derived(self, f"kernel_{self.options.mix}", sources, build)

    def _kernel_step(self, lib, weights, branches, x, position_embeddings, slot):
        """``decode_step`` as one CPU kernel call (``cpu_kernels.hybrid_step``)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, 1, H D): RoPE in the kernel
        ds = self._decode_state(slot, x.shape[0], x.device, x.dtype)
        o = self.options
        out = cpu_kernels.hybrid_step(lib, ds, q, k, v, position_embeddings, weights, heads=self.num_heads, kv_heads=self.num_kv_heads,
                                      mix=o.mix, overlap=o.overlap, branches=branches, scale=self.scaling, linear_rope=o.linear_rope)  # fmt: skip
        slot.advance(ds, 1)
        return out

    def _hybrid(self, branches: str) -> Attend:
        def attend(p, x, valid, state):
            o = self.options
            return hybrid_attention(
                p.q, p.k, p.v,
                phi_q=self.feature_map_q, phi_k=self.feature_map_k,
                window=o.window, mix=o.mix, overlap=o.overlap,
                window_factor=self.window_factor(), gate=self.gate(), branches=branches,
                valid=valid, state=expect_state(state, HybridState, self), scale=self.scaling,
                backend=resolve_kernel(o.kernel, p.q.device),
                **self.linear_inputs(p),
            )

        return attend


def window_bytes(options: WindowOptions, config) -> int:
    """The window's keys and values (plus keys before RoPE when the linear part sees them), float32."""
    _, hkv, head_dim = head_sizes(config)
    return options.window * (2 + (not options.linear_rope)) * hkv * head_dim * STATE_BYTES


def linear_state_bytes(options: FeatureMapOptions, config) -> int:
    """One (features x head_dim) state plus its normaliser per query head, float32."""
    h, _, head_dim = head_sizes(config)
    return h * options.features(head_dim) * (head_dim + 1) * STATE_BYTES


def hybrid_memory(options: HybridOptions, config, dtype_bytes: int) -> tuple[int, int]:
    return 0, window_bytes(options, config) + linear_state_bytes(options, config)


KIND = AttentionKind(
    name="hybrid",
    layer=HybridAttention,
    options=HybridOptions,
    state=HybridState,
    modes=("hybrid", "swa_only", "la_only"),
    ablation_modes=("hybrid", "swa_only", "la_only", "sinks_only", "none"),
    memory=hybrid_memory,
    diagnostics=("self_recall", "attention_mass"),
    description="sliding window + linear attention in one head (LoLCATs)",
)
