"""Faults on purpose against short real runs: what the user sees, how soon, what is lost, and whether a
resume trains as an unbroken run does (docs/RELIABILITY.md).

    python3 lab/faults.py --out outputs/faults                                   # a GPU: engine=sglang, SmolLM2
    python3 lab/faults.py --out /tmp/faults --engine colocated --device cpu       # the CPU stand-in
    python3 lab/faults.py --out DIR --faults engine_kill regen_kill               # some of them

On a bare GPU host run it with lab/device_run.sh's environment (its ``PYTHONPATH`` holds SGLang
and the project's wheels). ``--engine colocated`` is the transformers engine in its own process,
the CPU equivalent of SGLang's; ``--device cpu`` also shrinks the runs to the tests' tiny sizes.

The faults (each a few short ``python -m trainer`` or ``python -m trainer.regenerate`` processes;
they run ``--parallel`` at a time after ``oom_fraction``, which runs alone, all within ``--budget-s``):

- ``baseline``: the unbroken run the resumes are compared with;
- ``engine_kill`` / ``engine_stop``: SIGKILL / SIGSTOP to the engine process once step
  ``--fault-step`` is logged (the stop with ``engine.wait_timeout_s=--wait-timeout-s``); then
  the resume command the trainer printed, whose losses after its checkpoint are compared with the
  baseline's (CPU: exactly equal; GPU: within ``GPU_FIRST_TOLERANCE`` at the first resumed step and
  ``GPU_TOLERANCE`` after, relative);
- ``trainer_kill``: SIGKILL to the trainer: every process it started must be gone, nothing of
  theirs left in /dev/shm or on the GPU;
- ``nan``: NaN aux features from the engine in one training batch (``lab.fault_targets``),
  ``trainer.on_nan=skip``: the run must finish with the batch skipped and counted;
- ``oom_pool``: a KV pool (sglang: ``engine.sglang.max_total_tokens``) or a ring slot (colocated:
  ``engine.slot_tokens``) smaller than a batch: refused before training, naming the key;
- ``oom_fraction`` (sglang): ``engine.sglang.mem_fraction_static=0.99``, the pool unpinned, beside a
  16K-token batch leaves the trainer 1 % of the GPU, surely too little: it must be refused before any
  engine starts, naming a value that fits (what happens within ``ALONE_S`` is recorded);
- ``regen_kill`` / ``regen_kill_sampled``: ``trainer.regenerate`` (greedy / ``--temperature 0.6``)
  SIGKILLed with half a line on disk, then resumed: no torn line, no conversation twice, every
  conversation written or counted as dropped.

On a GPU every wait for the engine of ``engine_stop`` ends at ``--wait-timeout-s`` (60 s), its first
prefill too: restore SGLang's kernel cache first (docs/SGLANG.md; a cold one builds for ~50-70 s) or
raise it. Each result: the lines the user saw, seconds from the fault to the first of them, what was lost, the
resume's comparison, the processes / shared memory / GPU memory left behind. ``--out`` gets
``faults.json``, ``faults.md`` (the table) and a dir per fault with its run dirs and logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout: no install needed

from lab.gpu_runs import is_progress  # noqa: E402
from trainer.stream.engine_process import TARGET_BUILT  # noqa: E402

DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")  # each run sets up its own
GPU_FIRST_TOLERANCE, GPU_TOLERANCE = 1e-3, 2e-2  # relative loss differences a bf16 GPU resume may show (docs/RELIABILITY.md)
CPU_RUN = [  # tests/fixtures/tiny.py's sizes: a run of seconds a step on a 2-core CPU
    "trainer.device=cpu",
    "data.max_conversations=48",
    "data.max_eval_conversations=16",
    "data.max_tokens=512",
    "data.max_len=128",
    "draft.draft_vocab_size=1024",
    "draft.ttt_steps=3",
    "trainer.eval_prompts=2",
    "trainer.eval_max_new_tokens=8",
    "trainer.max_steps=6",
    "trainer.checkpoint_every=2",
]
GPU_RUN = ["trainer.device=cuda", "trainer.epochs=10", "trainer.max_steps=150", "trainer.checkpoint_every=20"]
EVERY_RUN = ["trainer.log_every=1", "trainer.eval_batches=1", "trainer.serve_eval=false"]
SGLANG_RUN = ["engine=sglang", "engine.sglang.max_total_tokens=4096"]  # a fixed KV pool: runs share the GPU
COLOCATED_RUN = ["engine.mode=colocated"]
# SGLang's share of the GPU at 0.99, the pool unpinned, beside a 16K-token batch (a trainer need of about 5 GiB,
# models.memory_plan): 1 % of an H200 is surely too little, and the trainer must refuse it before any engine starts
OOM_FRACTION = ["engine.sglang.mem_fraction_static=0.99", "engine.sglang.max_total_tokens=null", "data.max_tokens=16384"]
FAULTS = ("engine_kill", "engine_stop", "trainer_kill", "nan", "oom_pool", "oom_fraction", "regen_kill", "regen_kill_sampled")
MESSAGE_MARKS = ("the engine process ", "error: ", "stopped by ")  # the first line of what the trainer says when it stops
CRASH_MARKS = (*MESSAGE_MARKS, "Traceback (most recent call last)", "torch.OutOfMemoryError", "Error executing job")
RANK = re.compile(r"^\[rank\d+\]: ?")  # torch.distributed's prefix on a rank's traceback lines

# python -c programs: the trainer with NaN features in engine batch argv[1]; regenerate that writes half a line
# after its output's fsync number argv[2] and waits to be killed (argv[1]: the marker it touches then)
NAN_RUN = """
import sys
import trainer.build as build
from lab.fault_targets import NaNFeatures
target_factory, batch = build.target_factory, int(sys.argv.pop(1))
build.target_factory = lambda *args: NaNFeatures(target_factory(*args), batch)
from trainer.__main__ import cli
sys.argv[0] = "trainer"
cli()
"""
TORN_WRITE = """
import os, sys, time
from pathlib import Path
marker, after = Path(sys.argv.pop(1)), int(sys.argv.pop(1))
output = Path(sys.argv[sys.argv.index("--output") + 1]).resolve()
real, synced = os.fsync, []
def fsync(fd):
    real(fd)
    if Path(os.readlink(f"/proc/self/fd/{fd}")) != output:
        return
    synced.append(fd)
    if len(synced) == after:
        os.write(fd, b'{"id": "torn by the kill", "messages": [{"role": "us')
        real(fd)
        marker.touch()
        time.sleep(3600)
