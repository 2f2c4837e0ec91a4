"""End to end on the real embedded target: a step-capped run in process, and two ranks."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.target import HFTargetEngine
from serving.export import load_export
from serving.verify import verify_export
from tests.fixtures.tiny import ROOT, TINY, child_env, tiny_config
from trainer.loop import run
from trainer.phases import PHASES, STARTUP, TRAINING


@pytest.mark.slow
def test_grok_recipe_runs_with_a_step_cap_and_exports(tmp_path):
    cfg = tiny_config("+experiment=grok_100ep")
    summary = run(cfg, tmp_path)
    assert summary["steps"] == 3
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["eval"].values())
    assert list(tmp_path.glob("wandb/offline-run-*")), "no offline wandb run written"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3] and "train/acc_0" in rows[1] and "eval/sim_accept_len" in rows[0]
    # the export loads back strictly, on the target's embedding, with the trained weights
    target = HFTargetEngine.from_path(Path(os.environ["STREAMDRAFT_CACHE"]) / "smollm2-135m-instruct")
    draft, vocab, config = load_export(tmp_path / "export" / "sglang", embed_weight=target.embed_weight)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert vocab.draft_vocab_size == 1024 and draft.shape.draft_vocab_size == 1024
    # the export verified for both engines, and real speculative decoding ran on it
    assert summary["verify"]["sglang"].startswith("OK") and summary["verify"]["vllm"].startswith("OK")
    ev = summary["eval"]
    rates = [ev[f"eval/accept_rate_{i}"] for i in range(sum(k.startswith("eval/accept_rate_") for k in ev))]
    assert ev["eval/accept_len"] == pytest.approx(1 + sum(rates)) and ev["eval/verify_problems"] == 0
    assert ev["eval/spec_cycles"] > 0 and all(a >= b for a, b in zip(rates, rates[1:]))
    # the model card beside each export: what it is for, what it was trained on, what was measured, how to serve it
    card = (tmp_path / "export" / "sglang" / "README.md").read_text()
    for fragment in (
        "# EAGLE-3 draft for smollm2-135m-instruct",
        "aux layer ids: [1, 14, 26] (output of decoder layer k)",
        "- chatterbot (chatterbot, the packaged corpus): ",
        "schedule constant, lr 0.001",
        f"**{ev['eval/accept_len']:.3f} ± {ev['eval/accept_len_se']:.3f}** on 2 held-out prompts",
        "k = 5, up to 8 new tokens a turn",
        f"--prompts {tmp_path / 'eval_prompts.jsonl'}",
        f"python -m serving.launch --engine sglang --target {target.info.source} --draft {tmp_path / 'export' / 'sglang'}",
    ):
        assert fragment in card, fragment
    assert "python -m serving.launch --engine vllm" in (tmp_path / "export" / "vllm" / "README.md").read_text()


@pytest.mark.slow
def test_two_ranks_train_disjoint_shards_to_identical_weights(tmp_path):
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert launcher, "the deepspeed launcher is not installed beside this python"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    script = ROOT / "tests" / "fixtures" / "two_ranks.py"
    cmd = [launcher, "--num_gpus", "2", "--no_local_rank", "--master_port", "29533", str(script), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
    summary = json.loads((tmp_path / "ranks.json").read_text())
    assert summary["steps"] == 3 and len(summary["draft_checksums"]) == 2
    assert summary["draft_checksums"][0] == summary["draft_checksums"][1]
    assert summary["shard_overlap"] == 0
    # each rank's stall share is logged, and the headline figure is their mean
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    perf = [r for r in rows if "perf/stall_share" in r]
    assert perf, "no row carries the stall share"
    for r in perf:
        ranks = [r["perf/stall_share_rank0"], r["perf/stall_share_rank1"]]
        assert all(0.0 <= s <= 1.0 for s in ranks) and r["perf/stall_share"] == pytest.approx(sum(ranks) / 2)


def test_serve_eval_off_exports_and_verifies_without_decoding_and_says_so(tmp_path, capsys):
    summary = run(tiny_config("trainer.max_steps=1", "trainer.serve_eval=false"), tmp_path)
    assert summary["serve_eval"].startswith("off (trainer.serve_eval=false)") and "eval/accept_len" not in summary["eval"]
    assert summary["verify"]["sglang"].startswith("OK") and (tmp_path / "export" / "sglang" / "config.json").exists()
    err = capsys.readouterr().err
    assert "verify both, no serving eval (trainer.serve_eval=false)" in err and "speculatively" not in err
    card = (tmp_path / "export" / "sglang" / "README.md").read_text()  # a card beside the files engines read
    assert "- τ: not measured (off (trainer.serve_eval=false)" in card and "1 optimizer steps of 1 (" in card
    assert verify_export(tmp_path / "export" / "sglang", "sglang").ok and verify_export(tmp_path / "export" / "vllm", "vllm").ok
    phases = summary["phase_s"]  # the phases in the order the run entered them, each timed
    assert tuple(phases) == PHASES and min(phases.values()) >= 0 and phases[STARTUP] > 0
    assert phases[TRAINING] >= summary["train_time_s"] and summary["engine_start_s"] == 0.0  # in-process: no engine process


@pytest.mark.slow
def test_the_command_lines_records_hold_what_its_console_showed(tmp_path):
    """``python -m trainer``: the log holds the console's lines (a resume=auto with nothing to resume says so), the
    summary's wall time is its phases' from the process's start, no serving-eval prompts line with the eval off."""
    args = [f"hydra.run.dir={tmp_path / 'run'}", *TINY, "trainer.max_steps=1", "trainer.serve_eval=false", "trainer.resume=auto"]
    cmd = [sys.executable, "-m", "trainer", *args]
    out = subprocess.run(cmd, env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    nothing = f"trainer.resume=auto: no checkpoint in {tmp_path / 'run' / 'checkpoints'}, so the run starts from step 0"
    assert nothing in out.stdout and "wall time from process start" in out.stdout and "serving-eval prompts" not in out.stdout
    log = (tmp_path / "run" / "__main__.log").read_text()
    assert nothing in log and "verify both, no serving eval (trainer.serve_eval=false)" in log and "run summary" in log
    assert "trainer.resume=auto" in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["wall_time_s"] == pytest.approx(sum(summary["phase_s"].values())) and summary["eval_prompts"] is None


def test_deepspeed_does_not_synchronize_the_device_inside_a_training_step(tmp_path, monkeypatch):
    """DeepSpeed's throughput timer, on by default, synchronizes the device as each forward starts (seen on the H200:
    the TTT forward's host launches waited there for the labels' kernels, 17 ms a step); the trainer times its own."""
    from deepspeed.accelerator import get_accelerator

    from trainer.loop import Trainer

    trainer, syncs = Trainer(tiny_config("trainer.max_steps=4"), tmp_path), []
    monkeypatch.setattr(get_accelerator(), "synchronize", lambda *a, **k: syncs.append(1))
    try:
        trainer._train()
        assert trainer.state.step == 4 and syncs == []
    finally:
        trainer.close()  # ZeRO's teardown synchronizes, once
