"""Fused per-token decode steps on CPU: the C kernels of ``cpu_kernels.c``, built on first use.

A converted layer's decode step in PyTorch operations costs tens of dispatched operations per layer
and token, each a few microseconds on a small CPU, more than the whole attention of the teacher at a
few hundred tokens. The kernels here do one layer's step (feature maps, gates, state update, read,
window softmax, mix) in one call and one pass over each state, with the same numbers as the
decode-path ops in ``dsla.py`` / ``hybrid.py`` (tested against the reference ops).

The library is compiled with the system C compiler (``$CC``, else ``cc``, ``gcc``, ``clang``) the
first time a process needs it and cached under ``$LINEARIZE_CACHE/kernels`` (default
``~/.cache/linearize/kernels``), keyed by source, compiler, flags and CPU, so later processes load
it in milliseconds. ``LINEARIZE_CPU_KERNELS`` decides whether they are used:

- ``auto`` (default): used where they apply (float32 on CPU, Hedgehog or identity feature maps);
  when the library cannot be built or loaded the PyTorch decode path runs (logged once);
- ``on``: the same, but a library that cannot be built is an error;
- ``off``: never built or used (the PyTorch decode path runs).

``disabled()`` turns them off inside a block (tests compare both paths).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

from ..io import cache_root
from .common import EMPTY_DENOMINATOR

logger = logging.getLogger(__name__)

ENV = "LINEARIZE_CPU_KERNELS"
CHOICES = ("auto", "on", "off")
SOURCE = Path(__file__).with_suffix(".c")
ABI_VERSION = 2
FLAG_SETS = (
    ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"),
    ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"),
    ("-O3", "-fno-math-errno", "-fno-trapping-math"),  # no OpenMP: one thread
)
"""Compiler flags, tried in order until one builds (every set adds -std=gnu11 -fPIC -shared). No
-ffast-math: the kernels keep IEEE float semantics; errno and floating-point traps, which nothing
here reads, are what would stop loops over sqrt and comparisons from vectorising."""

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None
_disabled = 0
_parsed: tuple[str | None, str] = (None, "auto")


def setting() -> str:
    """``LINEARIZE_CPU_KERNELS`` (auto, on or off; unset: auto); ValueError naming the choices otherwise."""
    global _parsed
    raw = os.environ.get(ENV)
    if raw == _parsed[0]:  # read every decode step of every layer: parse each value once
        return _parsed[1]
    value = (raw or "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={raw!r} is not a valid setting; valid choices: {', '.join(CHOICES)}")
    _parsed = (raw, value)
    return value


@contextlib.contextmanager
def disabled():
    """Inside the block no kernel is used (the PyTorch decode path runs), whatever the setting."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when the setting (or ``disabled``)
    turns the kernels off or when it cannot be built (with ``on``: RuntimeError instead)."""
    if _disabled or setting() == "off":
        return None
    if _library is not None:
        return _library
    return _load()


def enabled() -> bool:
    """Whether decode steps on CPU use the kernels (building them if needed)."""
    return library() is not None


def _load() -> ctypes.CDLL | None:
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _open(_build())
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _failure = str(e)
                logger.warning("CPU decode kernels unavailable, the PyTorch decode path runs: %s", e)
    if _library is None and setting() == "on":
        raise RuntimeError(f"{ENV}=on but the CPU decode kernels cannot be built: {_failure}")
    return _library


def _compiler() -> str:
    """$CC, else the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        if shutil.which(cc.split()[0]) is None:
            raise RuntimeError(f"CC={cc!r} is not an executable C compiler")
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    raise RuntimeError("no C compiler found (set CC or install gcc or clang)")


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the platform."""
    ident = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            ident += sorted({line.strip() for line in f if line.startswith(("model name", "flags", "Features"))})
    except OSError:
        pass
    return "\n".join(ident)


def kernel_dir() -> Path:
    """Where built libraries are kept: $LINEARIZE_CACHE/kernels."""
    return cache_root() / "kernels"


def _build() -> Path:
    """The compiled library's path (built now when the cache has none)."""
    cc = _compiler()
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([*cc.split(), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"C compiler {cc!r} does not run: {e}") from e
    out_dir = kernel_dir()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), " ".join(flags).encode(),
                                         _cpu_identity().encode()])).hexdigest()[:20]  # fmt: skip
        path = out_dir / f"cpu_kernels-{key}.so"
        if path.is_file():
            return path
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [*cc.split(), *flags, "-std=gnu11", "-fPIC", "-shared", "-o", tmp, str(SOURCE)]
        logger.info("building the CPU decode kernels: %s", " ".join(cmd))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.SubprocessError as e:
            done, errors = None, errors + [str(e)]
        if done is not None and done.returncode == 0:
            os.replace(tmp, path)
            return path
        os.unlink(tmp)
        if done is not None:
            errors.append(f"{' '.join(flags)}: {done.stderr.strip()[-500:]}")
    raise RuntimeError(f"compiling {SOURCE.name} failed with every flag set: " + " | ".join(errors))


