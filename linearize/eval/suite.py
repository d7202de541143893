"""Evaluation suites: what one evaluation runs (quick, full, or a changed copy)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class EvalSuite:
    """What one evaluation runs."""

    name: str = "quick"
    """Suite name (quick | standard | full | custom). The field defaults are the standard suite's."""
    heldout_source: str = "wiki"
    """Held-out text for perplexity (a data source: wiki, essays, a local file, ...): the documents
    that source holds out under seed 0 and the default held-out fraction, i.e. exactly those the
    training recipes never see."""
    perplexity_lengths: list[int] = field(default_factory=lambda: [512, 1024])
    """Context lengths of the sliding-window perplexity."""
    perplexity_tokens: int | None = 16384
    """At most this many held-out tokens per length (None: all)."""
    synthetic_tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "passkey"])
    """Synthetic long-context tasks (RULER names + passkey)."""
    synthetic_lengths: list[int] = field(default_factory=lambda: [1024])
    """Target prompt lengths in the model's tokens."""
    synthetic_samples: dict[str, int] = field(default_factory=lambda: {"default": 10})
    """Samples per task and length: task name -> n, 'default' for the rest."""
    mc_tasks: list[str] = field(default_factory=lambda: ["copa", "piqa"])
    """lm-evaluation-harness tasks (local: piqa, winogrande, copa, openbook_qa, lambada_openai)."""
    mc_limit: int | None = 100
    """Documents per multiple-choice task (None: all)."""
    batch_size: int = 8
    """Batch size of generation and scoring."""
    seed: int = 0

    def samples(self, task: str) -> int:
        return self.synthetic_samples.get(task, self.synthetic_samples.get("default", 10))


SUITES: dict[str, EvalSuite] = {
    "quick": EvalSuite(
        perplexity_lengths=[1024],
        perplexity_tokens=4096,
        synthetic_tasks=["passkey", "niah_single_1"],
        synthetic_lengths=[512],
        synthetic_samples={"default": 5},
        mc_limit=25,
    ),
    "standard": EvalSuite(name="standard"),
    "full": EvalSuite(
        name="full",
        perplexity_lengths=[512, 1024, 2048, 4096, 8192],
        perplexity_tokens=None,
        synthetic_tasks=["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
                         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "passkey", "needle_recall"],
        synthetic_lengths=[1024, 2048, 4096, 8192],
        synthetic_samples={"niah_single_1": 100, "niah_single_2": 100, "niah_single_3": 100, "passkey": 100,
                           "needle_recall": 100, "default": 50},
        mc_tasks=["piqa", "winogrande", "copa", "openbook_qa", "lambada_openai"],
        mc_limit=None,
    ),
}


def describe(suite: EvalSuite) -> str:
    """One line: what the suite measures."""
    synthetic = "; ".join(f"{task} ({suite.samples(task)} samples)" for task in suite.synthetic_tasks)
    ppl_tokens = "all held-out" if suite.perplexity_tokens is None else f"{suite.perplexity_tokens} held-out"
    mc_docs = "all" if suite.mc_limit is None else f"{suite.mc_limit}"
    return (f"perplexity at {'/'.join(map(str, suite.perplexity_lengths)) or 'no'} tokens of context on {ppl_tokens} tokens; "
            f"{synthetic or 'no synthetic tasks'} at {'/'.join(map(str, suite.synthetic_lengths))} tokens; "
            f"{', '.join(suite.mc_tasks) or 'no multiple choice'} ({mc_docs} documents each)")


def get_suite(name: str, **changes) -> EvalSuite:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(SUITES)}")
    return dataclasses.replace(SUITES[name], **changes)
