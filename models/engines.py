"""Picklable target factories that build a target feature engine inside an engine process.

An engine process receives a target factory, not a model: it builds its own target on its own
device (``build(device)``). A factory must be picklable by reference to an importable
class; the engine that ``build`` returns needs only ``features(TokenBatch) -> FeatureBatch``,
its feature ``dtype`` and an ``info`` with ``hidden_size`` and ``aux_layer_ids``
(``models.target.TargetInfo``): ``models.target.HFTargetEngine`` is one, and
``models.backends.sglang.target.SGLangTargetEngine`` (one tensor-parallel rank of an SGLang target) another;
its factory, ``models.backends.sglang.target.SGLangTarget``, lives beside it. The ``features`` entries of
``models.backends.BACKENDS`` name the factory of each engine a run can choose.

Engines are imported inside ``build``: an engine process pays for transformers or SGLang only
when it builds that kind of target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
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


@dataclass(frozen=True)
class PathTarget:
    """``HFTargetEngine.from_path``: a local transformers dir or ``.gguf``; None is the embedded default."""

    path: str | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32

    def build(self, device: torch.device) -> FeatureEngine:
        from models.embedded import embedded_target_dir
        from models.target import HFTargetEngine

        path = Path(self.path) if self.path is not None else embedded_target_dir()
        ids = list(self.aux_layer_ids) if self.aux_layer_ids is not None else None
        return HFTargetEngine.from_path(path, aux_layer_ids=ids, device=device, dtype=self.dtype)


@dataclass(frozen=True)
class RandomTarget:
    """A transformers model of a given config with seeded random weights, built on ``device``.

    For throughput work: an 8B-shaped target without 16 GB of weights to carry. The same
    (config, seed, dtype, device) gives the same weights in every process.
    """

    config: dict  # a transformers config as a dict; "model_type" picks the class
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    aux_layer_ids: tuple[int, ...] | None = None
    attn_implementation: str = "sdpa"

    def build(self, device: torch.device) -> FeatureEngine:
        from transformers import AutoConfig, AutoModelForCausalLM

        from models.target import HFTargetEngine

        fields = dict(self.config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError("RandomTarget.config needs a model_type (e.g. 'llama')")
        config = AutoConfig.for_model(model_type, **fields)
        torch.manual_seed(self.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, attn_implementation=self.attn_implementation)
        ids = list(self.aux_layer_ids) if self.aux_layer_ids is not None else None
        return HFTargetEngine(model, ids, device=device, dtype=self.dtype, source=f"random:{model_type}:seed{self.seed}")
