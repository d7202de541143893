"""The commands of the command line (one function each, ``args`` from the parser)."""

from __future__ import annotations

import json
from pathlib import Path

from .output import mib, partial_writer, write_report
from .spec_flags import spec_from_args

DEFAULT_MODEL = "smollm2-135m"


DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def cmd_info(args) -> int:
    from ..summary import model_info

    model, _ = load(args.model, args)
    print(model_info(model, as_json=args.json))
    return 0


def cmd_convert(args) -> int:
    from ..api import save_adapter
    from ..convert import convert
    from ..io import atomic_dir
    from ..spec import ConversionSpec

    spec = spec_from_args(args) or ConversionSpec()
    model, tokenizer = load(args.model, args)
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
    from ..convert import set_mode
    from ..generate import generate_text

    # flags change the model's own spec, as in eval (e.g. --active 10 of a nested family)
    model, tokenizer = load_converted(args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; generate needs one")
    if args.mode:
        set_mode(model, args.mode)
    stream = None if args.json else stream_to_stdout
    result = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, chat=not args.no_chat, on_text=stream,
                           decoder=args.decoder)  # fmt: skip
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print()
        print(f"\n[{result.new_tokens} tokens in {result.seconds:.2f} s = {result.tokens_per_second:.1f} tok/s ({result.decoder} decoder); "
              f"memory held for this request: {mib(result.memory_bytes)}]")
    return 0


def stream_to_stdout(text: str) -> None:
    """Print generated text as it comes (no newline, flushed)."""
    print(text, end="", flush=True)


def parse_overrides(extra: list[str]) -> dict[str, object]:
    """``--transfer.optim.lr 0.01 --spec.window=32`` -> {"transfer.optim.lr": 0.01, "spec.window": 32} (YAML-typed;
    ``1e-3`` is a float)."""
    from ..checks import load_yaml

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
        out[key.replace("-", "_")] = load_yaml(value)
        i += 1
    return out


def cmd_train(args) -> int:
    from ..train.recipes import load_recipe, recipe_names, run

    if args.report:
        from ..train.report import load_summaries, training_table

        print(training_table(load_summaries(args.report)))
        return 0
    if args.compare_runs:
        from ..train.report import plot_runs, runs_markdown, runs_report

        report = runs_report(args.compare_runs)
        markdown = runs_markdown(report)
        print(markdown)
        if args.out:
            write_report(args.out, "runs", markdown, report)
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


