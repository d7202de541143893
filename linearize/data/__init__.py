"""Text for training and evaluation: corpora, packing and caching (``corpus``), and the evaluation
data files shipped with the package (``EVAL_DATA``)."""

from __future__ import annotations

from pathlib import Path

from .corpus import DataConfig, DataConfigError, build_dataset, heldout_tokens, iterate_batches, load_texts, num_batches

EVAL_DATA = Path(__file__).parent / "eval"
TRACES = Path(__file__).parent / "traces"
"""Request traces shipped with the package (the Azure LLM inference trace 2023; see traces/SOURCES.md)."""
"""PIQA, WinoGrande, COPA, OpenBookQA and LAMBADA for the local lm-eval tasks (sources and licences in SOURCES.md)."""

__all__ = ["EVAL_DATA", "TRACES", "DataConfig", "DataConfigError", "build_dataset", "heldout_tokens", "iterate_batches", "load_texts", "num_batches"]
