"""Feature maps phi for linear attention, applied per head over the feature axis.

Hedgehog (LoLCATs): phi(x) = [softmax(x W + b), softmax(-(x W + b))], softmax over the feature
axis (not over tokens). W is a learned per-head (d x f) matrix: square f = d gives 2d features,
rectangular f = d/2 gives d features. The fixed maps (exp, relu, elu = 1 + elu, identity) keep d
features and exist for ablations.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def hedgehog(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x (B, H, T, d), weight (H, d, f), bias (H, f) -> (B, H, T, 2f)."""
    b, h, t, d = x.shape
    xh = x.transpose(0, 1).reshape(h, b * t, d)  # a view when b * t == 1 (decoding one token)
    proj = torch.baddbmm(bias[:, None, :], xh, weight).view(h, b, t, -1).transpose(0, 1)  # (B, H, T, f)
    return torch.stack((proj, -proj), dim=-2).softmax(dim=-1).flatten(-2)  # [softmax(p), softmax(-p)]


def hedgehog_pair(q: Tensor, k: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The q and k Hedgehog maps of one token, as a decode step reads them: q (B, Hq, D) and k (B, Hkv, D)
    (grouped heads: k's features for every query head of its KV head), ``weight`` (2 Hq, D, f) and
    ``bias`` (2 Hq, 1, f) the two maps stacked, queries' first -> (phi_q(q), phi_k(k)) as (B, Hq, 2f)
    each: one batched projection and one softmax over both maps, no repeated copy of k's heads."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    n_rep = hq // hkv
    x = torch.cat((q.reshape(b, hkv, n_rep, d), k.reshape(b, hkv, 1, d).expand(b, hkv, n_rep, d)), dim=1)  # (B, 2 Hkv, n_rep, D)
    proj = torch.baddbmm(bias, x.view(b, 2 * hq, d).transpose(0, 1), weight)  # (2 Hq, B, f): q heads, then k per q head
    feats = torch.stack((proj, -proj), dim=-2).softmax(dim=-1).view(2 * hq, b, -1).transpose(0, 1)  # (B, 2 Hq, 2f)
    return feats[:, :hq], feats[:, hq:]


def hedgehog_reference(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The same map as a plain float32 loop over heads and tokens (the specification)."""
    b, h, t, _ = x.shape
    out = []
    for bi in range(b):
        heads = []
        for hi in range(h):
            rows = []
            for ti in range(t):
                p = x[bi, hi, ti].float() @ weight[hi].float() + bias[hi].float()  # (f,)
                rows.append(torch.cat([p.exp() / p.exp().sum(), (-p).exp() / (-p).exp().sum()]))
            heads.append(torch.stack(rows))
        out.append(torch.stack(heads))
    return torch.stack(out)


def elu_plus_one(x: Tensor) -> Tensor:
    return F.elu(x) + 1.0


FIXED_FEATURE_MAPS: dict[str, Callable[[Tensor], Tensor]] = {
    "exp": torch.exp,
    "relu": torch.relu,
    "elu": elu_plus_one,
    "identity": lambda x: x,
}
"""Parameter-free feature maps, by name (d -> d features)."""

LEARNED_FEATURE_MAPS = ("hedgehog",)
FEATURE_MAP_NAMES = LEARNED_FEATURE_MAPS + tuple(FIXED_FEATURE_MAPS)
