"""Read a finished (or running) run back from its run dir, without a wandb server.

Sources, in order of preference:

1. ``RUN_DIR/metrics.jsonl`` (``trainer.metrics_sink.MetricsSink``) plus ``RUN_DIR/summary.json``;
2. a wandb run under ``RUN_DIR/wandb/`` (offline or online), read from its ``run-<id>.wandb``
   transaction log. wandb 0.31 writes history, summary and config only there (``files/``
   holds just the console output and requirements), and ships no Python reader for it, so
   ``read_wandb_file`` decodes the log itself: LevelDB-log framing (32 KiB blocks, a CRC-32
   per chunk, verified) around ``wandb_internal_pb2.Record`` protobufs.

The config comes from Hydra's ``RUN_DIR/.hydra/config.yaml`` when present, else from wandb.
Note: in offline mode wandb 0.31's ``run.finish()`` can return before wandb-core has flushed the
log; a file without its exit record is read as far as it goes and marked ``finished=False``.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from serving.jsonl import json_lines
from trainer.report import metrics as M

SUMMARY_FILE = "summary.json"
HYDRA_CONFIG = Path(".hydra") / "config.yaml"


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class RunLog:
    run_dir: Path
    source: Path  # metrics.jsonl or the .wandb file the history came from
    history: dict[str, Series]  # metric -> values by step (a re-logged step keeps the later value)
    summary: dict[str, Any]  # summary.json, else the wandb run summary; {} when neither exists
    config: dict[str, Any] | None  # the composed config; None when the run dir has none
    finished: bool = True  # False: the wandb run read has no exit record yet (still writing, or killed)

    def last(self, name: str) -> float | None:
        series = self.history.get(name)
        return series.values[-1] if series and series.values else None

    def first(self, name: str) -> float | None:
        series = self.history.get(name)
        return series.values[0] if series and series.values else None

    def data(self) -> dict[str, float]:
        """Data figures (``data/*``): summary.json's ``data`` block, else logged/summary values."""
        if isinstance(self.summary.get("data"), dict):
            return M.data_metrics(self.summary["data"])
        found = {k: v for k, v in self.summary.items() if k.startswith("data/") and _is_number(v)}
        found.update({k: s.values[-1] for k, s in self.history.items() if k.startswith("data/") and s.values})
        return found


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _history(rows: list[tuple[int, dict[str, Any]]]) -> dict[str, Series]:
    by_metric: dict[str, dict[int, float]] = {}
    for step, row in rows:
        for name, value in row.items():
            if _is_number(value) and not name.startswith("_") and name != "step":
                by_metric.setdefault(name, {})[step] = value
    return {name: Series(sorted(v), [v[s] for s in sorted(v)]) for name, v in by_metric.items()}


def read_metrics_jsonl(path: Path) -> dict[str, Series]:
    rows = []
    for record in json_lines(path):
        row = record.value
        if record.error is not None:
            raise ValueError(f"{record.where}: not a JSON object ({record.error})")
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{record.where}: expected an object with an integer 'step', got {json.dumps(row)[:80]}")
        rows.append((row["step"], row))
    return _history(rows)


# --------------------------------------------------------------------------- wandb transaction log

_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_IDENT, _MAGIC, _VERSION = b":W&B", 0xBEE1, 0
_CHUNK = struct.Struct("<IHB")  # crc32, length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    rows: list[tuple[int, dict[str, Any]]]  # (step, logged row) in log order
    summary: dict[str, Any]
    config: dict[str, Any]
    finished: bool  # the run's exit record is in the file

    @property
    def history(self) -> dict[str, Series]:
        return _history(self.rows)


def _records(path: Path) -> list[bytes]:
    """The record payloads of a wandb transaction log; a torn last record (a run still writing
    or killed mid-write) ends the list, any other damage raises."""
    data = path.read_bytes()
    if len(data) < _HEADER.size or _HEADER.unpack_from(data) != (_IDENT, _MAGIC, _VERSION):
        raise ValueError(f"{path}: not a wandb transaction log (expected the ':W&B' header, version {_VERSION})")
    out, pending, pos = [], None, _HEADER.size
    while pos < len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK.size:  # block trailer, zero-filled
            pos += room
            continue
        if pos + _CHUNK.size > len(data):
            break
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if crc == length == kind == 0 and not any(data[pos : pos + room]):
            pos += room  # zero-filled rest of a block
            continue
        start, end = pos + _CHUNK.size, pos + _CHUNK.size + length
        if end > len(data):
            break
        chunk = data[start:end]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: corrupt record at byte {pos} (CRC mismatch)")
        if kind not in (_FULL, _FIRST, _MIDDLE, _LAST) or (kind in (_MIDDLE, _LAST)) != (pending is not None):
            raise ValueError(f"{path}: chunk type {kind} out of place at byte {pos}")
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = bytearray(chunk)
        else:
            pending += chunk
            if kind == _LAST:
                out.append(bytes(pending))
                pending = None
        pos = end
    return out


def _item_name(item) -> str:
    return item.key or ".".join(item.nested_key)


def _public(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if not k.startswith("_")}  # "_..." are wandb's own keys


def read_wandb_file(path: Path) -> WandbRun:
    """History, final summary and config of one wandb run from its ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows: list[tuple[int, dict[str, Any]]] = []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    finished = False
    for payload in _records(path):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append((record.history.step.num, {_item_name(i): json.loads(i.value_json) for i in record.history.item}))
        elif kind == "summary":
            summary.update({_item_name(i): json.loads(i.value_json) for i in record.summary.update})
            for item in record.summary.remove:
                summary.pop(_item_name(item), None)
        elif kind in ("run", "config"):
            cfg = record.run.config if kind == "run" else record.config
            config.update({_item_name(i): json.loads(i.value_json) for i in cfg.update})
        elif kind == "exit":
            finished = True
    return WandbRun(rows, _public(summary), _public(config), finished)


_RUN_DIR_NAME = re.compile(r"(?:offline-)?run-(\d{8}_\d{6})-\w+")  # wandb's run dir: [offline-]run-<time>-<id>


def find_wandb_files(run_dir: Path) -> list[Path]:
    """The ``run-*.wandb`` files under ``run_dir/wandb/*/`` (offline-run-* or run-* dirs), oldest
    first: a resumed run starts a new wandb run in the same run dir."""
    found = [p for p in (run_dir / "wandb").glob("*run-*/run-*.wandb") if _RUN_DIR_NAME.fullmatch(p.parent.name)]
    return sorted(found, key=lambda p: (_RUN_DIR_NAME.fullmatch(p.parent.name).group(1), p.stat().st_mtime_ns))


# --------------------------------------------------------------------------- the run dir


def read_run(run_dir: Path) -> RunLog:
    """Everything the report needs from a run dir; ValueError naming the dir when it holds no metrics."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory")
    summary_path = run_dir / SUMMARY_FILE
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{summary_path}: not JSON ({e.msg} at line {e.lineno})") from None
    hydra = run_dir / HYDRA_CONFIG
    config = yaml.safe_load(hydra.read_text()) if hydra.is_file() else None
    jsonl = run_dir / M.METRICS_FILE
    history = read_metrics_jsonl(jsonl) if jsonl.is_file() else {}
    if history:
        return RunLog(run_dir, jsonl, history, summary, config)
    runs = [(path, read_wandb_file(path)) for path in find_wandb_files(run_dir)]
    rows = [row for _, run in runs for row in run.rows]  # a later run's value wins a re-logged step
    if rows:
        last_path, last = runs[-1]
        merged = _history(rows)
        return RunLog(run_dir, last_path, merged, summary or last.summary, config or last.config or None, last.finished)
    raise ValueError(f"{run_dir}: no metrics to report (looked for a non-empty {M.METRICS_FILE} and for wandb/*run-*/run-*.wandb)")
