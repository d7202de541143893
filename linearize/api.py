"""load_model / save_adapter: the ways a (converted) model comes in and goes out."""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .convert import convert, new_parameters, set_active
from .hub import load_base_model
from .io import atomic_dir
from .names import ADAPTER_CONFIG, SHIPPED, check_model_name, shipped_path  # noqa: F401 (SHIPPED: re-exported)
from .spec import ConversionSpec

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter.safetensors"
LORA_WEIGHTS = "lora.safetensors"
ADAPTER_FORMAT = 1

def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    active: int | None = None,
):
    """Return (model, tokenizer or None).

    ``name_or_path``: a model alias (``smollm2-135m``), a shipped trained conversion (``SHIPPED``,
    e.g. ``smollm2-135m-lolcats``), a local Hugging Face checkpoint directory
    (converted ones included: their config carries the spec), an adapter directory written by
    ``save_adapter`` (new parameters + the base model's name), or a hub id where a network exists.
    ``active``: for a nested family (spec with ``order``), how many layers of the order run converted.
    An unknown name fails at once, offline too, naming the valid choices.
    """
    check_model_name(name_or_path)
    path = shipped_path(str(name_or_path)) or Path(name_or_path)
    if (path / ADAPTER_CONFIG).is_file():
        model, tokenizer = _load_adapter(path, str(name_or_path), dtype=dtype, device=device)
    else:
        model, tokenizer = load_base_model(str(name_or_path), dtype=dtype, device=device)
        if getattr(model.config, "linearize_base_model", None) is None:
            model.config.linearize_base_model = str(name_or_path)
    if active is not None:
        if getattr(model.config, "linearize", None) is None:
            raise ValueError(f"active={active} needs a converted model with a layer order; {name_or_path!r} is not converted")
        set_active(model, active)
    return model, tokenizer


