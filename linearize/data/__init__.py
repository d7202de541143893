"""Data files shipped with the package."""

from __future__ import annotations

from pathlib import Path

EVAL_DATA = Path(__file__).parent / "eval"
"""PIQA, WinoGrande, COPA, OpenBookQA and LAMBADA for the local lm-eval tasks (sources and licences in SOURCES.md)."""
