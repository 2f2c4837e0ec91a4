"""From config to the target as the trainer holds it: its head (plus the whole target in
inprocess mode), the target loaded for one serving eval, and the target factory an engine
process builds the target from (``engine=sglang``: after the SGLang preflight)."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from models.backends.hf.target import PathTarget
from models.backends.registry import able
from models.backends.sglang.preflight import check_target, choose_attention_backend, tp_size_problem
from models.backends.sglang.target import SGLangTarget
from models.embedded import embedded_target_dir
from models.engines import TargetFactory
from models.target import HFTargetEngine, load_tokenizer
from models.target_head import TargetHead, checkpoint_bytes
from trainer import console
from trainer.config import Config, EngineConfig, TargetConfig, TrainConfig
from trainer.dist import Parallel, group_port


@dataclass
class TargetBundle:
    """The target as the trainer process holds it: its head (tokenizer, config, embedding,
    lm_head) always; the whole model only when it runs in this process (``engine.mode=inprocess``)."""

    head: TargetHead
    engine: HFTargetEngine | None  # inprocess: the loaded target (the head shares its tensors); colocated: None
    pad_id: int
    path: Path  # local transformers dir or .gguf file


def load_target(cfg: TargetConfig, mode: str, device: torch.device, dtype: torch.dtype) -> TargetBundle:
    """``mode`` inprocess: load the whole target here; colocated (and so sglang): read its head
    from the checkpoint by tensor name, never a decoder layer (the target runs in the engine process)."""
    path = Path(cfg.path).expanduser() if cfg.path is not None else embedded_target_dir()
    if mode == "inprocess":
        engine = HFTargetEngine.from_path(path, aux_layer_ids=cfg.aux_layer_ids, device=device, dtype=dtype)
        head = TargetHead.of_engine(engine, load_tokenizer(path))
    else:
        engine, head = None, TargetHead.from_path(path, cfg.aux_layer_ids, device, dtype)
    tokenizer = head.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(f"target {path}: tokenizer has neither a pad nor an eos token")
    return TargetBundle(head=head, engine=engine, pad_id=pad_id, path=path)


def with_eval_target(
    target: TargetBundle, cfg: TrainConfig, device: torch.device, dtype: torch.dtype, run: Callable[[object], dict]
) -> dict:
    """``run(model)`` for one serving eval, ``model`` the whole target (a transformers causal LM)
    or None, plus ``serve_eval``: which it was and why.

    inprocess: the trainer's own target. Colocated: loaded for this eval only and freed when
    ``run`` returns; not loaded (None) when ``trainer.serve_eval`` is off or the checkpoint is
    over ``trainer.serve_eval_max_gb``."""
    if not cfg.serve_eval:
        return run(None) | {"serve_eval": "off (trainer.serve_eval=false): exported and verified only"}
    if target.engine is not None:
        return run(target.engine.model) | {"serve_eval": "the in-process target"}
    gb = checkpoint_bytes(target.path) / 1e9
    if cfg.serve_eval_max_gb is not None and gb > cfg.serve_eval_max_gb:
        why = (
            f"skipped: the target checkpoint {target.path} is {gb:.1f} GB, over trainer.serve_eval_max_gb={cfg.serve_eval_max_gb:g} "
            "(raise it, or null for no limit, to load the target for the eval); exported and verified only"
        )
        console.show(f"serving eval {why}", err=False)
        return run(None) | {"serve_eval": why}
    console.show(f"serving eval: loading the whole target {target.path} ({gb:.1f} GB) on {device} for this eval; freed after it", err=False)
    engine = HFTargetEngine.from_path(target.path, aux_layer_ids=target.head.info.aux_layer_ids, device=device, dtype=dtype)
    try:
        return run(engine.model) | {"serve_eval": f"the target loaded for the eval ({gb:.1f} GB), then freed"}
    finally:
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sglang_rank_factory(
    target: TargetConfig, engine: EngineConfig, ids: Sequence[int], dtype: torch.dtype, local_rank: int, port: int | None = None
) -> SGLangTarget:
    """engine=sglang's target factory for the engine process of ``local_rank``: rank ``local_rank % tp_size``
    of TP group ``local_rank // tp_size``, which meets on port ``dist_port + group``, or on ``port``
    (the group's free port, ``trainer.dist.group_port``) when ``engine.sglang.dist_port`` is null.
    With no ``target.path`` SGLang loads the embedded default's dequantised dir (``embedded_target_dir``)."""
    s = engine.sglang
    path = target.path if target.path is not None else embedded_target_dir()
    group, rank = divmod(local_rank, s.tp_size)
    prefill = None if engine.slot_tokens is None else s.tp_size * engine.slot_tokens  # a group's prefill: every rank's batch
    if prefill is not None and s.max_total_tokens is not None and s.max_total_tokens < prefill:
        raise ValueError(
            f"config engine.sglang.max_total_tokens: a KV pool of {s.max_total_tokens} tokens cannot hold one prefill of {prefill} "
            f"tokens (tp_size {s.tp_size} x engine.slot_tokens {engine.slot_tokens}); set engine.sglang.max_total_tokens={prefill} "
            "or more, or null (the pool mem_fraction_static leaves)"
        )
    if s.dist_port is None and port is None:
        raise ValueError("engine.sglang.dist_port is null: the group's port must be given (trainer.dist.group_port)")
    return SGLangTarget(
        path=str(path),
        aux_layer_ids=tuple(ids),
        dtype=dtype,
        tp_size=s.tp_size,
        tp_rank=rank,
        dist_port=s.dist_port + group if s.dist_port is not None else port,
        mem_fraction_static=s.mem_fraction_static,
        attention_backend=s.attention_backend,
        load_format=s.load_format,
        max_total_tokens=s.max_total_tokens,
        prefill_tokens=prefill,
    )


def local_world_size(par: Parallel) -> int:
    """Trainer ranks on this node: $LOCAL_SIZE (deepspeed launcher), $LOCAL_WORLD_SIZE (torchrun), else all of them."""
    return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or par.world)


