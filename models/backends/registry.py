"""The registry of the outside engines StreamDraft runs a target in (``models/backends/NAME/``): one entry each in
``BACKENDS``.

An entry says what its engine can do and points to the objects that do it:

* ``features``: the hidden states the draft trains on (``engine.name``): the target factory an
  engine process builds the target from, the ``engine.mode`` values it runs in and whether it
  computes in float32. ``trainer.config`` checks ``engine.name``, ``engine.mode`` and the target's
  dtype against it; ``trainer.target_setup.MAKERS`` makes its factory from config.
* ``generation``: answers and prompts written by the target (``--engine`` of ``trainer.regenerate`` and
  ``trainer.synthesize``): the function that opens its generator (``models.generation.Generator``)
  from a target path and the ``GeneratorSettings`` (``trainer.datagen.gen_backend``).
* ``serving``: an export served with the target (``serving.launch``: the server's readiness path; its
  command is ``serving.launch.server_command``'s) and, where it has one, the module run as one engine
  process of ``serving.speedup``. SGLang's own τ (``serving.sglang_eval``) decodes in
  ``models.backends.sglang.spec_decode``.

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
class Serving:
    ready_path: str  # GET it until it answers 200: the server is ready
    speedup_engine: str | None = None  # the module run as one engine process of serving.speedup; None: it is not measured there


@dataclass(frozen=True)
class Backend:
    features: Features | None = None  # None: it hands out no features for training
    generation: Callable[[Path, GeneratorOptions], Generator] | None = None  # opens its generator; None: it writes no data
    serving: Serving | None = None  # None: no server of ours serves an export with it


BACKENDS: dict[str, Backend] = {
    "hf": Backend(  # transformers
        features=Features(PathTarget, ("inprocess", "colocated")),
        generation=open_hf_generator,
    ),
    "sglang": Backend(  # SGLang 0.5.14 (docs/SGLANG.md)
        features=Features(SGLangTarget, ("colocated",), no_float32="SGLang's CUDA RMSNorm, sgl_kernel, has no float32"),
        generation=open_sglang_generator,
        serving=Serving("/health_generate", speedup_engine="models.backends.sglang.speedup_engine"),
    ),
    "vllm": Backend(serving=Serving("/health")),  # vLLM 0.33.0 serves speculators exports; nothing else of ours runs in it
}


def able(capability: str) -> dict:
    """The backends that can do ``capability`` (a field of ``Backend``), by name: their entry for it."""
    return {name: getattr(b, capability) for name, b in BACKENDS.items() if getattr(b, capability) is not None}
