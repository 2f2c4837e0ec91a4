"""The GPU runs of docs/BENCHMARKS.md as sequences of commands; a failed command stops its sequence.

    python3 lab/gpu_runs.py SEQUENCE [ARGS]          # on a bare GPU host: lab/device_run.sh SEQUENCE [ARGS]

Every sequence writes under one results root, ``--res`` (default /tmp/res). ``--recipe NAME`` names
the recipe run whose results are ``RES/NAME`` (default ``recipe``): ``recipe`` writes there, ``study``
and ``dp`` train on its greedy answers, ``RES/NAME/answered.jsonl``.

- ``recipe CORPORA [ARGS]``: ``launch/recipe.py --corpora CORPORA --out RES/NAME ARGS`` (ARGS are its own).
- ``sweep CORPORA --answered A --sampled S --variant NAME [OVERRIDE...] ...``: the recipe's training
  (``h200_quality`` on the carried answers A and S, capped at ``--steps``, its own speedup phase off) once per
  variant, one after the other (``RES/NAME``; ``--side-by-side``: at once, each started once the one before has built
  its target engine), then ``serving.speedup`` on each export with ``--settings`` at
  ``--concurrency`` on the held-out ShareGPT and code files: the target alone is measured with the first export
  measured and taken from its results for the others, so the drafts share one baseline (``--plain-from FILE``:
  taken from that results file for all of them).
- ``budget CORPORA --answered A --sampled S [--minutes 5 10]``: τ against training time (docs/STUDY.md): the recipe's
  training capped at the longest budget (the trunk, ``RES/tM``), keeping a checkpoint where each shorter budget's decay
  starts (``trainer.checkpoint_at_s``), each shorter budget resumed from it with its own ``trainer.max_time_s``
  (``RES/tM``), then ``serving.speedup`` on every export (the 6-step chain at concurrency 1 by default), one baseline.
  ``--trainer-args``: more Hydra overrides for the trunk and every branch.
- ``baseline CORPORA``: the embedded default recipe (``python -m trainer``), then τ in SGLang on the three
  held-out files of CORPORA (``RES/baseline``).
- ``study CORPORA``: waits for the recipe's greedy answers (``answered.done``), shuffles them (seed 0: every
  size holds the sources in the file's proportions; the file is in source order), the first 1000 as the base,
  and runs ``lab/study.py`` on sizes all, 16x, 4x and 1x (the largest first: their points are the longest)
  with the ``h200_quality`` recipe's data settings (``RES/study``).
- ``genbench``: generation speeds of transformers and SGLang, 1-4 replicas; then SGLang without prefill
  CUDA graphs and with decode graphs up to batch 1024 (``RES/benches``).
- ``perfbench``: the trainer's memory, the draft step's profile at 8B shapes, the stream at the recipe's
  SmolLM2 shapes, the static-cache generation (``RES/benches``).
- ``faults [ARGS]``: ``lab/faults.py --out RES/faults ARGS`` (docs/RELIABILITY.md).
- ``gputests [-k EXPR]``: one pytest per test file that marks ``gpu`` tests, output uncaptured: SGLang kills
  its parent process when its scheduler fails, so a file's log keeps its own cause (``RES/gputests``).
- ``dp CORPORA [RUN...]``: one GPU against two data-parallel ranks on the recipe's answers and
  ``h200_quality`` shapes, both engines, then ``dp.json`` (``dp_summary``: tokens/s, losses, stall per rank;
  ``RES/dp``, ``--dir``). The runs: ENGINE-one-ga1: one GPU, the per-GPU batch of the two-rank run (the
  throughput baseline); ENGINE-one: one GPU with grad_accum 2, the two ranks' global batch (the loss
  baseline); ENGINE-two: two data-parallel ranks, an engine each. ENGINE: sglang | colocated (transformers).
  The one-GPU runs take the first device of ``CUDA_VISIBLE_DEVICES`` (default 0).

Each command's output, progress bars taken out, goes to its log (``recipe`` and ``study``: to the screen as it
comes); after it its last lines are shown. A command that fails ends the sequence with its log's tail and exit
code 1; ``--keep-going`` runs the rest of the sequence and still ends with exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from serving.usage import PlainHelp
from trainer.checkpoint import is_complete, read_meta
from trainer.corpora import leak_checked_files
from trainer.stream.engine_process import TARGET_BUILT

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
FAIL_TAIL = 25  # lines of a failed command's log shown
BASE = 1000  # records of the study's base size (1x)
DP_ENGINES = ("sglang", "colocated")  # the dp runs' feature engines: engine=sglang, or transformers in engine.mode=colocated
KINDS = ("one-ga1", "one", "two")
RUNS = tuple(f"{engine}-{kind}" for engine in DP_ENGINES for kind in KINDS)
WARMUP_STEPS = 5  # dp medians and rates are over the steps past these
STABLE_SHARE = 0.8  # h200_quality's wsd holds its LR until this share of trainer.max_time_s (1 - schedule.decay_ratio)
POLL_S = 2.0  # how often a side-by-side start looks at the step before it
GEN_VARIANTS = ("hf-b256", "hf-b256-r4", "sglang", "sglang-r2", "sglang-r4")
SCRATCH = Path("/tmp")  # where the memory bench writes its temporary 8B-shaped checkpoint
DS_LAUNCHER = ("-c", "import sys; from deepspeed.launcher.runner import main; sys.exit(main())", "--num_gpus", "2", "--no_local_rank")
STUDY_OVERRIDES = (  # the h200_quality recipe's data settings, a 5 % loss-side hold-out, 64 eval prompts
    "draft.draft_vocab_size=32000",
    "schedule.lr=5e-4",
    "data.max_len=2048",
    "data.max_tokens=16384",
    "data.answer_tokens=128",
    "data.holdout_fraction=0.05",
    "trainer.spec_tokens=6",
    "trainer.log_every=50",
    "trainer.eval_prompts=64",
    "trainer.eval_max_new_tokens=128",
)


@dataclass(frozen=True)
class Step:
    """One command of a sequence: its argv (run from the checkout), where its output goes, what of it is shown."""

    name: str
    argv: tuple[str, ...]
    log: Path | None = None  # None: the output goes to the screen as it comes
    show: int = 6  # lines of the log's end shown after it
    grep: str | None = None  # show the log's lines holding this instead
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    ok: frozenset[int] = frozenset({0})  # exit codes that are no failure


Runner = Callable[[Step], int]


class StepFailed(Exception):
    """A command of the sequence failed; the message holds its exit code and its log's tail."""


