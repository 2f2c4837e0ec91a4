"""The two batch types that cross module boundaries (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TokenBatch:
    """What the data pipeline hands a feature engine.

    A padded batch holds one sample a row (``doc_ids`` None). A packed batch
    (``trainer.data.batching.PackedBatcher``) holds several samples (documents) a row, back
    to back from the row's start: ``doc_ids`` numbers them 0, 1, ... within the row, and no
    token may attend to, or be a label for, a token of another document.
    """

    input_ids: Tensor  # [B, T] long, right-padded
    loss_mask: Tensor  # [B, T] bool, True on assistant content and its end-of-turn token
    lengths: Tensor  # [B] long, valid tokens per row (a packed row: all its documents)
    doc_ids: Tensor | None = None  # [B, T] long, packed rows: document of each token in its row, -1 on padding

    def to(self, device) -> "TokenBatch":
        doc_ids = self.doc_ids.to(device) if self.doc_ids is not None else None
        return TokenBatch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device), doc_ids)

    def positions(self) -> Tensor:
        """[B, T] long: each token's position in its document (in its row when not packed)."""
        return token_positions(self.input_ids, self.doc_ids)

    def documents(self) -> list[Tensor]:
        """The token ids of every document (a padded row: its valid tokens), row by row."""
        if self.doc_ids is None:
            return [row[:n] for row, n in zip(self.input_ids, self.lengths.tolist())]
        return [row[doc == d] for row, doc in zip(self.input_ids, self.doc_ids) for d in range(int(doc.max()) + 1)]


def token_positions(input_ids: Tensor, doc_ids: Tensor | None) -> Tensor:
    """[B, T] long: position in the row (doc_ids None) or in the document (doc_ids [B, T])."""
    if doc_ids is None:
        b, t = input_ids.shape
        return torch.arange(t, device=input_ids.device).expand(b, t)
    return document_positions(doc_ids)


def document_positions(doc_ids: Tensor) -> Tensor:
    """doc_ids [B, T] (each document a contiguous run of one id) -> [B, T] position within the run."""
    t = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, t, 0).cummax(dim=1).values  # [B, T] index where each token's run starts
    return t - first


@dataclass
class FeatureBatch:
    """What a feature engine hands the trainer."""

    tokens: TokenBatch
    aux: Tensor  # [B, T, num_aux * H_target]  outputs of the decoder layers at the aux ids
    final: Tensor  # [B, T, H_target]            final normed hidden state
