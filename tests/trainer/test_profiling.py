"""trainer.profile_steps: torch.profiler over whole loop iterations of a real (tiny) run."""

import json

import pytest
import torch

from tests.fixtures.tiny import tiny_config
from trainer.loop import Trainer
from trainer.profiling import PROFILE_DIR

RANGES = ("labels", "ttt_forward", "backward", "optimizer")  # trainer.ttt.draft_step's record_function ranges


def _profiled_run(tmp_path, *overrides: str) -> dict:
    trainer = Trainer(tiny_config("trainer.max_steps=4", "trainer.profile_steps=[2,3]", *overrides), tmp_path)
    try:
        trainer._train()
    finally:
        trainer.close()
    out = tmp_path / PROFILE_DIR
    table = (out / "kernels.txt").read_text()
    assert all(name in table for name in RANGES), table
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    host = [e for e in events if e.get("cat") == "user_annotation"]  # a GPU adds gpu_user_annotation twins
    assert sum(e["name"] == "ttt_forward" for e in host) == 2  # steps 2 and 3, not 1 or 4
    frames = {e["name"] for e in events if e.get("cat") == "python_function"}
    assert any(name.startswith("trainer/ttt.py(") and name.endswith("draft_step") for name in frames), sorted(frames)[:20]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == [2, 3] and summary["wall_ms_per_step"] > 0
    return summary


@pytest.mark.slow
def test_the_profiled_steps_and_no_others_are_traced(tmp_path):
    summary = _profiled_run(tmp_path, "trainer.device=cpu")
    assert "gpu_busy_share" not in summary


@pytest.mark.gpu
def test_on_a_gpu_the_busy_time_is_the_traced_kernels_and_copies(tmp_path):
    """The trace's GPU ranges of ttt_forward etc. (gpu_user_annotation) span idle time too: they are not kernels."""
    summary = _profiled_run(tmp_path, "trainer.device=cuda")
    events = json.loads((tmp_path / PROFILE_DIR / "trace.json").read_text())["traceEvents"]
    device_us = sum(e["dur"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    assert summary["gpu_busy_ms_per_step"] == pytest.approx(device_us / 1e3 / 2, rel=0.01)
    assert 0 < summary["gpu_busy_ms_per_step"] <= summary["wall_ms_per_step"]
    assert summary["gpu_busy_share"] == pytest.approx(summary["gpu_busy_ms_per_step"] / summary["wall_ms_per_step"])
    assert torch.cuda.is_available()
