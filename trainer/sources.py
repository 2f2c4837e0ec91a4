"""From config to the trainer's inputs: the target engine with its tokenizer, and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.embedded import embedded_target_dir
from models.target import HFTargetEngine, load_tokenizer
from trainer.config import DataConfig, TargetConfig
from trainer.data import DatasetStats, EncodedSample, encode_conversations, read_chatterbot, split_holdout


@dataclass
class TargetBundle:
    engine: HFTargetEngine
    tokenizer: object
    pad_id: int


def load_target(cfg: TargetConfig, device: torch.device, dtype: torch.dtype) -> TargetBundle:
    path = cfg.path if cfg.path is not None else embedded_target_dir()
    engine = HFTargetEngine.from_path(path, aux_layer_ids=cfg.aux_layer_ids, device=device, dtype=dtype)
    tokenizer = load_tokenizer(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(f"target {path}: tokenizer has neither a pad nor an eos token")
    return TargetBundle(engine=engine, tokenizer=tokenizer, pad_id=pad_id)


def prepare_samples(cfg: DataConfig, tokenizer, seed: int) -> tuple[list[EncodedSample], list[EncodedSample], DatasetStats]:
    """Training and held-out samples; the held-out conversations never reach training."""
    convs, stats = read_chatterbot(tuple(cfg.languages))
    train, held = split_holdout(convs, cfg.holdout_fraction, seed)
    train, held = train[: cfg.max_conversations], held[: cfg.max_eval_conversations]
    train_samples, stats = encode_conversations(tokenizer, train, cfg.max_len, stats)
    eval_samples, _ = encode_conversations(tokenizer, held, cfg.max_len)
    return train_samples, eval_samples, stats
