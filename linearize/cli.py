"""The ``linearize`` command line: info, convert, generate, demo.

Spec flags (``--attention``, ``--window``, ...) are generated from the ConversionSpec dataclass and
every registered attention kind's options, so the CLI, YAML spec files and the Python API share one
definition (and its documentation); a flag the chosen kind does not have is an error.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Callable

from .layers.registry import KINDS, all_modes, option_fields
from .spec import ConversionSpec, LayerSpec

EXIT_USAGE = 2
MODES = all_modes()
DEFAULT_CONVERSION = "smollm2-135m-lolcats"
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
DEMO_PROMPT = (
    "Read this passage, then answer the question.\n\n"
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans about seven "
    "million square kilometres, of which about five and a half million are covered by the rainforest. The "
    "region includes territory belonging to nine nations: the majority of the forest lies in Brazil, "
    "followed by Peru with thirteen percent and Colombia with ten percent, with smaller amounts in Venezuela, "
    "Ecuador, Bolivia, Guyana, Suriname and French Guiana. The rainforest represents over half of the "
    "planet's remaining rainforests and is the largest and most biodiverse tract of tropical rainforest in "
    "the world, with an estimated 390 billion individual trees divided into 16,000 species.\n\n"
    "Question: Which country holds the majority of the Amazon rainforest, and how many tree species does it have?"
)


# --- spec flags from the dataclass -------------------------------------------------------------
def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal right after each field) of a dataclass."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parse_layers(text: str):
    if text == "all":
        return "all"
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers must be 'all' or comma-separated indices like 0,1,-1; got {text!r}") from None


def _parse_optional_int(text: str):
    return None if text.lower() == "none" else int(text)


def _spec_flag_fields() -> list[tuple[dataclasses.Field, type, str, str]]:
    """(field, type hint, doc, which kinds have it) of every spec flag: the attention, each kind's
    options (first definition wins: kinds that share a field share its meaning) and the selection."""
    out = []
    owners = option_fields()
    sources = [LayerSpec] + [kind.options for kind in KINDS.values()] + [ConversionSpec]
    seen = {"options", "overrides"}
    for cls in sources:
        docs, hints = _field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            kinds = f" [attention: {', '.join(owners[f.name])}]" if f.name in owners else ""
            out.append((f, hints[f.name], docs.get(f.name, ""), kinds))
    return out


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per spec field (default None = keep the spec file's or the default value)."""
    group = parser.add_argument_group("conversion spec (each overrides --spec; a field the chosen attention lacks is an error)")
    for f, hint, doc, kinds in _spec_flag_fields():
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict = {"default": None, "help": f"{doc}{kinds} (default: {_default(f)})"}
        if f.name == "layers":
            kwargs.update(type=_parse_layers, metavar="all|I,J,...")
        elif hint is bool:
            kwargs.update(type=_parse_bool, metavar="true|false")
        elif hint is int:
            kwargs.update(type=int)
        elif hint is float:
            kwargs.update(type=float)
        elif hint == (int | None):
            kwargs.update(type=_parse_optional_int)
        elif hint == (list[int] | None):
            kwargs.update(type=_int_list, metavar="I,J,...")
        else:
            kwargs.update(type=str)
        group.add_argument(flag, dest=f"spec_{f.name}", **kwargs)
    group.add_argument("--spec", dest="spec_file", help="YAML/JSON spec file (flags above override its values)")


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _spec_flags(args: argparse.Namespace) -> dict:
    """The spec fields given as flags (--window 8 -> {"window": 8})."""
    return {k[5:]: v for k, v in vars(args).items() if k.startswith("spec_") and k != "spec_file" and v is not None}


def spec_from_args(args: argparse.Namespace, base: dict | None = None) -> ConversionSpec | None:
    """The spec the flags describe, or None when no spec flag was given. The flags override --spec;
    without --spec they override ``base`` (a loaded model's own spec), if given."""
    flags = _spec_flags(args)
    if not flags and not args.spec_file:
        return None
    if args.spec_file:
        return ConversionSpec.from_file(args.spec_file).replace(**flags)
    if base is not None:
        return ConversionSpec.from_dict(base).replace(**flags)
    return ConversionSpec.from_dict(flags)


# --- commands ----------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from .summary import model_info

    model, _ = _load(args.model, args)
    print(model_info(model, as_json=args.json))
    return 0


