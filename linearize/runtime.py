"""Running a model for measurement: its position limit, and eval mode for the length of a block."""

from __future__ import annotations

import contextlib


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
