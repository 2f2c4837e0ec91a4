"""Held-out split by prompt: the same conversation lands on the same side every run."""

from __future__ import annotations

import hashlib
from typing import Sequence

from trainer.data.conversation import Conversation


def _first_user_text(conv: Conversation) -> str:
    for message in conv:
        if message["role"] == "user":
            return message["content"]
    raise ValueError("a conversation without a user turn cannot be split by prompt")


def _unit_hash(text: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}\0{text}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_holdout(convs: Sequence[Conversation], fraction: float, seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """(train, heldout): a conversation is held out when a seeded hash of its first user turn
    (whitespace-collapsed, case-folded) falls below ``fraction``. Each prompt decides alone, so
    a prompt never lands on both sides, and the split of old conversations is unchanged when
    the corpus grows (or when its assistant turns are regenerated). Order within each side
    follows ``convs``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout fraction must be in (0, 1), got {fraction!r}")
    train, heldout = [], []
    for conv in convs:
        key = " ".join(_first_user_text(conv).split()).casefold()
        (heldout if _unit_hash(key, seed) < fraction else train).append(conv)
    return train, heldout