os.fsync = fsync
from trainer.regenerate import main
main(sys.argv[1:])
"""
REGEN_REPORT = """
import json, sys
from dataclasses import asdict
from trainer.regenerate import main
print("REPORT " + json.dumps(asdict(main(sys.argv[1:]))), flush=True)
"""


# --------------------------------------------------------------------------- processes


def proc_state(pid: int) -> str | None:
    """The kernel's state letter for ``pid`` (R, S, D, T, Z, ...), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (``/proc/PID/task/*/children``)."""
    kids = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, nearest first."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop(0))
        found, todo = found + kids, todo + kids
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def gpu_apps() -> dict[int, int] | None:
    """pid -> MiB of every process nvidia-smi sees holding GPU memory; None without nvidia-smi."""
    out = _nvidia_smi("--query-compute-apps=pid,used_memory")
    return None if out is None else {int(p): int(m) for p, m in (line.split(",") for line in out)}


def gpu_used_mib() -> int | None:
    """Memory used on every GPU, summed (nvidia-smi); None without it."""
    out = _nvidia_smi("--query-gpu=memory.used")
    return None if out is None else sum(int(line) for line in out)


def _nvidia_smi(query: str) -> list[str] | None:
    try:
        done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else None


def leftovers(pids: Sequence[int], grace_s: float = 30.0) -> dict:
    """What ``pids`` left once ``grace_s`` passed for them to go: live processes, their /dev/shm segments
    (torch names them ``torch_<pid>_...``), their GPU memory. A process that has ended can stay in
    nvidia-smi's list while the driver frees its memory (seen: 14 GB of a killed SGLang scheduler), so the
    grace waits for that too."""
    deadline = time.monotonic() + grace_s

    def going() -> bool:
        apps = gpu_apps() or {}
        return any(alive(p) or p in apps for p in pids)

    while going() and time.monotonic() < deadline:
        time.sleep(0.2)
    shm = sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(f"torch_{p}_") for p in pids)) if Path("/dev/shm").is_dir() else []
    apps = gpu_apps()
    return {
        "processes": [f"{p}: {cmdline(p)[:120]}" for p in pids if alive(p)],
        "shm": shm,
        "gpu": None if apps is None else [f"{p}: {apps[p]} MiB" for p in pids if p in apps],
    }


