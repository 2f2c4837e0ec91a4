"""JSON lines: one record a line, each with where it came from (``file:line``).

A line that is not valid JSON comes back as a ``RawRecord`` with ``error`` set, so the caller
decides what a bad line means (training data's ``data.on_error``, a prompt file's ValueError).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@dataclass(frozen=True)
class RawRecord:
    where: str  # "file:line" (or "file:row N" for parquet / datasets rows)
    value: object  # the decoded record; None when error is set
    error: str | None = None  # why the record could not be decoded


def json_error(e: json.JSONDecodeError) -> str:
    """Why a line is not JSON, with its column (``e.msg`` may already end in "at")."""
    at = "" if e.msg.endswith(" at") else " at"
    return f"not valid JSON ({e.msg}{at} column {e.colno})"


def json_lines(path: Path) -> Iterator[RawRecord]:
    """One record a line, read as a stream (a large .jsonl is never held whole); a ``.gz`` file
    is read through gzip."""
    path = Path(path)
    with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                yield RawRecord(where, None, json_error(e))
                continue
            yield RawRecord(where, value)
