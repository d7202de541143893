"""ConversionSpec: which layers get which attention, as one JSON-serialisable dataclass.

The spec is stored in the converted model's config (``config.linearize``), so save/load keeps it.
It is also the single source of truth for the CLI (``linearize convert --window 64 ...``) and for
YAML spec files: every field below is a flag and a YAML key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ops.feature_maps import FEATURE_MAP_NAMES, LEARNED_FEATURE_MAPS

ATTENTION_KINDS = ("softmax", "hybrid", "lola", "dsla")
MIXES = ("joint", "gate")
KERNELS = ("auto", "torch", "fla")


class SpecError(ValueError):
    """A bad conversion spec value (message names the value and the valid choices)."""


def check_choice(name: str, value: Any, choices: tuple[str, ...], error: type[ValueError] | None = None) -> None:
    """Raise ``error`` (default SpecError) naming ``value`` and the valid ``choices`` unless it is one."""
    if value not in choices:
        raise (error or SpecError)(f"unknown {name} {value!r}; valid choices: {', '.join(choices)}")


@dataclass
class LayerSpec:
    """How one layer's attention is converted."""

    attention: str = "hybrid"
    """softmax (the teacher's attention, re-implemented) | hybrid (sliding window + linear attention
    in one head, LoLCATs) | lola (hybrid + sparse cache chosen by self-recall error, LoLA) | dsla
    (dual-state gated linear attention)."""
    window: int = 64
    """Sliding-window size w (hybrid) = LoLA's eta: the last w tokens up to and including t."""
    overlap: bool = False
    """False: linear attention covers only tokens older than the window; True: all tokens."""
    mix: str = "joint"
    """joint: one shared softmax denominator with a learned per-head window factor (LoLCATs);
    gate: g * SWA + (1 - g) * LA, each branch normalised (HedgeCATs Eq. 3)."""
    feature_map: str = "hedgehog"
    """hedgehog (learned +-softmax) | exp | relu | elu (1 + elu) | identity. DSLA: identity is the
    paper's raw form (q, k as they are, no normaliser); any other map is applied to q and k and each
    state's read is normalised."""
    linear_rope: bool = True
    """True: the feature maps act on RoPE-rotated q/k (LoLCATs). False: on q/k before RoPE, so the
    linear part depends on no absolute position (it cannot drift past the positions seen in
    training) while the window softmax keeps RoPE; DSLA then runs without RoPE."""
    feature_dim: int | None = None
    """Number of features phi produces. hedgehog: 2 * head_dim (square W, default) or head_dim
    (rectangular d x d/2 W). Fixed maps: head_dim (None means the default)."""
    sparse_cache: int = 0
    """LoLA's lambda: sparse global cache slots per head (attention 'lola' only)."""
    sinks: int = 0
    """LoLA: the first ``sinks`` tokens of a sequence never leave the sparse cache (attention sinks,
    as in StreamingLLM); they take ``sinks`` of its ``sparse_cache`` slots."""
    linear_weight: float = 1.0
    """LoLA: weight of the linear state's term in the shared numerator and denominator (1 is the
    trained hybrid's read; below 1 keeps the linear term from swamping the explicit entries)."""
    chunk: int = 16
    """LoLA's prefill chunk length C (queries of a chunk share the linear state); DSLA's block length
    on the torch kernel (its memory grows with it)."""
    window_factor_init: float = -2.197
    """Initial logit theta of the joint mix's window factor f = sigmoid(theta) (~0.1, LoLCATs)."""
    gate_init: float = 0.5
    """Initial g of the gate mix."""
    learn_gate: bool = False
    """Learn g per head in the gate mix (else fixed at gate_init)."""
    dsla_history_gate: float = 0.999
    """DSLA: initial gate value of the slow (history) state."""
    dsla_recent_gate: float = 0.9
    """DSLA: initial gate value of the fast (recent) state."""
    dsla_gate_rank: int = 16
    """DSLA: rank of the low-rank gate projection (hidden -> rank -> heads * features)."""
    kernel: str = "auto"
    """auto (fla on CUDA when installed, else torch) | torch | fla."""

    def __post_init__(self) -> None:
        check_choice("attention", self.attention, ATTENTION_KINDS)
        check_choice("mix", self.mix, MIXES)
        check_choice("feature_map", self.feature_map, FEATURE_MAP_NAMES)
        check_choice("kernel", self.kernel, KERNELS)
        for name in ("window", "chunk", "dsla_gate_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.sparse_cache, int) or isinstance(self.sparse_cache, bool) or self.sparse_cache < 0:
            raise SpecError(f"sparse_cache must be an integer >= 0, got {self.sparse_cache!r}")
        if self.feature_dim is not None and (not isinstance(self.feature_dim, int) or self.feature_dim < 1):
            raise SpecError(f"feature_dim must be a positive integer or None, got {self.feature_dim!r}")
        if self.feature_dim is not None and self.feature_map in LEARNED_FEATURE_MAPS and self.feature_dim % 2:
            raise SpecError(f"feature_dim of a hedgehog map must be even (2 x projection width), got {self.feature_dim}")
        if not 0.0 <= self.gate_init <= 1.0:
            raise SpecError(f"gate_init must lie in [0, 1], got {self.gate_init}")
        for name in ("dsla_history_gate", "dsla_recent_gate"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise SpecError(f"{name} must lie in (0, 1), got {getattr(self, name)}")
        if not isinstance(self.linear_rope, bool):
            raise SpecError(f"linear_rope must be true or false, got {self.linear_rope!r}")
        if self.sparse_cache and self.attention != "lola":
            raise SpecError(f"sparse_cache={self.sparse_cache} needs attention 'lola', got {self.attention!r}")
        if not isinstance(self.sinks, int) or isinstance(self.sinks, bool) or not 0 <= self.sinks <= self.sparse_cache:
            raise SpecError(f"sinks must be an integer in [0, sparse_cache={self.sparse_cache}], got {self.sinks!r}")
        if isinstance(self.linear_weight, bool) or not isinstance(self.linear_weight, (int, float)) or self.linear_weight < 0:
            raise SpecError(f"linear_weight must be a number >= 0, got {self.linear_weight!r}")
        if self.linear_weight != 1.0 and self.attention != "lola":
            raise SpecError(f"linear_weight={self.linear_weight} needs attention 'lola', got {self.attention!r}")
        if self.attention == "lola" and (self.mix != "joint" or self.overlap):
            raise SpecError("attention 'lola' builds on the joint, non-overlap hybrid: use mix 'joint' and overlap false")

    @property
    def dsla_normalized(self) -> bool:
        """DSLA: feature-mapped q/k with normalised state reads (every feature map but identity)."""
        return self.feature_map != "identity"

    def features(self, head_dim: int) -> int:
        """Number of features phi produces for this head size."""
        if self.feature_map in LEARNED_FEATURE_MAPS:
            return self.feature_dim or 2 * head_dim
        if self.feature_dim not in (None, head_dim):
            raise SpecError(f"feature map {self.feature_map!r} keeps head_dim={head_dim} features; got feature_dim={self.feature_dim}")
        return head_dim


LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerSpec))


