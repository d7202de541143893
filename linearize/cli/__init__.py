"""The ``linearize`` command line: info, convert, generate, train, sensitivity, eval, compare, ablate,
bench, plots, demo, serve, replay.

``parser``: this module (build_parser, main); ``spec_flags``: the spec flags generated from the spec
and the attention kinds; ``commands`` and ``demo``: what each command does; ``output``: report
writing and the demo's text layout.

Parsing imports nothing heavy (torch, transformers, lm-eval and peft load inside the commands), so
``--help`` and argument errors answer at once. Bad input exits with code 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..eval.suite import SUITES, describe
from .commands import (
    DEFAULT_MODEL,
    DEFAULT_PROMPT,
    cmd_ablate,
    cmd_bench,
    cmd_compare,
    cmd_convert,
    cmd_eval,
    cmd_generate,
    cmd_info,
    cmd_plots,
    cmd_calibrate,
    cmd_sensitivity,
    cmd_train,
    check_args,
    load_converted,
    parse_overrides,
)
from .demo import DEFAULT_CONVERSION, DEMO_PROMPT, cmd_demo
from ..bench.shapes import SHAPES as _SHAPES
from ..bench.shapes import STACKS as _STACKS
from .serve import add_serve_parser
from .spec_flags import add_spec_flags, int_at_least, int_list_or_none, non_negative_float, non_negative_float_list, positive_int_list, spec_from_args, stored_flag_table

LAYER_SHAPES = tuple(_SHAPES)

EXIT_USAGE = 2
MODES = tuple(stored_flag_table()["modes"])
POSITIVE = int_at_least(1)


class Parser(argparse.ArgumentParser):
    """argparse, with each error on one line: ``linearize CMD: error: ...; see 'linearize CMD --help'``."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="linearize", description="Turn a Transformer LLM into a hybrid linear-attention model.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_model_commands(sub)
    _add_eval_commands(sub)
    parser.commands = dict(sub.choices)
    return parser


