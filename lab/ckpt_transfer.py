"""A training checkpoint carried off a GPU host and onto another (or the same one, started afresh), in parts.

A host without network access may hand back only a few files of each command's results folder, each of limited
size (``--return-files``, ``--file-mib``, ``--return-mib``: by default 8 files of at most 16 MiB, 64 MiB together),
and take in only a limited tree beside the checkout. A checkpoint of the recipe's draft, its optimizer state in
float32, is a few hundred MB, so it leaves in parts over several commands and comes back in as many:

    # on the host that trained: each command puts the next --per-call parts and the manifest into RESULTS/ckpt_NNN/
    python3 lab/ckpt_transfer.py out runs/t/checkpoints/step_N --out RESULTS      # again until "all N parts sent"
    # here: each returned folder kept under an ignored folder (.payload_ckpt/ckpt_NNN/)
    # on the next host: each command carries some of the folders; the one that completes the set rebuilds the checkpoint
    python3 lab/ckpt_transfer.py in /tmp/ckpt/step_N .payload_ckpt/ckpt_NNN [.payload_ckpt/ckpt_MMM ...]

The checkpoint travels as one uncompressed tar cut into parts; the manifest holds each part's size and sha256 and
the whole tar's. ``out`` keeps its parts under ``--stage`` while the host keeps its disk, so a command whose return
was lost is sent again with ``--from K``. ``in`` checks each part as it arrives, keeps the good ones under its
``--stage``, says which are missing, and writes the checkpoint only from a complete, verified set (regular files and
folders alone).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tarfile
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from trainer.checkpoint import is_complete, read_meta

MIB = 1 << 20
MANIFEST = "manifest.json"
RETURN_FILES, FILE_MIB, RETURN_MIB = 8, 16.0, 64.0  # the defaults of what one command hands back from --out


class _PartWriter:
    """A write-only stream cut into files of ``part_bytes`` under ``stage``, each hashed as it is written."""

    def __init__(self, stage: Path, part_bytes: int):
        self.stage, self.part_bytes = stage, part_bytes
        self.parts: list[dict] = []
        self.whole = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._left = 0

    def _next_part(self) -> None:
        self._close_part()
        name = f"part_{len(self.parts):03d}"
        self.parts.append({"name": name, "bytes": 0})
        self._file, self._hash, self._left = open(self.stage / name, "wb"), hashlib.sha256(), self.part_bytes

    def _close_part(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._file is None or self._left == 0:
                self._next_part()
            piece = view[: self._left]
            self._file.write(piece)
            self._hash.update(piece)
            self.whole.update(piece)
            self.parts[-1]["bytes"] += len(piece)
            self._left -= len(piece)
            view = view[len(piece) :]
        return len(data)

    def close(self) -> None:
        self._close_part()


def pack(ckpt: Path, stage: Path, part_bytes: int) -> dict:
    """Cut ``ckpt`` (a complete checkpoint) into parts under ``stage``; returns the manifest, also written there."""
    if not is_complete(ckpt):
        raise ValueError(f"{ckpt}: not a complete checkpoint (step_N/ with meta.json and state/)")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    writer = _PartWriter(stage, part_bytes)
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        tar.add(ckpt, arcname=ckpt.name)
    writer.close()
    total = sum(p["bytes"] for p in writer.parts)
    manifest = {"name": ckpt.name, "source": str(ckpt.resolve()), "step": read_meta(ckpt)["position"]["step"]}
    manifest |= {"bytes": total, "sha256": writer.whole.hexdigest(), "parts": writer.parts}
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _staged(ckpt: Path, stage: Path) -> dict | None:
    """The manifest of ``ckpt``'s parts already under ``stage``, or None."""
    path = stage / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    return manifest if manifest["source"] == str(ckpt.resolve()) else None


