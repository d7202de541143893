"""Atomic file and directory writes: readers never see a half-written result."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator


CACHE_ENV = "LINEARIZE_CACHE"
DEFAULT_CACHE = "~/.cache/linearize"


def cache_root() -> Path:
    """The folder everything this package caches lives under: $LINEARIZE_CACHE, default ~/.cache/linearize."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(directory: str | Path) -> None:
    """Raise unless ``directory`` is, or can be made, a writable directory: NotADirectoryError when
    it or one of its parents is a file, PermissionError when its nearest existing parent is not
    writable. Nothing is created."""
    directory = Path(directory)
    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        where = "it is" if existing == directory else f"{str(existing)!r} is"
        raise NotADirectoryError(f"cannot write {str(directory)!r}: {where} a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {str(directory)!r}: {str(existing)!r} is not writable")


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; on success it replaces ``target`` in one rename.

    On error the temporary directory is removed and ``target`` is left as it was.
    """
    target = Path(target)
    check_writable(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700: give it a normal directory's mode
        yield tmp
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, flush it to disk, then rename it to
    ``path``: readers see the old file or the whole new one, never a part."""
    path = Path(path)
    check_writable(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and a rename."""
    atomic_write(path, lambda f: f.write(text.encode()))


def write_results(out_dir: str | Path, stem: str, data: Any, markdown: str, *, indent: int = 2) -> None:
    """OUT_DIR/STEM.json (``data``) and OUT_DIR/STEM.md (``markdown``), each written atomically."""
    out = Path(out_dir)
    atomic_write_text(out / f"{stem}.json", json.dumps(data, indent=indent) + "\n")
    atomic_write_text(out / f"{stem}.md", markdown)


def save_png(fig, path: str | Path, *, dpi: int = 120) -> None:
    """Write a matplotlib Figure as PNG, atomically."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
