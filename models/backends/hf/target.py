"""The transformers target factories: picklable, each builds a ``models.target.HFTargetEngine`` inside an
engine process (``models.engines``), transformers imported only in ``build``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from models.engines import FeatureEngine


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