@dataclass
class Steps:
    """Runs a sequence's commands in order: a failure raises StepFailed, or with keep_going is noted and passed."""

    runner: Runner
    keep_going: bool = False
    failed: list[str] = field(default_factory=list)

    def run(self, step: Step) -> None:
        print(f"== {step.name}: {shlex.join(step.argv)}", flush=True)
        self.finish(step, self.runner(step))

    def run_side_by_side(self, steps: Sequence[Step], started: Callable[[Step], bool]) -> None:
        """The steps at once, each started once the one before has ``started`` (or ended), then all waited for and
        finished in order. A runner that raised counts as exit code 1 (its traceback is printed as it happens)."""
        codes: dict[str, int] = {}

        def run_one(step: Step) -> None:
            codes[step.name] = self.runner(step)

        threads = []
        for step in steps:
            print(f"== {step.name}: {shlex.join(step.argv)}", flush=True)
            thread = threading.Thread(target=run_one, args=(step,), name=step.name)
            thread.start()
            threads.append(thread)
            while thread.is_alive() and not started(step):
                time.sleep(POLL_S)
        for thread in threads:
            thread.join()
        for step in steps:
            self.finish(step, codes.get(step.name, 1))

    def finish(self, step: Step, code: int) -> None:
        if code in step.ok:
            for line in shown(step):
                print(line, flush=True)
            return
        message = failure(step, code)
        if not self.keep_going:
            raise StepFailed(message)
        print(message, file=sys.stderr, flush=True)
        self.failed.append(step.name)


def log_lines(log: Path) -> list[str]:
    return log.read_text(encoding="utf-8", errors="replace").splitlines()


def shown(step: Step) -> list[str]:
    """What a finished command shows of its log: the lines holding ``grep``, or the last ``show``."""
    if step.log is None:
        return []
    lines = log_lines(step.log)
    return [x for x in lines if step.grep in x] if step.grep is not None else lines[-step.show :]


def failure(step: Step, code: int) -> str:
    if step.log is None:
        return f"{step.name} failed (exit code {code}); its output is above"
    tail = "\n".join(log_lines(step.log)[-FAIL_TAIL:]) if step.log.is_file() else "(no log)"
    return f"{step.name} failed (exit code {code}); {step.log}, last lines:\n{tail}"


