"""SpecForge against StreamDraft on one GPU: both train an EAGLE-3 draft of the target on the recipe's answers for the
same minutes, and both exports are measured in the same SGLang engine on the recipe's held-out prompts:

    python3 lab/peer_bench/run.py --corpora CORPORA --answered answered.jsonl --sampled sampled.jsonl \\
        --specforge-scripts SPECFORGE/scripts --minutes 5 10 --out DIR

The peer runs as its own launcher runs it on one GPU without network: its offline capture
(``scripts/prepare_hidden_states.py``) of the answers rendered with the target's chat template, then ``specforge train``
(local offline, its small-target recipe's settings) and ``specforge export --to sglang``. Its schedule is in optimizer
steps, so two short calibration runs give its steps per second and start-up, and each minutes value trains for the steps
that fill it. StreamDraft trains with ``launch/recipe.py --phases training --train-s``. ``serving.speedup`` measures
each export (the 6-step chain and ``--trees``, concurrency 1 and 16), ``serving.speedup_compare`` pairs them by prompt.
A failure of one side (missing, a non-zero exit, no export, an export refused) is recorded with its log's last lines and
the other side is still measured. Writes ``peer_bench.json``, ``tau_vs_minutes.png`` and the logs into ``--out``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's product packages (run as a script)

from lab.peer_bench import commands as C  # noqa: E402
from lab.peer_bench import report  # noqa: E402


class StepFailed(RuntimeError):
    """A command of one side failed; ``stage`` names it, the message ends with its log's last lines."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


def tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(text[-lines:])