def cmd_calibrate(args) -> int:
    """Fit per-head linear-term weights of the LoLA layers on held-out text; save the adapter with them."""
    from ..api import save_adapter
    from ..train.calibrate import (
        CalibrationConfig,
        apply_linear_weights,
        calibrate_linear_weights,
        calibration_inputs,
        calibration_markdown,
        lola_layers,
        plot_calibration,
    )

    config = CalibrationConfig(source=args.source, tokens=args.tokens, skip=args.skip, grid=args.grid, inputs=args.inputs,
                               text=args.text, probes=args.probes, passage=args.passage)
    model, tokenizer = load_converted(args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; calibration needs one to read its text")
    lola_layers(model)  # no LoLA layer: say so before reading any text
    ids = calibration_inputs(tokenizer, config)
    result = calibrate_linear_weights(model, ids.to(model.device), config)
    spec = apply_linear_weights(model, result["weights"])
    summary = {k: result[k] for k in ("uniform", "calibrated", "config")}
    # the adapter builds on the model it calibrated (a trained conversion keeps its LoRA that way):
    # loading it loads --model, then reads it with the calibrated spec
    base = str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model
    save_adapter(model, args.out, base_model=base, spec=spec.to_dict(), extra={"calibration": summary})
    markdown = calibration_markdown(result, title=f"{args.model}: LoLA read-out calibration")
    write_report(args.out, "calibration", markdown, result)
    plot_calibration(result, Path(args.out) / "calibration.png")
    print(markdown)
    print(f"wrote the adapter and calibration.{{json,md,png}} to {args.out}")
    return 0


def cmd_sensitivity(args) -> int:
    """Per layer: entropy of the last query's attention, the measured held-out loss increase and, with
    --recall-weight, the recall-probe loss increase."""
    from ..data import DataConfig, build_dataset
    from ..train.sensitivity import (
        attention_entropy,
        loss_increase,
        plot_sensitivity,
        recall_probes,
        save_order,
        sensitivity_report,
        trained_sensitivity,
    )

    if args.recall_weight > 0 and 2 * args.recall_passage >= args.seq_len:
        raise ValueError(f"--recall-passage {args.recall_passage} leaves no gap in rows of --seq-len {args.seq_len}: "
                         f"use a passage below {(args.seq_len + 1) // 2}")
    model, tokenizer = load(args.model, args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; sensitivity needs one to read its data")
    data = build_dataset(DataConfig(source=args.source, seq_len=args.seq_len, heldout_sequences=args.batches * args.batch_size + (args.recall_weight > 0)), tokenizer)  # probes take their gaps from the next row
    batches = [data.heldout[i * args.batch_size:(i + 1) * args.batch_size] for i in range(args.batches)]
    probes = (recall_probes(data.heldout, passage=args.recall_passage, batch_size=args.batch_size, max_probes=args.batches * args.batch_size)
              if args.recall_weight > 0 else None)
    if getattr(model.config, "linearize", None) is not None:  # a trained conversion: measure its own layers
        report = trained_sensitivity(model, batches, probes, recall_weight=args.recall_weight)
    else:
        from ..spec import ConversionSpec

        spec = spec_from_args(args) or ConversionSpec(attention="dsla")
        recall = None if probes is None else loss_increase(model, spec, probes)
        report = sensitivity_report(attention_entropy(model, batches), loss_increase(model, spec, batches), recall=recall,
                                    recall_weight=args.recall_weight)
    out = Path(args.out)
    save_order(report, out / "sensitivity.json")
    plot_sensitivity(report, out / "sensitivity.png")
    extra = "recall_weight" in report
    print(f"{'layer':>5}  {'entropy':>8}  {'loss increase':>13}" + (f"  {'recall increase':>15}  {'score':>8}" if extra else ""))
    for row in report["layers"]:
        print(f"{row['layer']:>5}  {row['entropy']:>8.3f}  {row['loss_increase']:>13.4f}"
              + (f"  {row['recall_increase']:>15.4f}  {row['score']:>8.4f}" if extra else ""))
    print(f"Spearman(entropy, measured increase) = {report['spearman']}")
    print(f"order (least sensitive first): {report['order']}")
    print(f"wrote {out / 'sensitivity.json'} and {out / 'sensitivity.png'}")
    return 0


def suite_from_args(args):
    from ..eval.suite import get_suite

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


def load_converted(args):
    """Load --model; spec flags (e.g. --attention lola --sparse-cache 64) convert it, keeping trained parameters."""
    from ..convert import convert

    model, tokenizer = load(args.model, args)
    # flags change the model's own spec (e.g. --active 10 of a chained family's order); --spec replaces it
    spec = spec_from_args(args, base=getattr(model.config, "linearize", None))
    if spec is not None:
        convert(model, spec)
    return model, tokenizer


def cmd_eval(args) -> int:
    from ..eval.markdown import to_markdown
    from ..eval.report import run_suite

    suite = suite_from_args(args)
    model, tokenizer = load_converted(args)
    title = f"{args.model}: {suite.name} suite"
    partial = partial_writer(args.out, "report", lambda r: to_markdown(title, r))
    result = run_suite(model, tokenizer, suite, data_dir=args.data_dir, device=args.device, on_update=partial)
    result["model"] = args.model
    markdown = to_markdown(title, result)
    print(markdown)
    write_report(args.out, "report", markdown, result)
    return 0


def cmd_compare(args) -> int:
    from ..eval.markdown import table
    from ..eval.perplexity import plot_perplexity_vs_length
    from ..eval.report import headline, run_suite
    from ..eval.synthetic import plot_task_scores

    if args.reports:
        title, results = "Comparison (from saved reports)", _saved_reports(args.reports)
    elif not args.models:
        raise ValueError("name the models to compare (or give --reports NAME=REPORT.json[,REPORT.json ...])")
    else:
        suite = suite_from_args(args)
        title, results = f"Comparison: {suite.name} suite", {}
        for name in args.models:
            model, tokenizer = load(name, args)
            results[name] = run_suite(model, tokenizer, suite, data_dir=args.data_dir, device=args.device)
            del model
    markdown = f"# {title}\n\n" + table({n: headline(r) for n, r in results.items()}) + "\n"
    print(markdown)
    write_report(args.out, "compare", markdown, results)
    with_ppl = {n: r["perplexity"] for n, r in results.items() if any("ppl" in row for row in r.get("perplexity") or ())}
    if args.out and with_ppl:
        plot_perplexity_vs_length(with_ppl, Path(args.out) / "perplexity_vs_length.png")
    if args.out:
        plot_task_scores({n: r.get("synthetic") or {} for n, r in results.items()}, Path(args.out) / "tasks.png")
    return 0


def _saved_reports(items: list[str]) -> dict[str, dict]:
    """--reports NAME=A.json,B.json ...: each model's saved report JSONs merged (later files win)."""
    from ..eval.report import merge_results

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
            try:
                parts.append(json.loads(path.read_text()))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"report {file!r} (for {name!r}) is not JSON: {err}") from None
        results[name] = merge_results(parts)
    return results


def cmd_ablate(args) -> int:
    from ..eval.ablation import ablate
    from ..eval.markdown import table
    from ..eval.report import headline

    suite = suite_from_args(args)
    model, tokenizer = load_converted(args)
    title = f"# Component ablation: {args.model} ({suite.name} suite)\n\n"
    partial = partial_writer(args.out, "ablation", lambda r: title + table({m: headline(x) for m, x in r.items()}) + "\n")
    result = ablate(model, tokenizer, suite, modes=args.modes.split(",") if args.modes else None, data_dir=args.data_dir,
                    device=args.device, on_update=partial)
    extra = {"Delta_LA": result["delta_la"]} if result["delta_la"] else None
    markdown = title + table(result["table"], extra=extra) + "\n"
    print(markdown)
    write_report(args.out, "ablation", markdown, result)
    return 0


LAYER_KINDS = ({"attention": "hybrid", "window": 64}, {"attention": "dsla"},
               {"attention": "lola", "window": 64, "sparse_cache": 256, "chunk": 64})
"""What ``bench --layer`` compares without spec flags: each kind at the settings the shipped models use."""


def cmd_bench(args) -> int:
    from ..ops import kernel_options

    kernel_options.apply(args.kernel_option)  # a bad one fails before anything loads
    if args.compile and not (args.graphs or args.capacity or args.profile or args.layer):
        raise ValueError("--compile applies to static decoding: give --graphs, --capacity, --profile or --layer")
    if (args.stack or args.memory_gib is not None) and not args.capacity:
        raise ValueError("--stack and --memory-gib go with --capacity CONTEXT")
    if args.capacity:
        return _bench_capacity(args)
    if args.layer:
        return _bench_layer(args)
    from ..bench.efficiency import run_decode_speed, run_efficiency, speed_markdown, to_markdown
    from ..names import SHIPPED
    from ..runtime import configure_cpu

    configure_cpu()  # the speed table loads its models itself
    spec = spec_from_args(args)
    if spec is None and args.model not in SHIPPED and not Path(args.model).is_dir():  # a plain teacher: the speed table
        conversions = list(SHIPPED) if args.conversions is None else args.conversions
        result = run_decode_speed([args.model, *conversions], args.contexts, steps=args.decode_steps,
                                  device=args.device, out_dir=args.out)  # fmt: skip
        print(speed_markdown(result))
        return 0
    if args.profile:
        from ..bench.profile import profile_decode, profile_markdown

        contexts = [1024] if not args.decode_contexts else args.decode_contexts
        result = profile_decode(args.model, spec, context=contexts[0], batch_size=args.batch_size, compile=args.compile,
                                device=args.device, out_dir=args.out)  # fmt: skip
        print(profile_markdown(result))
        return 0
    result = run_efficiency(args.model, spec, prefill_lengths=[256, 512, 1024] if args.prefill_lengths is None else args.prefill_lengths,
                            decode_contexts=[512, 1024] if args.decode_contexts is None else args.decode_contexts, batch_size=args.batch_size,
                            decode_steps=args.decode_steps, repeats=args.repeats, device=args.device, out_dir=args.out,
                            static_decode="compile" if args.compile and args.graphs else args.graphs)  # fmt: skip
    print(to_markdown(result))
    return 0


def _bench_capacity(args) -> int:
    from ..bench.capacity import capacity_markdown, run_capacity
    from ..bench.shapes import STACKS
    from ..hub import build_tiny_llama
    from ..runtime import check_device

    spec = spec_from_args(args)
    device = check_device(args.device or "cpu")
    if args.stack:
        import torch

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_tiny_llama(0, device=device, dtype=dtype, **STACKS[args.stack])
        model.config.linearize_base_model = f"random {args.stack}"
        if spec is None:
            raise ValueError(f"--stack {args.stack} has random weights and no conversion: give spec flags (e.g. --attention hybrid)")
    else:
        model = args.model
    memory = None if args.memory_gib is None else int(args.memory_gib * 2**30)
    result = run_capacity(model, spec, out_dir=args.out, context=args.capacity, steps=args.decode_steps, memory_bytes=memory,
                          memory_fraction=args.memory_fraction, max_batch=args.max_batch, compile=args.compile, device=device,
                          profile=args.profile)  # fmt: skip
    print(capacity_markdown(result))
    return 0


def _bench_layer(args) -> int:
    from ..bench.layer import layer_markdown, run_layer_bench

    spec = spec_from_args(args)
    results = run_layer_bench(
        args.layer, [spec] if spec is not None else LAYER_KINDS, out_dir=args.out,
        prefill_lengths=[2048, 8192, 32768] if args.prefill_lengths is None else args.prefill_lengths,
        decode_contexts=[4096, 32768] if args.decode_contexts is None else args.decode_contexts,
        batch_sizes=args.batch_sizes or [args.batch_size], decode_steps=args.decode_steps, repeats=args.repeats, device=args.device,
        graphs=args.graphs, compile=args.compile, profile=args.profile,
    )  # fmt: skip
    print(layer_markdown(results))
    return 0


def cmd_plots(args) -> int:
    """Diagnostic plots of a converted model on held-out text (self-recall error, attention mass, DSLA gates)."""
    from ..data import DataConfig
    from ..eval.perplexity import heldout_tokens
    from ..eval.plots import diagnostic_plots

    if args.needle:
        from ..eval.synthetic import get_task

        get_task(args.needle)  # an unknown task fails before the model loads
    model, tokenizer = load_converted(args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; plots need one to read text")
    if args.needle:
        from ..eval.needle import needle_data, needle_markdown, plot_needle

        data = needle_data(model, tokenizer, args.needle, args.length, samples=args.samples)
        name = f"needle_{args.needle}_{args.length}"
        markdown = needle_markdown(data, title=f"{args.model}: {args.needle} at {args.length} tokens")
        write_report(args.out, name, markdown, data)
        plot_needle(data, Path(args.out) / f"{name}.png")
        print(markdown)
        print(f"wrote {Path(args.out) / name}.{{json,md,png}}")
        return 0
    ids = heldout_tokens(tokenizer, DataConfig(source=args.source, seq_len=64), max_tokens=args.tokens)
    for path in diagnostic_plots(model, tokenizer, ids[None], args.out, layer=args.layer):
        print(f"wrote {path}")
    return 0


STANDALONE_SPEC = ("convert", "demo", "bench", "sensitivity")
"""Commands whose spec flags make a spec of their own (the others change the loaded model's spec)."""


def model_names(args) -> list[str]:
    """The model names a command's arguments hold (--model, demo's --conversion, compare's models)."""
    names = [getattr(args, "model", None), getattr(args, "conversion", None), *(getattr(args, "models", None) or [])]
    return [name for name in names if name]


def check_args(args) -> None:
    """Fail at once on bad input the parser cannot see, before any model loads: text that is not
    UTF-8, outputs that cannot be written (convert: a non-empty --out needs --force), a --spec file,
    the evaluation data folder, the device and the model names."""
    from ..checks import check_text
    from ..io import check_writable

    if getattr(args, "prompt", None) is not None:
        check_text("--prompt", args.prompt)
    out = getattr(args, "out", None)
    if out is not None:
        check_writable(out)
        if args.command == "convert" and not args.force and Path(out).is_dir() and any(Path(out).iterdir()):
            raise ValueError(f"output directory {out!r} exists and is not empty; pass --force to replace it")
    if args.command in STANDALONE_SPEC:
        spec_from_args(args)
    elif getattr(args, "spec_file", None):
        from ..spec import ConversionSpec

        ConversionSpec.from_file(args.spec_file)
    if hasattr(args, "data_dir"):
        if args.data_dir is None:
            from ..data import EVAL_DATA

            args.data_dir = str(EVAL_DATA)
        elif not Path(args.data_dir).is_dir():
            raise FileNotFoundError(f"--data-dir {args.data_dir!r} is not a directory")
    if getattr(args, "device", None) is not None:
        from ..runtime import check_device

        check_device(args.device)
    if args.command == "compare" and args.reports:
        return
    names = model_names(args)
    if args.command in ("serve", "replay"):  # these also build random families (random:NAME)
        from ..serve.random_family import is_random, random_shape

        for name in filter(is_random, names):
            random_shape(name)
        names = [name for name in names if not is_random(name)]
    if names:
        from ..names import check_model_name

        for name in names:
            check_model_name(name)


def load(name: str, args):
    from ..api import load_model
    from ..runtime import configure_cpu

    configure_cpu()
    return load_model(name, device=getattr(args, "device", None))