def is_progress(line: str) -> bool:
    """A progress bar's redraw: tqdm's ``NN%|`` bar, or its rate at the end (``it/s]``, ``step/s]``, ...)."""
    return bool(re.search(r"\d+%\|", line)) or line.rstrip().endswith(("it/s]", "step/s]", "batch/s]", "conv/s]"))


def output_lines(stream: IO[bytes]) -> Iterator[str]:
    """A process's output as lines, as they come: a carriage return (a redrawn progress bar) ends a line too."""
    pending = b""
    for chunk in iter(lambda: stream.read1(1 << 16), b""):
        *done, pending = re.split(rb"\r\n|\r|\n", pending + chunk)
        yield from (x.decode(errors="replace") for x in done)
    if pending:
        yield pending.decode(errors="replace")


def run_step(step: Step) -> int:
    """Run one command from the checkout, its lines without progress bars to its log (or the screen) as they come."""
    if step.log is not None:
        step.log.parent.mkdir(parents=True, exist_ok=True)
    sink = open(step.log, "w", encoding="utf-8") if step.log is not None else sys.stdout
    try:
        with subprocess.Popen(step.argv, cwd=ROOT, env=os.environ | step.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
            for line in output_lines(proc.stdout):
                if not is_progress(line):
                    sink.write(line + "\n")
                    sink.flush()
    finally:
        if sink is not sys.stdout:
            sink.close()
    return proc.returncode


def heldout_overrides(corpora: Path) -> list[str]:
    """The held-out files of ``trainer.corpora prepare``: ShareGPT for the serving eval, the others leak-checked."""
    leak_checked = ",".join(map(str, leak_checked_files(corpora)))
    return [
        f"trainer.eval_prompts_file={corpora / 'heldout_sharegpt.jsonl'}",
        f"data.heldout_prompt_files=[{leak_checked}]",
    ]


def recipe_answers(res: Path, recipe: str) -> Path:
    """The greedy answers the recipe run ``recipe`` writes (``answered.done`` beside them once complete)."""
    return res / recipe / "answered.jsonl"


# -- the steps of each sequence


def recipe_step(res: Path, recipe: str, corpora: Path, args: Sequence[str]) -> Step:
    return Step("recipe", (PYTHON, "launch/recipe.py", "--corpora", str(corpora), "--out", str(res / recipe), *args))


def carried_training_step(res: Path, corpora: Path, a: argparse.Namespace, name: str, overrides: Sequence[str]) -> Step:
    """A run of the recipe's training phase on the carried answers (its own speedup phase off) into ``RES/NAME``."""
    answers = ("--answered", str(a.answered), "--sampled", str(a.sampled), "--phases", "training")
    argv = (PYTHON, "launch/recipe.py", "--corpora", str(corpora), "--out", str(res / name), *answers)
    return Step(f"{a.sequence}: {name} training", argv + ("--trainer-args", "trainer.speedup.enabled=false", *overrides))


def speedup_step(res: Path, corpora: Path, a: argparse.Namespace, name: str, plain: Path | None) -> Step:
    """``RES/NAME``'s export in ``serving.speedup``; ``plain``: the results file whose target-alone run it takes."""
    prompts = (str(corpora / "heldout_sharegpt.jsonl"), str(corpora / "heldout_codeio.jsonl"))
    argv = (PYTHON, "-m", "serving.speedup", str(res / name / "run" / "export" / "sglang"), "--prompts", *prompts)
    argv += ("--settings", *a.settings, "--concurrency", *map(str, a.concurrency), "--repeats", str(a.repeats))
    argv += ("--json", str(res / name / "speedup.json"))
    log = res / name / "speedup.log"
    return Step(f"{a.sequence}: {name} speedup", argv + (("--plain-from", str(plain)) if plain else ()), log, show=40)


def measure_exports(a: argparse.Namespace, steps: Steps, names: Sequence[str]) -> None:
    """``serving.speedup`` on each run's export against one target-alone run: ``--plain-from``'s, else the first
    export measured's. A run without an export (its training failed) is passed over."""
    plain = a.plain_from
    for name in names:
        if not (a.res / name / "run" / "export" / "sglang").is_dir():
            print(f"{a.sequence}: {name} has no export (its training failed), no speedup", file=sys.stderr, flush=True)
            continue
        failed = len(steps.failed)
        steps.run(speedup_step(a.res, a.corpora, a, name, plain))
        if plain is None and len(steps.failed) == failed:
            plain = a.res / name / "speedup.json"


def kept_checkpoint(root: Path, mark_s: float) -> Path:
    """The trunk's checkpoint kept at the ``trainer.checkpoint_at_s`` mark ``mark_s``: the first kept past it."""
    metas = [(read_meta(p), p) for p in root.iterdir() if is_complete(p)] if root.is_dir() else []
    past = sorted((m["position"]["train_s"], p) for m, p in metas if m.get("kept") and m["position"]["train_s"] >= mark_s)
    if not past:
        raise StepFailed(f"budget: {root} holds no checkpoint kept at {mark_s:g} s of training (did the trunk run?)")
    return past[0][1]


def baseline_steps(res: Path, corpora: Path) -> list[Step]:
    r = res / "baseline"
    heldout = [str(corpora / f"heldout_{name}.jsonl") for name in ("sharegpt", "codeio", "evals")]
    return [
        Step("baseline: training", (PYTHON, "-m", "trainer", f"hydra.run.dir={r / 'run'}"), r / "train.log", show=5),
        Step(
            "baseline: tau",
            (PYTHON, "-m", "serving.sglang_eval", str(r / "run" / "export" / "sglang"), "--prompts", *heldout)
            + ("--k", "6", "3", "--max-new-tokens", "128", "--json", str(r / "tau.json")),
            r / "tau.log",
            grep="tau =",
        ),
    ]


def study_step(res: Path, corpora: Path, records: int, steps: int, parallel: int, devices: Sequence[str], threads: int) -> Step:
    """lab/study.py on the split answers: sizes all, 16x, 4x, 1x of the base."""
    r = res / "study"
    return Step(
        "study",
        (PYTHON, "lab/study.py", "--out", str(r), "--base-file", str(r / "data" / "base.jsonl"))
        + ("--synthetic", str(r / "data" / "more.jsonl"), "--sizes", str(records // BASE), "16", "4", "1")
        + ("--max-steps", str(steps), "--parallel", str(parallel), *(("--devices", *devices) if devices else ()))
        + ("--", *STUDY_OVERRIDES, *heldout_overrides(corpora)),
        env={"OMP_NUM_THREADS": str(threads)},
    )


def genbench_steps(res: Path, variants: Sequence[str]) -> list[Step]:
    r, bench = res / "benches", (PYTHON, "lab/bench_generate.py")
    return [
        Step("genbench", (*bench, "--variants", *variants, "--out", str(r / "generate.json")), r / "generate.log", show=8),
        # SGLang compiles prefill graphs for 58 token counts at each start (tc_piecewise): 102 s to start one engine, 277 s four
        Step(
            "genbench: no prefill graphs",
            (
                *bench,
                "--variants",
                "sglang-r4",
                "--sglang-arg",
                "disable_prefill_cuda_graph=true",
                "--out",
                str(r / "generate_noprefillgraph.json"),
            ),
            r / "generate_noprefillgraph.log",
            show=3,
        ),
        # SGLang captures decode graphs up to batch 256 on an H200
        Step(
            "genbench: decode graphs to 1024",
            (*bench, "--variants", "sglang", "--sglang-arg", "cuda_graph_max_bs_decode=1024", "--out", str(r / "generate_cg1024.json")),
            r / "generate_cg1024.log",
            show=3,
        ),
    ]


def perfbench_steps(res: Path) -> list[Step]:
    r, stream = res / "benches", (PYTHON, "lab/bench_throughput.py")
    memory = (PYTHON, "lab/bench_trainer_memory.py", "--device", "cuda", "--tmp", str(SCRATCH), "--out", str(r / "memory.json"))
    smol = (*stream, "--target", "smollm2-135m")  # the recipe's shapes: 16K and 64K tokens a batch
    return [
        Step("perfbench: trainer memory", memory, r / "memory.log", show=6),
        Step("perfbench: profile", (*stream, "--profile", "--out", str(r / "profile.json")), r / "profile.log", show=30),
        *(
            Step(
                f"perfbench: smol rows {rows}",
                (*smol, "--rows", str(rows), "--modes", "colocated,sglang", "--out", str(r / f"smol_r{rows}.json")),
                r / f"smol_r{rows}.log",
                show=8,
            )
            for rows in (8, 32)
        ),
        Step(
            "perfbench: smol profile",
            (*smol, "--rows", "8", "--profile", "--out", str(r / "smol_profile.json")),
            r / "smol_profile.log",
            show=30,
        ),
        Step(
            "perfbench: static cache",
            (PYTHON, "lab/bench_generate.py", "--variants", "hf-b256-static-compile", "--out", str(r / "generate_static.json")),
            r / "generate_static.log",
            show=4,
        ),
    ]


def faults_step(res: Path, args: Sequence[str]) -> Step:
    r = res / "faults"
    return Step("faults", (PYTHON, "lab/faults.py", "--out", str(r), *args), r / "faults.log", show=20)


def gpu_test_files(root: Path) -> list[Path]:
    """The test files (relative to ``root``) that mark gpu tests."""
    files = sorted((root / "tests").rglob("test_*.py"))
    return [f.relative_to(root) for f in files if "mark.gpu" in f.read_text(encoding="utf-8")]


def gputests_steps(res: Path, files: Sequence[Path], k: str | None) -> list[Step]:
    """One pytest a file; with ``-k`` a file where it selects nothing (pytest's exit code 5) is no failure."""
    r, suffix = res / "gputests", f"_{k.replace(' ', '_')}" if k else ""
    select = ("-k", k) if k else ()
    return [
        Step(
            f"gputests: {f}",
            (PYTHON, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", str(f), "-v", "-s", "-rfEs", *select),
            r / f"{f.stem}{suffix}.log",
            show=1,
            ok=frozenset({0, 5}) if k else frozenset({0}),
        )
        for f in files
    ]


def dp_steps(
    res: Path, out: str, answers: Path, corpora: Path, runs: Sequence[str], steps: int, gpu: str, extra: Sequence[str]
) -> list[Step]:
    """One trainer process (the two-rank runs: the DeepSpeed launcher) a run, in ``RES/out/RUN``."""
    r = res / out
    common = [
        "+experiment=h200_quality",
        "data=openai",
        f"data.sources.openai.path={answers}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.serve_eval=false",
        "trainer.eval_batches=1",
        *heldout_overrides(corpora),
        *extra,
    ]
    one_gpu = {"CUDA_VISIBLE_DEVICES": gpu}
    commands = {
        "one-ga1": ((PYTHON, "-m", "trainer"), one_gpu),
        "one": ((PYTHON, "-m", "trainer", "deepspeed.grad_accum=2"), one_gpu),
        "two": ((PYTHON, *DS_LAUNCHER, "launch/train.py"), {}),
    }
    result = []
    for run in runs:
        engine, kind = run.split("-", 1)
        command, env = commands[kind]
        engine_override = "engine=sglang" if engine == "sglang" else "engine.mode=colocated"
        argv = (*command, *common, engine_override, f"hydra.run.dir={r / run}")
        result.append(Step(f"dp: {run}", argv, r / f"{run}.log", env=env))
    return result


# -- the analysis


def split_answers(answers: Path, out: Path, base: int = BASE) -> int:
    """The answered records shuffled (seed 0), the first ``base`` to OUT/base.jsonl, the rest to OUT/more.jsonl.

    Records are split at newlines alone: a record may hold U+2028, which ``splitlines`` would cut at.
    Returns the number of records."""
    lines = [x for x in answers.read_text(encoding="utf-8").split("\n") if x.strip()]
    random.Random(0).shuffle(lines)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("base", lines[:base]), ("more", lines[base:])):
        (out / f"{name}.jsonl").write_text("\n".join(part) + "\n", encoding="utf-8")
    return len(lines)


def train_rows(run_dir: Path) -> list[dict]:
    """The training rows of a run's metrics.jsonl (none when the run is not there)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [x for x in rows if "train/loss" in x]


def late_median(rows: list[dict], key: str) -> float | None:
    late = [x[key] for x in rows if x["step"] > WARMUP_STEPS and key in x]
    return statistics.median(late) if late else None


def run_rate(rows: list[dict]) -> float | None:
    """The run's tokens over its seconds past the warm-up (each row's rate over its window's step time)."""
    late = [x for x in rows if x["step"] > WARMUP_STEPS and "perf/step_time_s" in x]
    if not late:
        return None
    return sum(x["perf/tokens_per_s"] * x["perf/step_time_s"] for x in late) / sum(x["perf/step_time_s"] for x in late)


def run_figures(rows: list[dict]) -> dict:
    return {
        "steps": len(rows),
        "loss": [x["train/loss"] for x in rows],
        "tokens_per_s": late_median(rows, "perf/tokens_per_s"),
        "tokens_per_s_run": run_rate(rows),
        "step_time_s": late_median(rows, "perf/step_time_s"),
        "stall_share": late_median(rows, "perf/stall_share"),
        "stall_share_per_rank": [late_median(rows, f"perf/stall_share_rank{k}") for k in (0, 1)],
    }


def dp_compare(base: dict, one: dict, two: dict) -> dict:
    """Two ranks against one GPU: speedup by the median step's rate and by the run's; loss differences to grad_accum 2."""
    compare = {}
    if base["tokens_per_s"] and two["tokens_per_s"]:
        compare["speedup_vs_one_gpu"] = two["tokens_per_s"] / base["tokens_per_s"]
        compare["speedup_vs_one_gpu_run"] = two["tokens_per_s_run"] / base["tokens_per_s_run"]
    if one["loss"] and two["loss"]:
        rel = [abs(a - b) / abs(a) for a, b in zip(one["loss"], two["loss"])]
        compare |= {"rel_loss_diff_first": rel[0], "rel_loss_diff_max": max(rel), "rel_loss_diff_mean": sum(rel) / len(rel)}
    return compare


def dp_summary(r: Path) -> dict:
    """Each run's figures from ``r/RUN/metrics.jsonl`` (a run not there: no steps), and each engine's comparison."""
    out = {}
    for engine in DP_ENGINES:
        figures = {kind: run_figures(train_rows(r / f"{engine}-{kind}")) for kind in KINDS}
        out |= {f"{engine}-{kind}": figures[kind] for kind in KINDS}
        out[f"{engine}-compare"] = dp_compare(figures["one-ga1"], figures["one"], figures["two"])
    return out


# -- the sequences


def wait_for(path: Path, poll_s: float = 5.0) -> None:
    if not path.exists():
        print(f"waiting for {path}", flush=True)
    while not path.exists():
        time.sleep(poll_s)


def recipe(a: argparse.Namespace, steps: Steps) -> None:
    """launch/recipe.py into RES/NAME: generation, training and the speedup, each phase timed."""
    steps.run(recipe_step(a.res, a.recipe, a.corpora, a.rest))


def baseline(a: argparse.Namespace, steps: Steps) -> None:
    """The embedded default recipe, τ on the held-out files."""
    for step in baseline_steps(a.res, a.corpora):
        steps.run(step)


def study(a: argparse.Namespace, steps: Steps) -> None:
    """Data size x LR regime on the recipe's answers (waits for them)."""
    answers = recipe_answers(a.res, a.recipe)
    wait_for(answers.with_suffix(".done"))
    records = split_answers(answers, a.res / "study" / "data")
    steps.run(study_step(a.res, a.corpora, records, a.steps, a.parallel, a.devices, a.threads))


def engine_built(log: Path, since: float) -> bool:
    """Whether the training whose trainer log is ``log`` has built its target engine: the log written after
    ``since`` (a time.time()) holds the engine's line."""
    return log.is_file() and log.stat().st_mtime >= since and TARGET_BUILT.search(log.read_text(errors="replace")) is not None


def sweep(a: argparse.Namespace, steps: Steps) -> None:
    """Draft variants of the recipe, trained one after the other (``--side-by-side``: at once), then their speedups
    against one baseline."""
    names = [v[0] for v in a.variant]
    if len(set(names)) != len(names):
        raise SystemExit(f"sweep: --variant names must differ, got {', '.join(names)}")
    cap = (f"trainer.max_steps={a.steps}", "trainer.max_time_s=null")
    trainings = [carried_training_step(a.res, a.corpora, a, name, (*cap, *overrides)) for name, *overrides in a.variant]
    if a.side_by_side:
        since = time.time()
        logs = {step.name: a.res / name / "train.log" for step, name in zip(trainings, names)}
        steps.run_side_by_side(trainings, lambda step: engine_built(logs[step.name], since))
    else:
        for step in trainings:
            steps.run(step)
    measure_exports(a, steps, names)


def budget(a: argparse.Namespace, steps: Steps) -> None:
    """τ against training time: one wsd trunk of the longest budget, each shorter budget's decay resumed from the
    trunk's checkpoint kept where that budget's decay starts, then their speedups against one baseline."""
    minutes = sorted(set(a.minutes))
    trunk = f"t{minutes[-1]:g}"
    marks = [STABLE_SHARE * m * 60 for m in minutes[:-1]]
    kept = f"trainer.checkpoint_at_s=[{','.join(f'{t:g}' for t in marks)}]"
    trunk_overrides = (f"trainer.max_time_s={minutes[-1] * 60:g}", kept, *a.trainer_args)
    steps.run(carried_training_step(a.res, a.corpora, a, trunk, trunk_overrides))
    # a branch reads the trunk's answer files: a resume checks the data settings, their paths included
    same_data = tuple(f"data.sources.{s}.path={a.res / trunk / f'{f}.jsonl'}" for s, f in (("openai", "answered"), ("sampled", "sampled")))
    for m, mark in zip(minutes[:-1], marks):
        resume = f"trainer.resume={kept_checkpoint(a.res / trunk / 'run' / 'checkpoints', mark)}"
        branch = (f"trainer.max_time_s={m * 60:g}", resume, *same_data, *a.trainer_args)
        steps.run(carried_training_step(a.res, a.corpora, a, f"t{m:g}", branch))
    names = [f"t{m:g}" for m in minutes]
    measure_exports(a, steps, names)
    measured = [str(a.res / n) for n in names if (a.res / n / "speedup.json").is_file()]
    if measured:  # τ against the minutes trained: RES/budget.json, RES/budget.png
        plot = ("--out", str(a.res / "budget"), "--setting", a.settings[0], "--concurrency", str(a.concurrency[0]))
        steps.run(Step(f"{a.sequence}: tau against training time", (PYTHON, "lab/budget_plot.py", *plot, *measured)))


def genbench(a: argparse.Namespace, steps: Steps) -> None:
    """Generation speeds (transformers, SGLang; 1-4 replicas)."""
    for step in genbench_steps(a.res, a.variants):
        steps.run(step)


def perfbench(a: argparse.Namespace, steps: Steps) -> None:
    """Trainer memory and the draft step's profile at 8B shapes; the static cache."""
    for step in perfbench_steps(a.res):
        steps.run(step)


def faults(a: argparse.Namespace, steps: Steps) -> None:
    """lab/faults.py: faults on purpose against short SGLang runs."""
    steps.run(faults_step(a.res, a.rest))


def gputests(a: argparse.Namespace, steps: Steps) -> None:
    """The whole gpu marker, one pytest a file."""
    for step in gputests_steps(a.res, gpu_test_files(ROOT), a.k):
        steps.run(step)


def dp(a: argparse.Namespace, steps: Steps) -> None:
    """One GPU against two data-parallel ranks, both engines, then dp.json."""
    answers = recipe_answers(a.res, a.recipe)
    if not answers.is_file():
        raise SystemExit(f"{answers}: no answers to train on (the recipe run --recipe {a.recipe} writes them)")
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    for step in dp_steps(a.res, a.dir, answers, a.corpora, a.runs, a.steps, gpu, a.trainer_args):
        steps.run(step)
    summary = dp_summary(a.res / a.dir)
    (a.res / a.dir / "dp.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k.endswith("compare")}, indent=2))


SEQUENCES: dict[str, Callable[[argparse.Namespace, Steps], None]] = {
    "recipe": recipe,
    "baseline": baseline,
    "sweep": sweep,
    "budget": budget,
    "study": study,
    "genbench": genbench,
    "perfbench": perfbench,
    "faults": faults,
    "gputests": gputests,
    "dp": dp,
}
PASS_THROUGH = ("recipe", "faults")  # the arguments these do not know are their script's


# -- the command line


def absolute(text: str) -> Path:
    """A path argument made absolute: the commands run from the checkout."""
    return Path(text).absolute()


def run_name(text: str) -> str:
    if text not in RUNS:
        raise argparse.ArgumentTypeError(f"{text!r}: a run is one of {', '.join(RUNS)}")
    return text


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--res", type=absolute, default=Path("/tmp/res"), help="the results root (default /tmp/res)")
    p.add_argument("--keep-going", action="store_true", help="run the rest of the sequence past a failed command (exit code still 1)")
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lab/gpu_runs.py", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp, allow_abbrev=False)
    sub = p.add_subparsers(dest="sequence", required=True, metavar="SEQUENCE")
    common = _common()
    parsers = {
        name: sub.add_parser(name, help=run.__doc__, description=run.__doc__, parents=[common], allow_abbrev=False)
        for name, run in SEQUENCES.items()
    }
    for name in ("recipe", "baseline", "sweep", "budget", "study", "dp"):
        parsers[name].add_argument("corpora", type=absolute, help="trainer.corpora prepare's output dir")
    for name in ("recipe", "study", "dp"):
        parsers[name].add_argument("--recipe", default="recipe", help="the recipe run: its results are RES/NAME (default recipe)")
    s = parsers["study"]
    s.add_argument("--steps", type=int, default=200, help="optimizer steps a point (default 200)")
    s.add_argument("--parallel", type=int, default=4, help="points at once on each device (default 4)")
    s.add_argument("--devices", nargs="+", default=[], help="CUDA devices to spread the points over")
    s.add_argument("--threads", type=int, default=4, help="OMP_NUM_THREADS of the points (default 4)")
    w, b = parsers["sweep"], parsers["budget"]
    for carried in (w, b):
        carried.add_argument("--answered", type=absolute, required=True, help="gzipped greedy answers of an earlier recipe run")
        carried.add_argument("--sampled", type=absolute, required=True, help="gzipped sampled answers of an earlier recipe run")
        carried.add_argument("--plain-from", type=absolute, default=None, help="a results file whose target-alone run every export takes")
    w.add_argument(
        "--variant",
        nargs="+",
        action="append",
        required=True,
        metavar=("NAME", "OVERRIDE"),
        help="a results dir name and its Hydra overrides",
    )
    w.add_argument("--steps", type=int, default=2400, help="trainer.max_steps of each variant (default 2400: what the recipe's 300 s give)")
    w.add_argument(
        "--side-by-side",
        action="store_true",
        help="train the variants at once on the GPU, each started once the one before has built its target engine (two "
        "engines starting together size their KV pools against each other); two fit one H200. The speedups follow, one "
        "after the other",
    )
    w.add_argument("--settings", nargs="+", default=["8/8/64"], help="serving.speedup's settings (default 8/8/64)")
    w.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="serving.speedup's concurrency (default 1 16)")
    w.add_argument("--repeats", type=int, default=3, help="serving.speedup's repeats of each level (default 3)")
    b.add_argument(
        "--minutes", type=float, nargs="+", default=[5, 10], help="the training budgets (default 5 10); the longest is the trunk"
    )
    b.add_argument("--settings", nargs="+", default=["6/1/7"], help="serving.speedup's settings (default 6/1/7: the recipe's chain)")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1], help="serving.speedup's concurrency (default 1)")
    b.add_argument("--repeats", type=int, default=1, help="serving.speedup's repeats of each level (default 1: τ is the figure)")
    b.add_argument("--trainer-args", nargs="+", default=[], help="more Hydra overrides for the trunk and every branch")
    parsers["genbench"].add_argument("--variants", nargs="+", default=list(GEN_VARIANTS), help="lab/bench_generate.py's variants")
    parsers["gputests"].add_argument("-k", default=None, help="a pytest -k expression: a part of the marker")
    d = parsers["dp"]
    d.add_argument("runs", nargs="*", type=run_name, default=list(RUNS), metavar="RUN", help=f"some of {', '.join(RUNS)} (default all)")
    d.add_argument("--steps", type=int, default=30, help="trainer.max_steps of each run (default 30)")
    d.add_argument("--dir", default="dp", help="the results dir under RES (default dp)")
    d.add_argument("--trainer-args", nargs="+", default=[], help="more Hydra overrides for every run")
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _parser()
    a, rest = p.parse_known_args(argv)
    if rest and a.sequence not in PASS_THROUGH:
        p.error(f"{a.sequence}: unrecognized arguments: {shlex.join(rest)}")
    a.rest = rest
    return a


def main(argv: Sequence[str] | None = None, runner: Runner = run_step) -> int:
    a = parse(argv)
    steps = Steps(runner, a.keep_going)
    try:
        SEQUENCES[a.sequence](a, steps)
    except StepFailed as e:
        print(e, file=sys.stderr, flush=True)
        return 1
    if steps.failed:
        print(f"{a.sequence}: failed: {', '.join(steps.failed)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
