"""The ``h200_quality`` recipe from prepared corpora to a measured speedup, each phase timed:

    python3 launch/recipe.py --corpora outputs/corpora --out outputs/recipe

1. **generation**: one generator (SGLang, ``--replicas`` engines, by default as many as the GPU fits
   with the room each needs beyond its KV pool, ``trainer.datagen.gen_memory``; prefill CUDA graphs
   off: they cost each engine's start more than they save here) answers every training prompt
   greedily (``answered.jsonl``), then the ShareGPT prompts (``--sampled-sources``) again sampled at
   ``--temperature`` (``sampled.jsonl``): two passes, one set of engine starts. Both resume by id, so
   ``--answered`` / ``--sampled`` (gzipped answers of an earlier run) leave only what they lack;
   with nothing left to answer no engine starts.
2. **training**: ``python -m trainer +experiment=h200_quality engine=sglang`` on both files for
   ``--train-s`` seconds, the held-out files as its eval and leak checks. It ends with
   ``serving.speedup`` on the held-out ShareGPT and code prompts (``trainer.speedup``), whose
   engine starts and decoding are timed apart in ``run/speedup.json``. A failed training stops the
   recipe with its log's tail (no other engine is tried). ``--engine hf``: transformers generates and
   feeds the trainer instead, and there is no speedup phase (it is SGLang's).

3. **the grid** (``--grid SETTING...``, after the training): ``serving.speedup`` on the export with more
   draft settings (trees), resuming the training's own results (the target alone and its chain are
   not measured again), timed as its own phase: an experiment on the export, not part of the recipe's time.

``phases.json`` (rewritten as each phase ends, so a cut run keeps what finished; a later run adds
to it) and the table at the end give each phase's seconds and what it made. ``--phases training``
trains on the answers already in ``--out`` (or carried in). The corpora come from ``python -m
trainer.corpora prepare``: ``train_prompts.jsonl.gz`` and ``heldout_{sharegpt,codeio,evals}.jsonl``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from models import hub
from models.generation import GenerationSettings
from serving.usage import PlainHelp
from trainer.corpora import leak_checked_files
from trainer.datagen.gen_backend import GeneratorSettings, default_batch_size
from trainer.datagen.replicas import fit_generator, open_generator
from trainer.regenerate import generation_meta, prompt_conversations, regenerate, replicas_arg, unanswered

PHASES = ("generation", "training")
# the sources whose prompts get a sampled second answer; one for every source: docs/BENCHMARKS.md, "What did not help"
SAMPLED_SOURCES = ("sharegpt", "sharegpt_followups")
HELDOUT = ("sharegpt", "codeio", "evals")
GRID_PHASE = "speedup grid"  # --grid: an experiment on the export, not part of the recipe's time


class Phases:
    """Each phase's seconds and figures, kept in ``phases.json`` as they end."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = json.loads(path.read_text()) if path.is_file() else []

    def add(self, name: str, seconds: float, **figures) -> None:
        self.rows.append({"phase": name, "seconds": round(seconds, 1)} | figures)
        self.path.write_text(json.dumps(self.rows, indent=1) + "\n")
        print(f"== {name}: {seconds:.1f} s {json.dumps(figures)}", flush=True)

    def table(self) -> str:
        lines = [f"{'phase':<34} {'seconds':>8}  figures"]
        lines += [
            f"{r['phase']:<34} {r['seconds']:>8.1f}  {json.dumps({k: v for k, v in r.items() if k not in ('phase', 'seconds')})}"
            for r in self.rows
        ]
        recipe = sum(r["seconds"] for r in self.rows if r["phase"] != GRID_PHASE)
        return "\n".join(lines + [f"{'total (the grid apart)':<34} {recipe:>8.1f}"])


def carried(source: Path | None, output: Path) -> None:
    """Start ``output`` from an earlier run's gzipped answers (they are resumed, not asked again)."""
    if source is not None and not output.exists():
        with gzip.open(source, "rb") as f, open(output, "wb") as out:
            shutil.copyfileobj(f, out)


def generation_passes(args: argparse.Namespace) -> list[tuple]:
    """(name, conversations, their records' extras, output, settings) of the greedy pass over every training
    prompt and the sampled pass over those of ``--sampled-sources``."""
    prompts = args.corpora / "train_prompts.jsonl.gz"
    every, every_extras = prompt_conversations(prompts)
    some, some_extras = prompt_conversations(prompts, args.sampled_sources)
    return [
        ("greedy", every, every_extras, args.out / "answered.jsonl", GenerationSettings(args.new_tokens, 0.0, 1.0, 1, 0)),
        ("sampled", some, some_extras, args.out / "sampled.jsonl", GenerationSettings(args.new_tokens, args.temperature, 0.95, 1, 1)),
    ]


