"""JSON lines: one record a line, each with where it came from (``file:line``).

A line that is not UTF-8 or not valid JSON comes back as a ``RawRecord`` with ``error`` set, so the
caller decides what a bad line means (training data's ``data.on_error``, a prompt file's ValueError).
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


def utf8_error(e: UnicodeDecodeError, line_start: int = 0) -> str:
    """Why bytes are not UTF-8: the first bad byte and its column in bytes (its line starts at ``line_start``)."""
    return f"not UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start - line_start + 1}: {e.reason})"


def json_lines(path: Path) -> Iterator[RawRecord]:
    """One record a line, read as a stream (a large .jsonl is never held whole); a ``.gz`` file
    is read through gzip. Each line is decoded on its own, so a bad byte costs its line only."""
    path = Path(path)
    with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRecord(where, None, utf8_error(e))
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                yield RawRecord(where, None, json_error(e))
                continue
            yield RawRecord(where, value)