def cmd_convert(args) -> int:
    from .api import save_adapter
    from .convert import convert
    from .io import atomic_dir

    spec = spec_from_args(args) or ConversionSpec()
    model, tokenizer = _load(args.model, args)
    convert(model, spec)
    if args.adapter:
        save_adapter(model, args.out, base_model=args.model)
    else:
        with atomic_dir(args.out) as tmp:
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    print(f"wrote {'adapter' if args.adapter else 'checkpoint'} to {args.out}")
    return 0


def cmd_generate(args) -> int:
    from .convert import convert, set_mode
    from .generate import generate_text

    model, tokenizer = _load(args.model, args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; generate needs one")
    spec = spec_from_args(args)
    if spec is not None:
        convert(model, spec)
    if args.mode:
        set_mode(model, args.mode)
    result = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, chat=not args.no_chat)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(result.text)
        print(f"\n[{result.new_tokens} tokens in {result.seconds:.2f} s = {result.tokens_per_second:.1f} tok/s; "
              f"memory held for this request: {_mib(result.memory_bytes)}]")
    return 0


def cmd_demo(args) -> int:
    """The main job: teacher vs a trained conversion (or, with spec flags, a fresh untrained one),
    side by side, with the memory each holds."""
    from .convert import convert
    from .generate import generate_text
    from .memory import request_memory

    teacher_model, tokenizer = _load(args.model, args)
    teacher = generate_text(teacher_model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, chat=True)
    spec = spec_from_args(args)
    untrained = spec is not None
    if untrained:  # a fresh conversion of --model with these flags
        convert(teacher_model, spec)
        window = getattr(spec.options, "window", None)
        student_model, label = teacher_model, f"{spec.attention}{f', window {window}' if window else ''}, untrained"
    else:
        student_model, _ = _load(args.conversion, args)
        spec = ConversionSpec.from_dict(student_model.config.linearize)
        label = f"{args.conversion}, trained"
    student = generate_text(student_model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, chat=True)
    width = 60
    print(f"prompt: {args.prompt}\n")
    print(f"{'TEACHER (softmax attention)':<{width}} | CONVERTED ({label})")
    print("-" * width + "-+-" + "-" * width)
    for left, right in _side_by_side(teacher.text, student.text, width):
        print(f"{left:<{width}} | {right}")
    print("-" * width + "-+-" + "-" * width)
    for name, r in (("teacher", teacher), ("converted", student)):
        print(f"{name:>9}: {r.new_tokens} tokens, {r.tokens_per_second:.1f} tok/s, memory held: {_mib(r.memory_bytes)} "
              f"for {r.context_tokens} tokens of context (measured)")
    dtype_bytes = next(student_model.parameters()).element_size()
    for tokens in (1024, 8192):
        t_bytes = request_memory(None, student_model, tokens, dtype_bytes)
        s_bytes = request_memory(spec, student_model, tokens, dtype_bytes)
        print(f"  at {tokens:>5} tokens (formula): teacher {_mib(t_bytes)}, converted {_mib(s_bytes)} ({t_bytes / s_bytes:.1f}x less)")
    if untrained:
        print("\nnote: the converted model is untrained: expect degraded text once the context outgrows the window")
    else:
        print("\nnote: held-out quality of the shipped conversions against the teacher: docs/results/training.md")
    return 0


