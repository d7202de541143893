"""Random position offsets for training: length robustness at no extra compute.

A converted layer whose feature maps see RoPE-rotated q/k (or whose state otherwise depends on
absolute position) only learns the positions it is trained on, e.g. 0..1023 at seq_len 1024, and
drifts beyond them. The teacher's attention under RoPE depends on relative positions only, so adding
one offset to every position of a row leaves its targets unchanged while the converted layers see
absolute positions up to offset + seq_len.
"""

from __future__ import annotations

import torch
from torch import Tensor


def offset_position_ids(batch: int, seq_len: int, max_offset: int, *, seed: int, step: int, rank: int = 0,
                        device: torch.device | str | None = None) -> Tensor | None:
    """(B, T) long position ids ``arange(T) + offset_b`` with one offset per row drawn uniformly from
    0..max_offset, deterministic in (seed, rank, step); None when ``max_offset`` is 0 (the model's own
    0..T-1)."""
    if max_offset < 0:
        raise ValueError(f"max_offset must be >= 0, got {max_offset}")
    if max_offset == 0:
        return None
    gen = torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_033 + step + 7)
    offsets = torch.randint(0, max_offset + 1, (batch, 1), generator=gen)  # (B, 1)
    return (torch.arange(seq_len)[None, :] + offsets).to(device)  # (B, T)
