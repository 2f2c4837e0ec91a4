"""Faults on purpose, on the CPU: the co-located engine process (the CPU stand-in for SGLang's)
killed, stopped or handing over NaN features; the trainer killed; generation killed mid-line; and
the table of lab/faults.py. docs/RELIABILITY.md records what each shows the user."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from transformers import AutoConfig

import lab.faults as F
from lab.fault_targets import NaNFeatures
from models.embedded import embedded_target_dir
from models.memory_plan import GIB, draft_counts, draft_trainer_bytes
from tests.fixtures.tiny import ROOT, tiny_config
from tests.fixtures.tiny_generator import save_tiny_generator
from tests.fixtures.toy_target import ToyTarget, make_batches
from tests.trainer.test_config import _compose
from trainer import build, components, engine_memory
from trainer import regenerate as R
from trainer.config import EngineConfig
from trainer.datagen.record_ids import done_ids
from trainer.loop import Trainer, run
from trainer.stream import feature_stream
from trainer.stream.engine_process import EngineError, EngineProcess
from trainer.stream.feature_stream import TargetSource, open_feature_stream

RUN = ["engine.mode=colocated", "trainer.max_steps=6", "trainer.serve_eval=false"]


@dataclass
class Settings:
    """The engine config fields a stream reads, with a short wait."""

    mode: str = "colocated"
    slots: int = 2
    slot_tokens: int = 64
    start_timeout_s: float = 120.0
    wait_timeout_s: float = 5.0


def wait_state(pid: int, states: str, timeout_s: float = 30.0) -> None:
    """Until ``pid`` is in one of the kernel states ``states`` (Z: dead, not yet reaped; T: stopped)."""
    deadline = time.monotonic() + timeout_s
    while F.proc_state(pid) not in tuple(states):
        assert time.monotonic() < deadline, f"process {pid} is {F.proc_state(pid)}, not {states}"
        time.sleep(0.05)


def test_the_wait_timeout_is_a_checked_config_key():
    assert tiny_config().engine.wait_timeout_s == 600.0 and tiny_config("engine.wait_timeout_s=30").engine.wait_timeout_s == 30.0
    with pytest.raises(ValueError, match="config engine.wait_timeout_s: must be positive"):
        EngineConfig(wait_timeout_s=0)


def test_a_stopped_engine_is_killed_at_the_wait_timeout_naming_the_process_and_the_wait():
    with TargetSource(ToyTarget()) as source:
        with open_feature_stream(Settings(), source, make_batches(50), "cpu") as stream:
            next(stream)
            pid = source.process.pid
            os.kill(pid, signal.SIGSTOP)
            wait_state(pid, "T")
            with pytest.raises(EngineError) as err:
                for _ in stream:  # the batches the engine made before it stopped, then the wait
                    pass
        message = str(err.value)
        assert message.startswith(
            f"the engine process {pid} (ToyTarget on cpu) gave no answer within 5 s (engine.wait_timeout_s) "
            "while the trainer waited for the features of batch "
        )
        assert message.endswith("; the kernel said it was stopped by a signal (SIGSTOP, SIGTSTP); the trainer killed it")
        assert not F.alive(pid) and not source.process.alive


def test_a_killed_engine_names_itself_and_what_the_trainer_waited_for():
    with TargetSource(ToyTarget()) as source:
        with open_feature_stream(Settings(wait_timeout_s=120.0), source, make_batches(50), "cpu") as stream:
            next(stream)
            pid = source.process.pid
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineError) as err:
                for _ in stream:
                    pass
    assert str(err.value).startswith(
        f"the engine process {pid} (ToyTarget on cpu) was killed by signal 9 (SIGKILL) without reporting an error "
        "(killed? out of memory?); the trainer needed it for the features of batch "
    )


# --------------------------------------------------------------------------- a whole run (slow)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> dict[int, float]:
    """The losses of the run the faulted ones must match from their checkpoint on."""
    run_dir = tmp_path_factory.mktemp("unbroken")
    assert run(tiny_config(*RUN), run_dir)["steps"] == 6
    return F.logged_losses(run_dir)


@pytest.fixture
def engines(monkeypatch) -> list[EngineProcess]:
    """Every engine process the streams start, in order."""
    made = []

    class Recorded(EngineProcess):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(feature_stream, "EngineProcess", Recorded)
    return made


def at_step(monkeypatch, step: int, fault) -> None:
    """Call ``fault()`` once, when the run has finished step ``step`` (after its components)."""
    real, done = components.Counters.after_step, []

    def after_step(self, at):
        real(self, at)
        if self.step == step and not done:
            done.append(fault())

    monkeypatch.setattr(components.Counters, "after_step", after_step)


def signal_engine(engines: list, sig: signal.Signals, state: str):
    def fault():
        os.kill(engines[-1].pid, sig)
        wait_state(engines[-1].pid, state)

    return fault


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_an_engine_killed_or_stopped_mid_run_stops_it_keeps_every_step_and_the_resume_trains_as_an_unbroken_run(
    sig, unbroken, engines, monkeypatch, capsys, tmp_path
):
    """SIGKILL: noticed at the trainer's next wait. SIGSTOP: the batches made before it are trained, then the
    wait times out (engine.wait_timeout_s: 60 s while the engine runs, as a shared CPU's slowest batch takes ~15 s;
    once the kernel reports it stopped no answer can come, so the test shortens the wait to 2 s). Either way the
    steps trained are saved, exit code 1 with the cause and the resume command, no engine left."""
    wait = ["engine.wait_timeout_s=60"] if sig == signal.SIGSTOP else []
    fault = signal_engine(engines, sig, "Z" if sig == signal.SIGKILL else "T")

    def stop_then_shorten_the_wait():
        fault()
        engines[-1].wait_timeout_s = 2.0

    at_step(monkeypatch, 2, fault if sig == signal.SIGKILL else stop_then_shorten_the_wait)
    with pytest.raises(SystemExit) as stopped:
        run(tiny_config(*RUN, *wait), tmp_path)
    pid, err = engines[-1].pid, capsys.readouterr().err
    assert stopped.value.code == 1
    if sig == signal.SIGKILL:
        assert f"the engine process {pid} (PathTarget on cpu) was killed by signal 9 (SIGKILL) without reporting an error" in err
    else:
        assert f"the engine process {pid} (PathTarget on cpu) gave no answer within 2 s (engine.wait_timeout_s)" in err
        assert "the kernel said it was stopped by a signal (SIGSTOP, SIGTSTP); the trainer killed it" in err
    assert "stopped by the engine failure during the training: skipped the rest of the training; end-of-run held-out eval" in err
    trained = max(F.logged_losses(tmp_path))
    assert trained >= 2 and f"Checkpoint step {trained} kept" in err and F.kept_step(tmp_path) == trained  # nothing lost
    assert f"plus: trainer.resume=auto hydra.run.dir={tmp_path}" in err
    assert not F.alive(pid) and not [n for n in os.listdir("/dev/shm") if n.startswith((f"torch_{pid}_", f"torch_{os.getpid()}_"))]
    assert run(tiny_config(*RUN, *wait, "trainer.resume=auto"), tmp_path)["steps"] == 6
    resumed = F.logged_losses(tmp_path)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert {s: resumed[s] for s in range(trained + 1, 7)} == {s: unbroken[s] for s in range(trained + 1, 7)}  # bitwise, fp32 CPU


@pytest.mark.slow
def test_nan_features_from_the_engine_process_are_skipped_and_counted(monkeypatch, tmp_path):
    """Engine batch 0 is the held-out eval's; batch 2, the second training batch, comes with NaN aux features."""
    target_factory = build.target_factory
    monkeypatch.setattr(build, "target_factory", lambda *args: NaNFeatures(target_factory(*args), batch=2))
    trainer = Trainer(tiny_config(*RUN, "trainer.max_steps=3", "trainer.on_nan=skip"), tmp_path)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary["nonfinite_skipped"] == 1 and summary["steps"] == 3


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_process_shared_memory_or_gpu_memory(tmp_path):
    args = F.parse_args(["--out", str(tmp_path), "--engine", "colocated", "--device", "cpu", "--fault-step", "1"])
    result = F.trainer_kill(F.settings_for(args))
    started = result.details["processes"]
    assert result.ok and result.exit_code == -signal.SIGKILL, result
    assert any("spawn_main" in p for p in started)  # the engine process was among them
    assert result.left["processes"] == [] and result.left["shm"] == [] and not result.left["gpu"]


