"""τ against training time: the runs of one recipe at several budgets (``lab/device_run.sh budget``'s trunk and
branches, or any runs), each a run directory with its ``summary.json`` and its ``serving.speedup`` results, into a
table on stdout, ``OUT.json`` and ``OUT.png`` (τ ± one standard error against the minutes trained, one line per
held-out file; a run resumed from another's checkpoint is drawn hollow).

    python lab/budget_plot.py --out docs/study/budget RUN_DIR [RUN_DIR ...] [--setting 6/1/7] [--concurrency 1]

A run directory holds ``summary.json`` there or in ``run/`` (``launch/recipe.py``'s layout) and ``speedup.json`` or
``speedup.json.gz``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from serving.speedup_report import read_results


@dataclass(frozen=True)
class Point:
    """One run's τ on one held-out file."""

    run: str
    minutes: float  # training seconds / 60, over every resume
    steps: int
    resumed: bool
    set: str
    tau: float
    tau_se: float


def _one(run_dir: Path, names: Sequence[str]) -> Path:
    found = [run_dir / n for n in names if (run_dir / n).is_file()]
    if not found:
        raise ValueError(f"{run_dir}: none of {', '.join(names)} (a run directory of the trainer with its speedup results)")
    return found[0]


def read_run(run_dir: Path, setting: str, concurrency: int) -> list[Point]:
    """``run_dir``'s τ for ``setting`` at ``concurrency``, one point a held-out file; ValueError naming what is missing."""
    summary_path = _one(run_dir, ("summary.json", "run/summary.json"))
    summary = json.loads(summary_path.read_text())
    missing = [k for k in ("train_time_s", "steps", "resumed_from") if k not in summary]
    if missing:
        raise ValueError(f"{summary_path}: no {', '.join(missing)} (not the summary of a finished run)")
    results_path = _one(run_dir, ("speedup.json", "speedup.json.gz"))
    rows = [r for r in read_results(results_path)["rows"] if r["setting"] == setting and r["concurrency"] == concurrency]
    if not rows:
        raise ValueError(f"{results_path}: no row of setting {setting} at concurrency {concurrency}")
    minutes, resumed = summary["train_time_s"] / 60, summary["resumed_from"] is not None
    return [Point(run_dir.name, minutes, summary["steps"], resumed, r["set"], r["tau"], r["tau_se"]) for r in rows]


def table(points: Sequence[Point]) -> str:
    sets = sorted({p.set for p in points})
    lines = [f"{'run':<12} {'minutes':>8} {'steps':>7} {'resumed':>8} " + " ".join(f"{s:>22}" for s in sets)]
    for run in dict.fromkeys(p.run for p in points):
        mine = {p.set: p for p in points if p.run == run}
        first = next(iter(mine.values()))
        cells = [f"{mine[s].tau:>13.3f} ± {mine[s].tau_se:.3f}" if s in mine else f"{'-':>22}" for s in sets]
        lines.append(f"{run:<12} {first.minutes:>8.2f} {first.steps:>7,} {'yes' if first.resumed else 'no':>8} " + " ".join(cells))
    return "\n".join(lines)


def plot(points: Sequence[Point], title: str, path: Path) -> None:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for i, s in enumerate(sorted({p.set for p in points})):
        mine = sorted((p for p in points if p.set == s), key=lambda p: p.minutes)
        color = colormaps["tab10"](i)
        ax.plot([p.minutes for p in mine], [p.tau for p in mine], color=color, alpha=0.4)
        for p in mine:
            face = "none" if p.resumed else color
            ax.errorbar(p.minutes, p.tau, yerr=p.tau_se, fmt="o", color=color, mfc=face, capsize=3)
        ax.plot([], [], "o-", color=color, label=s)
    ax.plot([], [], "o", color="gray", mfc="none", label="resumed from another run's checkpoint")
    ax.set(xlabel="minutes of training", ylabel="τ (accepted tokens a verify, ± 1 SE)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories (summary.json and speedup.json[.gz])")
    p.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    p.add_argument("--setting", default="6/1/7", help="the serving.speedup setting to plot (default: the 6-step chain)")
    p.add_argument("--concurrency", type=int, default=1)
    return p


def main(argv: Sequence[str] | None = None) -> list[Point]:
    args = _parser().parse_args(argv)
    try:
        points = [p for run in args.runs for p in read_run(run, args.setting, args.concurrency)]
    except ValueError as e:
        raise SystemExit(f"budget_plot: {e}") from None
    print(table(points))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    conditions = {"setting": args.setting, "concurrency": args.concurrency}
    args.out.with_suffix(".json").write_text(json.dumps({**conditions, "points": [asdict(p) for p in points]}, indent=1) + "\n")
    plot(points, f"τ against training time ({args.setting}, concurrency {args.concurrency})", args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}", file=sys.stderr)
    return points


if __name__ == "__main__":
    main()
