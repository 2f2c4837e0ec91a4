"""Data-size x regime study: one clean ``python -m trainer`` run per grid point, under one budget.

    python3 lab/study.py --out outputs/study --synthetic outputs/synthetic/answered.jsonl \\
        --base-file outputs/regenerated/chatterbot_english.jsonl --sizes 1 4 16 64 --max-steps 2000 \\
        --holdout-categories computers food history money movies science sports \
        -- trainer.export_every=200 draft.draft_vocab_size=4096 schedule.lr=1e-3 data.max_tokens=1024

**Data.** The base set is the training side of one source: the chatterbot corpus (default)
or ``--base-file`` (OpenAI-messages jsonl, e.g. the target's regeneration of chatterbot).
Size *m* is the base plus the first (m - 1) x n_base records of ``--synthetic`` (answered
synthetic prompts, ``python -m trainer.synthesize --answer``), written to
``OUT/data/synthetic_<k>.jsonl``; so 4x = base + 3x base of synthetic conversations, and a
larger size holds every smaller one's data. Too few synthetic records is an error.

**Evaluation.** ``--holdout-categories`` (``data.holdout_categories``) holds whole chatterbot
categories out of every source: the serving eval decodes prompts from categories no run
trained on. Without it the held-out side is the usual first-prompt hash split. Each run's
``summary.json`` says which prompts it used (``eval_prompts``); the table repeats it.

**Regimes.** A regime is a list of Hydra overrides (default: ``cosine`` = cosine LR for 3
epochs, ``constant`` = constant LR for up to 1000 epochs); every run gets the same budget,
``--max-steps`` (``trainer.max_steps``) and/or ``--max-time-s`` (``trainer.max_time_s``,
training seconds). A cosine run whose epochs end before the budget stops there; a run
stopped by the budget says so (``stopped by``). The cosine horizon is the run's planned
steps (epochs, capped by ``max_steps``), so under a time budget alone it may not decay to
its end: give ``--max-steps`` for schedules that end with the budget. Training seconds on a
shared machine swing with its load; steps and tokens do not. ``--grid FILE`` (YAML: ``sizes``,
``regimes: {name: [override, ...]}``, ``max_steps``, ``max_time_s``, ``overrides``) replaces
the defaults; flags given on the command line win. Arguments after ``--`` are Hydra
overrides for every run (``trainer.export_every=N`` gives the acceptance curves more points).
The chatterbot data group also sets its recipe (``draft.draft_vocab_size=4096 schedule.lr=1e-3
data.max_tokens=1024``); the ``openai`` group of ``--base-file`` does not, so pass those after
``--`` to compare the two.

**Parallel points.** ``--parallel N`` trains up to N points at once, each its own
``python -m trainer`` process with its own run dir and log (a small target leaves most of a
GPU idle, so several runs fit on one). The points then share the machine: a training-time
budget (``--max-time-s``) is not fair between them and their seconds are not comparable;
give ``--max-steps`` as the budget. ``study.md`` says how many points trained at a time.
``--devices 0 1`` spreads them over GPUs: up to N points on each device at once, each process
seeing its one device (``CUDA_VISIBLE_DEVICES``); the point's JSON names it.

**Output** (``--out``): ``points/<name>.json`` as each run finishes (a rerun skips the points
already there, so a killed study resumes), ``runs/<name>/`` (the run dirs), ``logs/``, and at
the end ``study.json``, ``study.md`` (the table; τ ± its standard error over the eval turns)
and ``study.png`` (real acceptance length τ against training time and against tokens seen,
one line per size x regime, a bar of one standard error on each τ).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

import yaml  # noqa: E402

from trainer.report import metrics as M  # noqa: E402
from trainer.report.report import describe_eval_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")  # each run sets up its own
DEFAULT_GRID = {
    "sizes": [1, 4, 16, 64],
    "regimes": {"cosine": ["schedule=cosine", "trainer.epochs=3"], "constant": ["schedule=constant", "trainer.epochs=1000"]},
    "max_steps": None,
    "max_time_s": None,
    "overrides": [],
}


@dataclass(frozen=True)
class Grid:
    sizes: list[int]
    regimes: dict[str, list[str]]
    max_steps: int | None
    max_time_s: float | None
    overrides: list[str]

    def __post_init__(self) -> None:
        if not self.sizes or any(not isinstance(s, int) or s < 1 for s in self.sizes) or not self.regimes:
            raise ValueError(f"grid: sizes must be integers >= 1 and regimes non-empty, got {self.sizes}, {list(self.regimes)}")
        if self.max_steps is None and self.max_time_s is None:
            raise ValueError("grid: give a budget, --max-steps and/or --max-time-s (max_steps / max_time_s in the grid file)")


@dataclass
class Point:
    size: int
    regime: str
    base: int  # base training conversations
    synthetic: int  # synthetic conversations added
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.size}x-{self.regime}"


def load_grid(args: argparse.Namespace) -> Grid:
    raw = dict(DEFAULT_GRID)
    if args.grid is not None:
        given = yaml.safe_load(args.grid.read_text()) or {}
        unknown = sorted(set(given) - set(raw))
        if unknown:
            raise ValueError(f"{args.grid}: unknown keys {unknown} (known: {', '.join(raw)})")
        raw |= given
    for key in ("sizes", "max_steps", "max_time_s"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    if args.regimes is not None:
        missing = sorted(set(args.regimes) - set(raw["regimes"]))
        if missing:
            raise ValueError(f"--regimes {missing}: not in the grid (has: {', '.join(raw['regimes'])})")
        raw["regimes"] = {r: raw["regimes"][r] for r in args.regimes}
    return Grid(raw["sizes"], raw["regimes"], raw["max_steps"], raw["max_time_s"], [*raw["overrides"], *args.overrides])


# --------------------------------------------------------------------------- data


def base_overrides(args: argparse.Namespace, with_synthetic: bool) -> list[str]:
    """The data group and paths: the base source, plus the synthetic one when it is used."""
    base = "openai" if args.base_file else "chatterbot"
    out = [f"data=[{base},synthetic]" if with_synthetic else f"data={base}"]
    out += [f"data.sources.openai.path={args.base_file}"] if args.base_file else []
    out += [f"data.holdout_categories=[{','.join(args.holdout_categories)}]"] if args.holdout_categories else []
    return out


def base_size(overrides: list[str]) -> int:
    """Training conversations of the base source under ``overrides``: read and split exactly as
    the trainer does (``trainer.data_setup``), capped by ``data.max_conversations``."""
    from hydra import compose, initialize_config_dir

    from trainer.config import register_schema, to_config
    from trainer.data import read_source
    from trainer.data_setup import Holdout

    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=overrides))
    ((name, src),) = cfg.data.sources.items()
    convs, _ = read_source(src.format, src.path, languages=src.languages, split=src.split, on_error=cfg.data.on_error, name=name)
    train, _ = Holdout.of(cfg.data, cfg.trainer.seed).split(name, convs)
    return len(train[: cfg.data.max_conversations])


def synthetic_subset(synthetic: Path, k: int, out_dir: Path) -> Path:
    """The first ``k`` records of ``synthetic`` as a file of their own (written once)."""
    path = out_dir / f"synthetic_{k}.jsonl"
    if not path.exists():
        text = synthetic.read_text(encoding="utf-8")  # split on newlines only: JSON strings may hold U+2028, \x1c, ...
        lines = [line for line in text.split("\n") if line.strip()]
        if len(lines) < k:
            raise ValueError(f"{synthetic}: {len(lines)} records, the grid needs {k}; synthesize more or drop the largest size")
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines[:k]) + "\n", encoding="utf-8")
        tmp.replace(path)
    return path


def plan(args: argparse.Namespace, grid: Grid) -> list[Point]:
    n_base = base_size([*base_overrides(args, False), *grid.overrides])
    if max(grid.sizes) > 1 and args.synthetic is None:
        raise ValueError(f"sizes {grid.sizes} need --synthetic (answered synthetic prompts)")
    budget = [f"trainer.max_steps={grid.max_steps}"] if grid.max_steps else []
    budget += [f"trainer.max_time_s={grid.max_time_s}"] if grid.max_time_s else []
    points = []
    for size, (regime, regime_overrides) in itertools.product(grid.sizes, grid.regimes.items()):
        k = (size - 1) * n_base
        data = base_overrides(args, k > 0)
        data += [f"data.sources.synthetic.path={synthetic_subset(args.synthetic, k, args.out / 'data')}"] if k else []
        points.append(Point(size, regime, n_base, k, [*data, *regime_overrides, *budget, *grid.overrides]))
    return points


# --------------------------------------------------------------------------- runs


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / M.METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def collect(point: Point, run_dir: Path, seconds: float) -> dict:
    """What the table and the plot need from a finished run: its summary and metrics.jsonl."""
    summary, rows = json.loads((run_dir / "summary.json").read_text()), _rows(run_dir)
    evals = summary["eval"]
    k = sum(1 for key in evals if key.startswith("eval/accept_rate_"))
    trained = [r for r in rows if M.step_acc(0) in r]
    ttt = sum(1 for key in trained[-1] if key.startswith("train/acc_")) if trained else 0
    curve = [
        {
            "step": r["step"],
            "train_time_s": r[M.TRAIN_TIME],
            "tokens_seen": r[M.TOKENS_SEEN],
            "accept_len": r[M.EVAL_ACCEPT_LEN],
            "accept_len_se": r.get(M.EVAL_ACCEPT_LEN_SE),
        }
        for r in rows
        if M.EVAL_ACCEPT_LEN in r and M.TRAIN_TIME in r
    ]  # the last entry is the final eval, the one in summary.json
    return {
        "name": point.name,
        "size": point.size,
        "regime": point.regime,
        "run_dir": str(run_dir),
        "overrides": point.overrides,
        "data": {"base_conversations": point.base, "synthetic_conversations": point.synthetic},
        "steps": summary["steps"],
        "stopped_by": summary["stopped_by"],
        "tokens_seen": summary["tokens_seen"],
        "train_time_s": summary["train_time_s"],
        "fit_wall_s": summary["wall_time_s"],
        "process_wall_s": seconds,
        "accept_len": evals[M.EVAL_ACCEPT_LEN],
        "accept_len_se": evals.get(M.EVAL_ACCEPT_LEN_SE),  # None (here and in the curve) in a run from before the trainer reported it
        "accept_rate": [evals[M.accept_rate(i)] for i in range(k)],
        "cond_accept_rate": [evals[M.cond_accept_rate(i)] for i in range(k)],
        "train_acc": [trained[-1][M.step_acc(i)] for i in range(ttt)] if trained else [],
        "eval_sim_accept_len": summary["eval_sim_accept_len"],
        "eval_prompts": summary["eval_prompts"],
        "curve": curve,
    }


class DeviceSlots:
    """Room for ``per_device`` points at once on each device, or on the devices this process sees (``None``)."""

    def __init__(self, devices: Sequence[str] | None, per_device: int):
        devices = list(devices) if devices else [None]
        self.size = per_device * len(devices)
        self._free: queue.Queue[str | None] = queue.Queue()
        for _ in range(per_device):
            for device in devices:  # dealt in turn: the first points go to different devices
                self._free.put(device)

    @contextmanager
    def take(self) -> Iterator[str | None]:
        device = self._free.get()
        try:
            yield device
        finally:
            self._free.put(device)


def run_point(point: Point, out: Path, device: str | None = None) -> dict:
    """Train one point in a fresh process (on ``device`` when given: its CUDA_VISIBLE_DEVICES); its result (or its
    failure) goes to points/<name>.json."""
    run_dir, log = out / "runs" / point.name, out / "logs" / f"{point.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "trainer", *point.overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    with log.open("w") as f:
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code == 0:
        result = collect(point, run_dir, seconds)
    else:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        result = {
            "name": point.name,
            "size": point.size,
            "regime": point.regime,
            "overrides": point.overrides,
            "error": f"exit {code}",
            "log_tail": tail,
        }
    if device is not None:
        result["device"] = device
    path = out / "points" / f"{point.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


# --------------------------------------------------------------------------- outputs


def tau_cell(r: dict) -> str:
    """τ with its standard error, or τ alone when the run did not report one."""
    se = r.get("accept_len_se")
    return f"{r['accept_len']:.3f}" if se is None else f"{r['accept_len']:.3f} ± {se:.3f}"


def table(results: Sequence[dict], parallel: int = 1) -> str:
    header = (
        "point",
        "data (conversations)",
        "steps",
        "stopped by",
        "tokens seen",
        "train s",
        "wall s",
        "τ ± SE",
        "accept rate per position",
        "train acc per position",
        "held-out sim. accept len",
    )
    shared = ": they shared it, so compare them by steps and tokens, not seconds" if parallel > 1 else ""
    lines = [f"Points trained {parallel} at a time on one machine{shared}.", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |" + " |" * (len(header) - 2))
            continue
        d = r["data"]
        cells = (
            r["name"],
            f"{d['base_conversations']} base + {d['synthetic_conversations']} synthetic",
            r["steps"],
            r["stopped_by"],
            f"{r['tokens_seen']:,}",
            f"{r['train_time_s']:.0f}",
            f"{r['process_wall_s']:.0f}",
            tau_cell(r),
            " / ".join(f"{a:.3f}" for a in r["accept_rate"]),
            " / ".join(f"{a:.3f}" for a in r["train_acc"]),
            f"{r['eval_sim_accept_len']:.3f}",
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    done = [r for r in results if "error" not in r]
    origins = sorted({describe_eval_prompts(r["eval_prompts"]) for r in done})
    return "\n".join(lines + ["", *(f"Serving-eval prompts: {o}" for o in origins)]) + "\n"


def plot(results: Sequence[dict], path: Path) -> None:
    """τ against training time and tokens seen (a mark per evaluation, a colour per size, a marker and line style
    per regime), and the final τ against the number of training conversations (a line per regime)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(17, 4.5))
    axes = fig.subplots(1, 3)
    done = [r for r in results if "error" not in r and r["curve"]]
    sizes = sorted({r["size"] for r in results})
    regimes = sorted({r["regime"] for r in results})
    colors = colormaps["viridis"]
    for r in done:
        color = colors(sizes.index(r["size"]) / max(1, len(sizes) - 1))
        style, marker = _regime_style(regimes.index(r["regime"]))
        for ax, x in zip(axes, ("train_time_s", "tokens_seen")):
            ax.plot([c[x] for c in r["curve"]], [c["accept_len"] for c in r["curve"]], style, marker=marker, color=color, label=r["name"])
            _error_bars(ax, [c[x] for c in r["curve"]], r["curve"], color)
    for i, (regime, ends) in enumerate(sorted(final_tau_by_size(done).items())):
        style, marker = _regime_style(i)
        xs = [n for n, _ in ends]
        axes[2].plot(xs, [p["accept_len"] for _, p in ends], style, marker=marker, color="black", label=regime)
        _error_bars(axes[2], xs, [p for _, p in ends], "black")
    axes[2].set_xscale("log")
    for ax, label in zip(axes, ("training time (s)", "tokens seen", "training conversations (final τ)")):
        ax.set_xlabel(label)
        ax.set_ylabel("acceptance length τ (real spec. decoding)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def final_tau_by_size(results: Sequence[dict]) -> dict[str, list[tuple[int, dict]]]:
    """Per regime, (training conversations, {accept_len, accept_len_se}) of each finished point, fewest first."""
    out: dict[str, list[tuple[int, dict]]] = {}
    for r in results:
        if "error" not in r:
            n = r["data"]["base_conversations"] + r["data"]["synthetic_conversations"]
            out.setdefault(r["regime"], []).append((n, {"accept_len": r["accept_len"], "accept_len_se": r["accept_len_se"]}))
    return {regime: sorted(ends, key=lambda e: e[0]) for regime, ends in out.items()}


def _regime_style(i: int) -> tuple[str, str]:
    return ("-", "--", ":", "-.")[i % 4], ("o", "s", "^", "D")[i % 4]


def _error_bars(ax, xs: Sequence[float], points: Sequence[dict], color) -> None:
    """Standard-error bars where a point has one (points from before the standard error was recorded lack it)."""
    bars = [(x, p) for x, p in zip(xs, points) if p.get("accept_len_se") is not None]
    if bars:
        ax.errorbar(
            [x for x, _ in bars],
            [p["accept_len"] for _, p in bars],
            [p["accept_len_se"] for _, p in bars],
            fmt="none",
            ecolor=color,
            capsize=3,
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lab/study.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="study directory (a rerun resumes it)")
    p.add_argument("--synthetic", type=Path, default=None, help="answered synthetic conversations (OpenAI-messages jsonl)")
    p.add_argument("--base-file", type=Path, default=None, help="base set as OpenAI-messages jsonl (default: the chatterbot corpus)")
    p.add_argument(
        "--holdout-categories", nargs="+", default=None, help="chatterbot categories held out of every run (data.holdout_categories)"
    )
    p.add_argument("--grid", type=Path, default=None, help="YAML: sizes, regimes, max_steps, max_time_s, overrides")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="multiples of the base set (default 1 4 16 64)")
    p.add_argument("--regimes", nargs="+", default=None, help="run only these regimes of the grid")
    p.add_argument("--max-steps", type=int, default=None, help="budget: optimizer steps a run")
    p.add_argument("--max-time-s", type=float, default=None, help="budget: training seconds a run")
    p.add_argument("--parallel", type=int, default=1, help="train up to N points at once (give --max-steps as the budget)")
    p.add_argument("--devices", nargs="+", default=None, help="CUDA devices to spread the points over, --parallel on each")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    return p


