"""Whether SGLang's share of a GPU leaves the draft trainer beside it room to train, checked before
the engine starts: ``engine.sglang.mem_fraction_static`` of the memory free at the engine's start
goes to its weights and KV pool, the rest stays with the trainer (its draft, optimizer states and
one batch's activations, ``models.memory_plan.draft_trainer_bytes``). A share or a batch (``data.max_tokens``)
that leaves the trainer surely too little is refused with the values that fit this GPU."""

from __future__ import annotations

import math
from typing import Callable

import torch

from models.memory_plan import GIB, draft_counts, draft_trainer_bytes
from trainer.config import Config

SURE_SHORT = 0.5  # refused when the trainer keeps less than this share of the estimate: the estimate runs high (docs/RELIABILITY.md)


def fitting_fraction(free: float, need: float) -> float:
    """The largest mem_fraction_static, in hundredths, that leaves ``need`` bytes of ``free`` to the trainer."""
    return math.floor(100 * (1 - need / free)) / 100


def fitting_tokens(room: float, need_of: Callable[[int], float], step: int, tokens: int) -> int:
    """The largest data.max_tokens up to ``tokens``, a multiple of ``step`` (data.max_len), whose trainer estimate
    ``need_of`` fits ``room`` bytes; 0 if none does."""
    fit = tokens // step * step
    while fit and need_of(fit) > room:
        fit -= step
    return fit


def check_trainer_room(fraction: float, free: float, need: float, tokens: int, fit_tokens: int) -> None:
    """ValueError naming the key when ``(1 - fraction) * free`` is surely too little for a trainer estimated to need
    ``need`` at ``tokens`` a batch, with the values that fit (``fit_tokens``: the data.max_tokens that does at ``fraction``)."""
    left = (1 - fraction) * free
    if left >= SURE_SHORT * need:
        return
    fit = fitting_fraction(free, need)
    fixes = ([f"engine.sglang.mem_fraction_static={fit} or less"] if fit >= 0.05 else []) + (
        [f"data.max_tokens={fit_tokens} or less"] if fit_tokens else []
    )
    fix = f"set {' or '.join(fixes)}" if fixes else "no batch fits beside the engine on this GPU: lower both"
    raise ValueError(
        f"config engine.sglang.mem_fraction_static={fraction:g}: SGLang would take that share of the {free / GIB:.1f} GiB free "
        f"on this GPU and leave the draft trainer {left / GIB:.1f} GiB, where it needs about {need / GIB:.1f} GiB (its states and "
        f"the activations of a {tokens}-token batch, estimated); {fix}"
    )


def check_engine_memory(cfg: Config, target_config, num_aux: int, device: torch.device) -> None:
    """For engine=sglang on a CUDA device with the KV pool unpinned (a pinned ``engine.sglang.max_total_tokens``
    takes only its own tokens): refuse a mem_fraction_static or data.max_tokens that leaves the trainer surely too little."""
    s = cfg.engine.sglang  # None for an engine other than SGLang
    if s is None or device.type != "cuda" or s.max_total_tokens is not None:
        return
    free, _ = torch.cuda.mem_get_info(device)
    check_batch_fits(cfg, target_config, num_aux, free)


def check_batch_fits(cfg: Config, target_config, num_aux: int, free: float) -> None:
    """``check_trainer_room`` for ``cfg``'s draft and batch with ``free`` bytes free on the GPU."""
    d = draft_counts(target_config, num_aux, cfg.draft.draft_vocab_size, cfg.draft.intermediate_size, cfg.draft.layout)
    tokens, fraction = cfg.data.max_tokens, cfg.engine.sglang.mem_fraction_static
    fit = fitting_tokens((1 - fraction) * free, lambda n: draft_trainer_bytes(d, n), cfg.data.max_len, tokens)
    check_trainer_room(fraction, free, draft_trainer_bytes(d, tokens), tokens, fit)
