"""ConversionSpec: which layers get which attention kind, as one JSON-serialisable dataclass.

The spec is stored in the converted model's config (``config.linearize``), so save/load keeps it.
A layer's spec is its attention kind plus that kind's own options (``linearize.layers.registry``:
each kind declares its fields, defaults and validation); a field the chosen kind does not have is an
error. The same fields are the CLI flags (``linearize convert --attention lola --sparse-cache 64``),
YAML spec keys and training's ``--spec.X`` overrides, given flat; the JSON form nests them under
``options``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checks import check_choice, read_yaml  # noqa: F401  (check_choice re-exported: the spec's choice check)
from .layers.base import KindOptions, SpecError
from .layers.registry import ATTENTION_KINDS, KINDS, get_kind, option_fields

logger = logging.getLogger(__name__)

SELECTION_FIELDS = ("layers", "overrides", "order", "active")
"""ConversionSpec fields that choose layers (the rest describe a layer: attention + options)."""

LEGACY_DEFAULTS: dict[str, Any] = {
    "attention": "hybrid", "window": 64, "overlap": False, "mix": "joint", "feature_map": "hedgehog", "linear_rope": True,
    "feature_dim": None, "sparse_cache": 0, "chunk": 16, "window_factor_init": -2.197, "gate_init": 0.5, "learn_gate": False,
    "dsla_history_gate": 0.999, "dsla_recent_gate": 0.9, "dsla_gate_rank": 16, "kernel": "auto",
    "sinks": 0, "linear_weight": 1.0,
}
"""The flat layer fields (and their defaults) that specs were saved with before each kind had its own
options. A flat dict holding all of them (``linear_rope`` came later) is read in that format: the
fields its kind ignored are dropped (``linear_rope``, ``sinks`` and ``linear_weight`` came later and may be absent)."""
LEGACY_REQUIRED = frozenset(LEGACY_DEFAULTS) - {"attention", "linear_rope", "sinks", "linear_weight"}


def _layer_changes(attention: str, options: KindOptions | None, changes: dict[str, Any]) -> tuple[str, KindOptions]:
    """(attention, options) after flat ``changes`` (``attention`` and option fields). Switching kind
    keeps the option values both kinds have; a changed field the new kind lacks is a SpecError."""
    changes = dict(changes)
    attention = changes.pop("attention", attention)
    kind = get_kind(attention)
    known = option_fields()
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise SpecError(f"unknown spec field(s) {unknown}; valid fields: {', '.join(('attention', *known, *SELECTION_FIELDS))}")
    fields = kind.options.field_names()
    foreign = sorted(set(changes) - set(fields))
    if foreign:
        where = "; ".join(f"{name}: {', '.join(known[name])}" for name in foreign)
        raise SpecError(f"field(s) {foreign} do not apply to attention {attention!r} (they belong to {where}); "
                        f"{attention}'s fields: {', '.join(fields) or 'none'}")
    carried = {k: v for k, v in options.to_dict().items() if k in fields} if options is not None else {}
    return attention, kind.make_options({**carried, **changes})


@dataclass
class LayerSpec:
    """How one layer's attention is converted: its kind and that kind's options."""

    attention: str = "hybrid"
    """The attention kind: softmax (the teacher's attention, re-implemented) | hybrid (sliding window
    + linear attention in one head, LoLCATs) | lola (hybrid + sparse cache chosen by self-recall
    error, LoLA) | dsla (dual-state gated linear attention)."""
    options: Any = None
    """The kind's own fields (a dict or the kind's options dataclass; None = its defaults)."""

    def __post_init__(self) -> None:
        kind = get_kind(self.attention)
        if self.options is None or isinstance(self.options, dict):
            self.options = kind.make_options(self.options)
        elif type(self.options) is not kind.options:
            raise SpecError(f"attention {self.attention!r} takes {kind.options.__name__}, got {type(self.options).__name__}")

    @property
    def kind(self):
        """This layer's AttentionKind record."""
        return KINDS[self.attention]

    def check_head_dim(self, head_dim: int) -> None:
        """SpecError when the options cannot serve heads of ``head_dim`` (e.g. a feature_dim)."""
        self.options.check_head_dim(head_dim)

    def layer_replace(self, **changes: Any) -> "LayerSpec":
        """A LayerSpec with flat changes (attention and option fields) applied."""
        attention, options = _layer_changes(self.attention, self.options, changes)
        return LayerSpec(attention, options)


