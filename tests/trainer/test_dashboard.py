"""The wandb workspace is built (not saved: saving needs credentials) from the shared panels."""

import json

import pytest
import torch
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from trainer.dashboard import build_workspace, main
from trainer.report import metrics as M
from trainer.report.panels import sections


def _panel_metrics(panel) -> list[str]:
    return list(panel.metrics if isinstance(panel, wr.BarPlot) else panel.y)


def test_workspace_has_the_four_sections_with_the_shared_metric_names():
    w = build_workspace("team", "proj", ttt_steps=3, spec_tokens=2, mix_sources=["sharegpt", "ultrachat"])
    assert (w.entity, w.project, w.name) == ("team", "proj", "StreamDraft")
    assert [s.name for s in w.sections] == [s.title for s in sections(3, 2, ["sharegpt", "ultrachat"])]
    by_title = {p.title: _panel_metrics(p) for s in w.sections for p in s.panels}
    assert len(by_title) == sum(len(s.panels) for s in w.sections), "panel titles must be unique"
    assert by_title["Loss per TTT position"] == [M.LOSS, "train/loss_0", "train/loss_1", "train/loss_2"]
    assert by_title["Accuracy per TTT position"] == ["train/acc_0", "train/acc_1", "train/acc_2"]
    assert by_title["Held-out accuracy per TTT position"] == ["eval/acc_0", "eval/acc_1", "eval/acc_2"]
    assert by_title["Acceptance length τ (real spec. decoding)"] == [M.EVAL_ACCEPT_LEN]
    assert by_title["Acceptance rate per draft position"] == ["eval/accept_rate_0", "eval/accept_rate_1"]
    assert by_title["Conditional acceptance per position"] == ["eval/cond_accept_rate_0", "eval/cond_accept_rate_1"]
    assert by_title["Export verification problems"] == [M.EVAL_VERIFY_PROBLEMS]
    assert by_title["Model FLOPs utilisation"] == [M.MFU] and by_title["GPU memory"] == [M.GPU_MEM]
    assert by_title["Stall share (waiting on the target)"] == [M.STALL_SHARE]
    assert by_title["Mix shares"] == ["data/mix/sharegpt", "data/mix/ultrachat"]
    assert all(isinstance(p, wr.BarPlot) for p in w.sections[3].panels)
    assert all(s.is_open for s in w.sections)


def test_what_the_trainer_logs_is_on_the_dashboard():
    from trainer.components import StepStats  # the logger's own row builder

    k = 4
    row = StepStats(torch.ones(k), torch.ones(k), torch.ones(k)).report("train")
    row.update({n: 1.0 for n in (M.LR, M.GRAD_NORM, M.TOKENS_PER_S, M.STEP_TIME, M.TARGET_TIME, M.DRAFT_TIME)})
    evals = StepStats(torch.ones(k), torch.ones(k), torch.ones(k)).report("eval")
    w = build_workspace("team", "proj", ttt_steps=k, spec_tokens=3)
    shown = {m for s in w.sections for p in s.panels for m in _panel_metrics(p)}
    missing = (set(row) | set(evals)) - shown - {f"eval/loss_{i}" for i in range(k)} - {M.EVAL_LOSS}
    assert not missing, f"logged but not on the dashboard: {sorted(missing)}"
    from trainer.data.stats import DatasetStats  # the data pipeline's counters

    assert set(M.data_metrics(DatasetStats().as_dict() | {"mix": {"chatterbot": 1.0}})) <= shown


def test_workspace_serialises_to_the_view_spec_without_network(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    spec = json.loads(build_workspace("team", "proj")._to_model().spec.model_dump_json(by_alias=True, exclude_none=True))
    names = [s["name"] for s in spec["section"]["panelBankConfig"]["sections"]]
    assert names == ["Training", "Evaluation", "Performance", "Data"]
    assert "train/acc_6" in json.dumps(spec) and "perf/stall_share" in json.dumps(spec)


def test_dry_run_prints_and_does_not_save(monkeypatch, capsys):
    def no_save(self):
        raise AssertionError("--dry-run must not save")

    monkeypatch.setattr(ws.Workspace, "save", no_save)
    main(["--entity", "team", "--project", "proj", "--dry-run", "--mix-sources", "a", "b"])
    out = capsys.readouterr().out
    assert "team/proj" in out and "[Performance]" in out and "data/mix/b" in out


def test_entity_is_required():
    with pytest.raises(ValueError, match="entity and project are required"):
        build_workspace("", "proj")