def hf_factory(cfg: Config, ids: Sequence[int], dtype: torch.dtype, par: Parallel) -> PathTarget:
    """engine=hf's target factory: ``target.path`` (None: the embedded default) in transformers."""
    return PathTarget(cfg.target.path, tuple(ids), dtype)


def sglang_factory(cfg: Config, ids: Sequence[int], dtype: torch.dtype, par: Parallel) -> SGLangTarget:
    """engine=sglang's target factory for this rank, after the preflight: it runs here, before any
    weight is loaded or any step is taken, and picks the attention backend this install can run
    (models/backends/sglang/preflight.py)."""
    if par.device.type != "cuda":
        raise ValueError(f"config engine.name: sglang runs the target on CUDA GPUs; this trainer runs on {par.device}")
    tp, local = cfg.engine.sglang.tp_size, local_world_size(par)
    if local % tp:
        raise ValueError(f"config engine.sglang.tp_size: {tp} does not divide the {local} trainer ranks of a node (each runs one TP rank)")
    port = group_port(par, tp) if cfg.engine.sglang.dist_port is None else None
    factory = sglang_rank_factory(cfg.target, cfg.engine, ids, dtype, par.local_rank, port)
    check_target(factory.path, ids)
    problem = tp_size_problem(factory.path, tp)
    if problem is not None:
        raise ValueError(f"config engine.sglang.tp_size: {problem} ({factory.path}/config.json); choose a tp_size that does")
    choice = choose_attention_backend(factory.attention_backend, torch.cuda.get_device_capability(par.device))
    if par.rank == 0:
        console.show(f"engine=sglang: {choice.describe()}", err=False)
    return replace(factory, attention_backend=choice.backend)


FactoryMaker = Callable[[Config, Sequence[int], torch.dtype, Parallel], TargetFactory]
MAKERS: dict[type, FactoryMaker] = {
    PathTarget: hf_factory,
    SGLangTarget: sglang_factory,
}  # the maker of each models.backends features factory


def target_factory(cfg: Config, ids: Sequence[int], dtype: torch.dtype, par: Parallel) -> TargetFactory:
    """The target factory an engine process builds the target from: the one that ``engine.name``'s
    ``features`` entry in ``models.backends.registry.BACKENDS`` names, made by its maker. In colocated mode a ring slot
    must hold the largest batch (``data.max_tokens``): a batch that does not fit would stop the run when it comes."""
    slot, batch = cfg.engine.slot_tokens, cfg.data.max_tokens
    if cfg.engine.mode == "colocated" and slot is not None and slot < batch:
        raise ValueError(
            f"config engine.slot_tokens: a ring slot of {slot} tokens is smaller than a batch, up to data.max_tokens={batch}; "
            f"set engine.slot_tokens={batch} (its default, ${{data.max_tokens}}) or lower data.max_tokens"
        )
    return MAKERS[able("features")[cfg.engine.name].factory](cfg, ids, dtype, par)
