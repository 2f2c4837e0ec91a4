"""lab/budget_plot.py on the H200 budget runs kept in docs/device_runs (their summaries and speedup results)."""

from __future__ import annotations

import json
import shutil

import pytest

from lab import budget_plot
from tests.fixtures.tiny import ROOT

RUNS = ROOT / "docs" / "device_runs" / "2026-12-04-h200-budget"


def test_the_budget_runs_become_a_table_a_json_and_a_plot(tmp_path, capsys):
    points = budget_plot.main(["--out", str(tmp_path / "budget"), str(RUNS / "t5"), str(RUNS / "t10")])
    by = {(p.run, p.set): p for p in points}
    assert len(points) == 4 and by["t10", "heldout_sharegpt"].tau == pytest.approx(3.0507, abs=1e-4)
    assert by["t10", "heldout_codeio"].steps == 4969 and by["t10", "heldout_codeio"].minutes == pytest.approx(10.0, abs=0.01)
    assert by["t5", "heldout_sharegpt"].resumed and not by["t10", "heldout_sharegpt"].resumed
    saved = json.loads((tmp_path / "budget.json").read_text())
    assert saved["setting"] == "6/1/7" and saved["concurrency"] == 1 and len(saved["points"]) == 4
    assert (tmp_path / "budget.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "t10" in table and "3.051 ± 0.100" in table and "3.735 ± 0.082" in table
    at16 = budget_plot.main(["--out", str(tmp_path / "c16"), "--concurrency", "16", str(RUNS / "t10")])
    assert {p.set: round(p.tau, 3) for p in at16} == {"heldout_sharegpt": 3.077, "heldout_codeio": 3.693}


def test_a_run_without_results_or_the_asked_setting_is_named(tmp_path):
    bare = tmp_path / "t20"
    bare.mkdir()
    shutil.copy(RUNS / "t10" / "summary.json", bare / "summary.json")
    with pytest.raises(SystemExit, match=f"{bare}: none of speedup.json, speedup.json.gz"):
        budget_plot.main(["--out", str(tmp_path / "b"), str(RUNS / "t10"), str(bare)])
    with pytest.raises(SystemExit, match=r"speedup.json.gz: no row of setting 8/8/64 at concurrency 1"):
        budget_plot.main(["--out", str(tmp_path / "b"), "--setting", "8/8/64", str(RUNS / "t10")])
    (bare / "summary.json").write_text(json.dumps({"steps": 3}))
    shutil.copy(RUNS / "t10" / "speedup.json.gz", bare / "speedup.json.gz")
    with pytest.raises(SystemExit, match=f"{bare / 'summary.json'}: no train_time_s"):
        budget_plot.main(["--out", str(tmp_path / "b"), str(bare)])
    assert not (tmp_path / "b.json").exists()  # nothing written from a failed read
