"""Held-out split by prompt: the same conversation lands on the same side every run.

Two rules: a seeded hash of the first prompt (``split_holdout``), or membership of the first
prompt in a named prompt set (``split_by_prompts``: the first prompts of held-out chatterbot
categories, ``data.holdout_categories``).
"""

from __future__ import annotations

import hashlib
from typing import AbstractSet, Sequence

from trainer.data.conversation import Conversation


def _first_user_text(conv: Conversation) -> str:
    for message in conv:
        if message["role"] == "user":
            return message["content"]
    raise ValueError("a conversation without a user turn cannot be split by prompt")


def prompt_key(text: str) -> str:
    """A prompt as the split compares it: whitespace-collapsed and case-folded."""
    return " ".join(text.split()).casefold()


def first_prompt_key(conv: Conversation) -> str:
    return prompt_key(_first_user_text(conv))


def _unit_hash(text: str, seed: int) -> float:
    """A number in [0, 1) per (seed, prompt), salted apart from ``corpora prepare``'s held-out ranking: that
    one removes the smallest hashes of a seed, and an unsalted split at the same seed would find them gone."""
    digest = hashlib.sha256(f"split\0{seed}\0{text}".encode("utf-8")).digest()
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
        (heldout if _unit_hash(first_prompt_key(conv), seed) < fraction else train).append(conv)
    return train, heldout


def split_by_prompts(convs: Sequence[Conversation], heldout_keys: AbstractSet[str]) -> tuple[list[Conversation], list[Conversation]]:
    """(train, heldout): a conversation is held out when its first user turn's ``prompt_key`` is
    in ``heldout_keys``. Order within each side follows ``convs``."""
    train, heldout = [], []
    for conv in convs:
        (heldout if first_prompt_key(conv) in heldout_keys else train).append(conv)
    return train, heldout
