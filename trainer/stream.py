"""The seam between target engine and trainer: an iterator of feature batches.

This is the in-process form (``engine.mode=inprocess``): each token batch goes through the
target on the trainer's device when the trainer asks for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from trainer.batch import FeatureBatch, TokenBatch


def feature_stream(engine, batches: Iterable[TokenBatch], device: torch.device) -> Iterator[FeatureBatch]:
    for tokens in batches:
        yield engine.features(tokens.to(device))
