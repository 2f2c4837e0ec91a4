"""Where rank 0's metric rows go: the wandb run and ``RUN_DIR/metrics.jsonl`` (``MetricsSink``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.config import WandbConfig
from trainer.console import verbose
from trainer.report.metrics import METRICS_FILE, data_metrics


class MetricsSink:
    """Where rank 0's metrics go: wandb (offline unless WANDB_MODE or the config say
    otherwise) and ``run_dir/metrics.jsonl``, which needs no wandb to read back.

    A resumed run (``resume_step``: the checkpoint's step) continues wandb run ``run_id``
    and keeps the log's rows up to that step: rows a killed process wrote after its last
    checkpoint are dropped, so no step appears twice."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict, run_id: str | None = None, resume_step: int | None = None):
        import wandb

        mode = os.environ.get("WANDB_MODE", cfg.mode)
        settings = wandb.Settings(quiet=not verbose())  # no run summary / history table at the end
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            mode=mode,
            dir=str(run_dir),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
            settings=settings,
        )
        self.path = run_dir / METRICS_FILE
        if resume_step is None:
            self.path.write_text("")
        else:
            keep_rows_up_to(self.path, resume_step)

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")

    def finish(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
        if "data" in summary:  # flat data/* figures, for the dashboard's data section
            self.run.summary.update(data_metrics(summary["data"]))
        self.run.finish()


def keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrite the metrics log ``path`` (atomically) without rows past ``step`` and without a
    last line torn by a killed writer; a missing log starts empty."""
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
