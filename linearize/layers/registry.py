"""The attention kinds, by name: the one place a new kind is registered.

A kind is its own file in this package (options dataclass, layer class, memory formula and an
``AttentionKind`` record named ``KIND``) plus one entry in ``_REGISTERED`` below; the spec, the CLI
flags, conversion, modes, memory, ablations and diagnostic plots all read ``KINDS``.
"""

from __future__ import annotations

from . import dsla, hybrid, lola, softmax
from .base import GENERIC_MODES, AttentionKind, SpecError

_REGISTERED = (softmax.KIND, hybrid.KIND, lola.KIND, dsla.KIND)

KINDS: dict[str, AttentionKind] = {kind.name: kind for kind in _REGISTERED}
"""Attention kind name (the spec's ``attention``) -> its record."""

ATTENTION_KINDS = tuple(KINDS)


def get_kind(name: str) -> AttentionKind:
    """The record of kind ``name``; SpecError naming the valid kinds otherwise."""
    if name not in KINDS:
        raise SpecError(f"unknown attention {name!r}; valid choices: {', '.join(KINDS)}")
    return KINDS[name]


def all_modes() -> tuple[str, ...]:
    """Every kind's modes and the generic ones, each once, in registration order."""
    return tuple(dict.fromkeys([m for kind in KINDS.values() for m in kind.modes] + list(GENERIC_MODES)))


def option_fields() -> dict[str, tuple[str, ...]]:
    """Spec option field name -> the kinds that have it (in registration order)."""
    out: dict[str, list[str]] = {}
    for kind in KINDS.values():
        for name in kind.options.field_names():
            out.setdefault(name, []).append(kind.name)
    return {name: tuple(kinds) for name, kinds in out.items()}