def save_adapter(
    model: PreTrainedModel,
    directory: str | Path,
    *,
    base_model: str | None = None,
    spec: dict | None = None,
    extra: dict | None = None,
) -> Path:
    """Write only what a conversion adds, atomically: the new parameters, LoRA weights when the model
    is wrapped by peft, the spec (``spec`` overrides the model's, e.g. an inference-time window) and
    the base model's name. ``extra``: more JSON metadata (training summary, layer order, ...)."""
    lora = None
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        lora = ({k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()},
                model.peft_config["default"].to_dict())
        model = model.get_base_model()
    base_model = base_model or getattr(model.config, "linearize_base_model", None)
    if not base_model:
        raise ValueError("save_adapter needs base_model (the name or path load_model should load the teacher from)")
    if getattr(model.config, "linearize", None) is None:
        raise ValueError("model is not converted: nothing to save as an adapter (use save_pretrained)")
    tensors = {name: p.detach().cpu().contiguous() for name, p in new_parameters(model).items()}
    meta = {"format": ADAPTER_FORMAT, "base_model": base_model, "spec": spec or model.config.linearize, **(extra or {})}
    if lora is not None:
        meta["lora"] = {k: sorted(v) if isinstance(v, set) else v for k, v in lora[1].items() if _jsonable(v)}
    with atomic_dir(directory) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if lora is not None:
            save_file(lora[0], str(tmp / LORA_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    logger.info("saved adapter (%d tensors%s) to %s", len(tensors), ", LoRA" if lora else "", directory)
    return Path(directory)


def scrub_paths(obj):
    """A JSON value with every absolute path in it reduced to its last component (a machine's data
    caches, tokenizer and output folders), for metadata that leaves the machine it was written on."""
    if isinstance(obj, dict):
        return {k: scrub_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub_paths(v) for v in obj]
    if isinstance(obj, str) and obj.startswith("/"):
        return Path(obj).name
    return obj


def copy_adapter(source: str | Path, target: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The adapter folder ``source`` (as ``save_adapter`` writes it) into the folder ``target``
    (created if missing), every tensor stored as ``dtype`` (``load_model`` casts to the model's
    dtype), its config scrubbed of machine paths (``scrub_paths``; LoRA's base_model_name_or_path
    becomes the base model's name) and marked with its storage dtype. Not atomic by itself: write
    into an ``io.atomic_dir``.

    A run started from another adapter (``--model ADAPTER_DIR``) names that folder as its base. The
    copy must stand alone, so a base that is an adapter without LoRA weights is replaced by that
    adapter's own base (every new parameter is in ``source``: the parent adds nothing), recorded as
    ``started_from``; a parent with LoRA weights (merged into the q/k/v/o this adapter trained on)
    is refused, unless it is a shipped conversion: the copy then builds on it by name, with its
    fingerprint (``adapter_fingerprint``), and loads only on the same shipped weights."""
    source, target = Path(source), Path(target)
    if not (source / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{source} holds no adapter (no {ADAPTER_CONFIG})")
    meta = json.loads((source / ADAPTER_CONFIG).read_text())
    parents = []
    while (Path(meta["base_model"]) / ADAPTER_CONFIG).is_file():
        parent = Path(meta["base_model"])
        if (parent / LORA_WEIGHTS).is_file():
            raise ValueError(f"adapter {str(source)!r} starts from adapter {str(parent)!r}, whose LoRA weights are merged into the "
                             "weights it trained on: it cannot stand alone; train from the base model, or ship the parent with it")
        parents.append(str(parent))
        meta["base_model"] = json.loads((parent / ADAPTER_CONFIG).read_text())["base_model"]
    if parents:
        meta["started_from"] = parents
    shipped = shipped_path(meta["base_model"])
    if shipped is not None:
        meta["base_fingerprint"] = adapter_fingerprint(shipped)
    meta = scrub_paths(meta)
    meta["storage_dtype"] = str(dtype).removeprefix("torch.")
    if isinstance(meta.get("lora"), dict):
        meta["lora"]["base_model_name_or_path"] = meta["base_model"]
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.suffix == ".safetensors":
            tensors = {k: v.to(dtype).contiguous() for k, v in load_file(str(path)).items()}
            save_file(tensors, str(target / path.name), metadata={"format": "pt"})
        elif path.is_file() and path.name != ADAPTER_CONFIG:
            (target / path.name).write_bytes(path.read_bytes())
    (target / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return target


_LORA_PLAIN = {"use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}}


def stand_alone(source: str | Path, target: str | Path) -> Path:
    """The adapter folder ``source``, built on a shipped conversion with LoRA (``base_fingerprint``),
    written to ``target`` so that it no longer needs that conversion: its base becomes the parent's
    base, and the parent's LoRA and its own become one LoRA of rank r_parent + r_own on the same
    modules (A stacked, B side by side: B_p A_p s_p + B_o A_o s_o = [B_p B_o] [A_p; A_o] s when both
    scales s = alpha / r are equal; B is scaled otherwise), which merges to the same weights up to
    rounding. The parent is recorded in ``started_from`` and ``lora_composed_from``. Written atomically.
    Raises ValueError for an adapter that does not build on a shipped conversion with LoRA, or for
    LoRA forms this composition does not cover (rsLoRA, DoRA, per-module ranks, other modules)."""
    source = Path(source)
    meta = json.loads((source / ADAPTER_CONFIG).read_text())
    parent_path = shipped_path(meta.get("base_model", "")) if "base_fingerprint" in meta else None
    if parent_path is None or not (parent_path / LORA_WEIGHTS).is_file():
        raise ValueError(f"adapter {str(source)!r} does not build on a shipped conversion with LoRA weights (base "
                         f"{meta.get('base_model')!r}): it stands alone already")
    if adapter_fingerprint(parent_path) != meta["base_fingerprint"]:
        raise ValueError(f"adapter {str(source)!r} was trained on another {meta['base_model']!r} than the one installed (fingerprint)")
    parent = json.loads((parent_path / ADAPTER_CONFIG).read_text())
    configs = {"parent": parent.get("lora"), "own": meta.get("lora")}
    for who, cfg in configs.items():
        if not isinstance(cfg, dict):
            raise ValueError(f"adapter {str(source)!r}: the {who} LoRA config is missing")
        odd = {k: cfg.get(k) for k, plain in _LORA_PLAIN.items() if cfg.get(k, plain) not in (plain, None)}
        if odd:
            raise ValueError(f"adapter {str(source)!r}: the {who} LoRA uses {odd}; only plain LoRA can be composed")
    targets = [sorted(cfg["target_modules"]) for cfg in configs.values()]
    if targets[0] != targets[1]:
        raise ValueError(f"adapter {str(source)!r}: LoRA on {targets[1]} cannot be composed with its parent's on {targets[0]}")
    weights = {who: _read_adapter_file(path, LORA_WEIGHTS, lambda file: load_file(str(file)))
               for who, path in (("parent", parent_path), ("own", source))}
    if sorted(weights["parent"]) != sorted(weights["own"]):
        raise ValueError(f"adapter {str(source)!r}: its LoRA tensors are not those of its parent's LoRA")
    scales = {who: float(cfg["lora_alpha"]) / int(cfg["r"]) for who, cfg in configs.items()}
    rank = int(configs["parent"]["r"]) + int(configs["own"]["r"])
    same = scales["parent"] == scales["own"]
    composed = {}
    for key in sorted(weights["own"]):
        if ".lora_A." in key:
            composed[key] = torch.cat([weights["parent"][key], weights["own"][key]], dim=0).contiguous()
        else:
            parts = [weights[who][key] if same else weights[who][key].float() * scales[who] for who in ("parent", "own")]
            composed[key] = torch.cat(parts, dim=1).contiguous()
    lora = dict(configs["own"], r=rank, lora_alpha=scales["own"] * rank if same else float(rank))
    lora["base_model_name_or_path"] = parent["base_model"]
    out = {k: v for k, v in meta.items() if k != "base_fingerprint"}
    out.update(base_model=parent["base_model"], lora=lora, started_from=[meta["base_model"], *meta.get("started_from", [])],
               lora_composed_from=[meta["base_model"], "own"])
    with atomic_dir(Path(target)) as tmp:
        for path in sorted(source.iterdir()):
            if path.is_file() and path.name not in (ADAPTER_CONFIG, LORA_WEIGHTS):
                (tmp / path.name).write_bytes(path.read_bytes())
        save_file(composed, str(tmp / LORA_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(out, indent=2, sort_keys=True))
    logger.info("%s stands alone in %s: LoRA of rank %d (its parent's %s and its own)", source, target, rank, meta["base_model"])
    return Path(target)


def adapter_fingerprint(path: str | Path) -> str:
    """SHA-256 of an adapter's weight files (new parameters and LoRA), names and bytes: what an
    adapter trained on top of it depends on."""
    digest = hashlib.sha256()
    for name in (ADAPTER_WEIGHTS, LORA_WEIGHTS):
        file = Path(path) / name
        if file.is_file():
            digest.update(name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def _jsonable(value) -> bool:
    try:
        json.dumps(sorted(value) if isinstance(value, set) else value)
        return True
    except TypeError:
        return False


def _read_adapter_file(path: Path, name: str, read):
    try:
        return read(path / name)
    except (OSError, ValueError, SafetensorError) as err:  # truncated, corrupt, not JSON
        raise ValueError(f"adapter {str(path)!r}: {name} cannot be read ({' '.join(str(err).split())})") from err


def _load_adapter(path: Path, source_name: str, *, dtype, device):
    meta = _read_adapter_file(path, ADAPTER_CONFIG, lambda file: json.loads(file.read_text()))
    if not isinstance(meta, dict) or meta.get("format") != ADAPTER_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise ValueError(f"adapter {str(path)!r} has format {found!r}; this linearize reads format {ADAPTER_FORMAT}")
    tensors = _read_adapter_file(path, ADAPTER_WEIGHTS, lambda file: load_file(str(file)))  # before the base loads
    lora_tensors = _read_adapter_file(path, LORA_WEIGHTS, lambda file: load_file(str(file))) if (path / LORA_WEIGHTS).is_file() else None
    if "base_fingerprint" in meta:  # built on a shipped conversion: on those weights only
        base = shipped_path(meta["base_model"])
        found = None if base is None else adapter_fingerprint(base)
        if found != meta["base_fingerprint"]:
            raise ValueError(f"adapter {str(path)!r} was trained on top of the shipped conversion {meta['base_model']!r} with fingerprint "
                             f"{meta['base_fingerprint'][:12]}, but the one installed has {found and found[:12]!r}: its weights changed "
                             "since; train this adapter again from the conversion installed now")
    try:
        model, tokenizer = load_model(meta["base_model"], dtype=dtype, device=device)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"adapter {str(path)!r}: its base model cannot be loaded: {err}") from err
    convert(model, ConversionSpec.from_dict(meta["spec"]))
    expected = new_parameters(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter {str(path)!r} does not match its spec: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(tensors[name].to(p.dtype))
    if lora_tensors is not None:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        config = {k: v for k, v in meta["lora"].items() if k in LoraConfig.__dataclass_fields__}
        with warnings.catch_warnings():  # peft's notes on wrapping a model that is unwrapped at once
            warnings.filterwarnings("ignore", message=r"The PEFT config's `base_model_name_or_path` was renamed")
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            peft_model = get_peft_model(model, LoraConfig(**config))
        set_peft_model_state_dict(peft_model, lora_tensors)
        model = peft_model.merge_and_unload()  # LoRA folded into q/k/v/o: plain model, no overhead
        model.config.linearize_base_model = source_name  # what an adapter saved from it builds on: these merged weights
    return model, tokenizer
