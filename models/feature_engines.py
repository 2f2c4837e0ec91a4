"""The feature engines a run can name (``engine.name``), one entry each: the target factory
an engine is built from and the modes it runs in.

``trainer.config`` checks ``engine.name``, ``engine.mode`` and the target's dtype against
these entries; ``trainer.target_setup`` builds the factory an entry names. A new engine is one
entry here, its factory class and the maker of that factory from config in
``trainer.target_setup.MAKERS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.engines import PathTarget
from models.sglang_target import SGLangTarget


@dataclass(frozen=True)
class FeatureEngineKind:
    factory: type  # the TargetFactory class an engine of this kind is built from
    modes: tuple[str, ...]  # the engine.mode values it runs in (trainer.stream.feature_stream.MODES)
    no_float32: str | None = None  # why it cannot compute in float32; None: it can


FEATURE_ENGINES: dict[str, FeatureEngineKind] = {
    "hf": FeatureEngineKind(PathTarget, ("inprocess", "colocated")),  # transformers
    "sglang": FeatureEngineKind(  # SGLang 0.5.14, one tensor-parallel rank per engine process (docs/SGLANG.md)
        SGLangTarget, ("colocated",), no_float32="SGLang's CUDA RMSNorm, sgl_kernel, has no float32"
    ),
}
