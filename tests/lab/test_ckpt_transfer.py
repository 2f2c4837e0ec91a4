"""lab/ckpt_transfer.py: a checkpoint off a GPU host in parts, command by command, and back in, byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import ckpt_transfer
from tests.fixtures.tiny import ROOT

DEVICE_RUN = ROOT / "lab" / "device_run.sh"

PART_MIB = "0.01"  # 10,485-byte parts: the checkpoint below, a 102,400-byte tar, makes ten


def _checkpoint(root: Path, step: int = 7) -> Path:
    """A complete checkpoint's layout with random contents, about 90 KB."""
    ckpt = root / "checkpoints" / f"step_{step}"
    (ckpt / "state" / "zero").mkdir(parents=True)
    position = {"step": step, "epoch": 0, "micro": 3, "train_s": 960.4, "schedule_start_s": 21.0}
    (ckpt / "meta.json").write_text(json.dumps({"position": position, "data_state": {}}))
    (ckpt / "vocab_map.safetensors").write_bytes(os.urandom(7_000))
    (ckpt / "state" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(25_000))
    (ckpt / "state" / "zero" / "optim_states.pt").write_bytes(os.urandom(55_000))
    (ckpt / "state" / "empty").write_bytes(b"")
    return ckpt


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _send_all(ckpt: Path, tmp: Path, capsys) -> list[Path]:
    """``out`` once a command, each command a fresh results folder, until every part is sent; the returned folders."""
    folders = []
    for call in range(20):
        out = tmp / f"call{call}"
        ckpt_transfer.main(["out", str(ckpt), "--out", str(out), "--stage", str(tmp / "stage_out"), "--part-mib", PART_MIB])
        folders += sorted(out.iterdir())
        if "parts sent" in capsys.readouterr().out.splitlines()[-1]:
            return folders
    raise AssertionError("out never said every part was sent")


def test_a_checkpoint_leaves_in_parts_and_comes_back_byte_for_byte(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "run")
    folders = _send_all(ckpt, tmp_path, capsys)
    manifest = json.loads((folders[0] / "manifest.json").read_text())
    assert manifest["step"] == 7 and len(manifest["parts"]) == 10
    assert [f.name for f in folders] == ["ckpt_000", "ckpt_003", "ckpt_006", "ckpt_009"]
    for folder in folders:  # what one command hands back: the manifest and at most --per-call parts, each within its size
        parts = [p for p in folder.iterdir() if p.name != "manifest.json"]
        assert 1 <= len(parts) <= 3 and all(p.stat().st_size <= 10_485 for p in parts)

    dest, stage = tmp_path / "host2" / "step_7", str(tmp_path / "stage_in")
    ckpt_transfer.main(["in", str(dest), str(folders[2]), "--stage", stage])  # carried in any order
    assert "3 of 10 parts here; missing: part_000, part_001, part_002, part_003, part_004, part_005, part_009" in capsys.readouterr().out
    assert not dest.exists()
    ckpt_transfer.main(["in", str(dest), str(folders[0]), str(folders[1]), str(folders[3]), "--stage", stage])
    assert "5 files, 0.1 MB, sha256 as sent; step 7, 960 s trained" in capsys.readouterr().out
    assert _tree(dest) == _tree(ckpt)


def test_a_call_whose_return_was_lost_is_sent_again(tmp_path, capsys):
    ckpt, stage = _checkpoint(tmp_path / "run"), str(tmp_path / "stage_out")
    for call in ("a", "b"):
        ckpt_transfer.main(["out", str(ckpt), "--out", str(tmp_path / call), "--stage", stage, "--part-mib", PART_MIB])
    assert "4 of 10 parts left: call again" in capsys.readouterr().out
    ckpt_transfer.main(["out", str(ckpt), "--out", str(tmp_path / "again"), "--stage", stage, "--part-mib", PART_MIB, "--from", "3"])
    assert _tree(tmp_path / "again" / "ckpt_003") == _tree(tmp_path / "b" / "ckpt_003")
    assert "4 of 10 parts left" in capsys.readouterr().out  # the next call goes on after the resent ones
    with pytest.raises(SystemExit, match="--from 12: the checkpoint has parts 0 to 9"):
        ckpt_transfer.main(["out", str(ckpt), "--out", str(tmp_path / "c"), "--stage", stage, "--from", "12"])


