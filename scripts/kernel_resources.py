"""Registers, spilled bytes and shared memory of every Triton kernel a converted layer launches, as
compiled for a GPU architecture, on a machine without that GPU (or without any).

It builds one random layer of a shape (``linearize bench --layer``'s shapes) per kind, and runs a
prefill and decode steps through the layer's own code on the CPU with every Triton launch replaced
by a compilation for the target (``ptxas`` of Triton's wheel) that launches nothing: each kernel is
compiled with the arguments, constants and launch options the layer passes it, every autotuned
choice of tiles compiled, and ``cuobjdump --dump-resource-usage`` reads each result. The numbers
are ptxas's, as the driver reports them on the GPU (spills: the local memory and stack frame per
thread / 4, as Triton's ``n_spills`` counts them: 212 for the LoLA selection at the Llama-3-8B shape,
as measured on an H200); the outputs of the calls are garbage (nothing runs) and are not looked at.

    python scripts/kernel_resources.py OUT [--shape llama3-8b] [--kinds hybrid,dsla,lola]
        [--prefill 1024] [--batches 1,64] [--arch 90] [--set MODULE.NAME=VALUE ...] [--sass DIR]

writes OUT/kernel_resources.json and OUT/kernel_resources.md (a row per kernel and tile choice).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

KINDS = {
    "hybrid": "--attention hybrid --window 64",
    "dsla": "--attention dsla",
    "dsla-nope": "--attention dsla --linear-rope false",
    "lola": "--attention lola --window 64 --sparse-cache 256 --chunk 64 --keep-recalls true",
    "lola-state": "--attention lola --window 64 --sparse-cache 256 --chunk 64 --keep-recalls false",
    "lola64": "--attention lola --window 64 --sparse-cache 64 --chunk 64 --keep-recalls true",
    "lola-memory": "--attention lola --window 64 --sparse-cache 256 --chunk 64 --recall memory",
}
"""Kinds by name: the spec flags of ``linearize bench`` they stand for."""

logger = logging.getLogger("kernel_resources")


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} not found: this Triton wheel has no CUDA tools")
    return str(path)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED and LOCAL of the one function in ``cubin`` (cuobjdump's resource usage)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in found:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{text}")
    return {k: int(v) for k, v in found.items()}


def disassemble(cubin: bytes) -> str:
    """The SASS of ``cubin`` (cuobjdump -sass)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True, check=True).stdout


SASS_CLASSES = {"instructions": None, "barriers": ("BAR",), "global_loads": ("LDG",), "global_stores": ("STG",),
                "shared": ("LDS", "STS", "LDSM"), "local": ("LDL", "STL"), "mma": ("HMMA", "WGMMA", "HGMMA")}  # fmt: skip
"""Instruction classes counted in the SASS (by opcode prefix; "instructions": all of them)."""