@dataclass
class ConversionSpec(LayerSpec):
    """A LayerSpec for the chosen ``layers`` plus per-layer overrides of the attention and its options."""

    layers: str | list[int] = "all"
    """'all' or a list of layer indices to convert (negative indices count from the end)."""
    overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per-layer changes, flat, e.g. {3: {"attention": "softmax"}, 7: {"window": 128}}."""
    order: list[int] | None = None
    """A nested family (DSLA chained fine-tuning): the converted layers in conversion order."""
    active: int | None = None
    """With ``order``: only its first ``active`` layers run converted; the others run the teacher's
    attention and keep their (trained) parameters. None = all."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.layers, str):
            if self.layers != "all":
                raise SpecError(f"layers must be 'all' or a list of layer indices, got {self.layers!r}")
        else:
            try:
                self.layers = [int(i) for i in self.layers]
            except (TypeError, ValueError):
                raise SpecError(f"layers must be 'all' or a list of layer indices, got {self.layers!r}") from None
        fixed: dict[int, dict[str, Any]] = {}
        for key, changes in dict(self.overrides).items():
            try:
                idx = int(key)
            except (TypeError, ValueError):
                raise SpecError(f"override key must be a layer index, got {key!r}") from None
            try:
                self.layer_base().layer_replace(**changes)  # validate the overridden layer now
            except SpecError as err:
                raise SpecError(f"override for layer {idx}: {err}") from None
            fixed[idx] = dict(changes)
        self.overrides = fixed
        if self.order is not None:
            self.order = [int(i) for i in self.order]
            if len(set(self.order)) != len(self.order):
                raise SpecError(f"order repeats a layer: {self.order}")
        if self.active is not None:
            if self.order is None:
                raise SpecError("active needs order (the nested family's layer order)")
            if not isinstance(self.active, int) or not 0 <= self.active <= len(self.order):
                raise SpecError(f"active must be an integer in 0..{len(self.order)} (the length of order), got {self.active!r}")

    def layer_base(self) -> LayerSpec:
        return LayerSpec(self.attention, self.options)

    def replace(self, **changes: Any) -> "ConversionSpec":
        """A new spec with flat changes: selection fields (layers, overrides, order, active), the
        attention and option fields. Switching kind keeps the options both kinds have."""
        selection = {k: changes.pop(k) for k in SELECTION_FIELDS if k in changes}
        attention, options = _layer_changes(self.attention, self.options, changes)
        current = {"layers": self.layers, "overrides": self.overrides, "order": self.order, "active": self.active}
        return ConversionSpec(attention=attention, options=options, **{**current, **selection})

    def resolve_layers(self, num_layers: int) -> list[int]:
        """The sorted layer indices to convert, validated against the model's layer count."""
        for i in self.overrides:
            if not -num_layers <= i < num_layers:
                raise SpecError(f"override for layer {i} out of range: the model has {num_layers} layers (valid: 0..{num_layers - 1} or negative from the end)")
        if self.layers == "all":
            return list(range(num_layers))
        out = set()
        for i in self.layers:
            if not -num_layers <= i < num_layers:
                raise SpecError(f"layer index {i} out of range: the model has {num_layers} layers (valid: 0..{num_layers - 1} or negative from the end)")
            out.add(i % num_layers)
        return sorted(out)

    def inactive_layers(self, num_layers: int) -> list[int]:
        """Converted layers that run the teacher's attention (beyond the active prefix of ``order``)."""
        if self.order is None:
            return []
        chosen = self.resolve_layers(num_layers)
        order = [i % num_layers for i in self.order]
        if sorted(order) != chosen:
            raise SpecError(f"order {self.order} must list exactly the converted layers {chosen}")
        return sorted(order[self.active:]) if self.active is not None else []

    def layer_spec(self, idx: int, num_layers: int) -> LayerSpec | None:
        """The LayerSpec of layer ``idx``, or None if that layer keeps the teacher's attention."""
        if idx not in self.resolve_layers(num_layers):
            return None
        changes = self.overrides.get(idx, self.overrides.get(idx - num_layers, {}))
        return self.layer_base().layer_replace(**changes)

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "attention": self.attention,
            "options": self.options.to_dict(),
            "layers": self.layers if isinstance(self.layers, str) else list(self.layers),
            "overrides": {str(k): dict(v) for k, v in self.overrides.items()},
            "order": None if self.order is None else list(self.order),
            "active": self.active,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConversionSpec":
        """Read a spec: the JSON form (options nested under ``options``), flat fields (YAML, flags:
        a field the kind lacks is an error) or the flat form saved before per-kind options (every
        old field present: the fields its kind ignored are dropped, as they were ignored)."""
        if not isinstance(data, dict):
            raise SpecError(f"a spec must be a mapping of spec fields, got {type(data).__name__}")
        data = dict(data)
        selection = {k: data.pop(k) for k in SELECTION_FIELDS if k in data}
        attention = data.pop("attention", "hybrid")
        if "options" in data:
            options = data.pop("options")
            if options is not None and not isinstance(options, dict):
                raise SpecError(f"options must be a mapping of {attention!r} fields, got {options!r}")
            base = ConversionSpec(attention=attention, options=options)
            return base.replace(**data, **selection)
        if LEGACY_REQUIRED <= set(data):
            data = _drop_legacy_unused(attention, data)
        return ConversionSpec(attention=check_attention(attention)).replace(attention=attention, **data, **selection)

    @classmethod
    def coerce(cls, spec: "ConversionSpec | dict[str, Any] | None") -> "ConversionSpec":
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            return cls.from_dict(spec)
        raise SpecError(f"spec must be a ConversionSpec or a dict, got {type(spec).__name__}")

    @classmethod
    def from_file(cls, path: str | Path) -> "ConversionSpec":
        """Read a YAML (or JSON) spec file."""
        path = Path(path)
        if not path.is_file():
            raise SpecError(f"spec file {str(path)!r} does not exist")
        data = read_yaml(path, "spec file", SpecError) or {}
        if not isinstance(data, dict):
            raise SpecError(f"spec file {str(path)!r} must hold a mapping of spec fields")
        return cls.from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def check_attention(attention: Any) -> str:
    """``attention`` if it names a kind; SpecError naming the valid kinds otherwise."""
    check_choice("attention", attention, ATTENTION_KINDS, SpecError)
    return attention


def _drop_legacy_unused(attention: str, data: dict[str, Any]) -> dict[str, Any]:
    """The old flat format's fields that kind ``attention`` has (the others were ignored by it)."""
    fields = get_kind(check_attention(attention)).options.field_names()
    dropped = {k: v for k, v in data.items() if k in LEGACY_DEFAULTS and k not in fields and v != LEGACY_DEFAULTS[k]}
    if dropped:
        logger.info("spec in the old flat format: attention %r ignores %s (dropped)", attention, dropped)
    return {k: v for k, v in data.items() if k in fields or k not in LEGACY_DEFAULTS}
