"""Offline report: reading a run dir (metrics.jsonl or a wandb offline run), PNGs, Markdown,
and the end-of-run summary table."""

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from matplotlib.figure import Figure
from PIL import Image

from trainer.report import metrics as M
from trainer.report.panels import PanelSpec, sections
from trainer.report.plots import draw_panel, plot_section
from trainer.report.report import _verify_section, format_summary, main, write_report
from trainer.report.runlog import find_wandb_files, read_metrics_jsonl, read_run, read_wandb_file

K = 3


def _train_row(step: int) -> dict:
    row = {
        M.LOSS: 10.0 / step,
        M.SIM_ACCEPT: 0.1 * step,
        M.LR: 1e-3,
        M.GRAD_NORM: 5.0,
        M.TOKENS_PER_S: 100.0,
        M.STEP_TIME: 2.0,
        M.TARGET_TIME: 0.5,
        M.DRAFT_TIME: 1.5,
        "epoch": 0,
    }
    row.update({M.step_loss(k): 10.0 / step + k for k in range(K)} | {M.step_acc(k): 0.05 * step / (k + 1) for k in range(K)})
    return row


def _eval_row(acc: float) -> dict:
    return {M.step_acc(k, "eval"): acc / (k + 1) for k in range(K)} | {M.EVAL_SIM_ACCEPT: acc, M.EVAL_LOSS: 9.0}


SUMMARY = {
    "steps": 10,
    "wall_time_s": 12.5,
    "resumed_from": None,
    "start_eval_sim_accept_len": 0.0,
    "eval_sim_accept_len": 0.6,
    "eval": _eval_row(0.6),
    "nonfinite_skipped": 0,
    "checkpoint": "/runs/a/checkpoints/step_10",
    "export_dir": "/runs/a/export",
    "summary_path": "/runs/a/summary.json",
    "data": {
        "conversations": 40,
        "malformed": 1,
        "no_assistant": 2,
        "duplicates": 3,
        "samples": 36,
        "tokens": 4000,
        "masked_tokens": 1500,
        "truncated": 4,
        "no_masked_token": 0,
        "boundary_tokens": 0,
    },
}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    rows = [{"step": 0, **_eval_row(0.0)}, *({"step": s, **_train_row(s)} for s in (5, 10)), {"step": 10, **_eval_row(0.6)}]
    real = {
        M.EVAL_ACCEPT_LEN: 2.5,
        M.accept_rate(0): 0.8,
        M.accept_rate(1): 0.5,
        M.cond_accept_rate(0): 0.8,
        M.cond_accept_rate(1): 0.625,
        M.EVAL_VERIFY_PROBLEMS: 0.0,
    }  # real spec. decoding, k = 2
    rows.append({"step": 10, **real})
    (tmp_path / M.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY | {"verify": {"ok": True, "engine": "sglang"}}))
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"draft": {"ttt_steps": K, "vocab_size": 2048}}))
    return tmp_path


def test_report_writes_readable_pngs_and_markdown(run_dir, tmp_path):
    report = write_report(run_dir, tmp_path / "out")
    pngs = {p.path.name: p for p in report.plots if p.path is not None}
    assert set(pngs) == {"training.png", "evaluation.png", "performance.png", "data.png"}
    for plot in pngs.values():
        with Image.open(plot.path) as im:
            assert im.format == "PNG" and im.width >= 400 and im.height >= 250
        assert plot.path.stat().st_size < 200_000
    perf = pngs["performance.png"]
    assert M.MFU in perf.missing and M.GPU_MEM in perf.missing and M.TOKENS_PER_S in perf.drawn
    assert M.EVAL_ACCEPT_LEN in pngs["evaluation.png"].drawn and M.accept_rate(1) in pngs["evaluation.png"].drawn
    md = report.markdown.read_text()
    for text in (
        "## Key figures",
        "0.000 -> 0.600",
        "/runs/a/export",
        "/runs/a/checkpoints/step_10",
        "## Acceptance per draft position",
        "Result: **PASS**",
        "| engine | sglang |",
        "![Training](training.png)",
        "`perf/mfu`",
        "vocab_size: 2048",
        "`data/skipped_duplicates` | 3 |",
        "τ - 1 = 1.500 with the simulated length): **2.500**",
    ):
        assert text in md, text
    # acceptance table: trained acc_k = 0.6 / (k + 1), P(accept >= k+1) their running product, real rates
    assert "| 0 | 0.000 | 0.600 | 0.600 | 0.800 | 0.800 |" in md and "| 1 | 0.000 | 0.300 | 0.180 | 0.625 | 0.500 |" in md
    assert "| 2 | 0.000 | 0.200 | 0.036 | n/a | n/a |" in md


