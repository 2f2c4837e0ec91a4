"""Metric names (one place, shared by the logger and later the dashboards) and the wandb run."""

from __future__ import annotations

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


def start_wandb(cfg: WandbConfig, run_dir: Path, config: dict):
    """A wandb run under ``run_dir``; offline unless WANDB_MODE or the config say otherwise."""
    import wandb

    mode = os.environ.get("WANDB_MODE", cfg.mode)
    return wandb.init(
        project=cfg.project, entity=cfg.entity, name=cfg.name, mode=mode, dir=str(run_dir), config=config
    )
