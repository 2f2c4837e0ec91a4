"""A weighted mix of named sources, and what one epoch of it is.

Sources ``s`` hold ``n_s`` training samples and weights ``w_s > 0`` (``p_s = w_s / sum w``).
An epoch of the mix is ``N`` samples (``epoch_samples``; default ``sum n_s``), of which
source ``s`` gives exactly ``k_s = p_s * N`` (largest-remainder rounding, so the quotas sum
to ``N``). Weights are over samples (conversations), not tokens.

Each source is read as an endless stream of passes; pass ``c`` is a permutation of its
samples seeded by ``(seed, source name, c)``. Epoch ``e`` takes stream positions
``[e * k_s, (e + 1) * k_s)`` of each source, so a down-weighted source shows new samples
epoch after epoch (all of them before any repeats), and an up-weighted one repeats whole
passes. The epoch's samples are then interleaved by a shuffle seeded by ``(seed, e)``.
Everything is a pure function of (seed, epoch, sizes, weights, N): any epoch can be rebuilt
on any rank, which is what the rank sharding and the resume position rely on.

Without weights every source is weighted by its size and ``N = sum n_s``: each sample once
per epoch, which is a plain concatenation.
"""

from __future__ import annotations

import math
import random
from array import array
from functools import lru_cache
from typing import Mapping

Ref = tuple[int, int]  # (source index in Mix.names, sample index within that source)


def _quotas(weights: list[float], total: int) -> list[int]:
    """Integers proportional to ``weights`` summing to ``total`` (largest remainder; ties to
    the earlier source)."""
    s = sum(weights)
    exact = [w / s * total for w in weights]
    quotas = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in by_remainder[: total - sum(quotas)]:
        quotas[i] += 1
    return quotas


class Mix:
    """The epoch composition of named sources (see the module doc)."""

    def __init__(self, sizes: Mapping[str, int], weights: Mapping[str, float] | None, seed: int, epoch_samples: int | None = None):
        if not sizes:
            raise ValueError("data: no sources to mix")
        if weights is None:
            weights = {name: float(n) for name, n in sizes.items()}
        if not weights:
            raise ValueError("data.mix is empty: give at least one source a weight (or leave data.mix unset)")
        unknown = sorted(set(weights) - set(sizes))
        if unknown:
            raise ValueError(f"data.mix names unknown source(s) {unknown} (sources: {', '.join(sizes)})")
        for name, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise ValueError(f"data.mix.{name}: weight must be a positive number, got {w!r}")
            if sizes[name] < 1:
                raise ValueError(f"data.mix.{name}: the source has no training samples")
        if epoch_samples is not None and epoch_samples < 1:
            raise ValueError(f"data.epoch_samples must be >= 1, got {epoch_samples}")
        self.names: tuple[str, ...] = tuple(weights)
        self.sizes: tuple[int, ...] = tuple(sizes[n] for n in self.names)
        self.weights: tuple[float, ...] = tuple(float(weights[n]) for n in self.names)
        self.seed = seed
        self.epoch_samples = epoch_samples if epoch_samples is not None else sum(sizes[n] for n in self.names)
        self.quotas: tuple[int, ...] = tuple(_quotas(list(self.weights), self.epoch_samples))

    def describe(self) -> dict:
        """What fixes the epochs, for fingerprints and reports."""
        return {
            "sources": {
                n: {"samples": size, "weight": w, "per_epoch": k}
                for n, size, w, k in zip(self.names, self.sizes, self.weights, self.quotas)
            },
            "epoch_samples": self.epoch_samples,
            "seed": self.seed,
        }

    def _pass(self, source: int, index: int) -> array:
        return _permutation(self.seed, self.names[source], self.sizes[source], index)

    def _take(self, source: int, start: int, count: int) -> list[int]:
        """Stream positions [start, start + count) of ``source``."""
        n, out = self.sizes[source], []
        pos = start
        while pos < start + count:
            c, within = divmod(pos, n)
            take = min(n - within, start + count - pos)
            out.extend(self._pass(source, c)[within : within + take])
            pos += take
        return out

    def epoch(self, epoch: int) -> list[Ref]:
        """The samples of ``epoch``, interleaved (see the module doc)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        refs = [(s, i) for s, k in enumerate(self.quotas) for i in self._take(s, epoch * k, k)]
        random.Random(f"streamdraft-mix:{self.seed}:{epoch}").shuffle(refs)
        return refs


@lru_cache(maxsize=32)
def _permutation(seed: int, name: str, size: int, index: int) -> array:
    """Pass ``index`` of a source: a seeded permutation (8 bytes a sample; read-only)."""
    order = list(range(size))
    random.Random(f"streamdraft-mix-pass:{seed}:{name}:{index}").shuffle(order)
    return array("q", order)
