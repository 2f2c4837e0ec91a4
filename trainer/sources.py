"""From config to the trainer's inputs: the target engine with its tokenizer, and the data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.embedded import embedded_target_dir
from models.target import HFTargetEngine, load_tokenizer
from trainer.config import DataConfig, DataSourceConfig, TargetConfig
from trainer.data import (
    Batcher,
    Conversation,
    DatasetStats,
    EncodedSample,
    MaskPolicy,
    Mix,
    MixLoader,
    PaddedBatcher,
    encode_conversations,
    read_source,
    split_holdout,
)


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


@dataclass
class PreparedData:
    """Encoded samples per source, the mix over them, and the counters to report."""

    train: dict[str, list[EncodedSample]]  # per source, in source order
    eval: dict[str, list[EncodedSample]]  # per source: its held-out split
    eval_conversations: dict[str, list[Conversation]]  # per source: the held-out conversations (serving eval prompts)
    stats: dict[str, DatasetStats]  # per source: reading + encoding counters of its training side
    mix: Mix

    @property
    def total_stats(self) -> DatasetStats:
        return DatasetStats.total(self.stats.values())

    def report(self) -> dict:
        """The run summary's ``data`` entry: the summed counters, ``mix`` (source -> share of an
        epoch's samples, what ``trainer.metrics.data_metrics`` logs as data/mix/<source>) and
        ``sources`` (source -> its own counters)."""
        shares = {n: k / self.mix.epoch_samples for n, k in zip(self.mix.names, self.mix.quotas)}
        return self.total_stats.as_dict() | {"mix": shares, "sources": {n: s.as_dict() for n, s in self.stats.items()}}

    def heldout_conversations(self) -> list[Conversation]:
        """Every source's held-out conversations, sources in mix order."""
        return [c for name in self.mix.names for c in self.eval_conversations[name]]

    def eval_samples(self) -> list[EncodedSample]:
        """Every source's held-out samples, sources in mix order (not weighted)."""
        return [s for name in self.mix.names for s in self.eval[name]]

    def train_loader(self, batcher: Batcher, rank: int, world: int) -> MixLoader:
        return MixLoader(self.train, self.mix, batcher, rank, world)


def mask_policy(cfg: DataConfig) -> MaskPolicy:
    return MaskPolicy(last_turn_only=cfg.train_only_last_turn, train_thinking=cfg.train_thinking, think_tags=tuple(cfg.think_tags))


def padded_batcher(cfg: DataConfig, pad_id: int) -> PaddedBatcher:
    return PaddedBatcher(max_tokens=cfg.max_tokens, pad_id=pad_id)


def _read(name: str, src: DataSourceConfig, on_error: str):
    return read_source(src.format, src.path, languages=tuple(src.languages), split=src.split, on_error=on_error, name=f"data.sources.{name}")


def prepare_data(cfg: DataConfig, tokenizer, seed: int) -> PreparedData:
    """Read, split, cap and encode the sources the mix uses (all of ``data.sources`` when
    ``data.mix`` is unset); held-out conversations never reach training."""
    if not cfg.sources:
        raise ValueError("config data.sources: no source; select a data group (data=chatterbot, data=sharegpt, ...)")
    names = list(cfg.mix) if cfg.mix is not None else list(cfg.sources)
    policy = mask_policy(cfg)
    train, held, held_convs_by_source, stats = {}, {}, {}, {}
    for name in names:
        src = cfg.sources[name]
        convs, read_stats = _read(name, src, cfg.on_error)
        fraction = src.holdout_fraction if src.holdout_fraction is not None else cfg.holdout_fraction
        train_convs, held_convs = split_holdout(convs, fraction, seed)
        train_convs, held_convs = train_convs[: cfg.max_conversations], held_convs[: cfg.max_eval_conversations]
        train[name], stats[name] = encode_conversations(tokenizer, train_convs, cfg.max_len, read_stats, overlong=cfg.overlong, policy=policy)
        held[name], _ = encode_conversations(tokenizer, held_convs, cfg.max_len, overlong=cfg.overlong, policy=policy)
        held_convs_by_source[name] = held_convs
        if not train[name]:
            raise ValueError(f"data.sources.{name}: no training samples left ({stats[name].as_dict()})")
    weights = dict(cfg.mix) if cfg.mix is not None else None
    mix = Mix({n: len(train[n]) for n in names}, weights, seed, cfg.epoch_samples)
    return PreparedData(train=train, eval=held, eval_conversations=held_convs_by_source, stats=stats, mix=mix)

