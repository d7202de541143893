"""Running a model: the device it runs on, its position limit, eval mode for the length of a block,
the CPU thread pool."""

from __future__ import annotations

import contextlib
import logging
import os

logger = logging.getLogger(__name__)


def cpu_threads() -> int:
    """The intra-op thread count for this machine: the CPUs this process may run on (its affinity,
    which containers and ``taskset`` restrict), unless OMP_NUM_THREADS says otherwise."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def configure_cpu() -> int:
    """Set torch's intra-op pool to ``cpu_threads()`` (small models decode one token at a time: more
    threads than CPUs only contend) and flush denormal floats to zero (gated states decay towards
    zero: DSLA's recent state reaches the denormal range after some hundred tokens, where every
    arithmetic operation on it is tens of times slower; values below 1e-38 become 0). Returns the
    thread count."""
    import torch

    n = cpu_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
        logger.info("torch intra-op threads: %d", n)
    torch.set_flush_denormal(True)
    return n


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
