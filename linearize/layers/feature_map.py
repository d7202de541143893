"""Feature-map modules: learned Hedgehog maps (per head, untied for q and k) and fixed maps."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.feature_maps import FIXED_FEATURE_MAPS, hedgehog


class HedgehogFeatureMap(nn.Module):
    """phi(x) = [softmax(x W + b), softmax(-(x W + b))] with a learned (d x f) W per head.

    ``f = features // 2``: square (f = d, 2d features) or rectangular (f = d/2, d features). W starts
    at the identity (its first f columns for a rectangular map) plus small noise drawn from a generator
    seeded by ``seed``, so a conversion is reproducible.
    """

    def __init__(self, num_heads: int, head_dim: int, features: int, *, seed: int = 0, noise: float = 1e-3):
        super().__init__()
        width = features // 2
        eye = torch.eye(head_dim, width)  # (d, f)
        gen = torch.Generator().manual_seed(seed)
        init = eye.expand(num_heads, head_dim, width) + noise * torch.randn(num_heads, head_dim, width, generator=gen)
        self.weight = nn.Parameter(init.contiguous())  # (H, d, f)
        self.bias = nn.Parameter(torch.zeros(num_heads, width))  # (H, f)

    def forward(self, x: Tensor) -> Tensor:  # (B, H, T, d) -> (B, H, T, 2f)
        return hedgehog(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class FixedFeatureMap(nn.Module):
    """A parameter-free map by name (exp, relu, elu, identity)."""

    def __init__(self, name: str):
        super().__init__()
        if name not in FIXED_FEATURE_MAPS:
            raise ValueError(f"unknown fixed feature map {name!r}; valid: {', '.join(FIXED_FEATURE_MAPS)}")
        self.name = name

    def forward(self, x: Tensor) -> Tensor:
        return FIXED_FEATURE_MAPS[self.name](x)

    def extra_repr(self) -> str:
        return self.name


def build_feature_map(name: str, num_heads: int, head_dim: int, features: int, *, seed: int) -> nn.Module:
    if name == "hedgehog":
        return HedgehogFeatureMap(num_heads, head_dim, features, seed=seed)
    return FixedFeatureMap(name)