def kill_all(pids: Sequence[int]) -> None:
    """SIGKILL every one of ``pids`` still there (a stopped process too)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def nothing_left(left: dict) -> bool:
    return not left["processes"] and not left["shm"] and not left["gpu"]


class Leg:
    """One process of a fault: its output lines with the time each came, and every process it started."""

    def __init__(self, argv: Sequence[str], log: Path, threads: int | None = None):
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        env |= {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "PYTHONUNBUFFERED": "1"}
        env.setdefault("WANDB_MODE", "offline")
        if threads is not None:  # processes side by side: each its share of the cores, not all of them
            env.setdefault("OMP_NUM_THREADS", str(threads))
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log, self.lines, self.seen = log.open("w"), [], set()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            text = raw.decode(errors="replace")
            self.log.write(text)
            for line in re.split(r"[\r\n]", text):
                if line.strip():
                    self.lines.append((time.monotonic(), line.rstrip()))
        self.log.close()

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.seen.update(descendants(self.pid))
            time.sleep(0.2)

    def wait_for(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Poll ``ready`` while the process runs; False when it ended or ``deadline`` came first."""
        while self.proc.poll() is None and time.monotonic() < deadline:
            if ready():
                return True
            time.sleep(0.1)
        return False

    def finish(self, deadline: float) -> int | None:
        """Its exit code; None when ``deadline`` came first (it and what it started are then killed)."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_all([self.pid, *descendants(self.pid)])
            self.proc.wait()
            return None
        finally:
            self._reader.join(timeout=30)
        return self.proc.returncode

    def engine_pid(self) -> int | None:
        """The engine process the trainer spawned: its child running multiprocessing's spawn_main."""
        return next((p for p in children(self.pid) if "spawn_main" in cmdline(p)), None)

    def said(self, since: float, marks: Sequence[str] = MESSAGE_MARKS) -> tuple[list[str], float | None]:
        """The lines from the first one at or after ``since`` that starts with one of ``marks`` (the engine's start
        line aside), and when it came."""
        lines = [(t, RANK.sub("", line)) for t, line in self.lines if t >= since]
        first = next((k for k, (_, line) in enumerate(lines) if line.startswith(tuple(marks)) and not TARGET_BUILT.match(line)), None)
        if first is None:
            return [], None
        return [line for _, line in lines[first:] if not is_progress(line)][:40], lines[first][0]


# --------------------------------------------------------------------------- run dirs


def logged_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss of metrics.jsonl (a torn last line, from a kill, is ignored)."""
    path, out = run_dir / "metrics.jsonl", {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "train/loss" in row:
            out[row["step"]] = row["train/loss"]
    return out


def kept_step(run_dir: Path) -> int | None:
    """The step of the run's newest complete checkpoint."""
    from trainer import checkpoint as ckpt

    kept = ckpt.latest(run_dir / "checkpoints")
    return None if kept is None else ckpt.read_meta(kept)["position"]["step"]


def compare(base: dict[int, float], resumed: dict[int, float], after: int, exact: bool) -> dict:
    """The resumed run's losses after step ``after`` against the unbroken run's, relative."""
    steps = sorted(s for s in resumed if s > after and s in base)
    rel = [abs(resumed[s] - base[s]) / max(abs(base[s]), 1e-12) for s in steps]
    if not rel:
        return {"from_step": after, "steps": 0, "equal": False}
    first_tol, tol = (0.0, 0.0) if exact else (GPU_FIRST_TOLERANCE, GPU_TOLERANCE)
    return {
        "from_step": after,
        "steps": len(steps),
        "first_rel_diff": rel[0],
        "max_rel_diff": max(rel),
        "tolerance": "exact" if exact else f"first {first_tol:g}, then {tol:g}",
        "equal": rel[0] <= first_tol and max(rel) <= tol,
    }