def send(ckpt: Path, out: Path, stage: Path, part_bytes: int, per_call: int, first: int | None) -> tuple[dict, Path, list[str], int]:
    """Copy the next ``per_call`` parts (from part ``first`` when given) and the manifest into ``out``/ckpt_NNN/;
    returns the manifest, that folder, the parts' names and how many parts are left after them."""
    manifest = _staged(ckpt, stage) or pack(ckpt, stage, part_bytes)
    parts = manifest["parts"]
    start = first
    if start is None:  # where the last command stopped
        start = int((stage / "next").read_text()) if (stage / "next").is_file() else 0
    if not 0 <= start <= len(parts):
        raise ValueError(f"--from {start}: the checkpoint has parts 0 to {len(parts) - 1}")
    batch = parts[start : start + per_call]
    folder = out / f"ckpt_{start:03d}"
    if batch:
        folder.mkdir(parents=True, exist_ok=True)
        for part in batch:
            shutil.copyfile(stage / part["name"], folder / part["name"])
        shutil.copyfile(stage / MANIFEST, folder / MANIFEST)
    (stage / "next").write_text(str(start + len(batch)))
    return manifest, folder, [p["name"] for p in batch], len(parts) - start - len(batch)


def _check_part(path: Path, part: dict) -> str | None:
    """Why the file at ``path`` is not the manifest's ``part``, or None."""
    size = path.stat().st_size
    if size != part["bytes"]:
        return f"{path}: {size} bytes, the manifest says {part['bytes']}"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return None if h.hexdigest() == part["sha256"] else f"{path}: sha256 differs from the manifest's"


def gather(folders: Sequence[Path], stage: Path) -> dict:
    """Copy the verified parts of ``folders`` under ``stage``; returns the manifest. Parts of another checkpoint
    than the one already gathered there, and parts that fail their check, raise with the file named."""
    held = stage / MANIFEST
    kept = json.loads(held.read_text()) if held.is_file() else None
    for folder in folders:
        path = folder / MANIFEST
        if not path.is_file():
            raise ValueError(f"{folder}: no {MANIFEST} (a folder that `ckpt_transfer.py out` wrote into its --out)")
        mine = json.loads(path.read_text())
        if kept is None:
            stage.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, held)
            kept = mine
        elif mine["sha256"] != kept["sha256"]:
            raise ValueError(f"{path} is of {mine['source']}, the parts under {stage} of {kept['source']}: remove {stage} to start over")
        by_name = {p["name"]: p for p in kept["parts"]}
        for file in sorted(folder.iterdir()):
            if file.name == MANIFEST:
                continue
            if file.name not in by_name:
                raise ValueError(f"{file}: not a part in {path}")
            why = _check_part(file, by_name[file.name])
            if why:
                raise ValueError(why)
            shutil.copyfile(file, stage / f".{file.name}")
            (stage / f".{file.name}").rename(stage / file.name)  # a part under its name is whole
    return kept


class _Joined:
    """The gathered parts read back as one stream, hashed as it is read."""

    def __init__(self, paths: list[Path]):
        self._paths: Iterator[Path] = iter(paths)
        self._file: BinaryIO | None = None
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        while True:
            if self._file is None:
                path = next(self._paths, None)
                if path is None:
                    return b""
                self._file = open(path, "rb")
            data = self._file.read(n)
            if data:
                self.hash.update(data)
                return data
            self._file.close()
            self._file = None


def _extract(tar: tarfile.TarFile, root: Path, name: str) -> int:
    """Regular files and folders of the checkpoint ``name`` under ``root``; anything else raises. Returns the file count."""
    files = 0
    for member in tar:
        parts = Path(member.name).parts
        if not parts or parts[0] != name or ".." in parts or Path(member.name).is_absolute():
            raise ValueError(f"tar member {member.name!r} is outside the checkpoint {name}/")
        target = root.joinpath(*parts)
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
        elif member.isfile():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, MIB)
            files += 1
        else:
            raise ValueError(f"tar member {member.name!r} is neither a file nor a folder")
    return files


