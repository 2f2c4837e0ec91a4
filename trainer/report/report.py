"""Offline report of a run: PNG pictures of the dashboard's panels plus a Markdown summary;
and the compact end-of-run summary the trainer prints.

    python -m trainer.report RUN_DIR [--out DIR]      # default DIR: RUN_DIR/report

Reads ``RUN_DIR/metrics.jsonl`` + ``summary.json`` (or, failing those, the wandb run under
``RUN_DIR/wandb``; see ``trainer.report.runlog``) and writes ``DIR/report.md`` with one PNG per
section (training, evaluation, performance, data) beside it.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from serving.formats import DEFAULT_SPECULATIVE_TOKENS
from serving.speedup_report import describe
from trainer.report import metrics as M
from trainer.report.panels import sections
from trainer.report.plots import SectionPlot, plot_section
from trainer.report.runlog import RunLog, read_run

REPORT_DIR = "report"
REPORT_FILE = "report.md"
SUMMARY_REQUIRED = ("steps", "wall_time_s", "eval_sim_accept_len", "eval", "export_dir")


def fmt(value: Any) -> str:
    """A figure as people read it: integers plain, floats to 3 decimals (tiny ones to 3 digits)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.1f}"
    return f"{value:.3f}" if value == 0 or abs(value) >= 0.01 else f"{value:.3g}"


def _accept(summary: dict) -> str | None:
    trained = summary.get("eval_sim_accept_len")
    if trained is None:
        return None
    return f"{fmt(summary['start_eval_sim_accept_len'])} -> {fmt(trained)}  ({_start(summary)} -> trained)"


def _start(summary: dict) -> str:
    """The draft the run's first held-out eval measured: a resumed checkpoint's, draft.init_from's, or one made from the target."""
    if summary.get("resumed_from"):
        return "resumed"
    return f"draft.init_from {summary['init_from']}" if summary.get("init_from") else "untrained"


def _tau(evals: dict) -> str | None:
    tau, se = evals.get(M.EVAL_ACCEPT_LEN), evals.get(M.EVAL_ACCEPT_LEN_SE)
    if tau is None:
        return None
    return fmt(tau) if se is None or not math.isfinite(se) else f"{fmt(tau)} ± {fmt(se)}"


def key_figures(summary: dict) -> list[tuple[str, str]]:
    """The figures of a ``summary.json`` worth a glance; keys the summary lacks are left out."""
    evals = summary.get("eval") or {}
    rows = [
        ("optimizer steps", summary.get("steps")),
        ("stopped by", summary.get("stopped_by")),
        ("trainer ranks", summary.get("ranks")),
        ("wall time from process start", None if summary.get("wall_time_s") is None else f"{summary['wall_time_s']:.1f} s"),
        ("wall time by phase", _phases(summary)),
        ("held-out sim. accept length", _accept(summary)),
        ("real accept length τ (bonus incl.)", _tau(evals)),
        ("teacher-forced acc_0, those answers", evals.get(M.EVAL_TF_ACC0)),
        ("serving-eval prompts", None if summary.get("eval_prompts") is None else describe_eval_prompts(summary["eval_prompts"])),
        ("export verify problems", None if evals.get(M.EVAL_VERIFY_PROBLEMS) is None else int(evals[M.EVAL_VERIFY_PROBLEMS])),
        ("held-out acc_0", evals.get(M.step_acc(0, "eval"))),
        ("non-finite steps skipped", summary.get("nonfinite_skipped")),
        ("resumed from", summary.get("resumed_from")),
    ]
    return [(k, fmt(v)) for k, v in rows if v is not None] + speedup_figures(summary.get("speedup") or {})


def _phases(summary: dict) -> str | None:
    """Each phase's seconds (``summary["phase_s"]``), the engine's start inside the phase that started it."""
    phases = summary.get("phase_s")
    if not phases:
        return None
    parts = [f"{name} {seconds:.1f} s" for name, seconds in phases.items()]
    start = summary.get("engine_start_s")
    return "; ".join(parts) + (f" (engine process start {start:.1f} s of them)" if start else "")


def speedup_figures(speedup: dict) -> list[tuple[str, str]]:
    """The measured best setting per concurrency (``summary["speedup"]``, trainer.speedup), and failures."""
    rows = [
        (f"speedup in SGLang, concurrency {c}", f"{b['speedup']:.2f}x the target alone ({describe(b['setting'])}: {b['setting']})")
        for c, b in speedup.get("best", {}).items()
    ]
    if speedup.get("failed"):
        rows.append(("speedup settings that failed", ", ".join(speedup["failed"])))
    if speedup and not rows:
        rows.append(("speedup in SGLang", f"not measured (serving.speedup exit code {speedup.get('exit_code')})"))
    return rows


