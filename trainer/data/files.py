"""Records out of local files, each with where it came from (``file:line`` or ``file:row N``).

- ``.jsonl``: one JSON value a line; blank lines are skipped.
- ``.json``: a JSON array of records (each named by the line it starts on), or, when the
  file does not start with ``[``, JSON lines as above (many ShareGPT dumps are named .json).
- ``.parquet``: one record a row (needs ``pyarrow``).
- a directory written by ``datasets``' ``save_to_disk``: one record a row (needs ``datasets``).
- any other directory: its ``.json`` / ``.jsonl`` / ``.parquet`` files, sorted by name.

A line that is not UTF-8 or not valid JSON comes back as a ``RawRecord`` with ``error`` set, so
the caller's ``data.on_error`` decides; a JSON array with a bad byte or a syntax error cannot be
read past it and raises ``ValueError`` naming file:line:column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from serving.jsonl import RawRecord, json_lines, utf8_error

FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def local_path(path: str | Path, key: str) -> Path:
    """``path`` as an existing local path; a URL or hub id is refused (nothing is fetched)."""
    text = str(path)
    if "://" in text or text.startswith("hf:"):
        raise ValueError(f"{key}: {text!r} is not a local path; StreamDraft reads local files only")
    resolved = Path(text).expanduser()
    if not resolved.exists():
        raise ValueError(f"{key}: {text!r} does not exist")
    return resolved


def is_hf_disk_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in HF_DISK_MARKERS)


def data_files(path: Path) -> list[Path]:
    """The files a path stands for: itself, or a directory's data files sorted by name."""
    if path.is_file():
        if path.suffix not in FILE_SUFFIXES:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r} (supported: {', '.join(FILE_SUFFIXES)})")
        return [path]
    if is_hf_disk_dir(path):
        raise ValueError(f"{path} is a `datasets` save_to_disk directory: use format hf_disk")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in FILE_SUFFIXES)
    if not files:
        raise ValueError(f"{path}: no {', '.join(FILE_SUFFIXES)} files in this directory")
    return files


def read_file(path: Path) -> Iterator[RawRecord]:
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
    elif path.suffix == ".json" and _starts_with_bracket(path):
        yield from _json_array(path, _utf8_text(path))
    else:
        yield from json_lines(path)


def _starts_with_bracket(path: Path) -> bool:
    with path.open("rb") as f:
        while chunk := f.read(4096):
            if chunk.strip():
                return chunk.lstrip().startswith(b"[")
    return False


def _utf8_text(path: Path) -> str:
    """A whole file's text; a byte that is not UTF-8 is a ``ValueError`` naming its line and column."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, line_start) + 1
        raise ValueError(f"{path}:{line}: {utf8_error(e, line_start)}; a JSON array cannot be read past this") from None


def _json_array(path: Path, text: str) -> Iterator[RawRecord]:
    """Each element of a top-level JSON array, named by the line it starts on."""
    decoder = json.JSONDecoder()
    line, counted = 1, 0

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    def fail(pos: int, message: str) -> ValueError:
        return ValueError(f"{path}:{line_at(pos)}:{pos - text.rfind(chr(10), 0, pos)}: {message}; a JSON array cannot be read past this")

    def skip_space(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip_space(0) + 1  # past "["
    pos = skip_space(pos)
    if pos < len(text) and text[pos] == "]":
        return
    while True:
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise fail(e.pos, f"not valid JSON ({e.msg})") from None
        yield RawRecord(f"{path}:{line_at(pos)}", value)
        pos = skip_space(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_space(pos + 1)
        elif pos < len(text) and text[pos] == "]":
            if skip_space(pos + 1) != len(text):
                raise fail(skip_space(pos + 1), "text after the closing ']'")
            return
        else:
            raise fail(pos, "expected ',' or ']' after an array element")


def _parquet_rows(path: Path) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq  # a dependency; imported here to keep `import trainer.data` light

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield RawRecord(f"{path}:row {row}", record)
            row += 1


def hf_disk_rows(path: Path, split: str | None) -> tuple[list[str], Iterator[RawRecord]]:
    """(column names, rows) of a ``save_to_disk`` directory: a Dataset, or one split of a
    DatasetDict (``split``; default ``train``)."""
    import datasets  # a dependency; imported here because it is slow to import

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        name = split or "train"
        if name not in loaded:
            raise ValueError(f"{path}: no split {name!r} in this DatasetDict (splits: {', '.join(loaded)}); set the source's split")
        loaded = loaded[name]
    elif split is not None:
        raise ValueError(f"{path} holds one Dataset, not a DatasetDict: leave the source's split unset (got {split!r})")

    def rows() -> Iterator[RawRecord]:
        row = 0
        for table in loaded.with_format("arrow").iter(batch_size=1024):
            for record in table.to_pylist():
                yield RawRecord(f"{path}:row {row}", record)
                row += 1

    return list(loaded.column_names), rows()
