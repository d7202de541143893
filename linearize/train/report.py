"""The training results table: one row per run from its summary.json (tokens and seconds per stage,
held-out loss and perplexity against the teacher)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_summaries(run_dirs: list[str | Path]) -> list[dict[str, Any]]:
    out = []
    for d in run_dirs:
        path = Path(d) / "summary.json"
        if not path.is_file():
            raise FileNotFoundError(f"no summary.json in {str(d)!r}: is it a finished run directory?")
        out.append(json.loads(path.read_text()))
    return out


def training_table(summaries: list[dict[str, Any]]) -> str:
    """Markdown: per run, tokens and seconds of each stage, held-out loss/ppl of teacher and conversion."""
    header = ("| run | stage tokens (transfer / chained / finetune) | seconds (transfer / chained / finetune) | world | "
              "teacher loss | loss | teacher ppl | ppl | ppl ratio |")
    lines = [header, "|" + "---|" * 9]
    for s in summaries:
        stages = s.get("stages", {})

        def get(key: str, stages: dict = stages) -> str:
            return " / ".join(f"{stages[n][key]:,}" if n in stages else "-" for n in ("transfer", "chained", "finetune"))

        lines.append(
            f"| {s['name']} | {get('tokens')} | {get('seconds')} | {s.get('world_size', 1)} | {s['teacher_heldout_loss']:.4f} | "
            f"{s['heldout_loss']:.4f} | {s['teacher_heldout_ppl']:.2f} | {s['heldout_ppl']:.2f} | {s['heldout_ppl'] / s['teacher_heldout_ppl']:.2f} |"
        )
    return "\n".join(lines)


# --- held-out curves of several runs (data-parallel checks, seed noise) ------------------------------
Curve = dict[tuple[str, int], float]
"""(stage, step) -> held-out loss."""


def heldout_curve(run_dir: str | Path) -> Curve:
    """The held-out evaluations a run logged in metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {str(run_dir)!r}: is it a run directory?")
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {(r["stage"], r["step"]): r["heldout_loss"] for r in records if "heldout_loss" in r}


def curve_difference(a: Curve, b: Curve) -> dict[str, Any]:
    """|a - b| at the evaluations both runs made: points, max, mean, and at each stage's last point."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two runs share no held-out evaluation (stage, step)")
    diffs = [abs(a[k] - b[k]) for k in common]
    last = {}
    for stage in dict.fromkeys(s for s, _ in common):
        step = max(t for s, t in common if s == stage)
        last[stage] = abs(a[(stage, step)] - b[(stage, step)])
    return {"points": len(common), "max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs), "last_abs": last}


def _seed(run_dir: Path) -> int | None:
    import yaml

    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()).get("seed") if path.is_file() else None


def runs_report(run_dirs: list[str | Path]) -> dict[str, Any]:
    """Per run: world size, seed, training-only tokens/s per stage, final held-out loss; every pair's
    held-out curve difference; and, for runs of one seed at different world sizes, the speed-up and
    scaling efficiency (tokens/s of N ranks / (N x tokens/s of 1 rank)) per stage."""
    runs = []
    for d in map(Path, run_dirs):
        (summary,) = load_summaries([d])
        stages = {name: {k: st.get(k) for k in ("steps", "tokens", "train_seconds", "tokens_per_s")} for name, st in summary["stages"].items()}
        runs.append({"name": summary["name"], "dir": str(d), "world_size": summary.get("world_size", 1), "seed": _seed(d),
                     "teacher_heldout_loss": summary["teacher_heldout_loss"], "heldout_loss": summary["heldout_loss"],
                     "stages": stages, "curve": heldout_curve(d)})
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            kind = "same seed" if a["seed"] == b["seed"] else "different seeds"
            pairs.append({"a": a["name"], "b": b["name"], "kind": kind, **curve_difference(a["curve"], b["curve"])})
    scaling = []
    for one in (r for r in runs if r["world_size"] == 1):
        for many in (r for r in runs if r["world_size"] > 1 and r["seed"] == one["seed"]):
            for stage in one["stages"]:
                t1, tn = one["stages"][stage].get("tokens_per_s"), many["stages"].get(stage, {}).get("tokens_per_s")
                if t1 and tn:
                    scaling.append({"stage": stage, "one": one["name"], "many": many["name"], "world_size": many["world_size"],
                                    "tokens_per_s_one": t1, "tokens_per_s_many": tn, "speedup": tn / t1,
                                    "efficiency": tn / (many["world_size"] * t1)})
    for r in runs:  # in the order the run logged them
        r["curve"] = [{"stage": s, "step": t, "heldout_loss": v} for (s, t), v in r["curve"].items()]
    return {"runs": runs, "pairs": pairs, "scaling": scaling}


def runs_markdown(report: dict[str, Any]) -> str:
    stages = list(dict.fromkeys(stage for r in report["runs"] for stage in r["stages"]))
    lines = ["| run | world | seed | " + " | ".join(f"{s} tokens/s" for s in stages) + " | teacher loss | final held-out loss |",
             "|---|---:|---:|" + "---:|" * (len(stages) + 2)]
    for r in report["runs"]:
        tps = [r["stages"].get(s, {}).get("tokens_per_s") for s in stages]
        cells = " | ".join(f"{v:,.0f}" if v else "-" for v in tps)
        lines.append(f"| {r['name']} | {r['world_size']} | {r['seed']} | {cells} | {r['teacher_heldout_loss']:.4f} | {r['heldout_loss']:.4f} |")
    lines += ["", "Held-out loss curves, |a - b| at the evaluations both made:", "",
              "| a | b | | points | max | mean | at the end of each stage |", "|---|---|---|---:|---:|---:|---|"]
    for p in report["pairs"]:
        last = ", ".join(f"{s} {v:.4f}" for s, v in p["last_abs"].items())
        lines.append(f"| {p['a']} | {p['b']} | {p['kind']} | {p['points']} | {p['max_abs']:.4f} | {p['mean_abs']:.4f} | {last} |")
    if report["scaling"]:
        lines += ["", "| stage | 1 rank | N ranks | N | tokens/s, 1 | tokens/s, N | speed-up | scaling efficiency |", "|---|---|---|---:|---:|---:|---:|---:|"]
        for s in report["scaling"]:
            lines.append(f"| {s['stage']} | {s['one']} | {s['many']} | {s['world_size']} | {s['tokens_per_s_one']:,.0f} | "
                         f"{s['tokens_per_s_many']:,.0f} | {s['speedup']:.2f}x | {100 * s['efficiency']:.0f}% |")
    return "\n".join(lines) + "\n"


def plot_runs(report: dict[str, Any], path: str | Path) -> None:
    """Held-out loss against step, one panel per stage, one line per run (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    from ..io import save_png

    stages = list(dict.fromkeys(p["stage"] for r in report["runs"] for p in r["curve"]))
    fig = Figure(figsize=(5 * len(stages), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(stages), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        for r in report["runs"]:
            pts = [(p["step"], p["heldout_loss"]) for p in r["curve"] if p["stage"] == stage]
            ax.plot(*zip(*pts), marker=".", label=f"{r['name']} (world {r['world_size']}, seed {r['seed']})")
        ax.set(title=stage, xlabel="step", ylabel="held-out loss")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
