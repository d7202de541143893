"""Running a model: the device it runs on, its position limit, and eval mode for the length of a block."""

from __future__ import annotations

import contextlib


def check_device(device):
    """``device`` as a torch.device, if this machine has it; ValueError naming the valid choices otherwise."""
    import torch

    available = ["cpu"]
    if torch.cuda.is_available():
        available += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        available.append("mps")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {device!r}; valid choices here: {', '.join(available)}") from None
    if resolved.type == "cpu" or str(resolved) in available:
        return resolved
    reason = {"cuda": "no CUDA GPU is available (or torch was built without CUDA)", "mps": "MPS is not available"}
    raise ValueError(f"device {device!r} is not available: {reason.get(resolved.type, 'not on this machine')}; "
                     f"valid choices here: {', '.join(available)}")


def max_positions(model) -> int | None:
    """The model's max_position_embeddings (of its text config), or None when it has none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def check_length(model, length: int) -> None:
    """Raise when ``length`` exceeds the model's max_position_embeddings."""
    limit = max_positions(model)
    if limit is not None and length > limit:
        raise ValueError(f"context length {length} exceeds the model's max_position_embeddings ({limit})")


@contextlib.contextmanager
def eval_mode(model):
    """model.eval() inside the block; the training flag is restored after."""
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)
