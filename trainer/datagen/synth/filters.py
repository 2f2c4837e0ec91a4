"""Which generated prompts to keep: clean-up, then length, language and refusal / meta-text checks.

Each check is a rule one can read and tune (``FilterSettings``):

* **length**: ``min_chars`` <= characters <= ``max_chars`` and at least ``min_words`` words;
  a prompt the generator did not finish (cut by ``max_new_tokens``) is dropped here too.
* **language**: English by ``trainer.data.english.is_english`` at ``min_ascii`` and ``min_stopwords``.
* **refusal / meta-text**: the generator refused or talked about the task instead of writing
  a prompt: text that starts like an apology, a refusal or an acknowledgement ("I'm sorry",
  "As an AI", "I cannot help / write / ...", "Sure, ..."), or mentions the task anywhere
  ("language model", "here is a question", "the user", a chat-template marker). A user
  prompt may well say "I cannot sleep": a leading "I cannot" is a refusal only when what
  follows refuses the task.

A follow-up turn must also not **echo** the conversation: at least ``ECHO_SHARE`` of its word
bigrams found in the prompt or in the answer it follows means the generator copied instead
of writing the person's next message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from trainer.data.dedup import shingles, words
from trainer.data.english import is_english

STAGES = ("length", "language", "refusal")  # the order the checks run in
ECHO_SHARE = 0.5

_LABEL = re.compile(r"^(?:user|person|question|message|new message|prompt|request|q)\s*[:\-]\s*", re.IGNORECASE)
_QUOTES = ('"', "'", "\u201c", "\u201d", "`")
_REFUSAL_START = re.compile(
    r"^(?:i'?m sorry|sorry|i apologi[sz]e|unfortunately|as an ai"
    r"|i (?:cannot|can't|can not|am unable to|won't|am not able to) "
    r"(?:help|assist|write|provide|create|generate|do that|answer|comply|fulfil)"
    r"|(?:sure|certainly|of course|okay|ok|absolutely|great)\b)",
    re.IGNORECASE,
)
_META = re.compile(
    r"\bas an ai\b|\blanguage model\b|\bhere(?:'s| is| are) (?:a|an|some|the|your|my) (?:new |sample |example )?"
    r"(?:question|message|prompt|request)s?\b|\b(?:new|sample|example) (?:question|message|prompt)\b|\bthe user\b"
    r"|<\||\|>|\b(?:assistant|user)\s*:",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class FilterSettings:
    min_chars: int = 8
    max_chars: int = 400
    min_words: int = 2
    min_ascii: float = 0.95  # share of letters that are ASCII
    min_stopwords: float = 0.15  # share of words that are English function words (0: this check off)

    def __post_init__(self) -> None:
        if (
            not 0 <= self.min_chars <= self.max_chars
            or self.min_words < 0
            or not 0 <= self.min_ascii <= 1
            or not 0 <= self.min_stopwords <= 1
        ):
            raise ValueError(f"filter settings out of range: {self}")


def clean(text: str) -> str:
    """The prompt in a generation: its first paragraph, without a leading label ("Question:")
    and without quotes around the whole of it."""
    text = text.strip().split("\n\n", 1)[0].strip()
    text = _LABEL.sub("", text).strip()
    if len(text) >= 2 and text[0] in _QUOTES and text[-1] in _QUOTES:
        text = text[1:-1].strip()
    return text


def rejection(text: str, finished: bool, settings: FilterSettings) -> str | None:
    """The first check (``STAGES``) that ``text`` fails, or None when it is kept."""
    if not finished or not settings.min_chars <= len(text) <= settings.max_chars or len(words(text)) < settings.min_words:
        return "length"
    if not is_english(text, settings.min_ascii, settings.min_stopwords):
        return "language"
    if _REFUSAL_START.match(text) or _META.search(text):
        return "refusal"
    return None


def echoes(text: str, context: Sequence[str]) -> bool:
    """Whether ``ECHO_SHARE`` of ``text``'s word bigrams occur in one of the ``context`` texts."""
    own = shingles(text, 2)
    return bool(own) and any(len(own & shingles(c, 2)) >= ECHO_SHARE * len(own) for c in context)