def describe_eval_prompts(origin: dict) -> str:
    """Where the serving-eval prompts came from (``summary["eval_prompts"]``), in one line."""
    count = f"{origin['prompts']} prompts, {origin['turns']} turns"
    if origin["kind"] == "file":
        return f"{count} from prompt file {origin['path']}"
    sources = ", ".join(f"{name} {n}" for name, n in origin["sources"].items() if n)
    return f"{count}, held out of the training data ({sources or 'none'}); split: {origin['split']}"


def paths(summary: dict) -> list[tuple[str, str]]:
    exports = summary.get("export_dirs") or {}  # engine -> dir, from serving.pipeline
    rows = [
        ("checkpoint", summary.get("checkpoint")),
        ("export (SGLang)", summary.get("export_dir")),
        *((f"export ({engine})", path) for engine, path in exports.items() if path != summary.get("export_dir")),
        ("speedup", (summary.get("speedup") or {}).get("results")),
        ("report", summary.get("report")),
        ("summary", summary.get("summary_path")),
    ]
    return [(k, str(v)) for k, v in rows if v is not None]


def format_summary(summary: dict) -> str:
    """The end-of-run table the trainer prints: key figures, then where things were written."""
    missing = [k for k in SUMMARY_REQUIRED if k not in summary]
    if missing:
        raise ValueError(f"run summary: missing {', '.join(missing)} (has: {', '.join(sorted(summary))})")
    figures, where = key_figures(summary), paths(summary)
    if "verify" in summary:
        figures.append(("export verify", _verify_line(summary["verify"])))
    width = max(len(k) for k, _ in figures + where)
    rule = "-" * (width + 2 + max(len(v) for _, v in figures + where))
    lines = ["run summary", rule, *(f"{k:<{width}}  {v}" for k, v in figures), rule, *(f"{k:<{width}}  {v}" for k, v in where)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- Markdown


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    rule = "|" + "|".join("---" for _ in header) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in cells)]


def _engine_texts(verify: Any) -> bool:
    """serving.pipeline's form: engine -> ``serving.verify.format_report`` text ("OK  ..." / "FAIL  ...")."""
    return isinstance(verify, dict) and bool(verify) and all(isinstance(v, str) for v in verify.values())


def _verify_line(verify: Any) -> str:
    """PASS / FAIL of a ``summary["verify"]``: a bool, a dict with ``ok``, or engine -> report text."""
    if isinstance(verify, bool):
        return "PASS" if verify else "FAIL"
    if isinstance(verify, dict) and "ok" in verify:
        return "PASS" if verify["ok"] else "FAIL"
    if _engine_texts(verify):
        verdicts = {engine: text.split(maxsplit=1)[0] if text.strip() else "?" for engine, text in verify.items()}
        overall = "PASS" if all(v == "OK" for v in verdicts.values()) else "FAIL"
        return f"{overall} ({', '.join(f'{e}: {v}' for e, v in verdicts.items())})"
    return json.dumps(verify)[:120]


def _verify_section(summary: dict) -> list[str]:
    if "verify" not in summary:
        return ["No verify result in the run summary (no `verify` key)."]
    verify = summary["verify"]
    lines = [f"Result: **{_verify_line(verify)}**", ""]
    if _engine_texts(verify):
        for engine, text in verify.items():
            lines += [f"{engine}:", "", "```", text.rstrip(), "```", ""]
    elif isinstance(verify, dict):
        rows = [(k, v if isinstance(v, (str, int, float, bool)) else json.dumps(v)) for k, v in verify.items() if k != "ok"]
        lines += _table(("check", "value"), rows) if rows else []
    return lines


def _ttt_steps(log: RunLog) -> int:
    if log.config and isinstance(log.config.get("draft"), dict) and "ttt_steps" in log.config["draft"]:
        return int(log.config["draft"]["ttt_steps"])
    k = 0
    while M.step_acc(k) in log.history or M.step_acc(k, "eval") in log.history:
        k += 1
    return max(k, 1)


def _spec_tokens(log: RunLog) -> int:
    """Draft tokens per verify forward in the real eval: the logged positions, else the default."""
    k = 0
    while M.accept_rate(k) in log.history:
        k += 1
    return k or DEFAULT_SPECULATIVE_TOKENS


