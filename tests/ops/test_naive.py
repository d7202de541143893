"""The references in linearize.ops.naive stand alone: they share no helper with the fast paths.

Two checks. Structurally, naive.py imports nothing but torch, the state containers and the
empty-normaliser threshold. Behaviourally, breaking a helper of a fast path (masking, mixing, GQA
repetition, division, selection) leaves the reference unchanged and makes the fast path disagree
with it, so the fast-vs-reference tests catch that helper's bugs instead of passing on both sides.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from linearize.ops import dsla, hybrid, linear_attn, lola, naive, softmax
from linearize.ops.states import BatchState


def test_naive_imports_only_torch_states_and_the_threshold():
    tree = ast.parse(inspect.getsource(naive))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    allowed_modules = ("__future__.", "torch", "linearize.ops.states.")
    allowed_names = {"linearize.ops.common.EMPTY_DENOMINATOR", "linearize.ops.common.FeatureFn"}
    stray = {name for name in imported if not name.startswith(allowed_modules) and name not in allowed_names}
    assert not stray, f"naive.py imports {sorted(stray)}: references must not share code with the fast paths"


@pytest.mark.parametrize(
    "module, name",
    [
        ("softmax", "softmax_attention_reference"),
        ("softmax", "sinks_attention_reference"),
        ("linear_attn", "linear_attention_reference"),
        ("hybrid", "hybrid_attention_reference"),
        ("lola", "lola_attention_reference"),
        ("dsla", "gla_reference"),
        ("dsla", "dsla_attention_reference"),
    ],
    ids=lambda x: x,
)
def test_old_import_paths_give_the_naive_reference(module, name):
    assert getattr(importlib.import_module(f"linearize.ops.{module}"), name) is getattr(naive, name)


# ---------------------------------------------------------------- breaking a fast path's helper


def _inputs(seed=0, b=2, hq=4, hkv=2, t=11, d=8):
    """Random q, k, v and a left-padded second row (its padding holds garbage, not zeros)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h in (hq, hkv, hkv))
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :3] = False
    return q, k, v, valid


def _phi(heads, d, seed):
    w = torch.randn(heads, d, d // 2, generator=torch.Generator().manual_seed(seed)) / d**0.5

    def phi(x):  # (B, H, T, D) -> (B, H, T, D)
        z = torch.einsum("bhtd,hdf->bhtf", x, w.to(x.dtype))
        return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1)

    return phi


def run_softmax(impl):
    q, k, v, valid = _inputs()
    if impl == "fast":
        return softmax.softmax_attention(q, k, v, valid=valid)[0]
    return naive.softmax_attention_reference(q, k, v, valid=valid)


def run_sinks(impl):
    q, k, v, valid = _inputs()
    if impl == "fast":
        return softmax.sinks_attention(q, k, v, n_sinks=3, valid=valid)[0]
    return naive.sinks_attention_reference(q, k, v, n_sinks=3, valid=valid)


def run_linear(impl):
    q, k, v, _ = _inputs(hkv=4)
    q_phi, k_phi = q.exp(), k.exp()
    if impl == "fast":
        return linear_attn.linear_attention(q_phi, k_phi, v, chunk=4)
    return naive.linear_attention_reference(q_phi, k_phi, v)


def run_hybrid(impl, mix="gate"):
    q, k, v, valid = _inputs()
    kw = dict(phi_q=_phi(4, 8, 1), phi_k=_phi(4, 8, 2), window=3, mix=mix, window_factor=torch.full((4,), 0.3),
              gate=torch.full((4,), 0.7), valid=valid)
    if impl == "fast":
        return hybrid.hybrid_attention(q, k, v, chunk=4, **kw)
    return naive.hybrid_attention_reference(q, k, v, **kw)


def run_lola(impl):
    q, k, v, valid = _inputs()
    kw = dict(phi_q=_phi(4, 8, 1), phi_k=_phi(4, 8, 2), window=3, sparse=2, chunk=2,
              window_factor=torch.full((4,), 0.3), valid=valid)
    fn = lola.lola_attention if impl == "fast" else naive.lola_attention_reference
    return fn(q, k, v, **kw)