def generate(args: argparse.Namespace, phases: Phases) -> tuple[Path, Path]:
    out = args.out
    answered, sampled = out / "answered.jsonl", out / "sampled.jsonl"
    passes = generation_passes(args)
    if not any(unanswered(convs, path, s.temperature == 0) for _, convs, _, path, s in passes):
        print("every prompt is answered already: no generation", flush=True)
        return answered, sampled
    sglang = args.engine == "sglang"
    generator = GeneratorSettings(
        args.engine,
        args.target,
        mem_fraction_static=args.mem_fraction_static,
        replicas=args.replicas if sglang else 1,
        sglang_args=(("disable_prefill_cuda_graph", True),) if sglang else (),
    )
    try:
        generator = fit_generator(generator, sampled=True)  # one set of engines runs both passes
    except ValueError as e:
        raise SystemExit(str(e)) from None
    start = time.perf_counter()
    backend = open_generator(generator)
    phases.add("generation: engine start", time.perf_counter() - start, replicas=generator.replicas)
    batch = default_batch_size(args.engine, "auto") * generator.replicas
    try:
        for name, convs, extras, path, settings in passes:
            settings = GenerationSettings(settings.max_new_tokens, settings.temperature, settings.top_p, batch, settings.seed)
            report = regenerate(convs, backend, path, settings, generation_meta(backend, settings), progress=False, extras=extras)
            print(report.line(), flush=True)
            rate = report.new_tokens / report.seconds if report.seconds else 0.0
            phases.add(
                f"generation: {name}", report.seconds, written=report.written, new_tokens=report.new_tokens, tokens_per_s=round(rate)
            )
            if name == "greedy":
                (out / "answered.done").touch()  # lab/device_run.sh study waits for it
    finally:
        backend.close()
    return answered, sampled


def train_overrides(args: argparse.Namespace, answered: Path, sampled: Path) -> list[str]:
    """The training run's Hydra overrides: h200_quality on both answer files, the held-out files as its evals."""
    c, run = args.corpora, args.out / "run"
    engine = ["engine=sglang"] if args.engine == "sglang" else ["trainer.speedup.enabled=false"]  # the speedup is SGLang's
    overrides = [
        "+experiment=h200_quality",
        *engine,
        f"data.sources.openai.path={answered}",
        f"data.sources.sampled.path={sampled}",
        f"trainer.eval_prompts_file={c / 'heldout_sharegpt.jsonl'}",
        f"data.heldout_prompt_files=[{','.join(map(str, leak_checked_files(c)))}]",
        f"trainer.speedup.prompts_files=[{c / 'heldout_sharegpt.jsonl'},{c / 'heldout_codeio.jsonl'}]",
        *([] if args.train_s is None else [f"trainer.max_time_s={args.train_s}"]),
        f"trainer.serve_eval={str(args.serve_eval).lower()}",
        f"hydra.run.dir={run}",
        *args.trainer_args,
    ]
    if args.target is not None:
        overrides += ["target=local", f"target.path={args.target}"]
    return overrides


def train(args: argparse.Namespace, answered: Path, sampled: Path, phases: Phases) -> Path:
    run, log = args.out / "run", args.out / "train.log"
    overrides = train_overrides(args, answered, sampled)
    start = time.perf_counter()
    with open(log, "wb") as f:
        code = subprocess.run([sys.executable, "-m", "trainer", *overrides], stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code != 0 or not (run / "summary.json").is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise SystemExit(f"the training run failed (exit code {code}); {log}, last lines:\n{tail}")
    phases.add("training process", seconds, **training_figures(run))
    return run


def speedup_grid_argv(args: argparse.Namespace, run: Path) -> list[str]:
    """``serving.speedup`` on the run's export with ``--grid``'s settings, resuming the training's results: the
    same prompts, target and conditions as the training's speedup phase (its defaults)."""
    results = run / "speedup.json"
    if not results.is_file():
        raise SystemExit(f"--grid: {results} is missing (the training's speedup phase writes it; is trainer.speedup off?)")
    conditions = json.loads(results.read_text())["conditions"]  # resumed only when the export and target are the same
    export, target = conditions["export"], conditions["target"]
    prompts = [str(args.corpora / "heldout_sharegpt.jsonl"), str(args.corpora / "heldout_codeio.jsonl")]
    command = [sys.executable, "-m", "serving.speedup", export, "--prompts", *prompts]
    return command + ["--target", target, "--json", str(results), "--settings", *args.grid]


def check_grid(args: argparse.Namespace) -> None:
    """``--grid`` refused before anything starts: a setting SGLang would change or refuse, no SGLang, no training."""
    from serving.speedup import parse_setting

    if not args.grid:
        return
    if args.engine != "sglang" or "training" not in args.phases:
        raise SystemExit("--grid: the grid follows the training phase, on the SGLang engine")
    for setting in args.grid:
        try:
            parse_setting(setting)
        except ValueError as e:
            raise SystemExit(f"--grid: {str(e).removeprefix('--settings ')}") from None


def grid(args: argparse.Namespace, run: Path, phases: Phases) -> None:
    argv, log = speedup_grid_argv(args, run), args.out / "grid.log"
    start = time.perf_counter()
    with open(log, "wb") as f:
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    phases.add(GRID_PHASE, time.perf_counter() - start, settings=args.grid, exit_code=code)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"the speedup grid failed (exit code {code}); {log}, last lines:\n{tail}")