def _add_model_commands(sub) -> None:
    """info, convert, generate, train, sensitivity."""
    p = sub.add_parser("info", help="layers, spec, parameter counts, memory per layer")
    p.add_argument("model", help="alias (smollm2-135m), checkpoint dir, adapter dir or hub id")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("convert", help="convert a model (untrained new parameters) and save it")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model to convert (default: {DEFAULT_MODEL})")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--adapter", action="store_true", help="write only the new parameters + the base model's name")
    p.add_argument("--force", action="store_true", help="replace --out when it exists and is not empty")
    add_spec_flags(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("generate", help="generate text; shows tokens/s and memory held per request")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=POSITIVE, default=64)
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text (no chat template)")
    p.add_argument("--mode", choices=MODES, metavar="MODE", help=f"component mode of converted layers ({', '.join(MODES)}; each kind has a subset)")
    p.add_argument("--decoder", default="auto",
                   help="static: static buffers, each decode step one CUDA graph replay on CUDA (softmax, hybrid, dsla and lola layers); "
                        "generate: model.generate() with the model's cache; auto (default): static on CUDA where every layer has it")
    p.add_argument("--json", action="store_true")
    add_spec_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("train", help="run a conversion recipe (any field overridable: --transfer.optim.lr 0.01)")
    p.add_argument("--recipe", help="recipe name or path to a recipe YAML (see --list)")
    p.add_argument("--resume", action="store_true", help="continue a killed run from its last checkpoints")
    p.add_argument("--list", action="store_true", help="list the recipes and exit")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--report", nargs="+", metavar="RUN_DIR", help="print the markdown results table of finished runs and exit")
    p.add_argument("--compare-runs", nargs="+", metavar="RUN_DIR",
                   help="held-out curves of finished runs against each other (data-parallel vs one process, seed noise), "
                        "tokens/s and scaling efficiency; writes OUT/runs.{md,json} and OUT/runs.png with --out, and exits")
    p.add_argument("--out", help="directory for --compare-runs output")
    p.set_defaults(func=cmd_train)

    from ..train.calibrate import CALIBRATION_INPUTS, CALIBRATION_TEXTS, CalibrationConfig

    calib = CalibrationConfig()
    p = sub.add_parser("calibrate", help="fit a LoLA read-out: a linear-term weight per layer and head, on held-out text; "
                                         "saves an adapter")
    p.add_argument("--model", required=True, help="a trained hybrid read as LoLA (with --attention lola --sparse-cache N ...) "
                                                  "or a LoLA conversion")
    p.add_argument("--source", default=calib.source, help=f"held-out text (a data source; default {calib.source}: not a needle haystack)")
    p.add_argument("--tokens", type=int_at_least(2), default=calib.tokens, help="length of each calibration sequence")
    p.add_argument("--skip", type=int_at_least(0), default=calib.skip, help="positions before this are not scored")
    p.add_argument("--grid", type=non_negative_float_list, default=calib.grid, help="comma-separated candidate weights")
    p.add_argument("--inputs", choices=CALIBRATION_INPUTS, default=calib.inputs,
                   help="what each layer reads while scored: the teacher's layer inputs, or 'chained' (the model being "
                        "calibrated, layers below already calibrated; the target stays the teacher's output)")
    p.add_argument("--text", choices=CALIBRATION_TEXTS, default=calib.text,
                   help="what is scored: the held-out text from --skip on, or recall probes (a passage, a gap, the passage "
                        "again; the repeat only)")
    p.add_argument("--probes", type=int_at_least(1), default=calib.probes, help="recall probes read (--text recall-probes)")
    p.add_argument("--passage", type=int_at_least(2), default=calib.passage, help="a recall probe's passage length")
    p.add_argument("--device", help="cpu | cuda (default: cpu)")
    p.add_argument("--out", required=True, help="directory for the adapter and calibration.{json,md,png}")
    add_spec_flags(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("sensitivity", help="per-layer attention entropy vs measured loss increase; saves the order")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a teacher (layers converted one at a time per the spec flags) or a trained conversion")
    p.add_argument("--source", default="wiki", help="held-out text source (as data.source of a recipe)")
    p.add_argument("--seq-len", type=int_at_least(2), default=512)
    p.add_argument("--batches", type=POSITIVE, default=4)
    p.add_argument("--batch-size", type=POSITIVE, default=4)
    p.add_argument("--recall-weight", type=non_negative_float, default=0.0,
                   help="also measure each layer's recall-probe loss increase (a held-out passage repeated after a gap "
                        "beyond the window, scored on the repeat) and order by held-out increase + this x recall increase "
                        "(0: held-out loss alone, no probes)")
    p.add_argument("--recall-passage", type=int_at_least(2), default=64, help="tokens in each recall probe's passage (< seq-len / 2)")
    p.add_argument("--out", required=True, help="directory for sensitivity.json and sensitivity.png")
    add_spec_flags(p)
    p.set_defaults(func=cmd_sensitivity)


def suite_flags(p) -> None:
    """The evaluation suite's flags (eval, compare, ablate)."""

    p.add_argument("--suite", default="quick", help="default: quick. " + " ".join(
        f"{name}: {describe(suite)}." for name, suite in SUITES.items()) + " Under 5 minutes on 2 CPU cores for the teacher "
        "and one conversion: quick (the others are for a GPU; standard is the suite of the published results)")
    p.add_argument("--data-dir", help="folder with the multiple-choice data files (default: the copy shipped in the package)")
    p.add_argument("--samples", type=POSITIVE, help="synthetic samples per task and length (overrides the suite)")
    p.add_argument("--tasks", help="comma-separated synthetic tasks (overrides the suite)")
    p.add_argument("--lengths", type=positive_int_list, help="comma-separated synthetic lengths (overrides the suite)")
    p.add_argument("--mc-limit", type=POSITIVE, help="documents per multiple-choice task (overrides the suite)")
    p.add_argument("--ppl-source", help="held-out text of the perplexity: a data source (wiki, essays, a local "
                   ".txt/.jsonl/.parquet file or folder); its held-out documents (default: wiki)")
    p.add_argument("--mc-tasks", help="comma-separated lm-eval tasks, or 'none' (overrides the suite)")
    p.add_argument("--ppl-lengths", type=int_list_or_none,
                   help="comma-separated perplexity context lengths, or 'none' (overrides the suite)")
    p.add_argument("--batch-size", type=POSITIVE, help="generation and scoring batch size (overrides the suite)")
    p.add_argument("--device", help="cpu | cuda (default: cpu)")
    p.add_argument("--out", help="directory for the markdown + JSON report")


def _add_eval_commands(sub) -> None:
    """eval, compare, ablate, bench, plots, demo."""
    p = sub.add_parser("eval", help="evaluate a model: perplexity by length, synthetic long-context tasks, multiple choice")
    p.add_argument("--model", default=DEFAULT_MODEL)
    suite_flags(p)
    add_spec_flags(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("compare", help="evaluate several models side by side (or tabulate saved reports)")
    p.add_argument("models", nargs="*")
    p.add_argument("--reports", nargs="+", metavar="NAME=REPORT.json[,...]",
                   help="no evaluation: merge each model's saved report JSONs (later files win) and tabulate them")
    suite_flags(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("ablate", help="a converted model under each component mode, with Delta_LA")
    p.add_argument("--model", required=True)
    defaults = "; ".join(f"{name}: {','.join(modes)}" for name, modes in stored_flag_table()["ablation_modes"].items())
    p.add_argument("--modes", help=f"comma-separated modes (default per kind: {defaults})")
    suite_flags(p)
    add_spec_flags(p)
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("bench", help="decode speed by context of the teacher and conversions; with spec flags or a converted "
                                      "--model, prefill/decode latency and memory per request; with --layer, one attention layer "
                                      "against flash softmax and the roofline",
                       description="Without spec flags and with a plain --model (the teacher): greedy decode tokens/s after "
                                   "each of --contexts tokens for --model and each of --conversions, loaded together and run "
                                   "in turn in one process (ratios to --model), with the thread count (--out: speed.json/md/png). "
                                   "With spec flags (a fresh conversion) or a converted --model: teacher vs converted prefill and "
                                   "decode latency and memory per request (--out: efficiency.json/md/png). With --layer SHAPE: "
                                   "one attention layer of random weights against SDPA softmax (--out: layer.json/md/png).")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--conversions", type=lambda s: [x for x in s.split(",") if x],
                   help="comma-separated conversions to measure beside --model (default: every shipped one)")
    p.add_argument("--contexts", type=positive_int_list, default=[256, 1024, 4096], help="context lengths of the decode-speed table")
    p.add_argument("--prefill-lengths", type=int_list_or_none,
                   help="default: 256,512,1024 (model); 2048,8192,32768 (--layer; 'none' to skip prefill)")
    p.add_argument("--decode-contexts", type=int_list_or_none,
                   help="default: 512,1024 (model); 4096,32768 (--layer; 'none' to skip decode)")
    p.add_argument("--batch-size", type=POSITIVE, default=1)
    p.add_argument("--layer", metavar="SHAPE", choices=LAYER_SHAPES,
                   help=f"benchmark one attention layer of this shape ({', '.join(LAYER_SHAPES)}) with random weights "
                        "instead of a model: the spec flags' kind, or hybrid, dsla and lola at their defaults")
    p.add_argument("--batch-sizes", type=positive_int_list, help="--layer: batch sizes to run (default: --batch-size)")
    p.add_argument("--decode-steps", type=POSITIVE, default=16)
    p.add_argument("--repeats", type=POSITIVE, default=3)
    p.add_argument("--graphs", action="store_true",
                   help="decode on static buffers, each step one CUDA graph replay, for the teacher and the conversion alike "
                        "(with spec flags or a converted --model: linearize.decoding.StaticDecoder, which also runs on CPU, "
                        "eagerly; with --layer: CUDA only)")
    p.add_argument("--compile", action="store_true",
                   help="with --graphs, --capacity, --profile or --layer: compile the decode step (each side's) with torch.compile first")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing: profile one static decode step of the teacher and the conversion at the first "
                        "--decode-contexts context and --batch-size (kernels by device time, launches per step; --compile "
                        "profiles the compiled step; --out: profile.json/md); with --layer: each prefill case is also profiled, "
                        "both sides, and layer.md lists the converted prefill's kernels; with --capacity: each side's step is also "
                        "profiled at its largest batch (capacity.md lists the kernels)")
    p.add_argument("--capacity", type=POSITIVE, metavar="CONTEXT",
                   help="throughput at equal memory: the teacher's and the conversion's largest batch at CONTEXT tokens within "
                        "one memory budget, and their decode tokens/s there (StaticDecoder; --out: capacity.json/md)")
    p.add_argument("--stack", choices=tuple(_STACKS), help="with --capacity: a random-weight model of this shape instead of --model")
    p.add_argument("--memory-gib", type=float, help="with --capacity: the memory budget in GiB (default: --memory-fraction of free GPU memory)")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="with --capacity on CUDA: the share of free memory to fill")
    p.add_argument("--max-batch", type=POSITIVE, default=65536, help="with --capacity: the largest batch tried")
    p.add_argument("--device", help="cpu | cuda (default: cpu)")
    p.add_argument("--out", help="directory for efficiency.{json,md,png} (--layer: layer.{json,md,png})")
    p.add_argument("--kernel-option", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a kernel constant of linearize.ops for this run, e.g. fused_lola.ONE_KERNEL_ROWS=0 or "
                        "fused_lola.STAGES=1 (repeatable; recorded in the results as kernel_options)")
    add_spec_flags(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("plots", help="diagnostic plots: self-recall error, attention mass by position, DSLA gates")
    p.add_argument("--model", required=True, help="a converted model (or any model plus spec flags)")
    p.add_argument("--source", default="wiki", help="held-out text source")
    p.add_argument("--tokens", type=int_at_least(2), default=512, help="sequence length to analyse")
    p.add_argument("--layer", type=int, help="converted layer to show (default: the middle one)")
    p.add_argument("--needle", metavar="TASK",
                   help="instead of text: a synthetic task (e.g. passkey, niah_single_1) read by LoLA layers; per layer and "
                        "head, the needle's share of the sparse cache and of the last query's attention, LoLA vs the "
                        "teacher: needle_TASK_LENGTH.{json,md,png}")
    p.add_argument("--length", type=int_at_least(64), default=2048, help="--needle: prompt length in tokens")
    p.add_argument("--samples", type=int_at_least(1), default=4, help="--needle: prompts to average over")
    p.add_argument("--out", required=True, help="directory for the PNG files (and the needle JSON/markdown)")
    add_spec_flags(p)
    p.set_defaults(func=cmd_plots)
    p = sub.add_parser("demo", help="main job: teacher vs a trained conversion side by side, with memory held")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the teacher (default: {DEFAULT_MODEL})")
    p.add_argument("--conversion", default=DEFAULT_CONVERSION,
                   help=f"trained conversion to compare: shipped name or adapter dir (default: {DEFAULT_CONVERSION}); "
                        "spec flags instead convert --model afresh, untrained")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-new-tokens", type=POSITIVE, default=48)
    add_spec_flags(p)
    p.set_defaults(func=cmd_demo)

    add_serve_parser(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "train":
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("linearize.hub.progress").setLevel(logging.INFO)  # long waits (the one-time dequantisation) show without -v
    try:
        if args.command == "train":
            args.overrides = parse_overrides(extra)
        check_args(args)  # names, files, outputs, devices: before any model loads
        if not args.verbose:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # weight-loading bars; our own long work keeps its progress bars
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
        message = " ".join(str(err).split())  # one line
        print(f"linearize {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["EXIT_USAGE", "MODES", "build_parser", "load_converted", "main", "parse_overrides", "spec_from_args"]
