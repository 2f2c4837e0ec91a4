"""The data figures a run reports: what each source kept and skipped, what encoding made of it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable


@dataclass
class DatasetStats:
    """Counters of one source (or their sum). Reading counters first, then encoding counters."""

    conversations: int = 0  # conversations the source kept
    malformed: int = 0  # records skipped as malformed (data.on_error=skip; chatterbot always skips)
    no_assistant: int = 0  # conversations skipped: no assistant turn
    duplicates: int = 0  # conversations skipped: exact repeat of an earlier one in the same source
    leading_turns_dropped: int = 0  # assistant turns before the first user turn, dropped from kept conversations
    answers_cut: int = 0  # assistant turns cut to data.answer_tokens tokens
    samples: int = 0  # encoded samples (at least one masked token)
    tokens: int = 0  # tokens in the samples, after the length policy
    masked_tokens: int = 0  # tokens under the loss mask
    truncated: int = 0  # samples cut to data.max_len and kept (overlong=truncate)
    overlong_dropped: int = 0  # samples longer than data.max_len, dropped (overlong=drop)
    no_masked_token: int = 0  # conversations dropped: no masked token (left after truncation)
    boundary_tokens: int = 0  # tokens straddling a mask edge (left unmasked; expect 0)
    thinking_tokens: int = 0  # assistant tokens kept out of the mask as thinking (train_thinking=false)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def __add__(self, other: "DatasetStats") -> "DatasetStats":
        return DatasetStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    @staticmethod
    def total(parts: Iterable["DatasetStats"]) -> "DatasetStats":
        out = DatasetStats()
        for part in parts:
            out = out + part
        return out