def gpu_memory_mb() -> float | None:
    """The GPU's used memory (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True)
    except OSError:
        return None
    return max(float(v) for v in out.stdout.split()) if out.returncode == 0 and out.stdout.strip() else None


def execute(stage: str, argv: list[str], log: Path) -> dict:
    """Run one command to its end, its output into ``log``; its wall seconds and the GPU's peak used memory meanwhile.
    StepFailed naming the stage when it cannot start or exits non-zero."""
    log.parent.mkdir(parents=True, exist_ok=True)
    peak, done = [None], threading.Event()

    def poll() -> None:
        while not done.wait(1.0):
            used = gpu_memory_mb()
            if used is not None:
                peak[0] = max(peak[0] or 0.0, used)

    start = time.perf_counter()
    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        with open(log, "wb") as f:
            code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=C.ROOT).returncode
    except OSError as e:
        raise StepFailed(stage, f"{stage}: cannot run {argv[0]} ({e})") from None
    finally:
        done.set()
        watcher.join()
    if code != 0:
        raise StepFailed(stage, f"{stage}: exit code {code}; {log}, last lines:\n{tail(log)}")
    return {"stage": stage, "argv": argv, "log": str(log), "seconds": round(time.perf_counter() - start, 1),
            "peak_gpu_mem_gb": None if peak[0] is None else round(peak[0] / 1024, 2)}  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def place_answers(args: argparse.Namespace, out: Path) -> None:
    """The answer files as the recipe reads them in its ``--out`` (answered.jsonl, sampled.jsonl)."""
    out.mkdir(parents=True, exist_ok=True)
    for source, name in ((args.answered, "answered.jsonl"), (args.sampled, "sampled.jsonl")):
        opener = gzip.open if source.suffix == ".gz" else open
        with opener(source, "rb") as f, open(out / name, "wb") as g:
            shutil.copyfileobj(f, g)


def preformatted(args: argparse.Namespace, target: Path, path: Path) -> tuple[int, float]:
    """Both answer files as SpecForge's pre-formatted records (``{"id", "text"}``), rendered with the target's own chat
    template (the text the target sees when served); their count and mean tokens (at most SpecForge's max length)."""
    from models.target import load_tokenizer

    tokenizer = load_tokenizer(target)
    count, tokens = 0, 0
    with open(path, "w") as f:
        for source in (args.answered, args.sampled):
            for n, record in enumerate(read_jsonl(source), 1):
                if "messages" not in record:
                    raise ValueError(f"{source}, line {n}: no 'messages' (an answer file of launch/recipe.py is expected)")
                text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
                f.write(json.dumps({"id": f"{source.name}:{record.get('id', n)}", "text": text}) + "\n")
                count += 1
                tokens += min(C.PEER_MAX_LENGTH, len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return count, tokens / max(count, 1)


def peer_train(args, paths: C.PeerPaths, name: str, steps: int) -> dict:
    config = paths.config(name)
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(C.run_config(args.target, paths, name, steps), indent=1))  # YAML is a superset of JSON
    return execute(f"specforge train {name}", C.train_argv(args.specforge, config), paths.root / "logs" / f"{name}.log")


def calibrate(args, paths: C.PeerPaths) -> dict:
    """SpecForge's optimizer steps per second and its seconds before the first step, from two runs of
    ``--calibrate-steps`` steps: the rate from their difference in wall time, the start-up from the shorter."""
    (k1, k2), runs = args.calibrate_steps, []
    for k in (k1, k2):
        runs.append(peer_train(args, paths, f"calibrate{k}", k))
    rate = (k2 - k1) / max(runs[1]["seconds"] - runs[0]["seconds"], 1e-3)
    return {"steps_per_s": rate, "first_step_s": max(runs[0]["seconds"] - k1 / rate, 0.0), "runs": runs}


def peer_side(args, out: Path) -> tuple[list[dict], dict]:
    """The peer's records, one per minutes value (each with ``failed`` when it failed), and its set-up."""
    paths, setup = C.PeerPaths(out / "peer"), {"commands": []}
    paths.root.mkdir(parents=True, exist_ok=True)
    try:
        if shutil.which(args.specforge[0]) is None:
            raise StepFailed("find specforge", f"{args.specforge[0]} is not on PATH: SpecForge is not installed on this host")
        script = args.specforge_scripts / "prepare_hidden_states.py"
        if not script.is_file():
            raise StepFailed("find specforge", f"--specforge-scripts {args.specforge_scripts}: no prepare_hidden_states.py")
        paths.draft_config.write_text(json.dumps(C.draft_config(args.target), indent=1))
        setup["samples"], setup["mean_tokens"] = preformatted(args, args.target, paths.data)
        capture = execute(
            "specforge capture",
            C.capture_argv(args.specforge_scripts, args.target, paths, args.mem_fraction),
            paths.root / "logs" / "capture.log",
        )
        setup["capture"] = capture
        setup["calibration"] = calibrate(args, paths)
    except (StepFailed, ValueError) as e:
        failed = {"stage": getattr(e, "stage", "set-up"), "message": str(e)}
        return [{"side": "peer", "minutes": m, "failed": failed} for m in args.minutes], setup
    rate, records = setup["calibration"]["steps_per_s"], []
    for m in args.minutes:
        name, steps = f"minutes{m:g}", max(1, round(rate * m * 60))
        record = {"side": "peer", "minutes": m, "steps": steps, "failed": None}
        try:
            trained = peer_train(args, paths, name, steps)
            exported = execute(
                f"specforge export {name}", C.export_argv(args.specforge, paths, name), paths.root / "logs" / f"{name}-export.log"
            )
            if not (paths.export(name) / "config.json").is_file():
                raise StepFailed("specforge export", f"specforge export wrote no {paths.export(name) / 'config.json'}")
            first = setup["calibration"]["first_step_s"]
            record |= {"commands": [trained, exported], "export": str(paths.export(name)), "first_step_s": round(first, 1)}
            record |= {"train_s": round(trained["seconds"] - first, 1), "peak_gpu_mem_gb": trained["peak_gpu_mem_gb"]}
            record["tokens_per_s"] = round(setup["mean_tokens"] * steps * C.PEER_TRAINING["batch_size"] / max(record["train_s"], 1e-3))
        except StepFailed as e:
            record["failed"] = {"stage": e.stage, "message": str(e)}
        records.append(record)
    return records, setup


def streamdraft_side(args, out: Path) -> list[dict]:
    records = []
    for m in args.minutes:
        recipe_out = out / "streamdraft" / f"minutes{m:g}"
        place_answers(args, recipe_out)
        argv = C.streamdraft_argv(recipe_out, args.corpora, args.target, m * 60)
        record = {"side": "streamdraft", "minutes": m, "failed": None}
        try:
            trained = execute(f"streamdraft train minutes{m:g}", argv, recipe_out / "bench.log")
            summary = json.loads((recipe_out / "run" / "summary.json").read_text())
            phases = summary["phase_s"]
            before = sum(v for k, v in phases.items() if k != "training" and list(phases).index(k) < list(phases).index("training"))
            record |= {
                "commands": [trained],
                "export": summary["export_dir"],
                "steps": summary["steps"],
                "train_s": round(summary["train_time_s"], 1),
            }
            record |= {"tokens_per_s": round(summary["tokens_seen"] / max(summary["train_time_s"], 1e-3)), "first_step_s": round(before, 1)}
            record["peak_gpu_mem_gb"] = trained["peak_gpu_mem_gb"]
        except StepFailed as e:
            record["failed"] = {"stage": e.stage, "message": str(e)}
        records.append(record)
    return records


def measure(args, records: list[dict], out: Path) -> None:
    """``serving.speedup`` on every export trained, the target alone measured once (``--plain-from`` after)."""
    prompts = [args.corpora / "heldout_sharegpt.jsonl", args.corpora / "heldout_codeio.jsonl"]
    plain = None
    for record in records:
        if record["failed"]:
            continue
        results = out / "speedup" / f"{record['side']}-minutes{record['minutes']:g}.json"
        argv = C.speedup_argv(
            Path(record["export"]), prompts, args.target, [report.CHAIN, *args.trees], [1, 16], args.mem_fraction, results, plain
        )
        try:
            record["commands"].append(execute(f"serving.speedup {record['side']}", argv, results.with_suffix(".log")))
        except StepFailed as e:
            record["failed"] = {"stage": "serving.speedup", "message": str(e)}
            continue
        record["speedup_json"] = str(results)
        record["speedup"] = json.loads(results.read_text())
        plain = plain or results


def paired(records: list[dict]) -> list[dict]:
    """serving.speedup_compare's rows: the peer's τ minus StreamDraft's, by prompt, at each minutes value."""
    from serving.speedup_compare import compare
    from serving.speedup_report import read_results

    rows = []
    for m in sorted({r["minutes"] for r in records}):
        ours = [r for r in records if r["minutes"] == m and r.get("speedup_json")]
        base = [r for r in ours if r["side"] == "streamdraft"]
        other = [r for r in ours if r["side"] == "peer"]
        if base and other:
            b, o = Path(base[0]["speedup_json"]), Path(other[0]["speedup_json"])
            rows += [row | {"minutes": m} for row in compare(b, read_results(b), o, read_results(o))]
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 lab/peer_bench/run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpora", type=Path, required=True, help="trainer.corpora prepare's dir (held-out ShareGPT and code prompts)")
    p.add_argument("--answered", type=Path, required=True, help="the recipe's greedy answers (answered.jsonl, or .gz)")
    p.add_argument("--sampled", type=Path, required=True, help="the recipe's sampled answers (sampled.jsonl, or .gz)")
    p.add_argument("--target", type=Path, default=None, help="the target's transformers dir (default: the embedded SmolLM2 target)")
    p.add_argument("--specforge", nargs="+", default=["specforge"], help="SpecForge's command (its wheel's console script)")
    p.add_argument("--specforge-scripts", type=Path, required=True, help="a SpecForge source tree's scripts/ (prepare_hidden_states.py)")
    p.add_argument("--minutes", type=float, nargs="+", required=True, help="training minutes, each a run of both sides")
    p.add_argument("--trees", nargs="+", default=["5/4/8", "6/8/32", "8/8/64"], help="tree settings measured beside the 6-step chain")
    p.add_argument("--calibrate-steps", type=int, nargs=2, default=[50, 550], help="the peer's two calibration runs' optimizer steps")
    p.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang's mem_fraction_static in the capture and the measurement")
    p.add_argument("--sides", nargs="+", choices=report.SIDES, default=list(report.SIDES))
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ["HF_HUB_OFFLINE"] = "1"
    args = _parser().parse_args(argv)
    if args.target is None:
        from models.embedded import embedded_target_dir

        args.target = embedded_target_dir()
    for name in ("corpora", "answered", "sampled", "target", "specforge_scripts", "out"):
        setattr(args, name, getattr(args, name).resolve())  # the commands run in the checkout's root
    for path in (args.answered, args.sampled, args.corpora / "heldout_sharegpt.jsonl", args.corpora / "heldout_codeio.jsonl"):
        if not path.is_file():
            raise SystemExit(f"{path}: no such file")
    if args.calibrate_steps[0] >= args.calibrate_steps[1]:
        raise SystemExit("--calibrate-steps: the second count must be larger")
    records, setup = [], {}
    if "streamdraft" in args.sides:
        records += streamdraft_side(args, args.out)
    if "peer" in args.sides:
        peer, setup = peer_side(args, args.out)
        records += peer
    measure(args, records, args.out)
    try:
        pairs = paired(records)
    except ValueError as e:
        pairs = [{"error": str(e)}]
    extra = {
        "argv": sys.argv,
        "peer_setup": setup,
        "paired": pairs,
        "peer_settings": {"training": C.PEER_TRAINING, "max_length": C.PEER_MAX_LENGTH},
    }
    print(report.write(args.out, records, args.trees, extra))
    failed = [r for r in records if r["failed"]]
    for r in failed:
        print(f"{r['side']} {r['minutes']:g} min failed at {r['failed']['stage']}:\n{r['failed']['message']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
