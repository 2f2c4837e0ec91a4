"""PNG pictures of a run's panels (``trainer.report.panels``) with matplotlib, one file per section.

Uses ``matplotlib.figure.Figure`` directly (the Agg canvas, no pyplot state, no display).
A panel with no logged metric is left out of the picture; the caller lists what is missing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from trainer.report import metrics as M
from trainer.report.panels import X_LABEL, PanelSpec, SectionSpec, label
from trainer.report.runlog import RunLog

COLUMNS = 3
PANEL_SIZE = (4.6, 3.2)  # inches per panel
DPI = 90
MARKERS_UP_TO = 15  # points per series drawn with markers (a smoke run logs a handful)


@dataclass
class SectionPlot:
    path: Path | None  # None: nothing of this section was logged
    drawn: list[str]  # metrics in the picture
    missing: list[str]  # metrics of the section the run did not log


def _colors(n: int) -> list:
    if n <= 3:
        return [f"C{i}" for i in range(n)]
    cmap = colormaps["viridis"]
    return [cmap(i / (n - 1) * 0.9) for i in range(n)]  # ordered positions: dark = early, yellow = late


_POSITION = re.compile(r"_\d+$")  # loss_3, acc_3, accept_rate_3


def _line(ax: Axes, log: RunLog, names: list[str]) -> None:
    """One line per metric; per-position metrics in viridis order, their aggregate black dashed."""
    positional = [n for n in names if _POSITION.search(n)]
    colors = dict(zip(positional, _colors(len(positional)))) if len(positional) > 1 else {}
    for i, name in enumerate(names):
        s = log.history[name]
        if not colors:
            style, text = {"color": f"C{i}"}, label(name)
        elif name in colors:
            style, text = {"color": colors[name]}, label(name)
        else:
            style, text = {"color": "black", "linestyle": "--"}, f"{label(name)} (mean)"
        marker = None if len(s.steps) > MARKERS_UP_TO else "o"
        ax.plot(s.steps, s.values, marker=marker, markersize=4, linewidth=1.6, label=text, **style)
    ax.set_xlabel(X_LABEL)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    if not any(v for n in names for v in log.history[n].values):  # all zero (a count of nothing): a 0..1 axis, not ±0.04
        ax.set_ylim(-0.1, 1)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if len(names) > 3:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    elif len(names) > 1:
        ax.legend(fontsize=7, loc="best", framealpha=0.8)


def _one_step(log: RunLog, names: list[str]) -> int | None:
    """The step of a line panel whose every metric was logged once, at one step (one evaluation); else None."""
    steps = {x for n in names for x in log.history[n].steps}
    return next(iter(steps)) if len(steps) == 1 and all(len(log.history[n].steps) == 1 for n in names) else None


def _bar(ax: Axes, values: dict[str, float]) -> None:
    names = list(values)
    ys = range(len(names))
    bars = ax.barh(ys, [values[n] for n in names], color="C0")
    ax.set_yticks(list(ys), [M.DATA_LABELS.get(n, label(n).removeprefix("mix/")) for n in names], fontsize=8)
    ax.invert_yaxis()
    top = max(values.values()) if any(values.values()) else 1.0
    ax.set_xlim(0, top * 1.25)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=all(float(v).is_integer() for v in values.values())))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if abs(x) >= 10 else f"{x:g}"))
    for bar, n in zip(bars, names):
        v = values[n]
        text = f"{v:,.0f}" if float(v).is_integer() or abs(v) >= 1000 else f"{v:.3g}"
        ax.annotate(
            text, (bar.get_width(), bar.get_y() + bar.get_height() / 2), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8
        )


def draw_panel(ax: Axes, panel: PanelSpec, names: list[str], log: RunLog, data: dict[str, float]) -> None:
    """One panel: bars of final values, lines over steps, or bars when each metric has one point."""
    ax.set_title(panel.title, fontsize=10)
    step = _one_step(log, names) if panel.kind == "line" else None
    if panel.kind == "bar":
        _bar(ax, {n: data[n] for n in names})
        ax.set_xlabel(panel.y_label)
    elif step is not None:  # one point a metric: bars with their values, not dots on an empty axis
        _bar(ax, {n: log.history[n].values[0] for n in names})
        ax.set_xlabel(f"{panel.y_label} (one evaluation, step {step:,})")
    else:
        _line(ax, log, names)
        ax.set_ylabel(panel.y_label)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)


def _whole_mix(names: list[str]) -> bool:
    """A mix panel of one source: its share is the whole epoch, a single bar of 1 that says nothing."""
    return len(names) == 1 and names[0].startswith(M.DATA_MIX_PREFIX)


def _present(panel: PanelSpec, log: RunLog, data: dict[str, float]) -> list[str]:
    if panel.kind == "bar":
        return [m for m in panel.metrics if m in data]
    return [m for m in panel.metrics if m in log.history and log.history[m].values]


def plot_section(section: SectionSpec, log: RunLog, out_dir: Path, run_name: str) -> SectionPlot:
    """Draw the panels of ``section`` that the run logged into ``out_dir/<section.key>.png`` (but a one-source mix)."""
    data = log.data()
    logged = [(p, names) for p, names in ((p, _present(p, log, data)) for p in section.panels) if names]
    drawn = [(p, names) for p, names in logged if not _whole_mix(names)]
    present = {m for _, names in logged for m in names}
    missing = [m for m in section.metrics() if m not in present]
    path = out_dir / f"{section.key}.png"
    if not drawn:
        path.unlink(missing_ok=True)  # a picture from an earlier report of this dir would mislead
        return SectionPlot(None, [], missing)
    cols = min(COLUMNS, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    fig = Figure(figsize=(PANEL_SIZE[0] * cols, PANEL_SIZE[1] * rows + 0.5), dpi=DPI, layout="constrained")
    fig.suptitle(f"{section.title} — {run_name}", fontsize=13, fontweight="bold")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (panel, names) in zip(axes, drawn):
        draw_panel(ax, panel, names, log, data)
    for ax in axes[len(drawn) :]:
        ax.set_visible(False)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, pil_kwargs={"optimize": True})
    return SectionPlot(path, sorted(m for _, names in drawn for m in names), missing)
