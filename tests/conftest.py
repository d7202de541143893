"""Test-wide hygiene."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (linearize.ops.fused_decode) run in Triton's interpreter on a machine without a GPU.
    # Only code that asks for them (use_fused(True)) runs them there; it is read when they are compiled.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _restore_cpu_float_state():
    """The CLI flushes denormal floats for the whole process (``linearize.runtime.configure_cpu``);
    tests that call it in-process must not leave that state to the next test (hypothesis, for one,
    refuses to run when subnormals are flushed)."""
    yield
    torch.set_flush_denormal(False)
