"""The training data as the trainer reads it: this rank's micro-batches of a mix, epoch after
epoch, with a position that a checkpoint saves and a resumed run restores.

Epoch ``e``: the mix's samples of ``e`` (``Mix.epoch``) are planned into groups by the
batcher (with an rng seeded by ``(seed, e)``), the same on every rank; rank ``r`` of ``world``
takes groups ``r, r + world, ...`` (``shard``). The position is ``(epoch, offset)``:
``offset`` counts the groups of that epoch, over all ranks, already handed out. Because a
group list is a pure function of the data, the seed and the epoch, that position is all a
resumed run needs to continue at the same sample; a fingerprint of the data and the
batching guards against resuming onto different data.

Contract for the checkpoint code:

- ``state_dict()`` is the position right after the last batch ``epoch_batches`` handed out.
  In-process, the trainer takes a batch, trains on it, then saves: the saved state resumes
  at the next batch. A consumer that reads ahead (a prefetching feature stream) saves
  ``state_for(epoch, batches_trained)`` instead (the same dict for the position it trained
  up to).
- ``load_state_dict(state)`` on a loader built from the same data and config puts the cursor
  there; the next ``epoch_batches(state["epoch"])`` starts at the saved offset. All ranks
  hold the same state (one copy per checkpoint is enough). A different world size is fine:
  the offset counts global groups, and the new ranks deal the rest of the epoch among them.
- Different data (sources, sizes, lengths, weights, seed, batching) fails with ValueError
  unless ``strict=False``, which keeps the epoch and offset as they are.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Iterator, Mapping, Sequence

from models.batch import TokenBatch
from trainer.data.batching import Batcher, Group, check_rank, shard
from trainer.data.chat import EncodedSample
from trainer.data.mix import Mix, Ref

STATE_VERSION = 1


class MixLoader:
    def __init__(self, sources: Mapping[str, Sequence[EncodedSample]], mix: Mix, batcher: Batcher, rank: int, world: int):
        check_rank(rank, world)
        for name, size in zip(mix.names, mix.sizes):
            if name not in sources or len(sources[name]) != size:
                raise ValueError(
                    f"mix source {name!r}: the mix was built for {size} samples, the loader got "
                    f"{len(sources[name]) if name in sources else 'none'}"
                )
        self.mix, self.batcher, self.rank, self.world = mix, batcher, rank, world
        self._samples = [sources[name] for name in mix.names]
        self.epoch, self.offset = 0, 0
        self._planned: tuple[int, list[Ref], list[Group]] | None = None
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        h = hashlib.sha256(json.dumps([self.mix.describe(), self.batcher.describe()], sort_keys=True).encode())
        for samples in self._samples:
            for s in samples:  # lengths and a cheap content sum: a changed tokenizer or corpus shows
                h.update(f"{len(s.input_ids)},{sum(s.input_ids)},{sum(s.loss_mask)};".encode())
        return h.hexdigest()[:16]

    def _sample(self, ref: Ref) -> EncodedSample:
        return self._samples[ref[0]][ref[1]]

    def _plan(self, epoch: int) -> tuple[list[Ref], list[Group]]:
        if self._planned is None or self._planned[0] != epoch:
            refs = self.mix.epoch(epoch)
            rng = random.Random(f"streamdraft-batches:{self.mix.seed}:{epoch}")
            groups = self.batcher.plan([len(self._sample(r).input_ids) for r in refs], rng)
            self._planned = (epoch, refs, groups)
        return self._planned[1], self._planned[2]

    def epoch_samples(self, epoch: int) -> list[EncodedSample]:
        """Every sample of ``epoch`` (all ranks), in the mix's order; repeats included."""
        return [self._sample(r) for r in self._plan(epoch)[0]]

    def batches_per_rank(self, epoch: int) -> int:
        """Micro-batches each rank gets in the whole of ``epoch``."""
        return len(self._plan(epoch)[1]) // self.world

    def epoch_batches(self, epoch: int) -> Iterator[TokenBatch]:
        """This rank's batches of ``epoch``, from the saved offset when the cursor is in this
        epoch, else from its start. The cursor moves before each batch is handed out; after
        the last one it moves to (epoch + 1, 0)."""
        refs, groups = self._plan(epoch)
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0
        if self.offset == 0 and len(groups) < self.world:
            raise ValueError(f"{len(groups)} batch(es) in epoch {epoch} for {self.world} ranks: lower data.max_tokens or add data")
        for group in shard(groups, self.rank, self.world, self.offset):
            self.offset += self.world
            yield self.batcher.collate([self._sample(refs[i]) for i in group])
        self.epoch, self.offset = epoch + 1, 0

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "epoch": self.epoch, "offset": self.offset, "world": self.world, "fingerprint": self.fingerprint}

    def state_for(self, epoch: int, batches_done: int) -> dict:
        """The state after every rank has trained ``batches_done`` batches of ``epoch`` (for a
        consumer that reads ahead: it knows what it trained, not what was handed out)."""
        if epoch < 0 or batches_done < 0:
            raise ValueError(f"epoch and batches_done must be >= 0, got {epoch}, {batches_done}")
        return self.state_dict() | {"epoch": epoch, "offset": batches_done * self.world}

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state: version {state.get('version')!r}, this code reads version {STATE_VERSION}")
        epoch, offset = state.get("epoch"), state.get("offset")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, offset)):
            raise ValueError(f"data loader state: epoch and offset must be ints >= 0, got {epoch!r}, {offset!r}")
        if strict and state.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"data loader state: saved for data fingerprint {state.get('fingerprint')!r}, this run's data is "
                f"{self.fingerprint!r} (sources, sample lengths, weights, seed or batching differ); "
                "load with strict=False to keep the epoch and offset anyway"
            )
        self.epoch, self.offset = epoch, offset
