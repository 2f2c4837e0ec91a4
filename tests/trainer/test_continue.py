"""A run that continues a trained draft (draft.init_from, grokking from a checkpoint): its LR schedule starts
again at the run's first step and peaks at schedule.continue_lr_ratio of schedule.lr; the summary and the
model card name the draft it started from."""

import json

import pytest

from tests.fixtures.tiny import tiny_config
from trainer import checkpoint as ckpt
from trainer.loop import Trainer, run
from trainer.report.report import format_summary
from trainer.schedule import ScheduleStart, run_lr_factor, warmup_steps


def _lrs(run_dir) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}


def test_a_continued_schedule_warms_up_again_from_its_start_to_a_share_of_the_peak():
    """Grokking from step 150 of a cosine run: the constant LR warms up again over the steps left, to lr x 0.1;
    a run from the target keeps its own schedule."""
    s = tiny_config("schedule=constant").schedule
    start, total = ScheduleStart(150, continued=True), 5400
    warm = warmup_steps(s, total - 150)
    assert run_lr_factor(s, start, 150, total) == pytest.approx(s.continue_lr_ratio / warm)
    assert run_lr_factor(s, start, 150 + warm - 1, total) == pytest.approx(s.continue_lr_ratio)
    assert run_lr_factor(s, start, total - 1, total) == pytest.approx(s.continue_lr_ratio)
    assert run_lr_factor(s, ScheduleStart(), 150, total) == 1.0


def test_a_continue_lr_ratio_outside_its_range_is_refused_by_name():
    with pytest.raises(ValueError, match=r"schedule.continue_lr_ratio"):
        tiny_config("schedule.continue_lr_ratio=0")


@pytest.mark.slow
def test_a_run_from_an_export_trains_at_a_share_of_the_lr_and_names_its_start(tmp_path):
    """draft.init_from: the LR is a cosine from lr x continue_lr_ratio, and the summary,
    its printed table and the export's model card name the starting draft."""
    first = run(tiny_config("trainer.max_steps=1"), tmp_path / "a")
    init = first["export_dir"]
    cfg = tiny_config(f"draft.init_from={init}")
    summary = run(cfg, tmp_path / "b")
    peak, lrs = cfg.schedule.lr * cfg.schedule.continue_lr_ratio, _lrs(tmp_path / "b")
    assert lrs == pytest.approx({1: peak, 2: peak / 2, 3: 0.0}), lrs  # the cosine of 3 steps from lr x 0.1, not from lr
    assert summary["init_from"] == init and summary["schedule_start"] == {"step": 0, "continued": True}
    assert summary["start_eval_sim_accept_len"] == pytest.approx(first["eval_sim_accept_len"], rel=1e-4)  # the same draft
    assert f"(draft.init_from {init} -> trained)" in format_summary(summary)
    card = (tmp_path / "b" / "export" / "sglang" / "README.md").read_text()
    assert f"- started from: `{init}` (draft.init_from)\n" in card
    assert f"schedule cosine, peak lr {peak:g} (lr {cfg.schedule.lr:g} x continue_lr_ratio 0.1: a trained draft, from step 0)" in card


@pytest.mark.slow
def test_grokking_from_a_checkpoint_starts_a_schedule_for_a_trained_draft_that_a_resume_keeps(tmp_path):
    """A resume that changes schedule.name starts the new schedule at the checkpoint's step at lr x
    continue_lr_ratio, not at the full LR; its checkpoints keep that start, so a plain resume goes on with it."""
    cosine = Trainer(tiny_config("trainer.max_steps=2"), tmp_path)
    try:
        cosine.fit()
    finally:
        cosine.close()
    grok = ["schedule=constant", "trainer.resume=auto", "trainer.resume_allow=[schedule]"]
    resumed = Trainer(tiny_config("trainer.max_steps=4", *grok), tmp_path)
    try:
        assert resumed.built.schedule_start == ScheduleStart(2, continued=True)
        resumed.fit()
    finally:
        resumed.close()
    lr = resumed.cfg.schedule.lr
    assert _lrs(tmp_path)[3] == pytest.approx(lr * 0.1) and _lrs(tmp_path)[4] == pytest.approx(lr * 0.1)  # not lr
    position = ckpt.read_meta(tmp_path / "checkpoints" / "step_4")["position"]
    assert position["schedule_from_step"] == 2 and position["continued"]
    again = Trainer(tiny_config("trainer.max_steps=5", *grok), tmp_path)  # the same schedule: the start is the checkpoint's
    try:
        assert again.built.schedule_start == ScheduleStart(2, continued=True)
    finally:
        again.close()
