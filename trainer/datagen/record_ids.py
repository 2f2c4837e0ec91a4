"""The ids of generated records, what resuming a generation into a file rests on: a source
conversation's stable id (``record_id``), and the ids an output file holds already (``done_ids``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trainer.data.conversation import Conversation


def record_id(conv: Conversation) -> str:
    """A stable id of a source conversation: the digest of its messages."""
    return hashlib.sha256(json.dumps(conv, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:20]


def done_ids(output: Path) -> set[str]:
    """Ids already in ``output``. A torn last line (a crash mid-write) is cut off the file; a
    bad line anywhere else is an error naming file:line."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    keep = len(data) if data.endswith(b"\n") or not data else data.rfind(b"\n") + 1
    if keep < len(data):
        with output.open("r+b") as f:
            f.truncate(keep)
    ids = set()
    for lineno, line in enumerate(data[:keep].decode("utf-8").split("\n"), start=1):  # not splitlines: U+2028 is not a line end
        if not line.strip():
            continue
        try:
            rid = json.loads(line).get("id")
        except (json.JSONDecodeError, AttributeError):
            rid = None
        if not isinstance(rid, str):
            raise ValueError(
                f"{output}:{lineno}: not a regenerated record (JSON object with an 'id'); remove it or choose another --output"
            )
        ids.add(rid)
    return ids