def sass_counts(sass: str) -> dict[str, int]:
    """Static counts of SASS instructions by class (each instruction once, loops not unrolled)."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return {name: len(ops) if prefixes is None else sum(op.startswith(prefixes) for op in ops) for name, prefixes in SASS_CLASSES.items()}


class CompileOnly:
    """Within ``active()``, a Triton launch compiles its kernel for ``target`` and records its
    resources instead of running; an autotuned launch compiles every (pruned) choice."""

    def __init__(self, arch: int, sass_dir: Path | None = None) -> None:
        from triton.backends.compiler import GPUTarget

        self.sass_dir = sass_dir
        self.target = GPUTarget("cuda", arch, 32)
        self.rows: list[dict[str, Any]] = []
        self.context: dict[str, Any] = {}
        self._seen: set = set()
        self._config: str | None = None

    def _compile(self, jit, args, kwargs) -> None:
        from triton.compiler import ASTSource, compile, make_backend
        from triton.runtime.jit import compute_cache_key, create_function_from_signature

        backend = make_backend(self.target)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        kwargs = dict(kwargs)
        kwargs.setdefault("debug", False)
        bound, specialization, options = binder(*args, **kwargs)
        key = (jit.fn.__qualname__, compute_cache_key({}, specialization, options), tuple(sorted(self.context.items())))
        if key in self._seen:
            return
        self._seen.add(key)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
        compiled = compile(ASTSource(jit, signature, constexprs, attrs), target=self.target, options=options.__dict__)
        usage = resource_usage(compiled.asm["cubin"])
        sass = disassemble(compiled.asm["cubin"])
        counts = sass_counts(sass)
        spills = (usage.get("LOCAL", 0) + usage.get("STACK", 0)) // 4  # the driver's local size: the stack frame included
        consts = {str(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v for k, v in constexprs.items()}
        consts = {jit.arg_names[int(k)] if k.isdigit() else k: v for k, v in consts.items()}
        self.rows.append({
            **self.context, "kernel": jit.fn.__name__, "tiles": self._config, "num_warps": compiled.metadata.num_warps,
            "num_stages": compiled.metadata.num_stages, "registers": usage["REG"], "spills": spills,
            "stack_bytes": usage.get("STACK", 0), "local_bytes": usage.get("LOCAL", 0), "shared_bytes": compiled.metadata.shared,
            "sass": counts, "constexprs": {k: v for k, v in consts.items() if isinstance(v, (int, float, bool, str))},
        })  # fmt: skip
        if self.sass_dir is not None:
            self.sass_dir.mkdir(parents=True, exist_ok=True)
            (self.sass_dir / f"{len(self.rows):03d}-{jit.fn.__name__}.sass").write_text(sass)
            (self.sass_dir / f"{len(self.rows):03d}-{jit.fn.__name__}.ttgir").write_text(compiled.asm["ttgir"])
        logger.info("%s %s: %d registers, %d spilled", jit.fn.__name__, self._config or "", usage["REG"], spills)

    @contextlib.contextmanager
    def active(self):
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        recorder = self

        def run(self, *args, grid, warmup, **kwargs):  # noqa: ARG001 (nothing is launched)
            recorder._compile(self, args, kwargs)

        def tune(self, *args, **kwargs):
            self.nargs = dict(zip(self.arg_names, args))
            for config in self.prune_configs(kwargs):
                recorder._config = ", ".join(f"{k}={v}" for k, v in config.all_kwargs().items() if v is not None and k != "num_ctas")
                self.fn.run(*args, **kwargs, **config.all_kwargs())
            recorder._config = None
            self.nargs = None

        saved = JITFunction.run, Autotuner.run
        JITFunction.run, Autotuner.run = run, tune
        try:
            yield self
        finally:
            JITFunction.run, Autotuner.run = saved


def layer_workload(shape, flags: str, *, prefill: int, batches: list[int], recorder: CompileOnly) -> None:
    """A prefill of ``prefill`` tokens, then static decode steps at each batch size, through one
    random layer converted by ``flags``, on the CPU in bfloat16 (the kernels compiled, not run)."""
    from linearize.bench.layer import _positions, build_layer
    from linearize.cache import cache_kwargs, state_layer
    from linearize.decoding import StaticSlot
    from linearize.cli import build_parser, spec_from_args
    from linearize.ops import fused_decode
    from transformers import DynamicCache

    spec = spec_from_args(build_parser().parse_args(["bench", *shlex.split(flags)]))
    model = build_layer(shape, spec, max_positions=prefill + 64, device="cpu", dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), fused_decode.use_fused(True):
        recorder.context.update(phase="prefill", batch=1)
        x = torch.randn(1, prefill, shape.hidden, generator=gen, dtype=torch.bfloat16)
        cache = DynamicCache()
        attn(x, position_embeddings=_positions(model, x, 0), attention_mask=None, **cache_kwargs(cache))
        for batch in batches:
            recorder.context.update(phase="prefill", batch=1)
            cache = DynamicCache()
            attn(x, position_embeddings=_positions(model, x, 0), attention_mask=None, **cache_kwargs(cache))
            recorder.context.update(phase="decode", batch=batch)
            slot = state_layer(cache, 0)
            slot.batch_repeat_interleave(batch)
            if not attn.static_decoding(slot, batch, torch.device("cpu"), torch.bfloat16):
                logger.info("%s: no static decode step", flags)
                continue
            sslot = StaticSlot(slot.decode_state)
            x1 = torch.randn(batch, 1, shape.hidden, generator=gen, dtype=torch.bfloat16)
            for i in range(2):  # the first fused LoLA step rebuilds the kept recalls, the second keeps them
                attn.decode_step(x1, _positions(model, x1, prefill + i), sslot)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Triton kernels' resources, compiled for sm_{result['arch']}", "",
             f"Shape {result['shape']}, prefill of {result['prefill']} tokens, decode at batch {', '.join(map(str, result['batches'])) or '(none)'}; "
             f"Triton {result['triton']}. Spills: local memory and stack per thread / 4 (the driver's count)."
             + (" Set: " + ", ".join(f"{k}={v!r}" for k, v in result["settings"].items()) + "." if result["settings"] else ""), "",
             "| kind | phase | batch | kernel | tiles | warps | stages | registers | spills | shared KiB | SASS | barriers | local |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["kernels"]:
        lines.append(f"| {r['kind']} | {r['phase']} | {r['batch']} | `{r['kernel']}` | {r['tiles'] or ''} | {r['num_warps']} | {r['num_stages']} | "
                     f"{r['registers']} | {r['spills']} | {r['shared_bytes'] / 1024:.1f} | {r['sass']['instructions']} | "
                     f"{r['sass']['barriers']} | {r['sass']['local']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama3-8b", help="a layer shape of `linearize bench --layer`")
    parser.add_argument("--kinds", default="hybrid,dsla,lola", help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--prefill", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--batches", default="1,64", help="decode batch sizes")
    parser.add_argument("--sass", type=Path, default=None, help="a folder to write each kernel's SASS and Triton GPU IR (.ttgir) into")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="set a constant of a linearize.ops module first, e.g. fused_lola.PREFILL_READ_QUERIES=32 (repeatable)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        parser.error(f"unknown kinds {bad}; choose from {', '.join(KINDS)}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: unset it, the kernels are compiled, not interpreted")
    import triton

    from linearize.bench.layer import layer_shape
    from linearize.ops import fused_decode

    shape = layer_shape(args.shape)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]  # none: the prefill alone
    from linearize.ops import kernel_options

    try:
        settings = kernel_options.apply(args.set)
    except ValueError as e:
        parser.error(str(e).replace("kernel option", "--set"))
    recorder = CompileOnly(args.arch, args.sass)
    fused_decode.kernels_run_on = lambda x: True  # the layers take their Triton paths on the CPU
    with recorder.active():
        for kind in kinds:
            recorder.context = {"kind": kind}
            layer_workload(shape, KINDS[kind], prefill=args.prefill, batches=batches, recorder=recorder)
    result = {"arch": args.arch, "shape": args.shape, "prefill": args.prefill, "batches": batches, "triton": triton.__version__,
              "settings": settings, "kernels": recorder.rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in (("kernel_resources.json", json.dumps(result, indent=1)), ("kernel_resources.md", markdown(result))):
        tmp = args.out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(args.out / name)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(markdown(main()))