def _acceptance_table(log: RunLog, ttt_steps: int, spec_tokens: int) -> list[str]:
    rows, cumulative = [], 1.0
    for k in range(max(ttt_steps, spec_tokens)):
        series = log.history.get(M.step_acc(k, "eval"))
        untrained = series.values[0] if series and series.steps[0] == 0 else None
        trained = series.values[-1] if series and series.steps[-1] > 0 else None
        cumulative = None if trained is None or cumulative is None else cumulative * trained
        real = (log.last(M.cond_accept_rate(k)), log.last(M.accept_rate(k)))
        rows.append((k, fmt(untrained), fmt(trained), fmt(cumulative), *map(fmt, real)))
    header = (
        "position k",
        "held-out acc_k, untrained",
        "held-out acc_k, trained",
        "P(accept >= k+1), sim.",
        "real cond. accept rate",
        "real accept rate",
    )
    sim, tau = log.last(M.EVAL_SIM_ACCEPT), log.last(M.EVAL_ACCEPT_LEN)
    note = [
        "",
        f"Simulated acceptance length (sum of the P column, draft tokens only): **{fmt(sim)}**. "
        + (
            f"Real acceptance length τ (tokens per target verify forward, the bonus token included, so compare "
            f"τ - 1 = {fmt(tau - 1)} with the simulated length): **{fmt(tau)}**."
            if tau is not None
            else "No real speculative-decoding eval in this run (`eval/accept_len` not logged)."
        ),
    ]
    return _table(header, rows) + note


def _history_figures(log: RunLog) -> list[tuple[str, str]]:
    tps = log.history.get(M.TOKENS_PER_S)
    rows = [
        ("train loss, last logged", log.last(M.LOSS)),
        ("train acc_0, last logged", log.last(M.step_acc(0))),
        ("throughput, mean of logged windows", None if not tps else f"{sum(tps.values) / len(tps.values):,.0f} tokens/s"),
    ]
    return [(k, fmt(v)) for k, v in rows if v is not None]


@dataclass
class Report:
    markdown: Path
    plots: list[SectionPlot]


def _markdown(log: RunLog, plots: list[tuple[str, SectionPlot]], out_dir: Path, ttt_steps: int, spec_tokens: int) -> str:
    s = log.summary
    name = log.run_dir.resolve().name
    lines = [f"# StreamDraft run report: {name}", ""]
    lines += [f"Run dir `{log.run_dir}`; metrics read from `{log.source}`.", ""]
    if not log.finished:
        lines += ["**The wandb run has no exit record (still writing, or killed): its history may be incomplete.**", ""]
    lines += ["## Key figures", "", *_table(("figure", "value"), key_figures(s) + _history_figures(log)), ""]
    where = paths(s) + [("metrics", str(log.source)), ("this report", str(out_dir / REPORT_FILE))]
    lines += ["## Paths", "", *_table(("what", "path"), [(k, f"`{v}`") for k, v in where]), ""]
    lines += ["## Export verification", "", *_verify_section(s), ""]
    lines += ["## Acceptance per draft position", "", *_acceptance_table(log, ttt_steps, spec_tokens), ""]
    lines += ["## Plots", ""]
    for title, plot in plots:
        lines += [f"### {title}", ""]
        if plot.path is not None:
            lines += [f"![{title}]({plot.path.name})", ""]
        if plot.missing:
            lines += ["Not logged in this run: " + ", ".join(f"`{m}`" for m in plot.missing) + ".", ""]
    data = log.data()
    lines += ["## Data figures", ""]
    lines += _table(("figure", "value"), [(f"`{k}`", fmt(v)) for k, v in data.items()]) if data else ["No data figures recorded."]
    lines += ["", "## Final metrics", ""]
    rows = [(f"`{k}`", log.history[k].steps[-1], fmt(log.history[k].values[-1])) for k in sorted(log.history)]
    lines += _table(("metric", "step", "value"), rows)
    lines += ["", "## Config", ""]
    if log.config is None:
        lines += ["No config found (no `.hydra/config.yaml` and no wandb config)."]
    else:
        dumped = yaml.safe_dump(log.config, sort_keys=False).rstrip()
        lines += ["<details><summary>composed config</summary>", "", "```yaml", dumped, "```", "", "</details>"]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, out_dir: Path | None = None) -> Report:
    """Read ``run_dir`` and write ``out_dir/report.md`` plus one PNG per section."""
    log = read_run(Path(run_dir))
    out_dir = Path(out_dir) if out_dir is not None else log.run_dir / REPORT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    ttt_steps, spec_tokens = _ttt_steps(log), _spec_tokens(log)
    mix = [k.removeprefix(M.DATA_MIX_PREFIX) for k in log.data() if k.startswith(M.DATA_MIX_PREFIX)]
    run_name = log.run_dir.resolve().name
    plots = [(sec.title, plot_section(sec, log, out_dir, run_name)) for sec in sections(ttt_steps, spec_tokens, mix)]
    path = out_dir / REPORT_FILE
    path.write_text(_markdown(log, plots, out_dir, ttt_steps, spec_tokens))
    return Report(path, [p for _, p in plots])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run dir: metrics.jsonl + summary.json, or a wandb/ dir")
    parser.add_argument("--out", type=Path, default=None, help=f"output dir (default: RUN_DIR/{REPORT_DIR})")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.run_dir, args.out)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    print(report.markdown)
    for plot in report.plots:
        if plot.path is not None:
            print(plot.path)
