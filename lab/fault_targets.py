"""Target factories that misbehave on purpose: the fault runs of lab/faults.py and their CPU tests.

A factory wraps another (``PathTarget``, ``SGLangTarget``) and is picklable like it, so the engine
process builds it as it builds any target (``models.engines``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.batch import FeatureBatch, TokenBatch
from models.engines import FeatureEngine, TargetFactory


@dataclass(frozen=True)
class NaNFeatures:
    """``inner``'s engine, whose aux features are NaN in batch ``batch`` (0-based, over every batch the engine
    makes: the held-out evaluations' too)."""

    inner: TargetFactory
    batch: int

    def build(self, device: torch.device) -> "NaNEngine":
        return NaNEngine(self.inner.build(device), self.batch)


class NaNEngine:
    def __init__(self, engine: FeatureEngine, batch: int):
        self.engine, self.batch, self.made = engine, batch, 0
        self.info, self.dtype = engine.info, engine.dtype

    def features(self, tokens: TokenBatch) -> FeatureBatch:
        fb = self.engine.features(tokens)
        if self.made == self.batch:
            fb.aux.fill_(float("nan"))
        self.made += 1
        return fb