def answers_check(path: Path) -> dict:
    """An answers file as a resumed regenerate must leave it: whole lines that are records, no id twice, no torn end."""
    data = path.read_bytes() if path.exists() else b""
    cut = data.rfind(b"\n") + 1  # the end of the last whole line
    lines = [line for line in data[:cut].split(b"\n") if line.strip()]
    ids, bad = [], 0
    for line in lines:
        try:
            ids.append(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            bad += 1
    return {"lines": len(lines), "torn": bool(data[cut:].strip()), "bad_lines": bad, "duplicates": len(ids) - len(set(ids))}


# --------------------------------------------------------------------------- results


@dataclass
class FaultResult:
    fault: str
    what: str  # what was done to the run
    ok: bool  # the run behaved as the project promises
    exit_code: int | None = None  # of the process the fault hit (None: killed at the deadline)
    message: list[str] = field(default_factory=list)  # what the user saw
    message_s: float | None = None  # seconds from the fault to the message's first line
    lost: str = ""
    resume: str = ""  # the resume's verdict
    details: dict = field(default_factory=dict)  # the figures behind lost and resume
    left: dict | None = None  # processes, /dev/shm segments, GPU memory left behind
    gpu_used_mib: int | None = None  # every GPU's used memory once this fault ended (other faults may be running)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def table(results: Sequence[FaultResult]) -> str:
    """The Markdown table of ``results``: one row a fault."""
    rows = [
        "| fault | ok | what the user saw (first line) | to the message (s) | lost | resume | left behind |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        first = r.message[0] if r.message else "(nothing)"
        rows.append(
            f"| {r.fault} | {'yes' if r.ok else 'NO'} | {_cell(first)} | {_seconds(r.message_s)} | {_cell(r.lost)} "
            f"| {_cell(r.resume)} | {_cell(_left_cell(r.left))} |"
        )
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def resume_verdict(c: dict) -> str:
    """``compare``'s result in a line."""
    if not c["steps"] and c["exit_code"] is None:
        return f"cut by --budget-s before a step after {c['from_step']}"
    if not c["steps"]:
        return f"no step after {c['from_step']} to compare"
    verdict = "equal" if c["equal"] else "DIFFERENT"
    return f"{verdict} over steps {c['from_step'] + 1}+ ({c['steps']} steps; max rel diff {c['max_rel_diff']:.1e}; {c['tolerance']})"


def _left_cell(left: dict | None) -> str:
    if left is None:
        return ""
    if nothing_left(left):
        return "nothing" + ("" if left["gpu"] is not None else " (no nvidia-smi)")
    return "; ".join(f"{k}: {', '.join(v)}" for k, v in left.items() if v)


def write_results(out: Path, settings: dict, results: Sequence[FaultResult], gpu: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"settings": settings, "gpu_used_mib": gpu, "results": [asdict(r) for r in results]}
    (out / "faults.json").write_text(json.dumps(record, indent=1))
    (out / "faults.md").write_text(table(results) + "\n")


# --------------------------------------------------------------------------- the faults


@dataclass(frozen=True)
class Settings:
    out: Path
    engine: str  # sglang | colocated (the transformers engine in its own process)
    device: str  # cuda | cpu
    fault_step: int  # the engine and trainer faults come once this step is logged
    wait_timeout_s: float  # engine.wait_timeout_s of engine_stop
    regen_target: str | None  # --target of the generation faults; None: the embedded SmolLM2
    parallel: int  # faults at a time
    deadline: float  # time.monotonic() by which every process has ended

    @property
    def threads(self) -> int:
        """Torch threads of each process: the cores shared by ``parallel`` faults of two processes (trainer, engine)."""
        return max(1, (os.cpu_count() or 1) // (2 * self.parallel))

    @property
    def overrides(self) -> list[str]:
        engine = SGLANG_RUN if self.engine == "sglang" else COLOCATED_RUN
        return [*engine, *(CPU_RUN if self.device == "cpu" else GPU_RUN), *EVERY_RUN]

    def trainer(self, run_dir: Path, extra: Sequence[str] = (), log: str = "run", program: Sequence[str] = ()) -> Leg:
        """``python -m trainer`` (or ``python -c PROGRAM ARGS...``) on ``run_dir`` with this run's overrides."""
        head = [sys.executable, "-c", *program] if program else [sys.executable, "-m", "trainer"]
        return Leg([*head, f"hydra.run.dir={run_dir}", *self.overrides, *extra], run_dir.parent / f"{log}.log", self.threads)

    def regenerate_args(self, output: Path, sampled: bool) -> list[str]:
        cpu = self.device == "cpu"
        sizes = (
            ["--limit", "16", "--batch-size", "2", "--max-new-tokens", "8"]
            if cpu
            else ["--limit", "64", "--batch-size", "8", "--max-new-tokens", "32"]
        )
        if self.engine == "sglang":  # a small share of the GPU, no CUDA graphs to capture: a quick start beside the other faults
            engine = ["--engine", "sglang", "--mem-fraction-static", "0.1", "--sglang-arg", "disable_cuda_graph=true"]
        else:
            engine = ["--engine", "hf", "--device", self.device, "--dtype", "float32" if cpu else "auto"]
        target = ["--target", self.regen_target] if self.regen_target else []
        sampling = ["--temperature", "0.6", "--top-p", "0.95", "--seed", "1"] if sampled else []
        return ["--output", str(output), *sizes, *engine, *target, *sampling]


def _reach_step(s: Settings, leg: Leg, run_dir: Path) -> bool:
    return leg.wait_for(lambda: max(logged_losses(run_dir), default=0) >= s.fault_step, s.deadline)


def _lost(trained: int, kept: int | None) -> str:
    if kept is None:
        return f"{_steps(trained)}: no checkpoint"
    if kept == trained:
        return f"nothing: checkpoint step {kept} is the last step trained"
    return f"{_steps(trained - kept)} (trained {trained}, checkpoint step {kept})"


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _ended(r: FaultResult, t0: float, pids: Sequence[int]) -> FaultResult:
    """Record what the fault's processes left (unless the fault did), kill it, stamp the time and the GPU memory."""
    if r.left is None:
        r.left = leftovers(pids)
    if r.exit_code is None:
        r.notes.append("its run was ended at --budget-s: the row says what it did until then")
    kill_all(pids)
    r.seconds, r.gpu_used_mib = time.monotonic() - t0, gpu_used_mib()
    return r


def baseline(s: Settings, base: Future | None = None) -> FaultResult:
    t0, run_dir = time.monotonic(), s.out / "baseline" / "run"
    leg = s.trainer(run_dir)
    r = FaultResult("baseline", "an unbroken run: the losses the resumes are compared with", ok=False)
    r.exit_code = leg.finish(s.deadline)
    r.details = {"steps": len(logged_losses(run_dir))}
    r.lost, r.ok = f"{r.details['steps']} steps trained", r.exit_code == 0
    return _ended(r, t0, [leg.pid, *leg.seen])


def engine_fault(s: Settings, base: Future, name: str, sig: signal.Signals) -> FaultResult:
    """SIGKILL or SIGSTOP to the engine process mid-training; then the resume command the trainer printed."""
    t0, home = time.monotonic(), s.out / name
    extra = [f"engine.wait_timeout_s={s.wait_timeout_s:g}"] if sig == signal.SIGSTOP else []
    leg = s.trainer(home / "run", extra)
    r = FaultResult(name, f"{sig.name} to the engine process once step {s.fault_step} was logged", ok=False)
    if not _reach_step(s, leg, home / "run") or (pid := leg.engine_pid()) is None:
        r.exit_code, r.notes = leg.finish(s.deadline), ["the run never reached the fault step with an engine (see its log)"]
        return _ended(r, t0, [leg.pid, *leg.seen])
    at = time.monotonic()
    os.kill(pid, sig)
    r.exit_code = leg.finish(s.deadline)
    r.message, seen = leg.said(at)
    r.message_s = None if seen is None else seen - at
    trained, kept = max(logged_losses(home / "run"), default=0), kept_step(home / "run")
    r.lost, r.left = _lost(trained, kept), leftovers([leg.pid, *leg.seen])
    comparison = _resume(s, base, r.message, kept, extra, home)
    r.resume, r.details = resume_verdict(comparison) if comparison else "no resume command printed", {"trained": trained, "kept": kept}
    r.details["resume"] = comparison
    equal = bool(comparison and comparison["equal"])
    r.ok = r.exit_code == 1 and kept == trained and nothing_left(r.left) and equal
    return _ended(r, t0, [leg.pid, *leg.seen])


def _resume(s: Settings, base: Future, message: list[str], kept: int | None, extra: Sequence[str], home: Path) -> dict | None:
    """Run the resume command the trainer printed (the same overrides plus it); compare its losses with the baseline's."""
    printed = next((m for line in message if (m := re.search(r"plus: trainer\.resume=auto hydra\.run\.dir=(\S+)", line))), None)
    if printed is None or kept is None:
        return None
    run_dir = Path(printed.group(1))
    leg = s.trainer(run_dir, [*extra, "trainer.resume=auto"], log="resume")
    code = leg.finish(s.deadline)
    kill_all([leg.pid, *leg.seen])
    base.result()
    return compare(logged_losses(s.out / "baseline" / "run"), logged_losses(run_dir), kept, s.device == "cpu") | {"exit_code": code}


def trainer_kill(s: Settings, base: Future | None = None) -> FaultResult:
    """SIGKILL to the trainer mid-training: every process it started must go, with its shared and GPU memory."""
    t0, home = time.monotonic(), s.out / "trainer_kill"
    leg = s.trainer(home / "run")
    r = FaultResult("trainer_kill", f"SIGKILL to the trainer once step {s.fault_step} was logged", ok=False)
    if not _reach_step(s, leg, home / "run"):
        r.exit_code, r.notes = leg.finish(s.deadline), ["the run never reached the fault step (see its log)"]
        return _ended(r, t0, [leg.pid, *leg.seen])
    started = {p: cmdline(p)[:160] for p in [leg.pid, *descendants(leg.pid)]}
    at = time.monotonic()
    os.kill(leg.pid, signal.SIGKILL)
    r.exit_code = leg.finish(s.deadline)
    gone_s = _gone_within(started, at + 30.0) - at
    r.left = leftovers(sorted(set(started) | leg.seen))
    trained, kept = max(logged_losses(home / "run"), default=0), kept_step(home / "run")
    r.message = ["(the trainer is killed: it prints nothing; the shell says Killed)"]
    r.lost = _lost(trained, kept) + " (a killed trainer cannot save: trainer.checkpoint_every bounds the loss)"
    r.details = {"processes": [f"{p}: {c}" for p, c in started.items()], "all_gone_after_s": gone_s, "trained": trained, "kept": kept}
    r.ok = r.exit_code == -signal.SIGKILL and nothing_left(r.left)
    return _ended(r, t0, list(started))


def _gone_within(pids: Sequence[int], deadline: float) -> float:
    """When the last of ``pids`` was seen gone (polled), or ``deadline``."""
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return time.monotonic()


def nan(s: Settings, base: Future | None = None) -> FaultResult:
    """NaN aux features from the engine in the second training batch (engine batch 2: batch 0 is the held-out eval's)."""
    t0, run_dir = time.monotonic(), s.out / "nan" / "run"
    leg = s.trainer(run_dir, ["trainer.on_nan=skip"], program=[NAN_RUN, "2"])
    r = FaultResult("nan", "NaN aux features in the second training batch, trainer.on_nan=skip", ok=False)
    r.exit_code = leg.finish(s.deadline)
    r.message = [line for _, line in leg.lines if "non-finite" in line]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    steps, skipped = summary.get("steps"), summary.get("nonfinite_skipped")
    r.details = {"steps": steps, "nonfinite_skipped": skipped}
    r.lost = f"{skipped} batch skipped and counted; {steps} steps trained"
    r.ok = r.exit_code == 0 and skipped == 1 and steps == max(logged_losses(run_dir), default=-1)
    return _ended(r, t0, [leg.pid, *leg.seen])


def oom_pool(s: Settings, base: Future | None = None) -> FaultResult:
    """A KV pool (sglang) or a ring slot (colocated) smaller than a batch: refused before any engine starts."""
    t0, run_dir = time.monotonic(), s.out / "oom_pool" / "run"
    setting = "engine.sglang.max_total_tokens=512" if s.engine == "sglang" else "engine.slot_tokens=256"
    leg = s.trainer(run_dir, [setting])
    r = FaultResult("oom_pool", f"{setting}, below one batch (data.max_tokens)", ok=False)
    r.exit_code = leg.finish(s.deadline)
    r.message, seen = leg.said(leg.started)
    r.message_s = None if seen is None else seen - leg.started
    engines = [p for p in leg.seen if "spawn_main" in cmdline(p)]
    r.lost = "nothing: refused before training" if not logged_losses(run_dir) else "the run trained"
    r.details = {"engine_processes_started": len(engines)}
    r.ok = r.exit_code == 1 and not logged_losses(run_dir) and not engines and any(setting.split("=")[0] in m for m in r.message)
    return _ended(r, t0, [leg.pid, *leg.seen])


def oom_fraction(s: Settings, base: Future | None = None) -> FaultResult:
    """engine.sglang.mem_fraction_static=0.99 with the pool unpinned, which would let SGLang's KV pool take the GPU
    from the trainer: refused before any engine starts, naming the key and a value that fits."""
    t0, run_dir = time.monotonic(), s.out / "oom_fraction" / "run"
    leg = s.trainer(run_dir, OOM_FRACTION)
    r = FaultResult("oom_fraction", ", ".join(OOM_FRACTION), ok=False)
    r.exit_code = leg.finish(s.deadline)
    r.message, seen = leg.said(leg.started, CRASH_MARKS)
    r.message = r.message or [line for _, line in leg.lines[-12:]]
    r.message_s = None if seen is None else seen - leg.started
    trained = max(logged_losses(run_dir), default=0)
    engines = [p for p in leg.seen if "spawn_main" in cmdline(p)]
    r.lost, r.details = f"{trained} steps trained before it stopped", {"trained": trained, "engine_processes_started": len(engines)}
    named = any("engine.sglang.mem_fraction_static=" in m and "or less" in m for m in r.message)
    r.ok = r.exit_code == 1 and trained == 0 and not engines and named
    return _ended(r, t0, [leg.pid, *leg.seen])


def regen_kill(s: Settings, base: Future | None = None, sampled: bool = False) -> FaultResult:
    """``trainer.regenerate`` SIGKILLed with half a line on disk (after its second chunk), then run again."""
    name = "regen_kill_sampled" if sampled else "regen_kill"
    t0, home = time.monotonic(), s.out / name
    output, marker = home / "answers.jsonl", home / "torn"
    args = s.regenerate_args(output, sampled)
    leg = Leg([sys.executable, "-c", TORN_WRITE, str(marker), "2", *args], home / "regenerate.log", s.threads)
    r = FaultResult(name, f"SIGKILL to trainer.regenerate{' (sampled)' if sampled else ''} mid-line, after 2 chunks", ok=False)
    if not leg.wait_for(marker.exists, s.deadline):
        r.exit_code, r.notes = leg.finish(s.deadline), ["it never wrote its second chunk (see regenerate.log)"]
        return _ended(r, t0, [leg.pid, *leg.seen])
    started = [leg.pid, *descendants(leg.pid)]
    os.kill(leg.pid, signal.SIGKILL)
    r.exit_code = leg.finish(s.deadline)
    before, r.left = answers_check(output), leftovers(sorted(set(started) | leg.seen))
    again = Leg([sys.executable, "-c", REGEN_REPORT, *args], home / "resume.log", s.threads)
    code = again.finish(s.deadline)
    kill_all([again.pid, *again.seen])
    report = next((json.loads(line[7:]) for _, line in again.lines if line.startswith("REPORT ")), None)
    after = answers_check(output)
    r.message = [line for _, line in again.lines if "conversations written" in line]
    r.details = {"before": before, "after": after, "report": report, "resume_exit_code": code}
    r.ok = code == 0 and before["torn"] and _answers_whole(after, report) and nothing_left(r.left)
    r.lost = f"nothing: {before['lines']} whole lines kept, the torn end cut" if r.ok else f"see details: {r.details}"
    r.resume = f"{after['lines']} lines, {after['duplicates']} twice, torn end {after['torn']}, {after['bad_lines']} bad"
    return _ended(r, t0, started)


def _answers_whole(after: dict, report: dict | None) -> bool:
    """No torn or foreign line, no id twice, and every source conversation written, or counted as not written."""
    if report is None or after["torn"] or after["bad_lines"] or after["duplicates"]:
        return False
    dropped = report["same_prompts"] + report["empty"] + report["refused"]
    return after["lines"] == report["skipped_done"] + report["written"] and after["lines"] + dropped == report["records"]


FAULT_RUNS: dict[str, Callable[[Settings, Future | None], FaultResult]] = {
    "engine_kill": lambda s, base: engine_fault(s, base, "engine_kill", signal.SIGKILL),
    "engine_stop": lambda s, base: engine_fault(s, base, "engine_stop", signal.SIGSTOP),
    "trainer_kill": trainer_kill,
    "nan": nan,
    "oom_pool": oom_pool,
    "oom_fraction": oom_fraction,
    "regen_kill": regen_kill,
    "regen_kill_sampled": lambda s, base: regen_kill(s, base, sampled=True),
}
NEEDS_BASELINE = ("engine_kill", "engine_stop")
ALONE_S = 120.0  # oom_fraction's share of the budget


def guarded(name: str, s: Settings, base: Future | None) -> FaultResult:
    """One fault's result; a fault that could not run says why instead of ending the others."""
    if time.monotonic() >= s.deadline:
        return FaultResult(name, "not run: the budget (--budget-s) was spent", ok=False)
    try:
        return (baseline if name == "baseline" else FAULT_RUNS[name])(s, base)
    except Exception as e:  # one broken fault run must not lose the others' results
        return FaultResult(name, "the fault run failed", ok=False, notes=[f"{type(e).__name__}: {e}"])


def run_faults(s: Settings, names: Sequence[str]) -> list[FaultResult]:
    """oom_fraction first and alone (it takes the GPU's memory), within ``ALONE_S``; then the baseline, when a
    fault compares with it, and the rest, ``s.parallel`` at a time."""
    alone = []
    if "oom_fraction" in names:
        alone.append(guarded("oom_fraction", replace(s, deadline=min(s.deadline, time.monotonic() + ALONE_S)), None))
    with ThreadPoolExecutor(s.parallel) as pool:
        base = pool.submit(guarded, "baseline", s, None) if any(n in NEEDS_BASELINE for n in names) else None
        futures = [pool.submit(guarded, n, s, base) for n in names if n != "oom_fraction"]
        return ([base.result()] if base else []) + [f.result() for f in futures] + alone


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 lab/faults.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--engine", choices=("sglang", "colocated"), default="sglang")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--parallel", type=int, default=None, help="faults at a time (default: all on a GPU, 1 on the CPU)")
    p.add_argument("--budget-s", type=float, default=None, help="every process ends by then (default: 420 on a GPU, 3600 on the CPU)")
    p.add_argument("--fault-step", type=int, default=None, help="the step after which the fault comes (default: 50 on a GPU, 3 on the CPU)")
    p.add_argument("--wait-timeout-s", type=float, default=60.0, help="engine.wait_timeout_s of engine_stop")
    p.add_argument("--regen-target", default=None, help="--target of the generation faults (default: the embedded SmolLM2)")
    return p.parse_args(argv)


def fault_names(a: argparse.Namespace) -> list[str]:
    """The faults asked for that this engine can run (oom_fraction is SGLang's)."""
    return [n for n in a.faults if n != "oom_fraction" or a.engine == "sglang"]


def settings_for(a: argparse.Namespace) -> Settings:
    if a.engine == "sglang" and a.device != "cuda":
        raise ValueError("--engine sglang runs on a GPU: give --device cuda, or --engine colocated for the CPU")
    cpu = a.device == "cpu"
    budget = a.budget_s if a.budget_s is not None else (3600.0 if cpu else 420.0)
    return Settings(
        out=a.out.resolve(),
        engine=a.engine,
        device=a.device,
        fault_step=a.fault_step if a.fault_step is not None else (3 if cpu else 50),
        wait_timeout_s=a.wait_timeout_s,
        regen_target=a.regen_target,
        parallel=a.parallel if a.parallel is not None else (1 if cpu else len(fault_names(a)) + 1),
        deadline=time.monotonic() + budget,
    )


def main(argv: Sequence[str] | None = None) -> list[FaultResult]:
    a = parse_args(argv)
    s, names = settings_for(a), fault_names(a)
    if len(names) < len(a.faults):
        print("oom_fraction: needs --engine sglang, not run", flush=True)
    gpu = {"start": gpu_used_mib()}
    results = run_faults(s, names)
    time.sleep(0 if gpu["start"] is None else 10)  # the last processes' memory goes back to the driver
    gpu["end"] = gpu_used_mib()
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items() if k != "deadline"} | {"overrides": s.overrides}
    write_results(s.out, settings, results, gpu)
    print(table(results))
    print(f"GPU memory used (MiB): {gpu}; results: {s.out / 'faults.json'}, {s.out / 'faults.md'}")
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from a checkout: trainer.checkpoint for the checkpoints' steps
    main()
