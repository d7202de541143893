"""Normalised causal linear attention on already-featurised inputs.

    S_t = S_0 + sum_{i<=t} phi(k_i) v_i^T,   z_t = z_0 + sum_{i<=t} phi(k_i)
    o_t = phi(q_t)^T S_t / phi(q_t)^T z_t    (0 where the denominator is 0)

Inputs are per query head: keys already repeated for GQA and featurised, q_phi/k_phi (B, H, T, F),
v (B, H, T, Dv). The module is mask-free: callers zero phi(k) (and v) of padding tokens themselves,
so padding never enters a sum or a state. Sums are accumulated in float32 (float64 inputs stay
float64); states are returned in that dtype. The specification, ``linear_attention_reference``
(a token-by-token loop), lives in ``linearize.ops.naive`` and is re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import accumulation_dtype, safe_divide
from .naive import linear_attention_reference  # noqa: F401 (the specification)
from .states import LinearState

BACKENDS = ("torch", "fla")


def _zero_state(q_phi: Tensor, v: Tensor, dtype: torch.dtype) -> LinearState:
    b, h, _, f = q_phi.shape
    return LinearState.zeros(b, h, f, v.shape[-1], device=q_phi.device, dtype=dtype)


def _numden_torch(q_phi: Tensor, k_phi: Tensor, v: Tensor, state: LinearState | None, chunk: int):
    b, h, t, f = q_phi.shape
    dv = v.shape[-1]
    dt = accumulation_dtype(v.dtype)
    state = _zero_state(q_phi, v, dt) if state is None else state
    c = max(1, min(chunk, t))
    n = -(-t // c)
    pad = n * c - t
    qc = F.pad(q_phi.to(dt), (0, 0, 0, pad)).view(b, h, n, c, f)  # (B, H, N, C, F)
    kc = F.pad(k_phi.to(dt), (0, 0, 0, pad)).view(b, h, n, c, f)  # (B, H, N, C, F)
    vc = F.pad(v.to(dt), (0, 0, 0, pad)).view(b, h, n, c, dv)  # (B, H, N, C, Dv)
    # Inter-chunk: state before each chunk = initial state + sum of the earlier chunks.
    kv_cum = torch.einsum("bhncf,bhncd->bhnfd", kc, vc).cumsum(dim=2)  # (B, H, N, F, Dv)
    z_cum = kc.sum(dim=3).cumsum(dim=2)  # (B, H, N, F)
    kv_before = state.kv[:, :, None].to(dt) + F.pad(kv_cum[:, :, :-1], (0, 0, 0, 0, 1, 0))  # (B, H, N, F, Dv)
    z_before = state.k_sum[:, :, None].to(dt) + F.pad(z_cum[:, :, :-1], (0, 0, 1, 0))  # (B, H, N, F)
    # Intra-chunk: quadratic with a causal mask.
    causal = torch.ones(c, c, dtype=torch.bool, device=q_phi.device).tril()  # (C, C)
    a = torch.einsum("bhncf,bhnsf->bhncs", qc, kc) * causal  # (B, H, N, C, C)
    num = torch.einsum("bhncf,bhnfd->bhncd", qc, kv_before) + a @ vc  # (B, H, N, C, Dv)
    den = torch.einsum("bhncf,bhnf->bhnc", qc, z_before) + a.sum(-1)  # (B, H, N, C)
    final = LinearState(kv=state.kv.to(dt) + kv_cum[:, :, -1], k_sum=state.k_sum.to(dt) + z_cum[:, :, -1])
    return num.reshape(b, h, n * c, dv)[:, :, :t], den.reshape(b, h, n * c)[:, :, :t], final


def _numden_fla(q_phi: Tensor, k_phi: Tensor, v: Tensor, state: LinearState | None):
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as exc:
        raise RuntimeError(
            "backend 'fla' needs flash-linear-attention (fla-core==0.6.0) with CUDA and triton; "
            f"valid backends: {BACKENDS} (use 'torch' without them)"
        ) from exc
    dv = v.shape[-1]
    # Unnormalised kernel on v' = [v, 1]: o'[..., :Dv] = numerator, o'[..., Dv] = denominator;
    # the kernel's state is S' = [S, z].
    v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)  # (B, H, T, Dv+1)
    h0 = None if state is None else torch.cat([state.kv, state.k_sum[..., None]], dim=-1).float()  # (B, H, F, Dv+1)
    o, ht = chunk_simple_gla(
        q=q_phi.transpose(1, 2),  # (B, T, H, F): fla's layout
        k=k_phi.transpose(1, 2),
        v=v1.transpose(1, 2),  # (B, T, H, Dv+1)
        scale=1.0,
        initial_state=h0,
        output_final_state=True,
    )
    o = o.transpose(1, 2).float()  # (B, H, T, Dv+1)
    return o[..., :dv], o[..., dv], LinearState(kv=ht[..., :dv], k_sum=ht[..., dv])  # ht (B, H, F, Dv+1) float32


def linear_attention_numden(
    q_phi: Tensor,
    k_phi: Tensor,
    v: Tensor,
    state: LinearState | None = None,
    *,
    backend: str = "torch",
    chunk: int = 64,
) -> tuple[Tensor, Tensor, LinearState]:
    """Numerator phi(q_t)^T S_t (B, H, T, Dv) and denominator phi(q_t)^T z_t (B, H, T), separately.

    backend "torch": chunked form (quadratic inside a chunk of ``chunk`` tokens, states between
    chunks), float32 accumulation, differentiable. backend "fla": flash-linear-attention's chunk
    kernel (CUDA only; computes in the inputs' dtype with float32 accumulation; ``chunk`` unused).
    Outputs and the final state are float32 (float64 for float64 inputs on "torch").
    """
    if backend == "torch":
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        return _numden_torch(q_phi, k_phi, v, state, chunk)
    if backend == "fla":
        return _numden_fla(q_phi, k_phi, v, state)
    raise ValueError(f"unknown linear-attention backend {backend!r}; valid: {BACKENDS}")


def linear_attention(
    q_phi: Tensor,
    k_phi: Tensor,
    v: Tensor,
    state: LinearState | None = None,
    *,
    backend: str = "torch",
    chunk: int = 64,
) -> tuple[Tensor, LinearState]:
    """Normalised causal linear attention: (out (B, H, T, Dv) in v's dtype, final state)."""
    num, den, final = linear_attention_numden(q_phi, k_phi, v, state, backend=backend, chunk=chunk)
    return safe_divide(num, den).to(v.dtype), final
