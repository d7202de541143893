"""Test-wide hygiene."""

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (linearize.ops.fused_decode) run in Triton's interpreter on a machine without a GPU.
    # Only code that asks for them (use_fused(True)) runs them there; it is read when they are compiled.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_bfloat16_mended() -> bool:
    """Mend Triton's interpreter where it computes bfloat16 unlike a GPU (Triton 3.6), so that the
    kernels' bfloat16 paths can be tested on the CPU; True if it needed mending.

    - ``tl.dot`` of bfloat16 operands multiplied their bit patterns (the interpreter keeps bfloat16
      as uint16 and converts only 8-bit floats before ``np.matmul``: triton-lang/triton#11584,
      "not supported yet" upstream). The operands are now widened to float32 first: exact, and
      the products summed in float32 as a tensor core's are (in another order).
    - float32 -> bfloat16 truncated (the cast passes no rounding mode); a GPU rounds to nearest,
      ties to even. It now does that (NaN stays NaN; an explicit round-toward-zero is kept).

    Each mend is applied only where a probe shows the interpreter wrong."""
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def probe(a, b, c, x, y):
        o = tl.arange(0, 16)
        tile = o[:, None] * 16 + o[None, :]
        tl.store(c + tile, tl.dot(tl.load(a + tile), tl.load(b + tile)))
        tl.store(y + o, tl.load(x + o).to(tl.bfloat16))

    def wrong() -> tuple[bool, bool]:
        a, b = (torch.arange(256, dtype=torch.float32).reshape(16, 16).remainder(5).sub(2).bfloat16() for _ in range(2))
        c = torch.zeros(16, 16)
        x = torch.full((16,), 1.0 + 2.0**-8 + 2.0**-9)  # halfway and above: rounds up, truncation does not
        y = torch.zeros(16, dtype=torch.bfloat16)
        probe[(1,)](a, b, c, x, y)
        return not torch.equal(c, a.float() @ b.float()), not torch.equal(y, x.bfloat16())

    bad_dot, bad_round = wrong()
    if bad_round:
        convert = interpreter._convert_float
        toward_zero = interpreter._ir.ROUNDING_MODE.RTZ

        def convert_float(data, src, dst, rounding_mode):
            if src == tl.float32 and dst == tl.bfloat16 and rounding_mode != toward_zero:
                f = np.ascontiguousarray(data, dtype=np.float32)
                u = f.view(np.uint32).astype(np.uint64)
                out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
                return np.where(np.isnan(f), np.uint16(0x7FC0), out)
            return convert(data, src, dst, rounding_mode)

        interpreter._convert_float = convert_float
    if bad_dot:
        dot = interpreter.InterpreterBuilder.create_dot

        def widened(x):
            if x.dtype.scalar != tl.bfloat16:
                return x
            return interpreter.TensorHandle(interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

        interpreter.InterpreterBuilder.create_dot = create_dot
    if bad_dot or bad_round:
        assert wrong() == (False, False), "Triton's interpreter still computes bfloat16 wrongly"
    return bad_dot or bad_round


INTERPRETER_MENDED = (os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
                      and _interpreter_bfloat16_mended())  # fmt: skip


@pytest.fixture(autouse=True)
def _restore_cpu_float_state():
    """The CLI flushes denormal floats for the whole process (``linearize.runtime.configure_cpu``);
    tests that call it in-process must not leave that state to the next test (hypothesis, for one,
    refuses to run when subnormals are flushed)."""
    yield
    torch.set_flush_denormal(False)