def rebuild(manifest: dict, stage: Path, dest: Path) -> int:
    """Write the checkpoint from the complete set of parts under ``stage`` to ``dest``; returns its file count."""
    tmp = dest.parent / f".tmp-{dest.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stream = _Joined([stage / p["name"] for p in manifest["parts"]])
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        files = _extract(tar, tmp, manifest["name"])
    while stream.read(MIB):  # the tar's zero blocks past its end, for the whole digest
        pass
    if stream.hash.hexdigest() != manifest["sha256"]:
        shutil.rmtree(tmp)
        raise ValueError(f"the joined parts under {stage} differ from the manifest's sha256")
    (tmp / manifest["name"]).rename(dest)
    tmp.rmdir()
    return files


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    out = sub.add_parser("out", help="send the next parts of CKPT into OUT/ckpt_NNN/")
    out.add_argument("ckpt", type=Path, help="a complete checkpoint, RUN_DIR/checkpoints/step_N")
    out.add_argument("--out", type=Path, required=True, help="the results folder the host hands back after the command")
    out.add_argument("--stage", type=Path, default=Path("/tmp/ckpt-transfer-out"), help="where the parts wait")
    out.add_argument("--part-mib", type=float, default=13.0, help="size of a part (at most --file-mib)")
    out.add_argument("--per-call", type=int, default=3, help="parts a command sends: what one carry takes back in")
    out.add_argument("--return-files", type=int, default=RETURN_FILES, help="files one command hands back, the manifest one of them")
    out.add_argument("--file-mib", type=float, default=FILE_MIB, help="the largest file the host hands back")
    out.add_argument("--return-mib", type=float, default=RETURN_MIB, help="what one command hands back in all")
    out.add_argument("--from", dest="first", type=int, help="send from this part on (a command whose return was lost)")
    into = sub.add_parser("in", help="gather carried parts; rebuild the checkpoint at DEST once all are here")
    into.add_argument("dest", type=Path, help="the checkpoint to write, e.g. /tmp/ckpt/step_N (must not exist)")
    into.add_argument("folders", type=Path, nargs="+", help="carried ckpt_NNN folders")
    into.add_argument("--stage", type=Path, default=Path("/tmp/ckpt-transfer-in"), help="where verified parts wait")
    return p


def _out(args: argparse.Namespace) -> None:
    part_bytes = int(args.part_mib * MIB)
    fits = 0 < part_bytes <= args.file_mib * MIB and 0 < args.per_call < args.return_files
    if not fits or args.per_call * part_bytes > args.return_mib * MIB:
        each = f"{args.return_files} files (the manifest one of them) of {args.file_mib:g} MiB"
        limits = f"a command hands back {each}, {args.return_mib:g} MiB in all"
        raise ValueError(f"--part-mib {args.part_mib} x --per-call {args.per_call}: {limits}")
    manifest, folder, sent, left = send(args.ckpt, args.out, args.stage, part_bytes, args.per_call, args.first)
    n = len(manifest["parts"])
    size = f"{manifest['bytes'] / 1e6:.1f} MB"
    if sent:
        print(f"{args.ckpt} ({size}, {n} parts): sent {', '.join(sent)} into {folder}")
    print(f"all {n} parts sent" if left == 0 else f"{left} of {n} parts left: call again")


def _in(args: argparse.Namespace) -> None:
    if args.dest.exists():
        raise ValueError(f"{args.dest} exists; it is not overwritten")
    manifest = gather(args.folders, args.stage)
    missing = [p["name"] for p in manifest["parts"] if not (args.stage / p["name"]).is_file()]
    if missing:
        print(f"{len(manifest['parts']) - len(missing)} of {len(manifest['parts'])} parts here; missing: {', '.join(missing)}")
        return
    files = rebuild(manifest, args.stage, args.dest)
    meta = read_meta(args.dest)["position"]
    size = f"{files} files, {manifest['bytes'] / 1e6:.1f} MB"
    print(f"{args.dest}: {size}, sha256 as sent; step {meta['step']}, {meta['train_s']:.0f} s trained")


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        (_out if args.command == "out" else _in)(args)
    except ValueError as e:
        raise SystemExit(f"ckpt_transfer: {e}") from None


if __name__ == "__main__":
    main()
