"""load_model / save_adapter: the ways a (converted) model comes in and goes out."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .convert import convert, new_parameters
from .hub import load_base_model
from .io import atomic_dir
from .spec import ConversionSpec

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "linearize_adapter.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_FORMAT = 1


def load_model(name_or_path: str, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """Return (model, tokenizer or None).

    ``name_or_path``: a model alias (``smollm2-135m``), a local Hugging Face checkpoint directory
    (converted ones included: their config carries the spec), an adapter directory written by
    ``save_adapter`` (new parameters + the base model's name), or a hub id where a network exists.
    """
    path = Path(name_or_path)
    if (path / ADAPTER_CONFIG).is_file():
        return _load_adapter(path, dtype=dtype, device=device)
    model, tokenizer = load_base_model(str(name_or_path), dtype=dtype, device=device)
    if getattr(model.config, "linearize_base_model", None) is None:
        model.config.linearize_base_model = str(name_or_path)
    return model, tokenizer


def save_adapter(model: PreTrainedModel, directory: str | Path, *, base_model: str | None = None) -> Path:
    """Write only the conversion's new parameters and spec, plus the base model's name (atomic)."""
    base_model = base_model or getattr(model.config, "linearize_base_model", None)
    if not base_model:
        raise ValueError("save_adapter needs base_model (the name or path load_model should load the teacher from)")
    if getattr(model.config, "linearize", None) is None:
        raise ValueError("model is not converted: nothing to save as an adapter (use save_pretrained)")
    tensors = {name: p.detach().cpu().contiguous() for name, p in new_parameters(model).items()}
    meta = {"format": ADAPTER_FORMAT, "base_model": base_model, "spec": model.config.linearize}
    with atomic_dir(directory) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    logger.info("saved adapter (%d tensors) to %s", len(tensors), directory)
    return Path(directory)


def _load_adapter(path: Path, *, dtype, device):
    meta = json.loads((path / ADAPTER_CONFIG).read_text())
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"adapter {str(path)!r} has format {meta.get('format')!r}; this linearize reads format {ADAPTER_FORMAT}")
    model, tokenizer = load_model(meta["base_model"], dtype=dtype, device=device)
    convert(model, ConversionSpec.from_dict(meta["spec"]))
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    expected = new_parameters(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter {str(path)!r} does not match its spec: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(tensors[name].to(p.dtype))
    return model, tokenizer