def _open(path: Path) -> ctypes.CDLL:
    """Load the library (torch, imported above, has loaded its OpenMP runtime: the kernels share its threads)."""
    lib = ctypes.CDLL(str(path))
    if lib.linearize_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI version {lib.linearize_abi_version()}, expected {ABI_VERSION}")
    layout = (ctypes.c_int64 * 6)()
    lib.linearize_layout(layout)
    expected = [ctypes.sizeof(DslaArgs), DslaArgs.bf16_weights.offset, DslaArgs.out.offset,
                ctypes.sizeof(HybridArgs), HybridArgs.bf16_weights.offset, HybridArgs.out.offset]  # fmt: skip
    if list(layout) != expected:
        raise RuntimeError(f"{path}: argument layout {list(layout)} does not match the ctypes structures {expected}")
    for name, args in (("linearize_dsla_step", DslaArgs), ("linearize_hybrid_step", HybridArgs)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.POINTER(args)], None
    logger.info("CPU decode kernels loaded from %s (%d threads)", path, lib.linearize_max_threads())
    return lib


_f = ctypes.c_void_p


class DslaArgs(ctypes.Structure):
    """``dsla_args`` of cpu_kernels.c (same fields, same order)."""

    _fields_ = [(n, ctypes.c_int64) for n in ("threads", "batch", "heads", "kv_heads", "head_dim", "value_dim", "features", "rank",
                                               "hidden", "normalize", "rope", "rope_stride")] + [("empty", ctypes.c_float)] + [
        (n, _f) for n in ("x", "q", "k", "v", "cos", "sin")] + [("bf16_weights", ctypes.c_int64)] + [
        (n, _f) for n in ("wq", "bq", "wk", "bk", "down", "up", "up_bias", "mix",
                          "states", "scratch", "out")]  # fmt: skip


class HybridArgs(ctypes.Structure):
    """``hybrid_args`` of cpu_kernels.c (same fields, same order)."""

    _fields_ = [(n, ctypes.c_int64) for n in ("threads", "batch", "heads", "kv_heads", "head_dim", "value_dim", "features", "window",
                                               "slot", "gate_mix", "overlap", "branches", "linear_rope",
                                               "rope_stride")] + [
        ("scale", ctypes.c_float), ("empty", ctypes.c_float)] + [
        (n, _f) for n in ("q", "k", "v", "cos", "sin")] + [("bf16_weights", ctypes.c_int64)] + [
        (n, _f) for n in ("wq", "bq", "wk", "bk", "factor", "keys", "linear_keys", "values",
                          "feats", "linear", "valid", "scratch", "out")]  # fmt: skip


# ----------------------------------------------------------------------------- calling the kernels


MATRICES = ("wq", "wk", "down", "up")
"""The weights a kernel reads most of (Hedgehog maps, gate projections): float32, or bfloat16 when
every value is one (``Weights``)."""