def test_a_damaged_or_foreign_part_is_named_and_the_good_ones_are_kept(tmp_path, capsys):
    folders = _send_all(_checkpoint(tmp_path / "run"), tmp_path, capsys)
    dest, stage = tmp_path / "host2" / "step_7", tmp_path / "stage_in"
    damaged = folders[1] / "part_004"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=f"{damaged}: sha256 differs from the manifest's"):
        ckpt_transfer.main(["in", str(dest), str(folders[0]), str(folders[1]), "--stage", str(stage)])
    assert (stage / "part_003").is_file() and not (stage / "part_004").exists() and not dest.exists()
    (folders[2] / "part_006").write_bytes(b"short")
    with pytest.raises(SystemExit, match="part_006: 5 bytes, the manifest says 10485"):
        ckpt_transfer.main(["in", str(dest), str(folders[2]), "--stage", str(stage)])
    (folders[0] / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match="notes.txt: not a part in"):
        ckpt_transfer.main(["in", str(dest), str(folders[0]), "--stage", str(stage)])

    other = tmp_path / "other"
    _send_all(_checkpoint(tmp_path / "run2", step=9), other, capsys)
    with pytest.raises(SystemExit, match=f"step_9, the parts under {stage} of .*step_7: remove {stage} to start over"):
        ckpt_transfer.main(["in", str(dest), str(other / "call0" / "ckpt_000"), "--stage", str(stage)])


def test_bad_arguments_are_named(tmp_path):
    ckpt = _checkpoint(tmp_path / "run")
    with pytest.raises(SystemExit, match="--part-mib 20.0 x --per-call 3: a command hands back 8 files .* of 16 MiB, 64 MiB in all"):
        ckpt_transfer.main(["out", str(ckpt), "--out", str(tmp_path / "o"), "--part-mib", "20"])
    with pytest.raises(SystemExit, match="--part-mib 16.0 x --per-call 5"):
        ckpt_transfer.main(["out", str(ckpt), "--out", str(tmp_path / "o"), "--part-mib", "16", "--per-call", "5"])
    host = ["--return-files", "3", "--file-mib", "4", "--return-mib", "10"]  # another host's limits
    with pytest.raises(SystemExit, match="--part-mib 4.0 x --per-call 3: a command hands back 3 files .* of 4 MiB, 10 MiB in all"):
        ckpt_transfer.main(["out", str(ckpt), "--out", str(tmp_path / "o"), "--part-mib", "4", *host])
    ckpt_transfer.main(
        ["out", str(ckpt), "--out", str(tmp_path / "o"), "--stage", str(tmp_path / "s"), "--part-mib", PART_MIB, "--per-call", "2", *host]
    )
    assert sorted(p.name for p in (tmp_path / "o" / "ckpt_000").iterdir()) == ["manifest.json", "part_000", "part_001"]
    with pytest.raises(SystemExit, match="--part-mib 5.0 x --per-call 1"):
        ckpt_transfer.main(["out", str(ckpt), "--out", str(tmp_path / "o"), "--part-mib", "5", "--per-call", "1", *host])
    with pytest.raises(SystemExit, match=f"{tmp_path / 'run'}: not a complete checkpoint"):
        ckpt_transfer.main(["out", str(tmp_path / "run"), "--out", str(tmp_path / "o"), "--stage", str(tmp_path / "s")])
    with pytest.raises(SystemExit, match=f"{ckpt} exists; it is not overwritten"):
        ckpt_transfer.main(["in", str(ckpt), str(tmp_path / "o")])
    with pytest.raises(SystemExit, match=f"{tmp_path / 'o'}: no manifest.json"):
        ckpt_transfer.main(["in", str(tmp_path / "new" / "step_7"), str(tmp_path / "o"), "--stage", str(tmp_path / "s")])


def test_device_run_sends_and_rebuilds_through_its_two_subcommands(tmp_path):
    ckpt = _checkpoint(tmp_path / "run")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    folders = []
    for call in range(4):
        out = tmp_path / f"call{call}"
        args = ["ckpt-out", str(ckpt), str(out), "--stage", str(tmp_path / "s"), "--part-mib", PART_MIB]
        done = subprocess.run(["bash", str(DEVICE_RUN), *args], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        folders += sorted(out.iterdir())
    assert "all 10 parts sent" in done.stdout
    dest = tmp_path / "host2" / "step_7"
    args = ["ckpt-in", str(dest), *map(str, folders), "--stage", str(tmp_path / "s_in")]
    done = subprocess.run(["bash", str(DEVICE_RUN), *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _tree(dest) == _tree(ckpt)
