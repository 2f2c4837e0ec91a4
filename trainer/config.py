"""Typed configuration, one dataclass per component.

Hydra composes the YAML groups in ``conf/`` over these schemas (registered as
``streamdraft_schema``), so an unknown key or a value of the wrong type fails at
composition; ``__post_init__`` checks the values (``ValueError`` naming the key).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"config {key}: {message}")


@dataclass
class TargetConfig:
    name: str = "smollm2-135m-instruct"
    path: Optional[str] = None  # local transformers dir or .gguf file; None: the embedded default
    aux_layer_ids: Optional[list[int]] = None  # output of decoder layer k; None: [1, N//2-1, N-4]
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU


@dataclass
class DraftConfig:
    vocab_size: int = 32000  # capped at the target vocab
    ttt_steps: int = 7
    step_decay: float = 0.8
    norm_output: bool = False  # what SGLang feeds back at draft steps > 0 (DESIGN contract 5)

    def __post_init__(self) -> None:
        _require(self.vocab_size > 0, "draft.vocab_size", "must be positive")
        _require(self.ttt_steps >= 1, "draft.ttt_steps", "must be >= 1")
        _require(0 < self.step_decay <= 1, "draft.step_decay", "must be in (0, 1]")


@dataclass
class DataConfig:
    source: str = "chatterbot"
    languages: list[str] = field(default_factory=lambda: ["english"])
    holdout_fraction: float = 0.1
    max_len: int = 512
    max_tokens: int = 4096  # padded tokens per micro-batch (B x T)
    max_conversations: Optional[int] = None  # cap on training conversations (smoke runs)
    max_eval_conversations: Optional[int] = None

    def __post_init__(self) -> None:
        _require(self.source == "chatterbot", "data.source", f"unknown source {self.source!r} (known: chatterbot)")
        _require(0 < self.holdout_fraction < 1, "data.holdout_fraction", "must be in (0, 1)")
        _require(self.max_len >= 8, "data.max_len", "must be >= 8")
        _require(self.max_tokens >= self.max_len, "data.max_tokens", "must be >= data.max_len")


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # cosine | constant
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])

    def __post_init__(self) -> None:
        _require(self.name in ("cosine", "constant"), "schedule.name", f"{self.name!r} is not cosine or constant")
        _require(self.lr > 0, "schedule.lr", "must be positive")
        _require(0 <= self.warmup_ratio < 1, "schedule.warmup_ratio", "must be in [0, 1)")
        _require(0 <= self.min_lr_ratio <= 1, "schedule.min_lr_ratio", "must be in [0, 1]")
        _require(len(self.betas) == 2, "schedule.betas", "needs two values")


@dataclass
class EngineConfig:
    name: str = "hf"
    mode: str = "inprocess"

    def __post_init__(self) -> None:
        _require(self.name == "hf", "engine.name", f"unknown engine {self.name!r} (known: hf)")
        _require(self.mode == "inprocess", "engine.mode", f"unknown mode {self.mode!r} (known: inprocess)")


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 1
    grad_clip: float = 0.5
    grad_accum: int = 1

    def __post_init__(self) -> None:
        _require(self.zero_stage in (0, 1, 2, 3), "deepspeed.zero_stage", "must be 0, 1, 2 or 3")
        _require(self.grad_clip > 0, "deepspeed.grad_clip", "must be positive")
        _require(self.grad_accum >= 1, "deepspeed.grad_accum", "must be >= 1")


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled; the WANDB_MODE env var wins
    project: str = "streamdraft"
    entity: Optional[str] = None
    name: Optional[str] = None

    def __post_init__(self) -> None:
        _require(self.mode in ("offline", "online", "disabled"), "wandb.mode", f"{self.mode!r} is not offline, online or disabled")


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: Optional[int] = None  # optimizer steps; caps the run (smoke tests, step-capped recipes)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    log_every: int = 10
    export_every: Optional[int] = None  # optimizer steps between exports; the end always exports
    eval_batches: Optional[int] = None  # held-out batches per evaluation; None: all
    output_dir: str = "."  # relative to Hydra's run dir

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "trainer.epochs", "must be >= 1")
        _require(self.max_steps is None or self.max_steps >= 1, "trainer.max_steps", "must be >= 1")
        _require(self.device in ("auto", "cpu", "cuda"), "trainer.device", f"{self.device!r} is not auto, cpu or cuda")
        _require(self.log_every >= 1, "trainer.log_every", "must be >= 1")


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    trainer: TrainConfig = field(default_factory=TrainConfig)


def register_schema() -> None:
    ConfigStore.instance().store(name="streamdraft_schema", node=Config)


def to_config(cfg: DictConfig) -> Config:
    """Resolve a composed Hydra config into typed dataclasses (runs every check)."""
    return OmegaConf.to_object(cfg)