def test_leftovers_waits_for_an_ended_process_to_leave_the_gpu_list(monkeypatch):
    """nvidia-smi can list a process that has ended while the driver frees its memory: that is not a leftover
    while it goes within the grace, and is one when it stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    calls = []

    def apps():  # the ended process listed for its first three looks
        calls.append(1)
        return {dead.pid: 14106} if len(calls) <= 3 else {}

    monkeypatch.setattr(F, "gpu_apps", apps)
    assert F.leftovers([dead.pid], grace_s=30.0)["gpu"] == []
    monkeypatch.setattr(F, "gpu_apps", lambda: {dead.pid: 14106})
    assert F.leftovers([dead.pid], grace_s=0.5)["gpu"] == [f"{dead.pid}: 14106 MiB"]


@pytest.fixture(scope="module")
def generator_dir(tmp_path_factory):
    return save_tiny_generator(tmp_path_factory.mktemp("generator"))


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True])
def test_regenerate_killed_mid_line_resumes_with_every_conversation_once(sampled, generator_dir, tmp_path):
    """The faults script kills it with half a line on disk and runs it again; greedy, the file then equals an
    unbroken run's."""
    args = F.parse_args(["--out", str(tmp_path), "--engine", "colocated", "--device", "cpu", "--regen-target", str(generator_dir)])
    result = F.regen_kill(F.settings_for(args), sampled=sampled)
    before, after, report = result.details["before"], result.details["after"], result.details["report"]
    assert result.ok and result.exit_code == -signal.SIGKILL, result
    assert before["torn"] and 1 <= before["lines"] <= 4  # two chunks of two (less what the tiny target left empty), half a line
    assert not after["torn"] and after["bad_lines"] == after["duplicates"] == 0 and report["skipped_done"] == before["lines"]
    if not sampled:
        straight = tmp_path / "straight.jsonl"
        R.main(F.settings_for(args).regenerate_args(straight, sampled=False))
        answers = tmp_path / "regen_kill" / "answers.jsonl"
        assert sorted(answers.read_text().splitlines()) == sorted(straight.read_text().splitlines())


