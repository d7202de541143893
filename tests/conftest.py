"""Test-wide hygiene."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_cpu_float_state():
    """The CLI flushes denormal floats for the whole process (``linearize.runtime.configure_cpu``);
    tests that call it in-process must not leave that state to the next test (hypothesis, for one,
    refuses to run when subnormals are flushed)."""
    yield
    torch.set_flush_denormal(False)
