"""Feature-map modules (learned Hedgehog maps per head, untied for q and k; fixed maps) and the
spec fields every kind with a linear part shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..checks import check_choice, check_int
from ..ops.feature_maps import FEATURE_MAP_NAMES, FIXED_FEATURE_MAPS, LEARNED_FEATURE_MAPS, hedgehog
from ..ops.fused_prefill import hedgehog_token_major
from .base import KindOptions, SpecError


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

    def num_features(self, head_dim: int) -> int:
        """Features per token (2f), whatever the head size."""
        return 2 * self.weight.shape[-1]

    def token_major(self, x: Tensor, n_rep: int = 1, out: Tensor | None = None) -> Tensor:
        """The features of ``x`` (B, H / n_rep, T, d), each of its heads serving ``n_rep`` of this
        map's heads, token-major (B, T, H, 2f) (into ``out`` when given): one Triton kernel
        (inference: no gradient)."""
        return hedgehog_token_major(x, self.weight, self.bias, n_rep, out=out)


class FixedFeatureMap(nn.Module):
    """A parameter-free map by name (exp, relu, elu, identity)."""

    def __init__(self, name: str):
        super().__init__()
        if name not in FIXED_FEATURE_MAPS:
            raise ValueError(f"unknown fixed feature map {name!r}; valid: {', '.join(FIXED_FEATURE_MAPS)}")
        self.name = name

    def forward(self, x: Tensor) -> Tensor:
        return FIXED_FEATURE_MAPS[self.name](x)

    def num_features(self, head_dim: int) -> int:
        """Features per token: the head size (these maps act elementwise)."""
        return head_dim

    def extra_repr(self) -> str:
        return self.name


def build_feature_map(name: str, num_heads: int, head_dim: int, features: int, *, seed: int) -> nn.Module:
    if name == "hedgehog":
        return HedgehogFeatureMap(num_heads, head_dim, features, seed=seed)
    return FixedFeatureMap(name)


@dataclass
class FeatureMapOptions(KindOptions):
    """Spec fields of every kind with a linear part: its feature map and what the map sees."""

    feature_map: str = "hedgehog"
    """hedgehog (learned +-softmax) | exp | relu | elu (1 + elu) | identity. DSLA: identity is the
    paper's raw form (q, k as they are, no normaliser); any other map is applied to q and k and each
    state's read is normalised."""
    feature_dim: int | None = None
    """Number of features phi produces. hedgehog: 2 * head_dim (square W, default) or head_dim
    (rectangular d x d/2 W). Fixed maps: head_dim (None means the default)."""
    linear_rope: bool = True
    """True: the feature maps act on RoPE-rotated q/k (LoLCATs). False: on q/k before RoPE, so the
    linear part depends on no absolute position (it cannot drift past the positions seen in
    training) while the window softmax keeps RoPE; DSLA then runs without RoPE."""

    def __post_init__(self) -> None:
        check_choice("feature_map", self.feature_map, FEATURE_MAP_NAMES, SpecError)
        check_int("feature_dim", self.feature_dim, 1, allow_none=True, error=SpecError)
        if self.feature_dim is not None and self.feature_map in LEARNED_FEATURE_MAPS and self.feature_dim % 2:
            raise SpecError(f"feature_dim of a hedgehog map must be even (2 x projection width), got {self.feature_dim}")
        if not isinstance(self.linear_rope, bool):
            raise SpecError(f"linear_rope must be true or false, got {self.linear_rope!r}")

    def features(self, head_dim: int) -> int:
        """Number of features phi produces for this head size."""
        if self.feature_map in LEARNED_FEATURE_MAPS:
            return self.feature_dim or 2 * head_dim
        if self.feature_dim not in (None, head_dim):
            raise SpecError(f"feature map {self.feature_map!r} keeps head_dim={head_dim} features; got feature_dim={self.feature_dim}")
        return head_dim

    def check_head_dim(self, head_dim: int) -> None:
        self.features(head_dim)


def feature_map_pair(options: FeatureMapOptions, num_heads: int, head_dim: int, layer_idx: int) -> tuple[nn.Module, nn.Module]:
    """Untied maps for q and k (seeded by the layer index, so a conversion is reproducible)."""
    features = options.features(head_dim)
    return (build_feature_map(options.feature_map, num_heads, head_dim, features, seed=2 * layer_idx),
            build_feature_map(options.feature_map, num_heads, head_dim, features, seed=2 * layer_idx + 1))
