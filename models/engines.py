"""The contract of a target factory and the feature engine it builds inside an engine process.

An engine process receives a target factory, not a model: it builds its own target on its own
device (``build(device)``). A factory must be picklable by reference to an importable
class; the engine that ``build`` returns needs only ``features(TokenBatch) -> FeatureBatch``,
its feature ``dtype`` and an ``info`` with ``hidden_size`` and ``aux_layer_ids``
(``models.target.TargetInfo``): ``models.target.HFTargetEngine`` is one (its factories, ``PathTarget`` and
``RandomTarget``, are in ``models.backends.hf.target``), and ``models.backends.sglang.target.SGLangTargetEngine``
(one tensor-parallel rank of an SGLang target) another, its factory ``SGLangTarget`` beside it. The ``features``
entries of ``models.backends.registry.BACKENDS`` name the factory of each engine a run can choose.

Engines are imported inside ``build``: an engine process pays for transformers or SGLang only
when it builds that kind of target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from models.batch import FeatureBatch, TokenBatch

if TYPE_CHECKING:  # models.target imports transformers; an engine process imports it only when it builds that target
    from models.target import TargetInfo


class FeatureEngine(Protocol):
    info: TargetInfo  # architecture, layers, hidden size, vocab, aux layer ids
    dtype: torch.dtype  # of the features it hands out

    def features(self, tokens: TokenBatch) -> FeatureBatch: ...


class TargetFactory(Protocol):
    def build(self, device: torch.device) -> FeatureEngine: ...