def parse_overrides(extra: list[str]) -> dict[str, object]:
    """``--transfer.optim.lr 0.01 --spec.window=32`` -> {"transfer.optim.lr": 0.01, "spec.window": 32} (YAML-typed)."""
    import yaml

    out: dict[str, object] = {}
    i = 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or item == "--":
            raise ValueError(f"expected an override like --transfer.optim.lr 0.01, got {item!r}")
        key, eq, value = item[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise ValueError(f"override --{key} needs a value")
            value, i = extra[i + 1], i + 1
        out[key.replace("-", "_")] = yaml.safe_load(value)
        i += 1
    return out


def cmd_train(args) -> int:
    from .train.recipes import load_recipe, recipe_names, run

    if args.report:
        from .train.report import load_summaries, training_table

        print(training_table(load_summaries(args.report)))
        return 0
    if args.compare_runs:
        from .train.report import plot_runs, runs_markdown, runs_report

        report = runs_report(args.compare_runs)
        markdown = runs_markdown(report)
        print(markdown)
        if args.out:
            _write_report(args.out, "runs", markdown, report)
            plot_runs(report, Path(args.out) / "runs.png")
        return 0
    if args.list:
        for name in recipe_names():
            config = load_recipe(name)
            print(f"{name:<18} {config.description}")
        return 0
    if not args.recipe:
        raise ValueError(f"--recipe is required; valid recipes: {', '.join(recipe_names())}")
    config = load_recipe(args.recipe, args.overrides)
    if args.print_config:
        print(config.to_yaml())
        return 0
    summary = run(config, resume=args.resume)
    print(json.dumps({k: summary[k] for k in ("name", "teacher_heldout_loss", "heldout_loss", "heldout_ppl", "teacher_heldout_ppl", "adapter")}, indent=2))
    return 0


def cmd_sensitivity(args) -> int:
    """Per layer: entropy of the last query's attention and the measured held-out loss increase."""
    from .data import DataConfig, build_dataset
    from .train.sensitivity import (attention_entropy, loss_increase, plot_sensitivity, save_order,
                                    sensitivity_report, trained_loss_increase)

    model, tokenizer = _load(args.model, args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; sensitivity needs one to read its data")
    data = build_dataset(DataConfig(source=args.source, seq_len=args.seq_len, heldout_sequences=args.batches * args.batch_size), tokenizer)
    batches = [data.heldout[i * args.batch_size:(i + 1) * args.batch_size] for i in range(args.batches)]
    entropy = attention_entropy(model, batches)
    if getattr(model.config, "linearize", None) is not None:  # a trained conversion: measure its own layers
        increase = trained_loss_increase(model, batches)
        layers = sorted(increase)
        report = sensitivity_report([entropy[i] for i in layers], [increase[i] for i in layers], layers)
    else:
        spec = spec_from_args(args) or ConversionSpec(attention="dsla")
        report = sensitivity_report(entropy, loss_increase(model, spec, batches))
    out = Path(args.out)
    save_order(report, out / "sensitivity.json")
    plot_sensitivity(report, out / "sensitivity.png")
    print(f"{'layer':>5}  {'entropy':>8}  {'loss increase':>13}")
    for row in report["layers"]:
        print(f"{row['layer']:>5}  {row['entropy']:>8.3f}  {row['loss_increase']:>13.4f}")
    print(f"Spearman(entropy, measured increase) = {report['spearman']}")
    print(f"order (least sensitive first): {report['order']}")
    print(f"wrote {out / 'sensitivity.json'} and {out / 'sensitivity.png'}")
    return 0


def _suite(args):
    from .eval.report import get_suite

    changes = {}
    if args.samples is not None:
        changes["synthetic_samples"] = {"default": args.samples}
    if args.mc_limit is not None:
        changes["mc_limit"] = args.mc_limit
    if args.tasks is not None:
        changes["synthetic_tasks"] = [t for t in args.tasks.split(",") if t]
    if args.lengths is not None:
        changes["synthetic_lengths"] = args.lengths
    if args.ppl_lengths is not None:
        changes["perplexity_lengths"] = args.ppl_lengths
    if args.mc_tasks is not None:
        changes["mc_tasks"] = [] if args.mc_tasks == "none" else [t for t in args.mc_tasks.split(",") if t]
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    if args.ppl_source is not None:
        changes["heldout_source"] = args.ppl_source
    return get_suite(args.suite, **changes)


def _write_report(out: str | None, stem: str, markdown: str, data: dict) -> None:
    """Write OUT/STEM.md and .json atomically; the final report replaces any partial one."""
    if out is None:
        return
    from .io import atomic_write_text

    atomic_write_text(Path(out) / f"{stem}.md", markdown)
    atomic_write_text(Path(out) / f"{stem}.json", json.dumps(data, indent=2, default=str))
    for suffix in (".md", ".json"):
        (Path(out) / f"{stem}.partial{suffix}").unlink(missing_ok=True)
    print(f"wrote {Path(out) / stem}.md and .json")


def _partial_writer(out: str | None, stem: str, render: Callable[[dict], str]) -> Callable[[dict], None] | None:
    """on_update callback writing OUT/STEM.partial.md and .json (atomically) after each finished part."""
    if out is None:
        return None
    from .io import atomic_write_text

    def write(data: dict) -> None:
        atomic_write_text(Path(out) / f"{stem}.partial.md", "(partial: the run has not finished)\n\n" + render(data))
        atomic_write_text(Path(out) / f"{stem}.partial.json", json.dumps({**data, "partial": True}, indent=2, default=str))

    return write


def _load_converted(args):
    """Load --model; spec flags (e.g. --attention lola --sparse-cache 64) convert it, keeping trained parameters."""
    from .convert import convert

    model, tokenizer = _load(args.model, args)
    # flags change the model's own spec (e.g. --active 10 of a chained family's order); --spec replaces it
    spec = spec_from_args(args, base=getattr(model.config, "linearize", None))
    if spec is not None:
        convert(model, spec)
    return model, tokenizer


def cmd_eval(args) -> int:
    from .eval.report import run_suite, to_markdown

    suite = _suite(args)
    model, tokenizer = _load_converted(args)
    title = f"{args.model}: {suite.name} suite"
    partial = _partial_writer(args.out, "report", lambda r: to_markdown(title, r))
    result = run_suite(model, tokenizer, suite, data_dir=args.data_dir, device=args.device, on_update=partial)
    result["model"] = args.model
    markdown = to_markdown(title, result)
    print(markdown)
    _write_report(args.out, "report", markdown, result)
    return 0


def cmd_compare(args) -> int:
    from .eval.perplexity import plot_perplexity_vs_length
    from .eval.report import headline, run_suite, table

    if args.reports:
        title, results = "Comparison (from saved reports)", _saved_reports(args.reports)
    elif not args.models:
        raise ValueError("name the models to compare (or give --reports NAME=REPORT.json[,REPORT.json ...])")
    else:
        suite = _suite(args)
        title, results = f"Comparison: {suite.name} suite", {}
        for name in args.models:
            model, tokenizer = _load(name, args)
            results[name] = run_suite(model, tokenizer, suite, data_dir=args.data_dir, device=args.device)
            del model
    markdown = f"# {title}\n\n" + table({n: headline(r) for n, r in results.items()}) + "\n"
    print(markdown)
    _write_report(args.out, "compare", markdown, results)
    with_ppl = {n: r["perplexity"] for n, r in results.items() if r.get("perplexity")}
    if args.out and with_ppl:
        plot_perplexity_vs_length(with_ppl, Path(args.out) / "perplexity_vs_length.png")
    return 0


def _saved_reports(items: list[str]) -> dict[str, dict]:
    """--reports NAME=A.json,B.json ...: each model's saved report JSONs merged (later files win)."""
    from .eval.report import merge_results

    results = {}
    for item in items:
        name, eq, files = item.partition("=")
        if not eq or not name or not files:
            raise ValueError(f"--reports expects NAME=REPORT.json[,REPORT.json ...], got {item!r}")
        parts = []
        for file in files.split(","):
            path = Path(file)
            if not path.is_file():
                raise FileNotFoundError(f"report {file!r} (for {name!r}) does not exist")
            parts.append(json.loads(path.read_text()))
        results[name] = merge_results(parts)
    return results


def cmd_ablate(args) -> int:
    from .eval.report import ablate, headline, table

    suite = _suite(args)
    model, tokenizer = _load_converted(args)
    title = f"# Component ablation: {args.model} ({suite.name} suite)\n\n"
    partial = _partial_writer(args.out, "ablation", lambda r: title + table({m: headline(x) for m, x in r.items()}) + "\n")
    result = ablate(model, tokenizer, suite, modes=args.modes.split(",") if args.modes else None, data_dir=args.data_dir,
                    device=args.device, on_update=partial)
    extra = {"Delta_LA": result["delta_la"]} if result["delta_la"] else None
    markdown = title + table(result["table"], extra=extra) + "\n"
    print(markdown)
    _write_report(args.out, "ablation", markdown, result)
    return 0


def cmd_bench(args) -> int:
    from .bench.efficiency import run_efficiency, to_markdown

    spec = spec_from_args(args)
    result = run_efficiency(args.model, spec, prefill_lengths=args.prefill_lengths, decode_contexts=args.decode_contexts,
                            batch_size=args.batch_size, decode_steps=args.decode_steps, repeats=args.repeats,
                            device=args.device, out_dir=args.out)
    print(to_markdown(result))
    return 0


def cmd_plots(args) -> int:
    """Diagnostic plots of a converted model on held-out text (self-recall error, attention mass, DSLA gates)."""
    from .eval.perplexity import heldout_tokens
    from .eval.plots import diagnostic_plots
    from .data import DataConfig

    model, tokenizer = _load_converted(args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; plots need one to read text")
    ids = heldout_tokens(tokenizer, DataConfig(source=args.source, seq_len=64), max_tokens=args.tokens)
    for path in diagnostic_plots(model, tokenizer, ids[None], args.out, layer=args.layer):
        print(f"wrote {path}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _int_list_or_none(text: str) -> list[int]:
    return [] if text == "none" else _int_list(text)


def _side_by_side(a: str, b: str, width: int):
    import textwrap

    la = [line for para in a.splitlines() for line in (textwrap.wrap(para, width) or [""])]
    lb = [line for para in b.splitlines() for line in (textwrap.wrap(para, width) or [""])]
    n = max(len(la), len(lb))
    return zip(la + [""] * (n - len(la)), lb + [""] * (n - len(lb)))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _load(name: str, args):
    from .api import load_model

    return load_model(name, device=getattr(args, "device", None))


# --- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linearize", description="Turn a Transformer LLM into a hybrid linear-attention model.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="layers, spec, parameter counts, memory per layer")
    p.add_argument("model", help="alias (smollm2-135m), checkpoint dir, adapter dir or hub id")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("convert", help="convert a model (untrained new parameters) and save it")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model to convert (default: {DEFAULT_MODEL})")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--adapter", action="store_true", help="write only the new parameters + the base model's name")
    add_spec_flags(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("generate", help="generate text; shows tokens/s and memory held per request")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text (no chat template)")
    p.add_argument("--mode", help=f"component mode of converted layers ({', '.join(MODES)}; each kind has a subset)")
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

    p = sub.add_parser("sensitivity", help="per-layer attention entropy vs measured loss increase; saves the order")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a teacher (layers converted one at a time per the spec flags) or a trained conversion")
    p.add_argument("--source", default="wiki", help="held-out text source (as data.source of a recipe)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", required=True, help="directory for sensitivity.json and sensitivity.png")
    add_spec_flags(p)
    p.set_defaults(func=cmd_sensitivity)

    def suite_flags(p):
        p.add_argument("--suite", default="quick", help="quick | full (default: quick)")
        p.add_argument("--data-dir", help="folder with the multiple-choice data files (e.g. ../shared/data/eval); without it they are skipped")
        p.add_argument("--samples", type=int, help="synthetic samples per task and length (overrides the suite)")
        p.add_argument("--tasks", help="comma-separated synthetic tasks (overrides the suite)")
        p.add_argument("--lengths", type=_int_list, help="comma-separated synthetic lengths (overrides the suite)")
        p.add_argument("--mc-limit", type=int, help="documents per multiple-choice task (overrides the suite)")
        p.add_argument("--ppl-source", help="held-out text of the perplexity: a data source (wiki, essays, a local "
                       ".txt/.jsonl/.parquet file or folder); its held-out documents (default: wiki)")
        p.add_argument("--mc-tasks", help="comma-separated lm-eval tasks, or 'none' (overrides the suite)")
        p.add_argument("--ppl-lengths", type=_int_list_or_none,
                       help="comma-separated perplexity context lengths, or 'none' (overrides the suite)")
        p.add_argument("--batch-size", type=int, help="generation and scoring batch size (overrides the suite)")
        p.add_argument("--device", help="cpu | cuda (default: cpu)")
        p.add_argument("--out", help="directory for the markdown + JSON report")

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
    defaults = "; ".join(f"{name}: {','.join(kind.ablation_modes)}" for name, kind in KINDS.items())
    p.add_argument("--modes", help=f"comma-separated modes (default per kind: {defaults})")
    suite_flags(p)
    add_spec_flags(p)
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("bench", help="prefill/decode latency and memory per request, teacher vs converted, as ratios")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prefill-lengths", type=_int_list, default=[256, 512, 1024])
    p.add_argument("--decode-contexts", type=_int_list, default=[512, 1024])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", help="cpu | cuda (default: cpu)")
    p.add_argument("--out", help="directory for efficiency.json, efficiency.md and efficiency.png")
    add_spec_flags(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("plots", help="diagnostic plots: self-recall error, attention mass by position, DSLA gates")
    p.add_argument("--model", required=True, help="a converted model (or any model plus spec flags)")
    p.add_argument("--source", default="wiki", help="held-out text source")
    p.add_argument("--tokens", type=int, default=512, help="sequence length to analyse")
    p.add_argument("--layer", type=int, help="converted layer to show (default: the middle one)")
    p.add_argument("--out", required=True, help="directory for the PNG files")
    add_spec_flags(p)
    p.set_defaults(func=cmd_plots)

    p = sub.add_parser("demo", help="main job: teacher vs a trained conversion side by side, with memory held")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the teacher (default: {DEFAULT_MODEL})")
    p.add_argument("--conversion", default=DEFAULT_CONVERSION,
                   help=f"trained conversion to compare: shipped name or adapter dir (default: {DEFAULT_CONVERSION}); "
                        "spec flags instead convert --model afresh, untrained")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=48)
    add_spec_flags(p)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # weight-loading bars; our own long work keeps its progress bars
    if getattr(args, "max_new_tokens", 1) < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        if args.command == "train":
            args.overrides = parse_overrides(extra)
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        print(f"linearize {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