def test_verify_section_without_and_with_a_result():
    assert "No verify result" in _verify_section({})[0]
    texts = {"sglang": "OK  /r/export for sglang: 9 tensors consumed", "vllm": "FAIL  /r/export_vllm for vllm: 1 problem(s)"}
    assert _verify_section({"verify": texts})[0] == "Result: **FAIL (sglang: OK, vllm: FAIL)**"
    failed = _verify_section({"verify": {"ok": False, "missing": ["fc.weight"]}})
    assert failed[:3] == ["Result: **FAIL**", "", "| check | value |"] and '| missing | ["fc.weight"] |' in failed


def test_a_run_dir_without_metrics_is_named(tmp_path, capsys):
    with pytest.raises(ValueError, match=f"{tmp_path}: no metrics to report"):
        read_run(tmp_path)
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert f"{tmp_path}: no metrics to report" in capsys.readouterr().err


def test_metrics_jsonl_errors_name_the_line_and_relogged_steps_keep_the_later_value(tmp_path):
    path = tmp_path / M.METRICS_FILE
    path.write_text('{"step": 5, "train/loss": 2.0}\n{"step": 5, "train/loss": 1.0}\n')  # a resumed run re-logs step 5
    assert read_metrics_jsonl(path)[M.LOSS].values == [1.0]
    path.write_text('{"step": 5, "train/loss": 2.0}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics_jsonl(path)


def _wait_for_wandb(run_dir: Path, timeout_s: float = 30.0) -> None:
    """wandb 0.31's offline finish() can return before wandb-core has flushed the run file."""
    deadline = time.monotonic() + timeout_s
    while not all(read_wandb_file(f).finished for f in find_wandb_files(run_dir)):
        assert time.monotonic() < deadline, f"wandb did not finish writing under {run_dir}"
        time.sleep(0.1)


def test_wandb_offline_run_is_the_fallback(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = wandb.init(project="p", dir=str(tmp_path), config={"draft": {"ttt_steps": K}})
    run.log(_eval_row(0.0), step=0)
    for s in (5, 10):
        run.log(_train_row(s), step=s)
    run.summary.update(M.data_metrics(SUMMARY["data"]))
    run.finish()
    _wait_for_wandb(tmp_path)
    log = read_run(tmp_path)
    assert log.source.suffix == ".wandb" and log.finished and log.config == {"draft": {"ttt_steps": K}}
    assert log.history[M.LOSS].steps == [5, 10] and log.history[M.LOSS].values == [2.0, 1.0]
    assert log.data()[M.DATA_SKIPPED_DUPLICATES] == 3 and log.summary[M.DATA_SAMPLES] == 36
    # a resumed run is a second wandb run in the same dir: histories merge, the later value wins
    resumed = wandb.init(project="p", dir=str(tmp_path))
    resumed.log({M.LOSS: 0.5}, step=10)
    resumed.log({M.LOSS: 0.25}, step=15)
    resumed.finish()
    _wait_for_wandb(tmp_path)
    assert read_run(tmp_path).history[M.LOSS].values == [2.0, 0.5, 0.25]
    # damage is reported, a torn tail (a run still writing) is not
    assert read_wandb_file(log.source).rows[0][0] == 0
    data = log.source.read_bytes()
    log.source.write_bytes(data[:-3])
    torn = read_wandb_file(log.source)
    assert torn.history and not torn.finished
    log.source.write_bytes(data[:40] + bytes([data[40] ^ 0xFF]) + data[41:])
    with pytest.raises(ValueError, match="CRC mismatch"):
        read_wandb_file(log.source)


def test_format_summary_lists_figures_and_paths():
    text = format_summary(SUMMARY | {"report": "/runs/a/report/report.md"})
    for fragment in (
        "optimizer steps",
        "12.5 s",
        "0.000 -> 0.600",
        "held-out acc_0",
        "/runs/a/export",
        "/runs/a/checkpoints/step_10",
        "/runs/a/report/report.md",
    ):
        assert fragment in text, fragment
    assert "0.000 -> 0.600  (untrained -> trained)" in text
    resumed = SUMMARY | {"resumed_from": "/runs/t/checkpoints/step_4", "start_eval_sim_accept_len": 0.41}
    assert "0.410 -> 0.600  (resumed -> trained)" in format_summary(resumed)
    assert re.search(r"\nstopped by +trainer\.max_time_s\n", format_summary(SUMMARY | {"stopped_by": "trainer.max_time_s"}))
    assert re.search(r"\ntrainer ranks +2\n", format_summary(SUMMARY | {"ranks": 2}))
    served = SUMMARY["eval"] | {"eval/accept_len": 2.5, "eval/accept_len_se": 0.125}
    assert "τ (bonus incl.)  2.500 ± 0.125" in format_summary(SUMMARY | {"eval": served})
    piped = format_summary(
        SUMMARY
        | {"export_dirs": {"sglang": "/runs/a/export", "vllm": "/runs/a/export_vllm"}, "verify": {"sglang": "OK  ...", "vllm": "OK  ..."}}
    )
    assert "export (vllm)" in piped and "/runs/a/export_vllm" in piped and "PASS (sglang: OK, vllm: OK)" in piped
    with pytest.raises(ValueError, match="missing export_dir"):
        format_summary({k: v for k, v in SUMMARY.items() if k != "export_dir"})
    timed = format_summary(SUMMARY | {"phase_s": {"start-up": 20.04, "training": 541.0}, "engine_start_s": 41.26})
    assert re.search(r"\nwall time by phase +start-up 20\.0 s; training 541\.0 s \(engine process start 41\.3 s of them\)\n", timed)


def test_panels_say_what_they_show(run_dir):
    log = read_run(run_dir)
    evaluation, data = {s.key: s for s in sections(K, 2, ["chatterbot"])}["evaluation"], log.data()
    panels = {p.title: p for p in evaluation.panels}

    def drawn(title):
        ax = Figure().subplots()
        names = [m for m in panels[title].metrics if m in log.history]
        draw_panel(ax, panels[title], names, log, data)
        return ax

    tau = drawn("Acceptance length τ (real spec. decoding)")  # one evaluation: a bar with its value, not a dot
    assert len(tau.patches) == 1 and "one evaluation, step 10" in tau.get_xlabel() and tau.texts[0].get_text() == "2.5"
    problems = drawn("Export verification problems")
    assert problems.get_xlim()[1] == pytest.approx(1.25)  # a bar of 0 on a 0..1 axis
    rows = [{"step": s, M.NONFINITE: 0.0} for s in (1, 2, 3)]
    (run_dir / M.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    log, ax = read_run(run_dir), Figure().subplots()
    draw_panel(ax, PanelSpec("Non-finite steps skipped", (M.NONFINITE,), "count"), [M.NONFINITE], log, data)
    assert ax.get_ylim() == (-0.1, 1)  # a count of nothing: not a -0.04..0.04 axis
    bars, ax = {s.key: s for s in sections(K, 2, ["chatterbot"])}["data"], Figure().subplots()
    counts = bars.panels[0]
    draw_panel(ax, counts, [m for m in counts.metrics if m in data], log, data)
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["conversations kept (train + held out)", "training samples"]
    (run_dir / "summary.json").write_text(json.dumps(SUMMARY | {"data": SUMMARY["data"] | {"mix": {"chatterbot": 1.0}}}))
    plot = plot_section(bars, read_run(run_dir), run_dir / "report", "run")
    assert M.mix_share("chatterbot") not in plot.drawn + plot.missing  # one source: its share of 1 is not drawn
