"""Rendering, tokenizing and leak-checking many conversations on several cores: chunk functions mapped, in order, over
spawned worker processes that each hold a copy of the tokenizer. The chat template's rendering and the
offset bookkeeping run in Python, one core each, so a process per core is what scales them; the
workers start on the first call large enough to need them, and never for small data.

The tokenizer reaches the workers as a file, not as a start argument: a spawned process's start
arguments go through a pipe that the parent writes while the child imports the main module, so a
1.5 MB tokenizer among them makes the parent wait for each child's imports in turn (16 workers: about
16 x 3 s, one after another); with a file's path the children start and import side by side."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

PARALLEL_MIN = 4096  # items a call must have before it goes to the workers (a worker's start costs seconds)
MAX_WORKERS = 16

_HELD = None  # a worker's tokenizer


def _load(path: str) -> None:
    global _HELD
    with open(path, "rb") as f:
        _HELD = pickle.load(f)


def _run(task: tuple[Callable, tuple]):
    fn, args = task
    return fn(_HELD, *args)


def default_workers() -> int:
    """One a core this process may use, at most ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class TokenizerPool:
    """``fn(tokenizer, *args)`` for each task, results in task order: in ``workers`` processes for calls of at
    least ``PARALLEL_MIN`` items, in this process otherwise (and always with ``workers`` 1)."""

    def __init__(self, tokenizer, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.tokenizer, self.workers = tokenizer, workers
        self._pool, self._file = None, None

    def map(self, fn: Callable, tasks: Iterable[tuple], items: int) -> Iterator:
        if self.workers == 1 or items < PARALLEL_MIN:
            return (fn(self.tokenizer, *args) for args in tasks)
        if self._pool is None:
            with tempfile.NamedTemporaryFile("wb", prefix="streamdraft-tokenizer-", suffix=".pkl", delete=False) as f:
                pickle.dump(self.tokenizer, f)
            self._file = Path(f.name)  # removed by close(), once every worker has read it
            self._pool = mp.get_context("spawn").Pool(self.workers, initializer=_load, initargs=(f.name,))
        return self._pool.imap(_run, ((fn, args) for args in tasks))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None
        if self._file is not None:
            self._file.unlink(missing_ok=True)
            self._file = None

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None and self._pool is not None:
            self._pool.terminate()
        self.close()
