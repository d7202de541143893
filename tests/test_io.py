"""Atomic writes: all or nothing, with the modes an ordinary write would give."""

from __future__ import annotations

import os
import stat

import pytest

from linearize.io import atomic_dir, atomic_write, atomic_write_text


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_files_and_directories_get_the_umask_modes(tmp_path, umask_022):
    atomic_write_text(tmp_path / "report.md", "x")
    assert (tmp_path / "report.md").read_text() == "x" and _mode(tmp_path / "report.md") == 0o644
    with atomic_dir(tmp_path / "adapter") as d:
        (d / "a.txt").write_text("y")
    assert _mode(tmp_path / "adapter") == 0o755 and (tmp_path / "adapter" / "a.txt").read_text() == "y"


def test_a_failed_write_leaves_the_old_file_and_no_temporaries(tmp_path):
    atomic_write_text(tmp_path / "f.json", "old")

    def fails(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(tmp_path / "f.json", fails)
    assert (tmp_path / "f.json").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
    with pytest.raises(RuntimeError, match="boom"), atomic_dir(tmp_path / "d") as d:
        (d / "x").write_text("x")
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