@dataclass
class ConversionSpec(LayerSpec):
    """A LayerSpec for the chosen ``layers`` plus per-layer overrides of any LayerSpec field."""

    layers: str | list[int] = "all"
    """'all' or a list of layer indices to convert (negative indices count from the end)."""
    overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per-layer changes, e.g. {3: {"attention": "softmax"}, 7: {"window": 128}}."""
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
            unknown = sorted(set(changes) - set(LAYER_FIELDS))
            if unknown:
                raise SpecError(f"unknown override field(s) {unknown} for layer {idx}; valid fields: {', '.join(LAYER_FIELDS)}")
            LayerSpec(**{**self.layer_base().__dict__, **changes})  # validate the overridden layer now
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
        return LayerSpec(**{name: getattr(self, name) for name in LAYER_FIELDS})

    def resolve_layers(self, num_layers: int) -> list[int]:
        """The sorted layer indices to convert, validated against the model's layer count."""
        if self.layers == "all":
            return list(range(num_layers))
        out = set()
        for i in self.layers:
            if not -num_layers <= i < num_layers:
                raise SpecError(f"layer index {i} out of range: the model has {num_layers} layers (valid: 0..{num_layers - 1} or negative from the end)")
            out.add(i % num_layers)
        for i in self.overrides:
            if not -num_layers <= i < num_layers:
                raise SpecError(f"override for layer {i} out of range: the model has {num_layers} layers")
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
        return LayerSpec(**{**self.layer_base().__dict__, **changes})

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["overrides"] = {str(k): v for k, v in self.overrides.items()}
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConversionSpec":
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise SpecError(f"unknown spec field(s) {unknown}; valid fields: {', '.join(sorted(valid))}")
        return cls(**data)

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
        import yaml

        path = Path(path)
        if not path.is_file():
            raise SpecError(f"spec file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise SpecError(f"spec file {str(path)!r} must hold a mapping of spec fields")
        return cls.from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
