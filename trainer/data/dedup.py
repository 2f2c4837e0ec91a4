"""Near-duplicate texts: MinHash signatures over word shingles, LSH banding for candidates,
exact Jaccard similarity to decide.

A text is normalised (case-folded, split into runs of letters and digits), cut into word
n-gram shingles (``shingle`` words; a text shorter than that is one shingle), and each
shingle hashed to 32 bits (blake2b: the same on every machine and run). The signature is
``num_perm`` minima of ``(a * h + b) mod 2^61 - 1`` over the shingle hashes, with ``a, b``
drawn once from a fixed seed. Signatures are cut into ``bands`` bands of equal rows; two
texts sharing any band are candidates, and a candidate is a near-duplicate when the exact
Jaccard similarity of the two shingle sets is at least ``threshold``. With 128 permutations
in 32 bands of 4 rows, a pair at Jaccard 0.7 becomes a candidate with probability
1 - (1 - 0.7^4)^32 > 0.9999 (0.5: 0.87), so the threshold, not the banding, decides.

What it catches: the same prompt with other casing, punctuation or spacing (Jaccard 1), and
prompts that share most of their words in the same order. What it does not: paraphrases
with other words, and short prompts that differ in one word ("What is your name?" vs "What
is your job?" share 2 of 4 bigrams: 0.5, kept at the default 0.7).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import numpy as np

_WORD = re.compile(r"[^\W_]+")
_PRIME = np.uint64((1 << 61) - 1)


def words(text: str) -> list[str]:
    """Case-folded runs of letters and digits."""
    return _WORD.findall(text.casefold())


def shingles(text: str, n: int) -> frozenset[str]:
    """Word n-grams of ``text`` (one shingle of all its words when it has fewer than ``n``)."""
    w = words(text)
    if len(w) <= n:
        return frozenset([" ".join(w)]) if w else frozenset()
    return frozenset(" ".join(w[i : i + n]) for i in range(len(w) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _hash32(shingle: str) -> int:
    return int.from_bytes(hashlib.blake2b(shingle.encode("utf-8"), digest_size=4).digest(), "big")


@dataclass
class NearDupIndex:
    """Texts added so far, searchable for near-duplicates of a new one."""

    threshold: float = 0.7
    shingle: int = 2
    num_perm: int = 128
    bands: int = 32
    seed: int = 1
    _sets: dict[str, frozenset[str]] = field(default_factory=dict, repr=False)
    _buckets: dict[tuple[int, bytes], list[str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1 or self.shingle < 1 or self.num_perm < 1 or self.bands < 1 or self.num_perm % self.bands:
            raise ValueError(f"near-dup index: need 0 < threshold <= 1, shingle >= 1, bands dividing num_perm; got {self}")
        rng = np.random.default_rng(self.seed)
        self._a = rng.integers(1, int(_PRIME), self.num_perm, dtype=np.uint64)
        self._b = rng.integers(0, int(_PRIME), self.num_perm, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._sets)

    def signature(self, shingle_set: frozenset[str]) -> np.ndarray:
        """[num_perm] uint64 MinHash signature (all ones for an empty set)."""
        if not shingle_set:
            return np.full(self.num_perm, np.iinfo(np.uint64).max, dtype=np.uint64)
        h = np.array(sorted(_hash32(s) for s in shingle_set), dtype=np.uint64)  # [S]
        return ((h[:, None] * self._a[None, :] + self._b[None, :]) % _PRIME).min(axis=0)  # uint64 wraps: still a fixed hash

    def _band_keys(self, signature: np.ndarray) -> list[tuple[int, bytes]]:
        rows = self.num_perm // self.bands
        return [(i, signature[i * rows : (i + 1) * rows].tobytes()) for i in range(self.bands)]

    def find(self, text: str) -> str | None:
        """The key of the most similar indexed text with Jaccard >= threshold, else None."""
        s = shingles(text, self.shingle)
        candidates = dict.fromkeys(k for band in self._band_keys(self.signature(s)) for k in self._buckets.get(band, ()))
        best, best_sim = None, 0.0
        for key in candidates:  # in a fixed order: bands, then insertion
            sim = jaccard(s, self._sets[key])
            if sim >= self.threshold and sim > best_sim:
                best, best_sim = key, sim
        return best

    def add(self, key: str, text: str) -> None:
        if key in self._sets:
            raise ValueError(f"near-dup index: key {key!r} added twice")
        s = shingles(text, self.shingle)
        self._sets[key] = s
        for band in self._band_keys(self.signature(s)):
            self._buckets.setdefault(band, []).append(key)
