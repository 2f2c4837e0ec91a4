"""A tiny run on two ranks, then what the test checks from the trained state (``ranks.json``):

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank tests/two_ranks.py RUN_DIR [overrides...]

``draft_checksums``: each rank's sum of |draft weights|; ``shard_overlap``: samples (by token
content) that more than one rank trains on in epoch 0, 0 when the shards are disjoint.
"""

import json
import sys
from pathlib import Path

import torch

from tests.tiny import tiny_config
from trainer import loop
from trainer.data_setup import train_batcher


def draft_checksum(trainer: loop.Trainer) -> float:
    return float(sum(p.detach().double().abs().sum() for p in trainer.ds_model.module.draft.parameters()))


def shard_overlap(trainer: loop.Trainer) -> int:
    par = trainer.par
    loader = trainer.data.train_loader(train_batcher(trainer.cfg.data, trainer.target.pad_id), par.rank, par.world)
    mine = {hash(tuple(doc.tolist())) for b in loader.epoch_batches(0) for doc in b.documents()}
    every = [None] * par.world
    torch.distributed.all_gather_object(every, mine)
    return sum(len(a & b) for i, a in enumerate(every) for b in every[i + 1 :])


def main() -> None:
    run_dir, trained, fit = Path(sys.argv[1]), [], loop.Trainer.fit

    def keep_and_fit(self: loop.Trainer) -> dict:
        trained.append(self)  # the trainer run() builds, for the checks after it
        return fit(self)

    loop.Trainer.fit = keep_and_fit
    summary = loop.run(tiny_config(*sys.argv[2:]), run_dir)
    trainer = trained[0]
    checksums = [None] * trainer.par.world
    torch.distributed.all_gather_object(checksums, draft_checksum(trainer))
    overlap = shard_overlap(trainer)
    if trainer.par.is_main:
        out = {"steps": summary["steps"], "draft_checksums": checksums, "shard_overlap": overlap}
        (run_dir / "ranks.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