def run_dsla(impl, normalize=True):
    q, k, v, valid = _inputs()
    g = torch.Generator().manual_seed(5)
    g1 = dsla.log_gate(torch.randn(q.shape, generator=g) + 4)
    g2 = F.logsigmoid(torch.randn(q.shape, generator=g))
    if normalize:
        q, k = F.softplus(q), F.softplus(k)
    fn = dsla.dsla_attention if impl == "fast" else naive.dsla_attention_reference
    return fn(q, k, v, g1, g2, torch.tensor([0.2, 0.4, 0.6, 0.8]), valid=valid, normalize=normalize)


def _flat(result) -> list[torch.Tensor]:
    """Output and every floating state tensor of a result (a tensor or (out, state))."""
    if isinstance(result, torch.Tensor):
        return [result]
    out, state = result
    assert isinstance(state, BatchState)
    return [out, *(x for x in state.tensors() if x.is_floating_point())]


def _same(a, b) -> bool:
    xs, ys = _flat(a), _flat(b)
    return len(xs) == len(ys) and all(x.shape == y.shape and torch.allclose(x, y, atol=1e-5, rtol=1e-5) for x, y in zip(xs, ys))


def _scaled(fn: Callable) -> Callable:
    return lambda *a, **kw: fn(*a, **kw) * 1.01


def _heads_flipped(fn: Callable) -> Callable:
    return lambda x, n_rep: fn(x, n_rep).flip(1)


BROKEN = {
    # kind: (run, module, helper, how it is broken)
    "softmax._masked_softmax_attention": (run_softmax, softmax, "_masked_softmax_attention", _scaled),
    "softmax.repeat_kv": (run_softmax, softmax, "repeat_kv", _heads_flipped),
    "softmax.default_valid": (run_softmax, softmax, "default_valid", lambda fn: lambda x, valid: fn(x, None)),
    "sinks._masked_softmax_attention": (run_sinks, softmax, "_masked_softmax_attention", _scaled),
    "linear_attn.safe_divide": (run_linear, linear_attn, "safe_divide", _scaled),
    "hybrid._mix": (run_hybrid, hybrid, "_mix", _scaled),
    "hybrid.safe_divide": (run_hybrid, hybrid, "safe_divide", _scaled),
    "hybrid.repeat_kv": (run_hybrid, hybrid, "repeat_kv", _heads_flipped),
    "hybrid.default_valid": (run_hybrid, hybrid, "default_valid", lambda fn: lambda x, valid: fn(x, None)),
    "hybrid.linear_attention_numden": (
        run_hybrid, hybrid, "linear_attention_numden",
        lambda fn: lambda *a, **kw: (lambda num, den, st: (num * 1.01, den, st))(*fn(*a, **kw)),
    ),
    "lola.safe_divide": (run_lola, lola, "safe_divide", _scaled),
    "lola.repeat_kv": (run_lola, lola, "repeat_kv", _heads_flipped),
    "lola.self_recall_error": (run_lola, lola, "self_recall_error", lambda fn: lambda *a: -fn(*a)),
    "dsla._mix": (run_dsla, dsla, "_mix", lambda fn: lambda o1, o2, gamma, q, normalize=False: fn(o2, o1, gamma, q, normalize)),
    "dsla._mask_padding": (run_dsla, dsla, "_mask_padding", lambda fn: lambda q, k, v, g1, g2, valid: fn(q, k, v, g1, g2, None)),
    "dsla._with_ones": (run_dsla, dsla, "_with_ones", lambda fn: lambda v: torch.cat([v, 2 * torch.ones_like(v[..., :1])], -1)),
    "dsla.repeat_kv": (run_dsla, dsla, "repeat_kv", _heads_flipped),
}


@pytest.mark.parametrize("name", list(BROKEN), ids=list(BROKEN))
def test_a_broken_fast_path_helper_leaves_the_reference_and_is_caught(monkeypatch, name):
    run, module, helper, breaker = BROKEN[name]
    ref_before, fast_before = run("reference"), run("fast")
    assert _same(fast_before, ref_before), "fast path and reference disagree before anything is broken"
    monkeypatch.setattr(module, helper, breaker(getattr(module, helper)))
    ref_after, fast_after = run("reference"), run("fast")
    assert _same(ref_after, ref_before), f"breaking {name} changed the reference: it shares that helper"
    assert not _same(fast_after, ref_after), f"breaking {name} went unnoticed by the fast-vs-reference comparison"