def test_the_answers_check_sees_a_torn_end_and_a_restart_cuts_it(tmp_path):
    out = tmp_path / "a.jsonl"
    out.write_text('{"id": "a", "messages": []}\n{"id": "b", "mess')
    assert F.answers_check(out) == {"lines": 1, "torn": True, "bad_lines": 0, "duplicates": 0}
    done_ids(out)
    assert F.answers_check(out) == {"lines": 1, "torn": False, "bad_lines": 0, "duplicates": 0}


# --------------------------------------------------------------------------- the script's analysis


def test_resume_comparison_and_table():
    base = {1: 2.0, 2: 1.5, 3: 1.25, 4: 1.0}
    assert F.compare(base, dict(base), after=2, exact=True)["equal"]
    assert not F.compare(base, base | {4: 1.0 + 1e-9}, after=2, exact=True)["equal"]
    gpu = F.compare(base, base | {3: 1.25 * (1 + 5e-4), 4: 1.0 * (1 + 1e-2)}, after=2, exact=False)
    assert gpu["equal"] and gpu["steps"] == 2 and gpu["first_rel_diff"] == pytest.approx(5e-4)
    assert not F.compare(base, base | {3: 1.25 * (1 + 2e-3)}, after=2, exact=False)["equal"]  # the first step: 1e-3
    assert F.compare(base, base, after=4, exact=True) == {"from_step": 4, "steps": 0, "equal": False}
    assert F.resume_verdict({"from_step": 4, "steps": 0, "equal": False, "exit_code": 0}) == "no step after 4 to compare"
    assert F.resume_verdict({"from_step": 4, "steps": 0, "equal": False, "exit_code": None}) == "cut by --budget-s before a step after 4"
    rows = [
        F.FaultResult(
            "engine_kill",
            "SIGKILL",
            True,
            1,
            ["the engine process 7 (PathTarget on cpu) was killed | x", "stopped by the engine failure"],
            1.23,
            "nothing: checkpoint step 4 is the last step trained",
            F.resume_verdict(F.compare(base, base, after=2, exact=True) | {"exit_code": 0}),
            left={"processes": [], "shm": [], "gpu": None},
        ),
        F.FaultResult("nan", "NaN", False, 0, [], None, "1 batch skipped", left={"processes": ["9: python"], "shm": [], "gpu": []}),
    ]
    lines = F.table(rows).splitlines()
    assert lines[0].startswith("| fault | ok | what the user saw") and len(lines) == 4
    assert lines[2] == (
        "| engine_kill | yes | the engine process 7 (PathTarget on cpu) was killed \\| x | 1.2 | nothing: checkpoint step 4 is "
        "the last step trained | equal over steps 3+ (2 steps; max rel diff 0.0e+00; exact) | nothing (no nvidia-smi) |"
    )
    assert lines[3] == "| nan | NO | (nothing) |  | 1 batch skipped |  | processes: 9: python |"


