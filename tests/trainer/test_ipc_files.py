"""The ring's CUDA IPC reference-count files (``/dev/shm/torch_<pid>_*``) go with a trainer killed by
SIGKILL: the resource tracker the trainer started unlinks what ``track_ipc_files`` registered; an
untracked file is left for torch's own cleanup. A real process in the trainer's place, its own
resource tracker, a real SIGKILL (CPU)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.stream.feature_ring import SHM_DIR

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
ROOT = Path(__file__).resolve().parents[2]

OWNER = """
import os, sys, time
from trainer.stream.feature_ring import SHM_DIR, track_ipc_files, untrack_ipc_files
(SHM_DIR / f"torch_{os.getpid()}_7_1").write_bytes(bytes(64))  # named as torch names its CUDA IPC reference counts
names = track_ipc_files(os.getpid())
if sys.argv[1] == "untrack":
    untrack_ipc_files(names)
print(" ".join(names), flush=True)
if sys.argv[1] == "track":
    time.sleep(600)
"""


def _run(mode: str) -> tuple[Path, list[str]]:
    """The owner's file and what it registered; killed (``track``) or exited (``untrack``)."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER, mode], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    names = proc.stdout.readline().split()
    if mode == "track":
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(60)
    return SHM_DIR / f"torch_{proc.pid}_7_1", names


def test_a_tracked_file_goes_with_its_killed_owner():
    path, names = _run("track")
    assert names == [f"/{path.name}"]
    deadline = time.monotonic() + 60  # the tracker cleans up once the owner's end of its pipe is closed
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not path.exists()


def test_an_untracked_file_is_left_to_its_owner():
    path, names = _run("untrack")
    try:
        assert names == [f"/{path.name}"]
        time.sleep(2)  # time for a tracker to have acted, had the file stayed registered
        assert path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_each_file_is_registered_once_and_taken_back_once(monkeypatch, tmp_path):
    import trainer.stream.feature_ring as ring

    calls = []
    monkeypatch.setattr(ring, "SHM_DIR", tmp_path)
    monkeypatch.setattr(ring, "_tracked", set())
    monkeypatch.setattr(ring.resource_tracker, "register", lambda name, kind: calls.append(("register", name, kind)))
    monkeypatch.setattr(ring.resource_tracker, "unregister", lambda name, kind: calls.append(("unregister", name, kind)))
    (tmp_path / "torch_42_1_1").write_bytes(b"")
    (tmp_path / "torch_420_1_1").write_bytes(b"")  # another process's
    first = ring.track_ipc_files(42)
    assert first == ["/torch_42_1_1"] and ring.track_ipc_files(42) == []  # a second engine of the process: nothing new
    ring.untrack_ipc_files(first)
    ring.untrack_ipc_files(first)  # the tracker is told once: it errs on a name it does not hold
    assert calls == [("register", "/torch_42_1_1", "shared_memory"), ("unregister", "/torch_42_1_1", "shared_memory")]
