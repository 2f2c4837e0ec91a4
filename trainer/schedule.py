"""The draft's optimizer (AdamW) and its learning-rate schedules: a linear warmup, then the shape
``schedule.name`` names in ``SCHEDULES`` (cosine decay, a constant LR, or warmup-stable-decay).
A new schedule is one function here and one ``conf/schedule/NAME.yaml``.

A run's progress is the larger of its steps done and, under ``trainer.max_time_s``, its share of
the time budget spent: a time-capped run warms up over the first ``warmup_ratio`` of its time and
ends its decay when its time ends, not at the step count its epochs would have taken. The time
axis starts when the run's first step ends: that step's seconds are mostly compilation (about
18 s of a 300-s budget on an H200), longer than the whole warmup.

A run that continues a trained draft (``draft.init_from``, or a resume that changes
``schedule.name``: grokking from a checkpoint) has a ``ScheduleStart``: its schedule runs over the
steps from that start, warmup included, and peaks at ``lr x continue_lr_ratio``. A trained draft sits
in a minimum that the full LR of a draft made from the target would leave; a fresh AdamW moves every
weight by about the LR on its first steps whatever its gradient."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch


class ScheduleSettings(Protocol):
    """The fields of ``trainer.config.ScheduleConfig`` that the schedules and the optimizer read."""

    name: str
    lr: float
    warmup_ratio: float
    min_lr_ratio: float
    decay_ratio: float
    continue_lr_ratio: float
    weight_decay: float
    betas: list[float]


@dataclass
class RunClock:
    """A run's training seconds against ``trainer.max_time_s`` (the slowest rank's, over every resume)."""

    max_time_s: float | None = None
    spent_s: float = 0.0
    start_s: float | None = None  # training seconds when the run's first step ended: the schedule's time axis starts there

    @property
    def time_frac(self) -> float:
        """The share of the time budget spent (what ends the run); 0 without one."""
        return 0.0 if self.max_time_s is None else self.spent_s / self.max_time_s

    @property
    def schedule_frac(self) -> float:
        """The share of the time budget after the first step that is spent (what the LR schedule reads);
        the whole budget's share until that step has ended."""
        if self.start_s is None or self.max_time_s is None or self.spent_s >= self.max_time_s:
            return self.time_frac
        return max(0.0, self.spent_s - self.start_s) / (self.max_time_s - self.start_s)


@dataclass(frozen=True)
class ScheduleStart:
    """Where a run's LR schedule starts (kept in its checkpoints' position, so a resume goes on with it)."""

    step: int = 0  # the optimizer step the warmup starts at: a resume that changed schedule.name, its step
    continued: bool = False  # the draft was trained before this schedule: peak lr x continue_lr_ratio


def warmup_steps(cfg: ScheduleSettings, total_steps: int) -> int:
    return math.ceil(cfg.warmup_ratio * total_steps)


def cosine(cfg: ScheduleSettings, done: float, start: float) -> float:
    """Half a cosine from the end of the warmup (``start``, a share of the run) to the end, down to ``min_lr_ratio``."""
    progress = max(0.0, done - start) / max(1e-12, 1.0 - start)
    half = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * half


def constant(cfg: ScheduleSettings, done: float, start: float) -> float:
    """The peak LR to the end."""
    return 1.0


def wsd(cfg: ScheduleSettings, done: float, start: float) -> float:
    """The peak LR, then a linear fall to ``min_lr_ratio`` over the run's last ``decay_ratio``."""
    left = (1.0 - done) / cfg.decay_ratio  # 1 where the decay starts, 0 at the end
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * min(1.0, left)


# schedule.name -> the multiplier of the peak LR after the warmup, at the run's progress ``done`` (0..1)
SCHEDULES: dict[str, Callable[[ScheduleSettings, float, float], float]] = {"cosine": cosine, "constant": constant, "wsd": wsd}


def lr_factor(cfg: ScheduleSettings, step: int, total_steps: int, time_frac: float = 0.0) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based) of ``total_steps``, with
    ``time_frac`` of the run's time budget spent (``RunClock.schedule_frac``)."""
    warm = warmup_steps(cfg, total_steps)
    warmed = max((step + 1) / warm, time_frac / cfg.warmup_ratio) if warm else 1.0  # by steps or by time, the further
    if warmed < 1.0:
        return warmed
    done = min(1.0, max(step / max(1, total_steps), time_frac))  # the run's progress
    return SCHEDULES[cfg.name](cfg, done, warm / max(1, total_steps))


def run_lr_factor(cfg: ScheduleSettings, start: ScheduleStart, step: int, total_steps: int, time_frac: float = 0.0) -> float:
    """``lr_factor`` over the steps from ``start``, scaled by ``continue_lr_ratio`` for a trained draft."""
    peak = cfg.continue_lr_ratio if start.continued else 1.0
    return peak * lr_factor(cfg, step - start.step, total_steps - start.step, time_frac)


def draft_optimizer(params: list[torch.nn.Parameter], cfg: ScheduleSettings, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the draft's trainable parameters: one fused kernel per step on a GPU (what
    lab/bench_throughput.py times), the per-parameter loop elsewhere."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=fused, foreach=False)
