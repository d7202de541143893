"""dsla: dual-state gated linear attention (DSLA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import check_choice, check_int
from ..ops import cpu_kernels, fused_decode, fused_dsla
from ..ops.common import accumulation_dtype, repeat_kv
from ..ops.dsla import DslaDecodeState, dsla_attention, dsla_decode_step, dsla_prefill, init_gate_bias, log_gate
from ..ops.fused_prefill import for_inference, token_major_features
from ..ops.states import DslaState
from .base import (KERNELS, STATE_BYTES, AttentionKind, Attend, ConvertedAttention, SpecError, derived, expect_state, head_sizes,
                   qkv_heads, resolve_kernel, stacked_hedgehog, tensors_at, token_features)
from .feature_map import FeatureMapOptions, HedgehogFeatureMap, feature_map_pair


@dataclass
class DslaOptions(FeatureMapOptions):
    """Spec fields of a DSLA layer."""

    chunk: int = 16
    """DSLA's block length on the torch kernel (its memory grows with it)."""
    dsla_history_gate: float = 0.999
    """DSLA: initial gate value of the slow (history) state."""
    dsla_recent_gate: float = 0.9
    """DSLA: initial gate value of the fast (recent) state."""
    dsla_gate_rank: int = 16
    """DSLA: rank of the low-rank gate projection (hidden -> rank -> heads * features)."""
    kernel: str = "auto"
    """auto (fla on CUDA when installed, else torch) | torch | fla."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("kernel", self.kernel, KERNELS, SpecError)
        check_int("chunk", self.chunk, 1, error=SpecError)
        check_int("dsla_gate_rank", self.dsla_gate_rank, 1, error=SpecError)
        for name in ("dsla_history_gate", "dsla_recent_gate"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise SpecError(f"{name} must lie in (0, 1), got {getattr(self, name)}")

    @property
    def normalized(self) -> bool:
        """Feature-mapped q/k with normalised state reads (every feature map but identity)."""
        return self.feature_map != "identity"


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
        return log_gate(self.up(self.down(x)))


class DslaAttention(ConvertedAttention):
    """Dual-state gated linear attention (DSLA): a slow history state and a fast recent state that
    share the write and differ in forgetting, mixed by a learned gamma = sigmoid(theta) in [0, 1].

    q and k pass through the spec's feature map (learned Hedgehog by default, as in LoLCATs) and each
    state's read is normalised (divided by q z), so the layer starts as a decayed normalised linear
    attention of the teacher's q/k/v. With feature_map 'identity' it is the paper's raw form: q and
    k as they are, no normaliser."""

    def __init__(self, teacher, spec, layer_idx, config):
        super().__init__(teacher, spec, layer_idx, config)
        o = self.options
        hidden = config.hidden_size
        self.normalize = o.normalized
        self.features = o.features(self.head_dim)
        if self.normalize:
            self.feature_map_q, self.feature_map_k = feature_map_pair(o, self.num_heads, self.head_dim, layer_idx)
        width = self.num_heads * self.features
        self.gate_history = LowRankGate(hidden, o.dsla_gate_rank, width, o.dsla_history_gate)
        self.gate_recent = LowRankGate(hidden, o.dsla_gate_rank, width, o.dsla_recent_gate)
        self.gamma_logit = nn.Parameter(torch.zeros(()))

    @property
    def separate_linear_inputs(self) -> bool:
        return not self.options.linear_rope

    def reads_rotated(self, mode: str) -> bool:
        """DSLA's own modes read q_lin/k_lin and v only (no softmax part): RoPE only where the
        feature maps see it (``linear_rope``) or for the generic ablation modes."""
        return self.options.linear_rope or mode not in self.GAMMA

    def gamma(self) -> Tensor:
        return torch.sigmoid(self.gamma_logit.float())

    def log_gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, hidden) -> two (B, Hq, T, F) log-gates (F: features per head), views of token-major
        (B, T, Hq, F) tensors; x is cast to the gates' dtype once for both."""
        b, t, _ = x.shape
        xg = x.to(self.gate_history.down.weight.dtype)
        return tuple(g(xg).view(b, t, self.num_heads, self.features).transpose(1, 2) for g in (self.gate_history, self.gate_recent))

    def attend_modes(self):
        """hybrid: both states mixed by gamma; history_only / recent_only: read one state alone
        (gamma fixed to 1 / 0; both states are still written, so modes can switch at run time)."""
        return {
            "hybrid": self._dsla(None),
            "history_only": self._dsla(1.0),
            "recent_only": self._dsla(0.0),
        }

    GAMMA = {"hybrid": None, "history_only": 1.0, "recent_only": 0.0}
    """Each mode's fixed gamma (None: the learned one)."""

    def _inputs(self, p, x, fixed_gamma: float | None):
        """(q, k, v, log-gate history, log-gate recent, gamma, scale) as ``dsla_attention`` takes them."""
        q, k, v = p.q_lin, p.k_lin, p.v  # linear attention only: q/k before RoPE unless linear_rope
        log_h, log_r = self.log_gates(x)
        gamma = self.gamma() if fixed_gamma is None else torch.full((), fixed_gamma, device=q.device)
        scale = self.scaling
        if self.normalize:  # feature maps are per query head: repeat the kv heads first
            n_rep = q.shape[1] // k.shape[1]
            q, k = self.feature_map_q(q), self.feature_map_k(repeat_kv(k, n_rep))
            v, scale = repeat_kv(v, n_rep), 1.0  # the normaliser cancels any scale
        return q, k, v, log_h, log_r, gamma, scale

    def _prefill(self, p, x, state, fixed_gamma: float | None, backend: str, valid: Tensor | None = None):
        """DSLA's inference prefill on token-major inputs, the features written token-major (Hedgehog's
        in one kernel, without repeated KV heads): where ``fused_dsla.applies`` (half precision, tile
        sizes), its two kernels, the gates made inside them from their low-rank inputs; else
        ``dsla_prefill``, both gates from one projection (``stacked_log_gates``). ``valid``: the
        tokens from valid[0] on are padding (``prefill_padded``), for ``dsla_prefill`` with no key,
        value or decay, as ``dsla_attention`` masks them."""
        q, k, v = p.q_lin, p.k_lin, p.v
        n_rep = q.shape[1] // k.shape[1]
        if self.normalize:
            qf, kf, scale = token_major_features(self.feature_map_q, q, 1), token_major_features(self.feature_map_k, k, n_rep), 1.0
        else:  # the raw form: q and k as they are, k for every query head
            b, hkv, t, d = k.shape
            kf = k.transpose(1, 2)[:, :, :, None].expand(b, t, hkv, n_rep, d).reshape(b, t, hkv * n_rep, d)
            qf, scale = q.transpose(1, 2).contiguous(), self.scaling
        gamma = self.gamma() if fixed_gamma is None else torch.full((), fixed_gamma, device=q.device)
        state = expect_state(state, DslaState, self)
        vt = v.transpose(1, 2)
        rank = self.options.dsla_gate_rank
        if fused_dsla.applies(qf, vt, rank):  # the gates made inside the kernels, both states in one pass
            down, up, bias = self.fused_gate_weights()
            return fused_dsla.dsla_prefill_fused(qf, kf, vt, fused_dsla.gate_inputs(x, down, rank), up, bias, gamma, state=state,
                                                 scale=scale, normalize=self.normalize, valid=valid)  # fmt: skip
        gates = self.stacked_log_gates(x)  # (B, T, 2, Hq, F)
        if valid is not None:  # padding: no key, no value (nor the normaliser's one), no decay
            real = (torch.arange(x.shape[1], device=x.device) < valid.reshape(1))[None, :, None, None]  # (1, T, 1, 1)
            kf, vt, gates = kf.masked_fill(~real, 0.0), vt.masked_fill(~real, 0.0), gates.masked_fill(~real[..., None], 0.0)
        return dsla_prefill(qf, kf, vt, gates, gamma, state=state, scale=scale, backend=backend, normalize=self.normalize,
                            chunk=self.options.chunk)  # fmt: skip

    def prefill_padded(self, p, x: Tensor, state: DslaState | None, valid: Tensor) -> tuple[Tensor, DslaState]:
        """The hybrid mode's prefill of a chunk padded at its end: ``valid`` a one-element integer
        tensor on x's device, the tokens from valid[0] on padding, which leave the states as they are
        (their outputs are undefined). A device value, so a CUDA graph captured once serves every
        count: the inference prefill (``for_inference``) masks the padding itself (the fused kernels
        or ``dsla_prefill``); elsewhere the hybrid mode runs with the padding mask. Returns the
        output (B, Hq, T, Dv) and the states after the valid tokens."""
        if for_inference(p.q, None):
            return self._prefill(p, x, state, None, resolve_kernel(self.options.kernel, p.q.device), valid=valid)
        b, t = x.shape[:2]
        mask = (torch.arange(t, device=x.device) < valid.reshape(1))[None].expand(b, t)
        return self.attend(p, x, mask, state, mode="hybrid")

    def _dsla(self, fixed_gamma: float | None) -> Attend:
        def dsla(p, x, valid, state):
            backend = resolve_kernel(self.options.kernel, p.q.device)
            if for_inference(p.q, valid):
                return self._prefill(p, x, state, fixed_gamma, backend)
            q, k, v, log_h, log_r, gamma, scale = self._inputs(p, x, fixed_gamma)
            return dsla_attention(
                q, k, v, log_h, log_r, gamma,
                valid=valid, state=expect_state(state, DslaState, self), scale=scale,
                backend=backend, normalize=self.normalize, chunk=self.options.chunk,
            )

        return dsla

    def decode_step(self, x, position_embeddings, slot):
        if self.mode not in self.GAMMA:
            return None
        pooled = isinstance(slot.decode_state, DslaDecodeState) and slot.decode_state.index is not None  # rows of a pool
        kernel = (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling() and not fused_decode.enabled(x)
                  and not pooled)  # fmt: skip
        lib = cpu_kernels.library() if kernel else None
        if lib is not None:
            weights = self._kernel_weights()
            if weights is not None:
                return self._kernel_step(lib, weights, x, position_embeddings, slot)
        ds = self._decode_state(slot, x.shape[0], x.device, x.dtype)
        dt = ds.states.dtype
        maps = self._fused_maps(x, dt)
        rope = self._kernel_rope(x, position_embeddings) if maps is not None else None
        if rope is not None:  # q, k before RoPE: the inputs kernel rotates them
            q, k, v = qkv_heads(self, x)
        else:
            q, k, v = self.project_linear(x, position_embeddings)  # (B, Hq|Hkv, 1, D): no RoPE unless linear_rope
        b, hkv = k.shape[:2]
        if maps is not None:  # features and gates in one kernel
            qf, kf, decay = self._fused_inputs(x, q, k, maps, rope)
        else:
            if self.normalize:
                qf, kf = token_features(self, self.feature_map_q, self.feature_map_k, q, k)  # (B, Hq, F) each
            else:
                qf, kf = q.reshape(b, self.num_heads, -1), k.expand(b, hkv, self.num_heads // hkv, self.head_dim)
            if qf.dtype != dt:
                qf, kf = qf.to(dt), kf.to(dt)
            decay = self.decode_gates(x, dt)  # (B, 2, Hq, F)
        weights = derived(self, f"mix_{self.mode}", (self.gamma_logit,), lambda: self._mix_weights(dt))
        out = dsla_decode_step(ds, qf, kf, v, decay, weights, normalize=self.normalize)
        slot.advance(ds, 1)
        return out

    def _fused_maps(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """Both Hedgehog maps stacked (weight, bias) where ``fused_decode.dsla_decode_inputs`` takes
        the step's features and gates (one kernel for both maps and both gates): Hedgehog maps,
        float32 states, the fused kernels on for x's device and the maps' sizes; else None."""
        if not (self.normalize and dtype == torch.float32 and fused_decode.enabled(x)):
            return None
        phi_q, phi_k = self._modules.get("feature_map_q"), self._modules.get("feature_map_k")  # none without feature maps
        if not (isinstance(phi_q, HedgehogFeatureMap) and isinstance(phi_k, HedgehogFeatureMap)):
            return None
        weight, bias = stacked_hedgehog(self, phi_q, phi_k, x.dtype)
        return (weight, bias) if fused_decode.dsla_inputs_apply(x, weight) else None

    def _kernel_rope(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor] | None:
        """The token's (cos, sin) (B or 1, D) for the inputs kernel to rotate q and k itself, where the
        maps see q and k after RoPE (``linear_rope``), ``fused_decode.DSLA_ROPE_IN_KERNEL`` is on and
        the rotary embedding is one position per row in x's dtype; else None (RoPE applied before)."""
        if not (self.options.linear_rope and fused_decode.DSLA_ROPE_IN_KERNEL):
            return None
        cos, sin = position_embeddings
        b = x.shape[0]
        if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1:] != (1, self.head_dim) or cos.dtype != x.dtype:
            return None
        return cos[:, 0], sin[:, 0]

    def _fused_inputs(self, x: Tensor, q: Tensor, k: Tensor, maps: tuple[Tensor, Tensor],
                      rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """(qf, kf, decay) of one token from ``fused_decode.dsla_decode_inputs``, with the Hedgehog
        ``maps`` of ``_fused_maps``; ``rope``: q and k come before RoPE, rotated in the kernel."""
        b = q.shape[0]
        down, up, gate_bias = self.fused_gate_weights()
        xr = None
        if fused_decode.DSLA_GATE_DOWN and x.dtype == torch.bfloat16 and down.dtype == torch.float32:
            # the gates' down projection in the kernel, from the weights' bfloat16 parts (kept)
            h, r = self.gate_history, self.gate_recent
            down = derived(self, "gate_down_parts", (h.down.weight, r.down.weight), lambda: fused_decode.bf16_parts(down))
        else:  # as one float32 GEMM here
            xr = fused_dsla.gate_inputs(x, down, self.options.dsla_gate_rank).view(b, 2, -1)
        cos, sin = rope if rope is not None else (None, None)
        return fused_decode.dsla_decode_inputs(q.reshape(b, self.num_heads, -1), k.reshape(b, k.shape[1], -1), x.reshape(b, -1), down,
                                               *maps, up, gate_bias, xr, cos, sin)  # fmt: skip

    def has_static_decoding(self) -> bool:
        return self.mode in self.GAMMA

    def static_decode_state(self, slot, batch: int, device, dtype, clock=None) -> DslaDecodeState:
        return self._decode_state(slot, batch, device, dtype)  # already updated in place, no host reads

    def _decode_state(self, slot, b: int, device, dtype) -> DslaDecodeState:
        """The slot's decode state, made from its state (zeros when empty) before the first token."""
        ds = slot.decode_state
        if not isinstance(ds, DslaDecodeState):
            state = expect_state(slot.state, DslaState, self)
            if state is None:
                zeros = torch.zeros(b, self.num_heads, self.features, self.head_dim + self.normalize, device=device,
                                    dtype=accumulation_dtype(dtype))  # fmt: skip
                state = DslaState(history=zeros, recent=zeros.clone())
            ds = DslaDecodeState.from_state(state, self.num_kv_heads, self.normalize)
        return ds

    KERNEL_SOURCES = ("gate_history.down.weight", "gate_history.up.weight", "gate_history.up.bias", "gate_recent.down.weight",
                      "gate_recent.up.weight", "gate_recent.up.bias", "gamma_logit")  # fmt: skip
    """What the CPU kernel's weights are made of (and, with a feature map, the maps' weights and biases)."""

    def _kernel_weights(self) -> cpu_kernels.Weights | None:
        """The CPU kernel's weights for this layer's mode, kept between tokens (``derived``); None where
        the kernel does not apply: feature maps other than Hedgehog or identity, parameters other
        than float32."""
        maps = ()
        if self.normalize:
            if not isinstance(self._modules["feature_map_q"], HedgehogFeatureMap):
                return None
            maps = ("feature_map_q.weight", "feature_map_q.bias", "feature_map_k.weight", "feature_map_k.bias")
        sources = tensors_at(self, self.KERNEL_SOURCES + maps)
        mode = self.mode

        def build() -> cpu_kernels.Weights | None:
            if any(t.dtype != torch.float32 for t in sources):
                return None
            down_h, up_h, bias_h, down_r, up_r, bias_r, _, *hedgehog = sources
            wq, bq, wk, bk = (t.contiguous() for t in hedgehog) if hedgehog else (None,) * 4
            return cpu_kernels.Weights(down=torch.cat((down_h, down_r)), up=torch.stack((up_h.T, up_r.T)).contiguous(),
                                       up_bias=torch.stack((bias_h, bias_r)), wq=wq, bq=bq, wk=wk, bk=bk,
                                       mix=self._mix_weights(torch.float32))  # fmt: skip

        return derived(self, f"kernel_{mode}", sources, build)

    def _kernel_step(self, lib, weights, x, position_embeddings, slot):
        """``decode_step`` as one CPU kernel call (``cpu_kernels.dsla_step``)."""
        b = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, 1, H D): RoPE, if any, in the kernel
        ds = self._decode_state(slot, b, x.device, x.dtype)
        out = cpu_kernels.dsla_step(lib, ds, x, q, k, v, weights, heads=self.num_heads, kv_heads=self.num_kv_heads,
                                    head_dim=self.head_dim, normalize=self.normalize, rope=position_embeddings if self.options.linear_rope else None)  # fmt: skip
        slot.advance(ds, 1)
        return out

    def stacked_log_gates(self, x: Tensor) -> Tensor:
        """(B, T, hidden) -> (B, T, 2, Hq, F) float32 log-gates, history first: both gates' low-rank
        projections as two matmuls (down projections side by side, up projections block-diagonal,
        stacked once and kept), one log-sigmoid for both. The same numbers as ``log_gates``."""
        h, r = self.gate_history, self.gate_recent
        down, up, bias = derived(self, "gates", tuple(t for g in (h, r) for t in (g.down.weight, g.up.weight, g.up.bias)),
                                 lambda: (torch.cat((h.down.weight, r.down.weight)), torch.block_diag(h.up.weight, r.up.weight),
                                          torch.cat((h.up.bias, r.up.bias))))  # fmt: skip
        z = F.linear(F.linear(x.to(down.dtype), down), up, bias)  # (B, T, 2 Hq F)
        return log_gate(z).view(*x.shape[:2], 2, self.num_heads, self.features)

    def fused_gate_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """Both gates' weights as the fused prefill takes them, stacked once and kept: the down
        projections side by side (2 rank, hidden), the up projections (2, R, Hq F) and biases
        (2, Hq F) in float32 (``fused_dsla.gate_weights``)."""
        h, r = self.gate_history, self.gate_recent
        return derived(self, "fused_gates", tuple(t for g in (h, r) for t in (g.down.weight, g.up.weight, g.up.bias)),
                       lambda: (torch.cat((h.down.weight, r.down.weight)),
                                *fused_dsla.gate_weights(torch.stack((h.up.weight, r.up.weight)), torch.stack((h.up.bias, r.up.bias)),
                                                         self.options.dsla_gate_rank)))  # fmt: skip

    def decode_gates(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """(B, 2, Hq, F) gate values alpha = exp(log alpha) of one token x (B, 1, hidden), history
        first (``stacked_log_gates``, one exp for both)."""
        return self.stacked_log_gates(x).exp_().view(x.shape[0], 2, self.num_heads, self.features).to(dtype)

    def _mix_weights(self, dtype: torch.dtype) -> Tensor:
        """(gamma, 1 - gamma) of this layer's mode, times the read's scale without a normaliser."""
        fixed = self.GAMMA[self.mode]
        gamma = self.gamma() if fixed is None else torch.tensor(fixed, device=self.gamma_logit.device)
        scale = 1.0 if self.normalize else self.scaling
        return (torch.stack((gamma, 1 - gamma)) * scale).to(dtype)


def dsla_memory(options: DslaOptions, config, dtype_bytes: int) -> tuple[int, int]:
    """Two (features x head_dim [+ 1 normaliser column]) states per query head, float32."""
    h, _, head_dim = head_sizes(config)
    return 0, 2 * h * options.features(head_dim) * (head_dim + options.normalized) * STATE_BYTES


KIND = AttentionKind(
    name="dsla",
    layer=DslaAttention,
    options=DslaOptions,
    state=DslaState,
    modes=("hybrid", "history_only", "recent_only"),
    ablation_modes=("hybrid", "history_only", "recent_only", "sinks_only", "none"),
    memory=dsla_memory,
    diagnostics=("attention_mass", "gates"),
    description="dual-state gated linear attention (DSLA)",
)