class Weights:
    """Tensors a kernel reads every token (stacked or cast once), kept alive with their data pointers.
    Every tensor is a contiguous float32 CPU tensor; with ``compact`` the weight matrices (``MATRICES``)
    are kept in bfloat16 when that holds every one of their values exactly (as for weights trained
    or stored in bfloat16): the same numbers, half the bytes to read every token."""

    def __init__(self, *, compact: bool = True, **tensors) -> None:
        for name, t in tensors.items():
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError(f"kernel weight {name!r} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
        matrices = [t for name, t in tensors.items() if name in MATRICES and t is not None]
        self.bf16 = compact and bool(matrices) and all(torch.equal(t, t.bfloat16().float()) for t in matrices)
        if self.bf16:
            tensors = {name: t.bfloat16() if name in MATRICES and t is not None else t for name, t in tensors.items()}
        self.tensors = tensors
        self.pointers = {name: (None if t is None else t.data_ptr()) for name, t in tensors.items()}


def _token_inputs(**tensors) -> list[Tensor]:
    """The tensors, contiguous (the caller keeps them while the kernel reads them); ValueError
    unless they are float32 CPU tensors."""
    out = []
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        out.append(t if t.is_contiguous() else t.contiguous())
    return out


GRAIN = 32768
"""State elements below which a kernel runs on the calling thread alone (torch's own grain size):
a team costs more than it saves on so little work."""


class Teams:
    """Whether a kernel call runs on torch's intra-op threads (a team) or on the calling thread alone.

    A team waits for all its threads at every barrier. On an idle machine two threads take about a
    third off a SmolLM2 layer's step; but when another process holds the other core, each wait
    lasts until the scheduler runs the second thread again, and a step took ten times longer than
    on one thread (docs/results/performance/cpu.md). So team calls are timed: when a kernel's
    recent team calls (a moving average, weight ``RECENT`` on the newest) take more than ``STALL``
    times its fastest team call plus ``MARGIN_S``, teams are off for ``backoff_s`` seconds, doubling
    while they keep stalling (up to ``MAX_BACKOFF_S``); the first team call after that tries again.
    A single slow call (the scheduler ran something else for a moment) does not turn them off."""

    RECENT = 0.2
    STALL = 4.0
    MARGIN_S = 1e-3
    BACKOFF_S = 2.0
    MAX_BACKOFF_S = 60.0

    def __init__(self) -> None:
        self.fastest: dict[tuple[str, int], float] = {}
        self.recent: dict[tuple[str, int], float] = {}
        self.off_until = 0.0
        self.backoff_s = self.BACKOFF_S

    def threads(self, elements: int, now: float) -> int:
        threads = torch.get_num_threads()
        return 1 if threads == 1 or elements < GRAIN or now < self.off_until else threads

    def observe(self, key: tuple[str, int], seconds: float, now: float) -> None:
        """A team call of ``key`` (kernel, state elements) took ``seconds``, ending at ``now``."""
        fastest = self.fastest[key] = min(self.fastest.get(key, seconds), seconds)
        recent = self.recent.get(key)
        recent = self.recent[key] = seconds if recent is None else (1 - self.RECENT) * recent + self.RECENT * seconds
        if recent <= self.STALL * fastest + self.MARGIN_S:
            self.backoff_s = self.BACKOFF_S
            return
        self.off_until = now + self.backoff_s
        logger.debug("%s kernel teams take %.2f ms (fastest %.2f ms): one thread for %.0f s", key[0], recent * 1e3, fastest * 1e3,
                     self.backoff_s)  # fmt: skip
        self.backoff_s = min(2 * self.backoff_s, self.MAX_BACKOFF_S)
        self.recent.clear()


teams = Teams()


def _call(fn, args, kernel: str, elements: int) -> None:
    """``fn(args)`` on a team or one thread (``teams``), timed when on a team."""
    start = time.perf_counter()
    args.threads = threads = teams.threads(elements, start)
    fn(args)
    if threads > 1:
        end = time.perf_counter()
        teams.observe((kernel, elements), end - start, end)


def _check_sizes(what: str, **sizes: tuple[Tensor | None, int]) -> None:
    """ValueError unless each tensor is there and holds the number of elements the kernel reads from it."""
    for name, (t, expected) in sizes.items():
        if t is None:
            raise ValueError(f"{what}: {name} is missing")
        if t.numel() != expected:
            raise ValueError(f"{what}: {name} has {t.numel()} elements ({tuple(t.shape)}), the kernel reads {expected}")


def _point_at(args: ctypes.Structure, weights: Weights, expected: set[str]) -> None:
    """Set ``args``' weight pointers to ``weights`` (exactly the ``expected`` names)."""
    given = {name for name, t in weights.tensors.items() if t is not None}
    if given != expected:
        raise ValueError(f"kernel weights {sorted(given)} are not the expected {sorted(expected)}")
    for name, pointer in weights.pointers.items():
        setattr(args, name, pointer)
    args.bf16_weights = int(weights.bf16)


def _rope_tables(rope: tuple[Tensor, Tensor], b: int, d: int) -> tuple[Tensor, Tensor, int]:
    """(cos, sin, row stride) of position embeddings (B or 1, 1, D), contiguous (the caller keeps them
    while the kernel reads them)."""
    cos, sin = rope
    if cos.shape != sin.shape or cos.shape[1:] != (1, d) or cos.shape[0] not in (1, b):
        raise ValueError(f"position embeddings of shape {tuple(cos.shape)} do not fit a decode step of {b} rows, head dim {d}")
    cos, sin = _token_inputs(cos=cos, sin=sin)
    return cos, sin, 0 if cos.shape[0] == 1 else d


def dsla_step(lib: ctypes.CDLL, state, x: Tensor, q: Tensor, k: Tensor, v: Tensor, weights: Weights, *, heads: int,
              kv_heads: int, head_dim: int, normalize: bool, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:  # fmt: skip
    """``dsla_decode_step`` with the feature maps and gates before it, as one kernel call: one new
    real token per row; x (B, 1, hidden), q (B, 1, Hq D), k and v (B, 1, Hkv D) as the projections
    give them (D = ``head_dim``; before RoPE: ``rope`` = (cos, sin) (B or 1, 1, D) applies it to q and
    k first). ``state`` a
    DslaDecodeState, updated in place; ``weights`` the Hedgehog maps (wq, bq, wk, bk; None without
    ``normalize``), the gates (down (2 R, hidden), up (2, R, Hq F): the up projections' weights
    transposed, up_bias (2, Hq F)) and ``mix`` (2,) as ``dsla_decode_step`` takes it. Returns the
    output (B, Hq, 1, Dv)."""
    s = state.states  # (2, B, Hq, F, W)
    b, hidden = x.shape[0], x.shape[-1]
    dv = s.shape[-1] - normalize
    x, q, k, v = _token_inputs(x=x, q=q, k=k, v=v)
    args = state.kernel_args
    if args is None:
        if s.dtype != torch.float32 or not s.is_contiguous() or s.shape[1:3] != (b, heads):
            raise ValueError(f"DSLA states must be contiguous float32 (2, {b}, {heads}, F, W), got {s.dtype} {tuple(s.shape)}")
        rank = weights.tensors["down"].shape[0] // 2
        scratch = s.new_empty(b * 2 * rank + b * heads * 2 * 2 * s.shape[-1])
        args = DslaArgs(batch=b, heads=heads, kv_heads=kv_heads, head_dim=head_dim, value_dim=dv,
                        features=s.shape[3], rank=rank, hidden=hidden, normalize=int(normalize), empty=EMPTY_DENOMINATOR,
                        states=s.data_ptr(), scratch=scratch.data_ptr())  # fmt: skip
        state.kernel_args, state.kernel_scratch = args, scratch
    d, f, rank = args.head_dim, args.features, args.rank
    if state.kernel_weights is not weights:
        w = weights.tensors
        maps = ("wq", "bq", "wk", "bk") if normalize else ()
        _check_sizes("DSLA kernel weights", down=(w.get("down"), 2 * rank * hidden), up=(w.get("up"), 2 * rank * heads * f),
                     up_bias=(w.get("up_bias"), 2 * heads * f), mix=(w.get("mix"), 2),
                     **{n: (w.get(n), heads * d * (f // 2) if n[0] == "w" else heads * (f // 2)) for n in maps})  # fmt: skip
        _point_at(args, weights, {"down", "up", "up_bias", "mix", *maps})
        state.kernel_weights = weights
    _check_sizes("DSLA decode step", x=(x, args.batch * hidden), q=(q, args.batch * heads * d), k=(k, args.batch * kv_heads * d),
                 v=(v, args.batch * kv_heads * args.value_dim))  # fmt: skip
    out = q.new_empty(b, heads, 1, dv)
    args.x, args.q, args.k, args.v, args.out = x.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    if rope is None:
        args.rope = 0
    else:
        args.rope = 1
        cos, sin, args.rope_stride = _rope_tables(rope, b, head_dim)
        args.cos, args.sin = cos.data_ptr(), sin.data_ptr()
    _call(lib.linearize_dsla_step, args, "dsla", s.numel())
    return out


BRANCH_CODES = {"both": 0, "window": 1, "linear": 2}


def hybrid_step(lib: ctypes.CDLL, state, q: Tensor, k: Tensor, v: Tensor, rope: tuple[Tensor, Tensor], weights: Weights, *,
                heads: int, kv_heads: int, mix: str = "joint", overlap: bool = False, branches: str = "both", scale: float,
                linear_rope: bool = True) -> Tensor:  # fmt: skip
    """``hybrid_decode_step`` with RoPE and the Hedgehog feature maps before it, as one kernel call:
    one new real token per row; q (B, 1, Hq D), k and v (B, 1, Hkv D) as the projections give them
    (before RoPE), ``rope`` = (cos, sin) (B or 1, 1, D). ``state`` a HybridDecodeState, updated in
    place (its ring advances one slot); ``weights`` the maps (wq, bq, wk, bk) and ``factor`` (Hq,), the
    window factor (mix "joint") or the gate g (mix "gate"); ``linear_rope``: the maps see q/k after
    RoPE (else before; the state then keeps the keys before RoPE too). Returns the output (B, Hq, 1, Dv)."""
    b, bk, w, d = q.shape[0], *state.keys.shape
    dv = state.values.shape[-1] - 1
    f = state.linear.shape[1]
    q, k, v = _token_inputs(q=q, k=k, v=v)
    args = state.kernel_args
    if args is None:
        tensors = {"keys": state.keys, "values": state.values, "features": state.features, "linear": state.linear}
        if state.linear_keys is not None:
            tensors["linear_keys"] = state.linear_keys
        for name, t in tensors.items():
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"hybrid decode state {name} must be contiguous float32, got {t.dtype}")
        if bk != b * kv_heads or state.valid.dtype != torch.bool or not state.valid.is_contiguous():
            raise ValueError(f"hybrid decode state of {bk} rows x heads does not fit {b} rows of {kv_heads} KV heads")
        _check_sizes("hybrid decode state", values=(state.values, bk * w * (dv + 1)), features=(state.features, bk * w * heads // kv_heads * f),
                     linear=(state.linear, b * heads * f * (dv + 1)), valid=(state.valid, b * w),
                     **({} if state.linear_keys is None else {"linear_keys": (state.linear_keys, bk * w * d)}))  # fmt: skip
        scratch = state.keys.new_empty(b, heads, d + f + 2 * (dv + 1))
        args = HybridArgs(batch=b, heads=heads, kv_heads=kv_heads, head_dim=d, value_dim=dv, features=f, window=w,
                          empty=EMPTY_DENOMINATOR, keys=state.keys.data_ptr(),
                          linear_keys=None if state.linear_keys is None else state.linear_keys.data_ptr(),
                          values=state.values.data_ptr(), feats=state.features.data_ptr(), linear=state.linear.data_ptr(),
                          valid=state.valid.data_ptr(), scratch=scratch.data_ptr())  # fmt: skip
        state.kernel_args, state.kernel_scratch = args, scratch
    if state.kernel_weights is not weights:
        wt = weights.tensors
        _check_sizes("hybrid kernel weights", factor=(wt.get("factor"), heads),
                     **{n: (wt.get(n), heads * d * (f // 2) if n[0] == "w" else heads * (f // 2)) for n in ("wq", "bq", "wk", "bk")})
        _point_at(args, weights, {"wq", "bq", "wk", "bk", "factor"})
        state.kernel_weights = weights
    _check_sizes("hybrid decode step", q=(q, args.batch * heads * d), k=(k, args.batch * kv_heads * d),
                 v=(v, args.batch * kv_heads * args.value_dim))  # fmt: skip
    args.gate_mix, args.overlap, args.branches, args.linear_rope, args.scale = (mix == "gate", overlap, BRANCH_CODES[branches],
                                                                                linear_rope, scale)  # fmt: skip
    out = q.new_empty(b, heads, 1, dv)
    args.q, args.k, args.v, args.out = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    cos, sin, args.rope_stride = _rope_tables(rope, b, d)
    args.cos, args.sin = cos.data_ptr(), sin.data_ptr()
    args.slot = state.head
    _call(lib.linearize_hybrid_step, args, "hybrid", state.linear.numel() + state.keys.numel() + state.values.numel())
    state.steps += 1
    if not state.full:
        state.full = bool(state.valid.all())
    return out
