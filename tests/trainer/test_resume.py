"""Runs that survive: exact resume, atomic saves, signals, non-finite losses, refused resumes."""

import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch

from tests.fixtures.tiny import ROOT, TINY, child_env, tiny_config
from trainer import checkpoint as ckpt
from trainer import components, loop, phases
from trainer.build import check_resume
from trainer.loop import Trainer, run

pytestmark = pytest.mark.slow
STEPS = ["trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.keep_last=5"]


@pytest.fixture
def build():
    """``Trainer(cfg, run_dir)``, closed when the test ends (DeepSpeed's hooks keep an unclosed one in memory)."""
    made = []

    def make(cfg, run_dir) -> Trainer:
        made.append(Trainer(cfg, run_dir))
        return made[-1]

    yield make
    for trainer in made:
        trainer.close()


def test_a_closed_trainer_is_freed(tmp_path):
    """DeepSpeed's gradient hooks live in autograd, outside the garbage collector: an unclosed
    trainer (target, draft, optimizer: ~750 MB at the tiny config) stays until the process ends."""
    trainer = Trainer(tiny_config(), tmp_path)
    freed = weakref.ref(trainer)
    trainer.close()
    del trainer
    gc.collect()
    assert freed() is None


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.ds_model.module.draft.state_dict().items()}


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, and its final draft weights: the reference run
    the resume tests copy from instead of each training its own."""
    run_dir = tmp_path_factory.mktemp("straight")
    trainer = Trainer(tiny_config(*STEPS), run_dir)
    trainer.fit()
    weights = _weights(trainer)
    trainer.close()
    return run_dir, weights


def _copy_checkpoint(run_dir, step, to):
    (to / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / f"step_{step}", to / "checkpoints" / f"step_{step}")


def test_resume_continues_bitwise(build, straight, tmp_path):
    """4 steps straight == 2 steps, resume from the step-2 checkpoint, 2 more (fp32, CPU)."""
    a, weights = straight
    state = torch.load(a / "checkpoints" / "step_2" / ckpt.STATE_TAG / "mp_rank_00_model_states.pt", weights_only=False)
    assert not [k for k in state["module"] if "embed_tokens" in k]  # the target's frozen embedding is rebuilt, not saved
    _copy_checkpoint(a, 2, tmp_path)
    resumed = build(tiny_config(*STEPS, "trainer.resume=auto"), tmp_path)
    assert resumed.state.step == 2 and resumed.state.pos.epoch == 0 and resumed.state.pos.micro == 2
    summary = resumed.fit()
    assert summary["resumed_from"].endswith("step_2") and summary["steps"] == 4
    b = _weights(resumed)
    assert all(torch.equal(weights[k], b[k]) for k in weights), "resumed weights differ from the straight run"
    assert _losses(a)[3] == _losses(tmp_path)[3]
    assert _losses(a)[4] == _losses(tmp_path)[4]


def test_the_time_budget_counts_over_a_resume_and_drives_the_decay(build, tmp_path):
    """trainer.max_time_s counts the seconds trained before a resume: a run resumed past half its budget
    stops after one step, and the wsd schedule's LR is at its floor from the resumed clock on. The resumed
    draft is evaluated before its clock runs again, as a fresh run's untrained draft is (that eval's first
    batches hold the warm-up a first step would otherwise count), and it is the draft the first run ended with."""
    wsd = ["schedule=wsd", "schedule.decay_ratio=1.0", "schedule.min_lr_ratio=0.1"]
    first = build(tiny_config("trainer.max_steps=2", *wsd), tmp_path)
    ended = first.fit()
    spent = ckpt.read_meta(tmp_path / "checkpoints" / "step_2")["position"]["train_s"]
    assert spent > 0 and spent == pytest.approx(first.state.train_s)
    again = ["trainer.max_steps=50", "trainer.resume=auto", "trainer.resume_allow=[schedule]", f"trainer.max_time_s={spent / 2}"]
    resumed = build(tiny_config(*again, *wsd), tmp_path)
    assert resumed.state.train_s == spent and resumed.built.clock.time_frac == pytest.approx(2.0)
    summary = resumed.fit()
    assert summary["steps"] == 3 and summary["stopped_by"] == "trainer.max_time_s"
    assert summary["start_eval_sim_accept_len"] == ended["eval_sim_accept_len"]
    lr = {r["step"]: r["train/lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "train/lr" in r}
    assert lr[3] == pytest.approx(resumed.cfg.schedule.lr * 0.1)  # by steps alone (3 of 50) it would be 0.94 x lr


def test_a_resume_keeps_the_schedule_clocks_start(build, tmp_path):
    """The LR schedule's time axis starts at the end of the run's first step; a resume goes on from that start
    instead of its own first step, so the LR does not step back."""
    capped = ["trainer.max_time_s=100000", "schedule=wsd"]
    first = build(tiny_config("trainer.max_steps=2", *capped), tmp_path)
    first.fit()
    position = ckpt.read_meta(tmp_path / "checkpoints" / "step_2")["position"]
    assert 0 < position["schedule_start_s"] < position["train_s"]
    assert position["schedule_start_s"] == first.built.clock.start_s
    resumed = build(tiny_config("trainer.max_steps=3", "trainer.resume=auto", "trainer.resume_allow=[schedule]", *capped), tmp_path)
    assert resumed.built.clock.start_s == position["schedule_start_s"]


def test_a_checkpoint_at_a_time_mark_is_kept_and_a_shorter_budgets_decay_resumes_from_it(build, tmp_path):
    """trainer.checkpoint_at_s saves when the run's clock passes a mark and that checkpoint is never pruned; a run
    resumed from it with a shorter trainer.max_time_s decays over that budget (a wsd decay branch)."""
    marked = ["trainer.max_time_s=100000", "schedule=wsd", "trainer.checkpoint_at_s=[1e-9]", "trainer.checkpoint_every=1"]
    trunk = build(tiny_config("trainer.max_steps=3", "trainer.keep_last=1", *marked), tmp_path / "trunk")
    trunk.fit()
    root = tmp_path / "trunk" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]  # step_1 pruned; step_2 passed the mark first
    assert ckpt.read_meta(root / "step_2")["kept"] and not ckpt.read_meta(root / "step_3")["kept"]
    meta = ckpt.read_meta(root / "step_2")
    (root / "step_2" / ckpt.META_FILE).write_text(json.dumps(meta | {"wandb_id": "trunk-run"}))
    spent = meta["position"]["train_s"]
    branch = ["trainer.max_steps=3", f"trainer.resume={root / 'step_2'}", f"trainer.max_time_s={spent * 2}", "schedule=wsd"]
    resumed = build(tiny_config(*branch), tmp_path / "branch")
    assert resumed.state.step == 2 and resumed.built.clock.time_frac == pytest.approx(0.5)
    assert resumed.checkpointer.wandb_id is None  # a branch is a wandb run of its own; the trunk's own resume continues it
    assert build(tiny_config(*branch), tmp_path / "trunk").checkpointer.wandb_id == "trunk-run"


def test_resume_refuses_a_different_run_and_allows_a_deliberate_change(build, straight, tmp_path):
    _copy_checkpoint(straight[0], 2, tmp_path)
    # a draft vocab of another size (a recipe left off on resume) is refused before any tensor is built
    with pytest.raises(
        ValueError,
        match=(
            r"differs from this run:\n  draft.draft_vocab_size: 1024 in the checkpoint, 512 now\n"
            r"  vocab_map: '\w+' in the checkpoint, '\w+' now\n\("
        ),
    ):
        build(tiny_config(*STEPS, "trainer.resume=auto", "draft.draft_vocab_size=512"), tmp_path)
    with pytest.raises(ValueError, match=r"differs from this run:\n  draft.ttt_steps: 3 in the checkpoint, 2 now\n\("):
        build(tiny_config(*STEPS, "trainer.resume=auto", "draft.ttt_steps=2"), tmp_path)
    with pytest.raises(ValueError, match=r"data.max_conversations: 48 in the checkpoint, 40 now"):
        build(tiny_config(*STEPS, "trainer.resume=auto", "data.max_conversations=40"), tmp_path)
    with pytest.raises(ValueError, match=r"schedule.name: 'cosine' in the checkpoint, 'constant' now"):
        build(tiny_config(*STEPS, "trainer.resume=auto", "schedule=constant"), tmp_path)
    # switching a cosine run to grokking mode on purpose (the seed team's plan)
    grok = build(
        tiny_config("trainer.max_steps=3", "trainer.resume=auto", "schedule=constant", "trainer.resume_allow=[schedule]"), tmp_path
    )
    assert grok.state.step == 2 and grok.cfg.schedule.name == "constant"
    with pytest.raises(ValueError, match="trainer.resume: .*nowhere does not exist"):
        build(tiny_config(f"trainer.resume={tmp_path / 'nowhere'}"), tmp_path / "other")


def test_fingerprint_differences_name_only_the_keys_that_differ():
    saved = {"draft": {"draft_vocab_size": 2048, "hidden_size": 576}, "data": {"max_len": 128}, "vocab_map": "a"}
    now = {"draft": {"draft_vocab_size": 4096, "hidden_size": 576}, "data": {"max_len": 256}, "vocab_map": "b", "target": {"dtype": "bf16"}}
    assert ckpt.differences(saved, now, []) == [
        "data.max_len: 128 in the checkpoint, 256 now",
        "draft.draft_vocab_size: 2048 in the checkpoint, 4096 now",
        "target.dtype: absent in the checkpoint, 'bf16' now",
        "vocab_map: 'a' in the checkpoint, 'b' now",
    ]
    assert ckpt.differences(saved, now, ["data", "vocab_map"]) == [
        "draft.draft_vocab_size: 2048 in the checkpoint, 4096 now",
        "target.dtype: absent in the checkpoint, 'bf16' now",
    ]


def test_a_checkpoint_with_a_key_of_another_name_is_refused_naming_both(tmp_path):
    # a checkpoint written when the draft vocab's fingerprint key was draft.vocab_size
    saved = {"draft": {"vocab_size": 1024, "ttt_steps": 3}, "vocab_map": "a"}
    path = tmp_path / "step_1"
    (path / ckpt.STATE_TAG).mkdir(parents=True)
    (path / ckpt.META_FILE).write_text(json.dumps({"fingerprint": saved}))
    now = {"draft": {"draft_vocab_size": 1024, "ttt_steps": 3}, "vocab_map": "a"}
    with pytest.raises(ValueError) as err:
        check_resume(tiny_config(), path, now)
    assert str(err.value).splitlines()[1:3] == [
        "  draft.draft_vocab_size: absent in the checkpoint, 1024 now",
        "  draft.vocab_size: 1024 in the checkpoint, absent now",
    ]


def test_a_draft_vocab_above_the_targets_is_refused(build, tmp_path):
    with pytest.raises(ValueError, match=r"config draft.draft_vocab_size: 60000 is above the target's vocabulary of 49152 tokens"):
        build(tiny_config("draft.draft_vocab_size=60000"), tmp_path)


def _wandb_ids(run_dir) -> list[str]:
    return sorted(p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*"))


def test_a_resume_after_a_kill_continues_the_history(build, straight, tmp_path):
    """A process killed after step 4 was logged but before it was saved: the resume from step 2
    continues the same wandb run, and metrics.jsonl holds every step once."""
    shutil.copytree(straight[0], tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "checkpoints" / "step_4")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "train/lo')  # torn by the kill
    build(tiny_config(*STEPS, "trainer.resume=auto"), tmp_path).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4] and rows[0]["step"] == 0
    ids = _wandb_ids(tmp_path)
    assert len(ids) == 2 and ids[0] == ids[1], ids
    assert ckpt.read_meta(tmp_path / "checkpoints" / "step_4")["wandb_id"] == ids[0]


def test_non_finite_loss_is_skipped_or_stops(build, tmp_path):
    trainer = build(tiny_config("trainer.max_steps=3", "trainer.on_nan=skip"), tmp_path / "skip")
    real, calls = trainer.target.engine.features, []

    def poisoned(tokens):
        fb = real(tokens)
        calls.append(1)
        if len(calls) == 3:  # the second training batch (the first call is the held-out eval)
            fb.aux[:] = float("nan")
        return fb

    trainer.target.engine.features = poisoned
    summary = trainer.fit()
    assert summary["nonfinite_skipped"] == 1 and summary["steps"] == 3
    assert all(torch.isfinite(v).all() for v in _weights(trainer).values())

    calls.clear()
    stopper = build(tiny_config("trainer.max_steps=3"), tmp_path / "stop")
    real = stopper.target.engine.features
    stopper.target.engine.features = poisoned
    with pytest.raises(RuntimeError, match="non-finite loss at step 2"):
        stopper.fit()


def test_failed_save_keeps_the_previous_checkpoint(build, tmp_path, monkeypatch):
    trainer = build(tiny_config(*STEPS), tmp_path)
    calls = []

    def full_disk(self, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, path)

    real_save = ckpt.VocabMap.save
    monkeypatch.setattr(ckpt.VocabMap, "save", full_disk)
    with pytest.raises(RuntimeError, match=r"checkpoint save to .*step_4 failed .*No space left.*previous checkpoint is kept"):
        trainer.fit()
    assert ckpt.latest(tmp_path / "checkpoints").name == "step_2"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def _launch(run_dir, *overrides, env_extra=None, code=None):
    args = [f"hydra.run.dir={run_dir}", *TINY, *overrides]
    env = child_env(**(env_extra or {}))
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "trainer", *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path, proc, timeout=300):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_sigterm_saves_and_says_how_to_resume(tmp_path):
    proc = _launch(tmp_path, "trainer.max_steps=50")
    _wait_for(tmp_path / "metrics.jsonl", proc)
    while len((tmp_path / "metrics.jsonl").read_text().splitlines()) < 2:  # the first training step logged
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM during the training" in out and "trainer.resume=auto" in out, out[-2000:]
    assert f"trainer.resume=auto hydra.run.dir={tmp_path}" in (tmp_path / "__main__.log").read_text()  # the log has it too
    saved = ckpt.latest(tmp_path / "checkpoints")
    assert saved is not None and 1 <= ckpt.read_meta(saved)["position"]["step"] < 50


HANG_BEFORE_RENAME = """
import os, sys, time
from pathlib import Path
import trainer.checkpoint as ckpt
real = os.replace
def hang(src, dst):
    if Path(dst).name == "step_2":
        Path(src).parent.joinpath("SAVING").touch()
        time.sleep(600)
    return real(src, dst)
