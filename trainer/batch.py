"""The two batch types that cross module boundaries (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class TokenBatch:
    """What the data pipeline hands a target engine."""

    input_ids: Tensor  # [B, T] long, right-padded
    loss_mask: Tensor  # [B, T] bool, True on assistant content and its end-of-turn token
    lengths: Tensor  # [B] long, valid tokens per row

    def to(self, device) -> "TokenBatch":
        return TokenBatch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device))


@dataclass
class FeatureBatch:
    """What a target engine hands the trainer."""

    tokens: TokenBatch
    aux: Tensor  # [B, T, num_aux * H_target]  outputs of the decoder layers at the aux ids
    final: Tensor  # [B, T, H_target]            final normed hidden state
