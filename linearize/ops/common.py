"""Small tensor helpers shared by the attention ops (no model knowledge)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

FeatureFn = Callable[[Tensor], Tensor]
"""A feature map: (B, H, T, D) -> (B, H, T, F), applied per head (after GQA repetition)."""


def head_weights(weight, heads: int, device=None, *, name: str = "linear_weight") -> Tensor:
    """A weight per query head as float32 (heads,): one number >= 0 for every head, or one per head
    (a sequence or tensor of ``heads`` numbers >= 0). ValueError naming the bad value otherwise."""
    w = torch.as_tensor(weight, dtype=torch.float32, device=device)
    if w.dim() == 0:
        w = w.expand(heads).contiguous()  # the kernels read it as a plain (heads,) tensor
    if w.shape != (heads,):
        raise ValueError(f"{name} must be one number or {heads} (one per query head), got {tuple(w.shape)[0] if w.dim() == 1 else tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"{name} must be finite and >= 0, got {w.tolist()}")
    return w


def on_device(weights: Tensor, device) -> Tensor:
    """``weights`` (a small float32 CPU tensor of option values, e.g. ``head_weights``'s) on
    ``device``, copied there once per distinct value and device and kept: a forward that reads them
    every call makes no host-to-device copy, which PyTorch makes blocking (a wait for the stream)
    when the source is ordinary host memory. The tensor returned may be shared: read it, never
    write it."""
    device = torch.device(device)
    if weights.device == device:
        return weights
    return _kept_on_device(tuple(weights.tolist()), weights.dtype, device)


@functools.lru_cache(maxsize=256)
def _kept_on_device(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
        return torch.tensor(values, dtype=dtype, device=device)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D), each KV head repeated for its query heads (HF order)."""
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=1)


def gqa_groups(q: Tensor, k: Tensor) -> int:
    """Number of query heads per KV head; raises if the head counts do not divide."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return hq // hkv


def default_valid(x: Tensor, valid: Tensor | None) -> Tensor:
    """A (B, T) bool mask of real tokens; all True when ``valid`` is None."""
    b, t = x.shape[0], x.shape[2]
    if valid is None:
        return torch.ones(b, t, dtype=torch.bool, device=x.device)
    if valid.shape != (b, t):
        raise ValueError(f"valid mask has shape {tuple(valid.shape)}, expected {(b, t)}")
    return valid.to(device=x.device, dtype=torch.bool)


EMPTY_DENOMINATOR = 1e-12
"""Normalisers at or below this read as empty (output 0). Linear-attention normalisers are sums of
non-negative feature products; one that is this small means no key matched, and dividing by it
would give d(num/den)/d(den) = -num/den^2 overflowing to inf and NaN gradients (seen with peaked
Hedgehog features on SmolLM2, even in float32)."""


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den with 0 where den <= EMPTY_DENOMINATOR (den broadcast over the last axis of num);
    gradients stay finite."""
    den = den.unsqueeze(-1)
    ok = den > EMPTY_DENOMINATOR
    return torch.where(ok, num / torch.where(ok, den, 1.0), 0.0)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate in: float32 for half/bfloat16/float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def gather_tokens(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, L, X), index (B, L') -> (B, H, L', X): the same token gather for every head of a row."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
