"""``linearize demo``: the teacher and a trained conversion (or a fresh one from spec flags) side by
side, with the memory each holds."""

from __future__ import annotations

from .commands import load, stream_to_stdout
from .output import mib, side_by_side
from .spec_flags import spec_from_args

DEFAULT_CONVERSION = "smollm2-135m-lolcats"


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


def cmd_demo(args) -> int:
    """The main job: teacher vs a trained conversion (or, with spec flags, a fresh untrained one),
    side by side, with the memory each holds."""
    from ..convert import convert
    from ..generate import generate_text
    from ..memory import request_memory
    from ..spec import ConversionSpec

    print(f"prompt: {args.prompt}\n")
    teacher_model, tokenizer = load(args.model, args)
    print("TEACHER (softmax attention): ", end="", flush=True)
    teacher = generate_text(teacher_model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, chat=True, on_text=stream_to_stdout)
    print("\n")
    spec = spec_from_args(args)
    untrained = spec is not None
    if untrained:  # a fresh conversion of --model with these flags
        convert(teacher_model, spec)
        window = getattr(spec.options, "window", None)
        student_model, label = teacher_model, f"{spec.attention}{f', window {window}' if window else ''}, untrained"
    else:
        student_model, _ = load(args.conversion, args)
        spec = ConversionSpec.from_dict(student_model.config.linearize)
        label = f"{args.conversion}, trained"
    print(f"CONVERTED ({label}): ", end="", flush=True)
    student = generate_text(student_model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, chat=True, on_text=stream_to_stdout)
    print("\n")
    width = 60
    print(f"{'TEACHER (softmax attention)':<{width}} | CONVERTED ({label})")
    print("-" * width + "-+-" + "-" * width)
    for left, right in side_by_side(teacher.text, student.text, width):
        print(f"{left:<{width}} | {right}")
    print("-" * width + "-+-" + "-" * width)
    for name, r in (("teacher", teacher), ("converted", student)):
        print(f"{name:>9}: {r.new_tokens} tokens, {r.tokens_per_second:.1f} tok/s, memory held: {mib(r.memory_bytes)} "
              f"for {r.context_tokens} tokens of context (measured)")
    dtype_bytes = next(student_model.parameters()).element_size()
    for tokens in (1024, 8192):
        t_bytes = request_memory(None, student_model, tokens, dtype_bytes)
        s_bytes = request_memory(spec, student_model, tokens, dtype_bytes)
        print(f"  at {tokens:>5} tokens (formula): teacher {mib(t_bytes)}, converted {mib(s_bytes)} ({t_bytes / s_bytes:.1f}x less)")
    if untrained:
        print("\nnote: the converted model is untrained: expect degraded text once the context outgrows the window")
    else:
        print("\nnote: held-out quality of the shipped conversions against the teacher: docs/results/training.md")
    return 0
