"""The outside engines StreamDraft runs a target in: one folder each, and one entry each in ``BACKENDS``.

An entry says what its engine can do and points to the objects that do it:

* ``features``: the hidden states the draft trains on (``engine.name``): the target factory an
  engine process builds the target from, the ``engine.mode`` values it runs in and whether it
  computes in float32. ``trainer.config`` checks ``engine.name``, ``engine.mode`` and the target's
  dtype against it; ``trainer.target_setup.MAKERS`` makes its factory from config.

``able(capability)`` is the view every checker reads: the backends that can do it, by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.backends.hf.target import PathTarget
from models.backends.sglang.target import SGLangTarget


@dataclass(frozen=True)
class Features:
    factory: type  # the TargetFactory class an engine of this backend is built from
    modes: tuple[str, ...]  # the engine.mode values it runs in (trainer.stream.feature_stream.MODES)
    no_float32: str | None = None  # why it cannot compute in float32; None: it can


@dataclass(frozen=True)
class Backend:
    features: Features | None = None  # None: it hands out no features for training


BACKENDS: dict[str, Backend] = {
    "hf": Backend(features=Features(PathTarget, ("inprocess", "colocated"))),  # transformers
    "sglang": Backend(  # SGLang 0.5.14 (docs/SGLANG.md)
        features=Features(SGLangTarget, ("colocated",), no_float32="SGLang's CUDA RMSNorm, sgl_kernel, has no float32"),
    ),
}


def able(capability: str) -> dict:
    """The backends that can do ``capability`` (a field of ``Backend``), by name: their entry for it."""
    return {name: getattr(b, capability) for name, b in BACKENDS.items() if getattr(b, capability) is not None}