def test_a_leg_finds_the_message_after_the_fault_and_not_the_engines_start_line(tmp_path):
    printed = [
        "the engine process 5 (PathTarget on cpu): target built in 1.0 s; ring of 3 x 512 tokens",
        "train:  50%|#####     | 3/6 [00:03<00:03,  1.00s/step]",
        "[rank0]: Traceback (most recent call last):",
        "the engine process 5 (PathTarget on cpu) was killed by signal 9 (SIGKILL) without reporting an error",
        "train:  67%|######6   | 4/6 [00:04<00:02,  1.00s/step]",
        "stopped by the engine failure during the training",
    ]
    leg = F.Leg([sys.executable, "-c", f"print({chr(10).join(printed)!r})"], tmp_path / "leg.log")
    assert leg.finish(time.monotonic() + 300) == 0
    message, at = leg.said(leg.started)
    assert message == [printed[3], printed[5]] and at >= leg.started
    assert leg.said(leg.started, F.CRASH_MARKS)[0][0] == "Traceback (most recent call last):"  # torch's rank prefix off
    assert leg.said(time.monotonic() + 60) == ([], None)
    assert (tmp_path / "leg.log").read_text().splitlines() == printed


def test_oom_fraction_runs_first_and_alone_then_the_baseline_and_the_rest(tmp_path, monkeypatch):
    events = []

    def fake(name):
        def run(s, base=None):
            events.append(f"{name} start")
            time.sleep(0.05)
            events.append(f"{name} end")
            return F.FaultResult(name, "", True)

        return run

    monkeypatch.setattr(F, "FAULT_RUNS", {n: fake(n) for n in F.FAULTS})
    monkeypatch.setattr(F, "baseline", fake("baseline"))
    args = F.parse_args(["--out", str(tmp_path), "--parallel", "3"])
    results = F.run_faults(F.settings_for(args), F.fault_names(args))
    assert [r.fault for r in results] == ["baseline", *(n for n in F.FAULTS if n != "oom_fraction"), "oom_fraction"]
    assert events[:3] == ["oom_fraction start", "oom_fraction end", "baseline start"]


def test_the_script_refuses_sglang_on_the_cpu_and_skips_what_the_engine_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="--engine sglang runs on a GPU"):
        F.settings_for(F.parse_args(["--out", str(tmp_path), "--device", "cpu"]))
    cpu = F.parse_args(["--out", str(tmp_path), "--engine", "colocated", "--device", "cpu"])
    assert "oom_fraction" not in F.fault_names(cpu) and F.settings_for(cpu).parallel == 1
    gpu = F.settings_for(F.parse_args(["--out", str(tmp_path)]))
    assert "engine=sglang" in gpu.overrides and "trainer.device=cuda" in gpu.overrides and gpu.fault_step == 50


def test_the_script_runs_from_a_checkout(tmp_path):
    """``python3 lab/faults.py`` (no install, no PYTHONPATH): its help, and one quick fault end to end."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "lab/faults.py", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "--engine" in done.stdout
    args = ["--out", str(tmp_path), "--engine", "colocated", "--device", "cpu", "--faults", "oom_pool"]
    done = subprocess.run([sys.executable, "lab/faults.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "faults.json").read_text())["results"]
    assert [r["fault"] for r in result] == ["oom_pool"] and result[0]["ok"], result
    assert result[0]["message"][0].startswith("error: config engine.slot_tokens: a ring slot of 256 tokens is smaller than a batch")
    assert (tmp_path / "faults.md").read_text().startswith("| fault | ok |")


def test_the_fault_scripts_oom_fraction_is_refused_on_an_h200():
    """lab/faults.py's oom_fraction on its GPU runs: 1 % of an H200 beside its batch is surely too little (at the
    default 1,024-token batch it was not, and the H200 run went on into training instead of being refused)."""
    cfg = _compose(*F.SGLANG_RUN, *F.GPU_RUN, *F.EVERY_RUN, *F.OOM_FRACTION)
    d = draft_counts(AutoConfig.from_pretrained(embedded_target_dir()), 3, cfg.draft.draft_vocab_size, cfg.draft.intermediate_size)
    need = draft_trainer_bytes(d, cfg.data.max_tokens)
    assert cfg.engine.sglang.max_total_tokens is None
    with pytest.raises(ValueError, match="set engine.sglang.mem_fraction_static=0.9[0-9] or less"):
        engine_memory.check_trainer_room(cfg.engine.sglang.mem_fraction_static, 139 * GIB, need, cfg.data.max_tokens, 0)