def training_figures(run: Path) -> dict:
    """What the training process's summary and its speedup results say of its parts."""
    summary = json.loads((run / "summary.json").read_text())
    figures = {"train_s": round(summary["train_time_s"], 1), "steps": summary["steps"], "trainer_wall_s": round(summary["wall_time_s"], 1)}
    figures |= {"phases_s": {k: round(v, 1) for k, v in summary["phase_s"].items()}, "engine_start_s": round(summary["engine_start_s"], 1)}
    results = run / "speedup.json"
    if results.is_file():
        runs = json.loads(results.read_text())["runs"]
        figures |= {
            "speedup_s": round(sum(r["process_s"] for r in runs.values()), 1),
            "speedup_engine_starts_s": round(sum(r["start_s"] for r in runs.values()), 1),
            "speedup_settings": len(runs),
        }
    return figures


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 launch/recipe.py", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    p.add_argument("--corpora", type=Path, required=True, help="trainer.corpora prepare's output dir")
    p.add_argument("--out", type=Path, required=True, help="the answers, the run dir, train.log, phases.json")
    p.add_argument("--target", default=None, help="a transformers dir (default: the embedded SmolLM2 target)")
    p.add_argument("--engine", choices=("sglang", "hf"), default="sglang", help="hf: transformers generates and feeds, no speedup phase")
    p.add_argument("--answered", type=Path, default=None, help="gzipped greedy answers of an earlier run, resumed")
    p.add_argument("--sampled", type=Path, default=None, help="gzipped sampled answers of an earlier run, resumed")
    p.add_argument("--new-tokens", type=int, default=128, help="an answer's new tokens at most")
    p.add_argument("--temperature", type=float, default=0.6, help="the sampled pass's temperature (top-p 0.95)")
    p.add_argument(
        "--sampled-sources", nargs="+", default=list(SAMPLED_SOURCES), help="the corpora sources whose prompts get a sampled answer too"
    )
    p.add_argument(
        "--replicas",
        type=replicas_arg,
        default=None,
        help="generation engines on the GPU (a small target's scheduler is CPU-bound); default auto: as many as the GPU fits, "
        "up to 4 (a count that does not fit is refused with one that does)",
    )
    p.add_argument(
        "--mem-fraction-static", type=float, default=0.8, help="the generation engines' share of the GPU memory for their KV pools"
    )
    p.add_argument("--train-s", type=float, default=None, help="training seconds (default: h200_quality's trainer.max_time_s)")
    p.add_argument("--serve-eval", action="store_true", help="also the trainer's own speculative decoding of 32 held-out prompts")
    p.add_argument(
        "--phases", nargs="+", choices=PHASES, default=list(PHASES), help="the phases to run (training alone: on the answers there)"
    )
    p.add_argument("--trainer-args", nargs="*", default=[], help="more Hydra overrides for the training run")
    p.add_argument("--grid", nargs="+", default=[], help="after the training: serving.speedup with these settings too (e.g. 6/8/32 8/8/64)")
    return p


def main(argv: list[str] | None = None) -> int:
    hub.offline()
    args = _parser().parse_args(argv)
    for name in ("train_prompts.jsonl.gz", *(f"heldout_{h}.jsonl" for h in HELDOUT)):
        if not (args.corpora / name).is_file():
            raise SystemExit(f"--corpora {args.corpora}: no {name} (python -m trainer.corpora prepare --out DIR writes it)")
    check_grid(args)
    args.out.mkdir(parents=True, exist_ok=True)
    carried(args.answered, args.out / "answered.jsonl")
    carried(args.sampled, args.out / "sampled.jsonl")
    phases = Phases(args.out / "phases.json")
    answered, sampled = args.out / "answered.jsonl", args.out / "sampled.jsonl"
    if "generation" in args.phases:
        answered, sampled = generate(args, phases)
    if "training" in args.phases:
        for path in (answered, sampled):
            if not path.is_file():
                raise SystemExit(f"{path}: no answers to train on (run the generation phase first, or give --answered / --sampled)")
        run = train(args, answered, sampled, phases)
        if args.grid:
            grid(args, run, phases)
    print(phases.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
