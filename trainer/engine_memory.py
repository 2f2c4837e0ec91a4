"""Whether SGLang's share of a GPU leaves the draft trainer beside it room to train, checked before
the engine starts: ``engine.sglang.mem_fraction_static`` of the memory free at the engine's start
goes to its weights and KV pool, the rest stays with the trainer (its draft, optimizer states and
one batch's activations, ``models.memory_plan.draft_trainer_bytes``)."""

from __future__ import annotations

import math

import torch

from models.memory_plan import GIB, draft_counts, draft_trainer_bytes
from trainer.config import Config

SURE_SHORT = 0.5  # refused when the trainer keeps less than this share of the estimate: the estimate runs high (docs/RELIABILITY.md)


def fitting_fraction(free: float, need: float) -> float:
    """The largest mem_fraction_static, in hundredths, that leaves ``need`` bytes of ``free`` to the trainer."""
    return math.floor(100 * (1 - need / free)) / 100


def check_trainer_room(fraction: float, free: float, need: float, tokens: int) -> None:
    """ValueError naming the key when ``(1 - fraction) * free`` is surely too little for a trainer estimated to need ``need``."""
    left = (1 - fraction) * free
    if left >= SURE_SHORT * need:
        return
    fit = fitting_fraction(free, need)
    fix = f"set engine.sglang.mem_fraction_static={fit} or less" if fit >= 0.05 else "lower data.max_tokens"
    raise ValueError(
        f"config engine.sglang.mem_fraction_static={fraction:g}: SGLang would take that share of the {free / GIB:.1f} GiB free "
        f"on this GPU and leave the draft trainer {left / GIB:.1f} GiB, where it needs about {need / GIB:.1f} GiB (its states and "
        f"the activations of a {tokens}-token batch, estimated); {fix}"
    )


def check_engine_memory(cfg: Config, target_config, num_aux: int, device: torch.device) -> None:
    """For engine=sglang on a CUDA device with the KV pool unpinned (a pinned ``engine.sglang.max_total_tokens``
    takes only its own tokens): refuse a mem_fraction_static that leaves the trainer surely too little."""
    s = cfg.engine.sglang  # None for an engine other than SGLang
    if s is None or device.type != "cuda" or s.max_total_tokens is not None:
        return
    d = draft_counts(target_config, num_aux, cfg.draft.vocab_size, cfg.draft.intermediate_size)
    free, _ = torch.cuda.mem_get_info(device)
    need = draft_trainer_bytes(d, cfg.data.max_tokens)
    check_trainer_room(s.mem_fraction_static, free, need, cfg.data.max_tokens)