ckpt.os.replace = hang
from trainer.__main__ import main
sys.argv = ["trainer", *sys.argv[1:]]
main()
"""


def test_crash_during_save_leaves_the_previous_checkpoint_whole(build, tmp_path):
    proc = _launch(tmp_path, "trainer.max_steps=4", "trainer.checkpoint_every=1", code=HANG_BEFORE_RENAME)
    _wait_for(tmp_path / "checkpoints" / "SAVING", proc)
    proc.kill()  # SIGKILL while step 2's checkpoint is written but not yet renamed
    proc.wait()
    assert ckpt.latest(tmp_path / "checkpoints").name == "step_1"
    assert (tmp_path / "checkpoints" / ".tmp-step_2").exists()  # the half save is there, and ignored
    resumed = build(tiny_config("trainer.max_steps=4", "trainer.checkpoint_every=1", "trainer.resume=auto"), tmp_path)
    assert resumed.state.step == 1


def test_engine_death_stops_the_run_with_the_cause_and_keeps_the_checkpoint(build, tmp_path):
    import threading

    from trainer.stream.engine_process import EngineError

    trainer = build(tiny_config("trainer.max_steps=40", "trainer.checkpoint_every=1", "engine.mode=colocated"), tmp_path)

    def kill_engine_after_first_checkpoint():
        while ckpt.latest(tmp_path / "checkpoints") is None:
            time.sleep(0.05)
        os.kill(trainer.target_source._process.pid, signal.SIGKILL)

    threading.Thread(target=kill_engine_after_first_checkpoint, daemon=True).start()
    with pytest.raises(EngineError, match="signal 9"):
        trainer.fit()
    kept = ckpt.latest(tmp_path / "checkpoints")
    assert kept is not None and ckpt.read_meta(kept)["position"]["step"] >= 1


def test_a_signal_in_the_end_of_run_serving_eval_stops_at_once_and_resume_finishes(tmp_path, monkeypatch, capsys):
    real = components.export_verify_eval

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the export / decode runs
        return real(*args, **kwargs)

    monkeypatch.setattr(components, "export_verify_eval", interrupted)
    with pytest.raises(SystemExit) as stopped:
        run(tiny_config("trainer.max_steps=2"), tmp_path)
    assert stopped.value.code == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "stopped by SIGINT during the end-of-run export, verify and serving eval: skipped the rest of the " in err
    assert "; summary and report." in err and "Checkpoint step 2 kept" in err and "trainer.resume=auto" in err, err
    assert "held-out eval: " in err and "then decode 2 held-out prompts speculatively" in err  # what the wait was
    assert not (tmp_path / "summary.json").exists() and ckpt.latest(tmp_path / "checkpoints").name == "step_2"
    monkeypatch.setattr(components, "export_verify_eval", real)
    summary = run(tiny_config("trainer.max_steps=2", "trainer.resume=auto"), tmp_path)
    assert summary["steps"] == 2 and (tmp_path / "summary.json").exists() and summary["eval"]["eval/accept_len"] >= 1


def test_a_signal_at_start_up_stops_with_nothing_to_keep(tmp_path, monkeypatch, capsys):
    real = loop.init_parallel

    def interrupted(device):
        os.kill(os.getpid(), signal.SIGTERM)  # while DeepSpeed may be building its CPU op
        return real(device)

    monkeypatch.setattr(loop, "init_parallel", interrupted)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a signal run() does not catch is lost, not fatal here
    try:
        with pytest.raises(SystemExit) as stopped:
            run(tiny_config("trainer.max_steps=1"), tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped by SIGTERM during the start-up: skipped the rest of the start-up; start-of-run held-out eval; training;" in err
    assert "No checkpoint yet: run the same command again" in err and not (tmp_path / "checkpoints").exists()


def test_a_signal_in_a_serving_eval_between_steps_stops_at_once(tmp_path, monkeypatch):
    trainer = Trainer(tiny_config("trainer.max_steps=3", "trainer.export_every=1", "trainer.checkpoint_every=2"), tmp_path)

    def interrupted(*args, **kwargs):
        if trainer.state.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the second step's serving eval
        return real(*args, **kwargs)

    real = components.export_verify_eval
    monkeypatch.setattr(components, "export_verify_eval", interrupted)
    trainer.signals.install()
    try:
        with pytest.raises(phases.Stop):
            trainer.fit()
    finally:
        trainer.signals.restore()
    assert trainer.state.step == 2 and trainer.signals.phase == phases.PERIODIC_EVAL
    message = trainer.signals.message(trainer.ckpt_root, tmp_path)
    assert message.startswith(f"stopped by SIGINT during the {phases.PERIODIC_EVAL}: skipped the rest of the {phases.PERIODIC_EVAL}; ")
    assert "the rest of the training; end-of-run held-out eval" in message and "Checkpoint step 2 kept" in message


def test_the_draft_mlp_width_is_the_configured_one(tmp_path):
    trainer = Trainer(tiny_config("draft.intermediate_size=96"), tmp_path)
    try:
        gates = [m.gate_proj for m in trainer.ds_model.module.draft.modules() if hasattr(m, "gate_proj")]
        assert [g.out_features for g in gates] == [96]  # one decoder layer; the target's MLP is 1536 wide
    finally:
        trainer.close()


def test_stop_signals_time_each_phase_across_switches(monkeypatch):
    clock = iter([2.0, 5.0, 6.0, 10.0, 11.5])
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(clock))
    signals = phases.StopSignals(since=0.0)  # start-up from t=0
    signals.enter(phases.TRAINING)  # t=2
    signals.switch(phases.PERIODIC_EVAL)  # t=5
    signals.switch(phases.TRAINING)  # t=6
    signals.enter(phases.END_EVAL)  # t=10
    assert signals.phase_seconds() == {  # t=11.5
        phases.STARTUP: 2.0,
        phases.TRAINING: 7.0,
        phases.PERIODIC_EVAL: 1.0,
        phases.END_EVAL: 1.5,
    }