_PRINT = threading.Lock()  # one line at a time from the pool's threads


def _say(line: str) -> None:
    with _PRINT:
        print(line, flush=True)


def train(point: Point, out: Path, slots: DeviceSlots) -> dict:
    """``run_point`` on a free device slot, with a line as it starts and one as it ends (from a pool thread)."""
    with slots.take() as device:
        on = "" if device is None else f" on device {device}"
        _say(f"{point.name}: {point.base} base + {point.synthetic} synthetic conversations, training{on} ...")
        result = run_point(point, out, device)
    _say(f"{point.name}: " + (result.get("error") or f"τ = {tau_cell(result)}"))
    return result


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    if args.parallel < 1:
        raise ValueError(f"--parallel {args.parallel}: give at least 1 (points trained at once)")
    grid = load_grid(args)
    args.out.mkdir(parents=True, exist_ok=True)
    points, finished, todo = plan(args, grid), {}, []
    for point in points:
        path = args.out / "points" / f"{point.name}.json"
        earlier = json.loads(path.read_text()) if path.exists() else None
        if earlier is not None and "error" not in earlier:
            print(f"{point.name}: done earlier ({path})")
            finished[point.name] = earlier
        else:
            todo.append(point)
    slots = DeviceSlots(args.devices, args.parallel)
    with ThreadPoolExecutor(max_workers=slots.size) as pool:  # each thread waits on its own trainer process
        finished |= {point.name: result for point, result in zip(todo, pool.map(lambda p: train(p, args.out, slots), todo))}
    results = [finished[point.name] for point in points]
    study = {"grid": asdict(grid), "parallel": args.parallel, "devices": args.devices, "points": results}
    (args.out / "study.json").write_text(json.dumps(study, indent=2) + "\n")
    (args.out / "study.md").write_text(table(results, slots.size))
    plot(results, args.out / "study.png")
    print(table(results, slots.size))
    return results


if __name__ == "__main__":
    main()
