"""The draft's optimizer (AdamW) and its learning-rate schedules: linear warmup, then cosine
decay or a constant LR."""

from __future__ import annotations

import math

import torch

from trainer.config import ScheduleConfig


def warmup_steps(cfg: ScheduleConfig, total_steps: int) -> int:
    return math.ceil(cfg.warmup_ratio * total_steps)


def lr_factor(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based) of ``total_steps``."""
    warm = warmup_steps(cfg, total_steps)
    if step < warm:
        return (step + 1) / warm
    if cfg.name == "constant":
        return 1.0
    progress = (step - warm) / max(1, total_steps - warm)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def draft_optimizer(params: list[torch.nn.Parameter], cfg: ScheduleConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the draft's trainable parameters: one fused kernel per step on a GPU (what
    launch/bench_throughput.py times), the per-parameter loop elsewhere."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=fused, foreach=False)
