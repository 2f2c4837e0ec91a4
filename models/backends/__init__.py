"""The outside engines StreamDraft runs a target in: one folder each, and one entry each in ``BACKENDS``.

An entry says what its engine can do and points to the objects that do it:

* ``features``: the hidden states the draft trains on (``engine.name``): the target factory an
  engine process builds the target from, the ``engine.mode`` values it runs in and whether it
  computes in float32. ``trainer.config`` checks ``engine.name``, ``engine.mode`` and the target's
  dtype against it; ``trainer.target_setup.MAKERS`` makes its factory from config.
* ``generation``: answers and prompts written by the target (``--engine`` of ``trainer.regenerate`` and
  ``trainer.synthesize``): the function that opens its generator (``models.generation.Generator``)
  from a target path and the ``GeneratorSettings`` (``trainer.datagen.gen_backend``).

``able(capability)`` is the view every checker reads: the backends that can do it, by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from models.backends.hf.generate import open_hf_generator
from models.backends.hf.target import PathTarget
from models.backends.sglang.generate import open_sglang_generator
from models.backends.sglang.target import SGLangTarget
from models.generation import Generator, GeneratorOptions


@dataclass(frozen=True)
class Features:
    factory: type  # the TargetFactory class an engine of this backend is built from
    modes: tuple[str, ...]  # the engine.mode values it runs in (trainer.stream.feature_stream.MODES)
    no_float32: str | None = None  # why it cannot compute in float32; None: it can


@dataclass(frozen=True)
class Backend:
    features: Features | None = None  # None: it hands out no features for training
    generation: Callable[[Path, GeneratorOptions], Generator] | None = None  # opens its generator; None: it writes no data


BACKENDS: dict[str, Backend] = {
    "hf": Backend(  # transformers
        features=Features(PathTarget, ("inprocess", "colocated")),
        generation=open_hf_generator,
    ),
    "sglang": Backend(  # SGLang 0.5.14 (docs/SGLANG.md)
        features=Features(SGLangTarget, ("colocated",), no_float32="SGLang's CUDA RMSNorm, sgl_kernel, has no float32"),
        generation=open_sglang_generator,
    ),
}


def able(capability: str) -> dict:
    """The backends that can do ``capability`` (a field of ``Backend``), by name: their entry for it."""
    return {name: getattr(b, capability) for name, b in BACKENDS.items() if getattr(b, capability) is not None}
