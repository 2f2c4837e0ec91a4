"""Samples -> micro-batches: a batcher plans groups of samples, then collates each into a TokenBatch.

The two steps are apart so that layouts plug in without touching the order, the mix, the
rank sharding or the resume position (all of which only see *groups*, tuples of sample
indices):

- ``PaddedBatcher``: one sample a row, right-padded; a group's padded size
  ``rows x longest`` stays within ``max_tokens``.
- ``PackedBatcher`` (``data.packing``): several whole samples a row, back to back, rows of
  at most ``row_tokens`` (``data.max_len``), ``max_tokens // row_tokens`` rows a batch; the
  batch's ``doc_ids`` keep the documents apart in the target and in the draft.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from models.batch import TokenBatch
from trainer.data.chat import EncodedSample

Group = tuple[int, ...]  # indices of the samples that form one micro-batch


class Batcher(Protocol):
    def plan(self, lengths: Sequence[int], rng: random.Random) -> list[Group]:
        """Groups over indices into ``lengths`` (given in the epoch's order), in batch order."""

    def collate(self, samples: Sequence[EncodedSample]) -> TokenBatch:
        """One micro-batch of a group's samples."""

    def describe(self) -> str:
        """Everything that changes the plan, for the resume fingerprint."""


@dataclass(frozen=True)
class PaddedBatcher:
    """Padded micro-batches of ``B x T_max <= max_tokens`` (a sample longer than that alone).

    ``plan``: each window of ``sort_window`` consecutive samples is sorted by length
    (ascending and descending in turn, so lengths run smoothly across window edges), the
    result is cut into consecutive groups under the budget, and the group order is shuffled.
    ``sort_window=1`` keeps the given order (measured on chatterbot English with SmolLM2,
    4096-token budget: 39% of the padded tokens are real with 1, 80% with 256, 93% with 1024).
    """

    max_tokens: int
    pad_id: int
    sort_window: int = 256

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.sort_window < 1:
            raise ValueError(f"max_tokens and sort_window must be >= 1, got {self.max_tokens}, {self.sort_window}")

    def plan(self, lengths: Sequence[int], rng: random.Random) -> list[Group]:
        order = list(range(len(lengths)))
        windows = [order[w : w + self.sort_window] for w in range(0, len(order), self.sort_window)]
        order = [i for k, win in enumerate(windows) for i in sorted(win, key=lengths.__getitem__, reverse=k % 2 == 1)]
        groups = [tuple(order[j] for j in g) for g in group_by_budget([lengths[i] for i in order], self.max_tokens)]
        rng.shuffle(groups)
        return groups

    def collate(self, samples: Sequence[EncodedSample]) -> TokenBatch:
        return pad_batch(samples, self.pad_id)

    def describe(self) -> str:
        return f"padded(max_tokens={self.max_tokens}, sort_window={self.sort_window})"


@dataclass(frozen=True)
class PackedBatcher:
    """Packed micro-batches: rows of several whole samples, up to ``row_tokens`` tokens a row,
    ``max_tokens // row_tokens`` rows a batch (so ``B x T <= max_tokens``).

    ``plan``: the samples of each window of ``sort_window`` are packed into rows first-fit
    decreasing; the rows' samples, in row order, are cut into rows again by ``next_fit_rows``
    (what ``collate`` does, so a group carries its rows implicitly; inside a window this gives
    the same rows, since a sample never fits an earlier row's leftover room), the rows into
    groups, and the group order is shuffled. ``collate``: ``next_fit_rows``, then ``pack_rows``.
    """

    max_tokens: int
    row_tokens: int
    pad_id: int
    sort_window: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.row_tokens <= self.max_tokens or self.sort_window < 1:
            raise ValueError(
                f"need 1 <= row_tokens <= max_tokens and sort_window >= 1, got {self.row_tokens}, {self.max_tokens}, {self.sort_window}"
            )

    @property
    def rows(self) -> int:
        return self.max_tokens // self.row_tokens

    def plan(self, lengths: Sequence[int], rng: random.Random) -> list[Group]:
        n, window = len(lengths), self.sort_window
        if n and max(lengths) > self.row_tokens:
            raise ValueError(f"a sample of {max(lengths)} tokens does not fit a packed row of {self.row_tokens} (data.max_len)")
        windows = [range(w, min(n, w + window)) for w in range(0, n, window)]
        order = [i for win in windows for row in first_fit_rows(win, lengths, self.row_tokens) for i in row]
        rows = [[order[j] for j in row] for row in next_fit_rows([lengths[i] for i in order], self.row_tokens)]
        groups = [tuple(i for row in rows[r : r + self.rows] for i in row) for r in range(0, len(rows), self.rows)]
        rng.shuffle(groups)
        return groups

    def collate(self, samples: Sequence[EncodedSample]) -> TokenBatch:
        rows = next_fit_rows([len(s.input_ids) for s in samples], self.row_tokens)
        return pack_rows([[samples[j] for j in row] for row in rows], self.pad_id)

    def describe(self) -> str:
        return f"packed(max_tokens={self.max_tokens}, row_tokens={self.row_tokens}, sort_window={self.sort_window})"


def first_fit_rows(items: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """``items`` (indices into ``lengths``) longest first, each into the first row with room."""
    rows, room = [], []
    for i in sorted(items, key=lengths.__getitem__, reverse=True):
        r = next((r for r, free in enumerate(room) if lengths[i] <= free), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(capacity)
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def next_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Consecutive runs of indices whose lengths sum to at most ``capacity``: an item that does
    not fit the current run starts the next."""
    rows, used = [], capacity
    for i, length in enumerate(lengths):
        if not rows or used + length > capacity:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += length
    return rows


def group_by_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups whose padded size len(group) * max(length) <= max_tokens; a single
    item longer than the budget forms its own group."""
    groups, current, longest = [], [], 0
    for i, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def pad_batch(samples: Sequence[EncodedSample], pad_id: int) -> TokenBatch:
    """Right-pad ``samples`` into one TokenBatch (padding: ``pad_id``, mask False)."""
    width = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, s in enumerate(samples):
        input_ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.long)
        loss_mask[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.bool)
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    return TokenBatch(input_ids=input_ids, loss_mask=loss_mask, lengths=lengths)


def pack_rows(rows: Sequence[Sequence[EncodedSample]], pad_id: int) -> TokenBatch:
    """Each row's samples back to back, right-padded to the longest row; ``doc_ids`` number a
    row's samples 0, 1, ... (padding -1)."""
    width = max(sum(len(s.input_ids) for s in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)  # [B, T]
    doc_ids = torch.full((len(rows), width), -1, dtype=torch.long)  # [B, T]
    lengths = torch.zeros(len(rows), dtype=torch.long)  # [B]
    for r, row in enumerate(rows):
        for d, s in enumerate(row):
            start, end = int(lengths[r]), int(lengths[r]) + len(s.input_ids)
            input_ids[r, start:end] = torch.tensor(s.input_ids, dtype=torch.long)
            loss_mask[r, start:end] = torch.tensor(s.loss_mask, dtype=torch.bool)
            doc_ids[r, start:end] = d
            lengths[r] = end
    return TokenBatch(input_ids=input_ids, loss_mask=loss_mask, lengths=lengths, doc_ids=doc_ids)


def check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need world >= 1 and 0 <= rank < world, got rank={rank}, world={world}")


def shard(groups: Sequence[Group], rank: int, world: int, offset: int = 0) -> list[Group]:
    """This rank's groups from ``offset`` on: groups offset + rank, offset + rank + world, ...;
    every rank gets (len(groups) - offset) // world of them, so the last (at most world - 1)
    groups are left out and all ranks step in lockstep."""
    check_rank(rank, world)
    per_rank = max(0, len(groups) - offset) // world
    return list(groups[offset + rank : offset + per_rank * world : world])


def token_batches(
    samples: Sequence[EncodedSample],
    max_tokens: int,
    seed: int,
    epoch: int,
    rank: int,
    world: int,
    pad_id: int,
    sort_window: int = 256,
) -> list[TokenBatch]:
    """This rank's padded batches for one pass over ``samples`` (a single source, no mix; the
    held-out set uses it). The samples are shuffled by (seed, epoch), planned by
    ``PaddedBatcher`` and sharded by ``shard``: every rank builds the same groups, so ranks are
    disjoint; another epoch reshuffles, so the left-out samples change. With world = 1 every
    sample appears exactly once."""
    batcher = PaddedBatcher(max_tokens, pad_id, sort_window)
    check_rank(rank, world)
    if not samples:
        raise ValueError("no samples to batch")
    rng = random.Random(f"streamdraft-data:{seed}:{epoch}")
    order = list(range(len(samples)))
    rng.shuffle(order)
    groups = [tuple(order[i] for i in g) for g in batcher.plan([len(samples[i].input_ids) for i in order], rng)]
    mine = shard(groups, rank, world)
    if not mine:
        raise ValueError(f"{len(groups)} batch(es) for {world} ranks: lower max_tokens or add data")
    return [batcher.collate([samples[i] for i in group]) for group in mine]
