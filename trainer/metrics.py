"""Metric names (one place, shared by the logger and later the dashboards) and the wandb run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.config import WandbConfig

LOSS = "train/loss"
LR = "train/lr"
GRAD_NORM = "train/grad_norm"
SIM_ACCEPT = "train/sim_accept_len"
TOKENS_PER_S = "perf/tokens_per_s"
STEP_TIME = "perf/step_time_s"
TARGET_TIME = "perf/target_time_s"
DRAFT_TIME = "perf/draft_time_s"
EVAL_LOSS = "eval/loss"
EVAL_SIM_ACCEPT = "eval/sim_accept_len"


def step_loss(k: int, split: str = "train") -> str:
    return f"{split}/loss_{k}"


def step_acc(k: int, split: str = "train") -> str:
    return f"{split}/acc_{k}"


METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step: {"step": n, name: value, ...}


class MetricsSink:
    """Where rank 0's metrics go: wandb (offline unless WANDB_MODE or the config say
    otherwise) and ``run_dir/metrics.jsonl``, which needs no wandb to read back."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict):
        import wandb

        mode = os.environ.get("WANDB_MODE", cfg.mode)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, mode=mode, dir=str(run_dir), config=config)
        self.path = run_dir / METRICS_FILE
        self.path.write_text("")

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")

    def finish(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
        self.run.finish()
