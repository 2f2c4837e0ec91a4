"""Drafts' τ paired by prompt, from ``serving.speedup`` results files of their exports measured on the same
prompts (each export's ``--json``, gzipped or not):

    python -m serving.speedup_compare BASE.json OTHER.json [OTHER.json ...] [--json OUT]

For every setting, prompt set and concurrency that BASE and an OTHER both measured: a request's τ is its
output tokens over its verify steps, and a row is the mean over the level's prompts of OTHER's τ minus
BASE's on the same prompt, ± the standard error of that mean. Pairing takes the prompts' own spread out
of the difference, so it resolves what the two τ ± their standard errors cannot (the same prompt is easy
or hard for either draft). A mean of per-request τ weights each prompt once, so it sits above the
token-weighted τ of ``serving.speedup``'s table. Files measured on other prompts, another target,
other new tokens or other engine options are refused by name. Files measured with other ``--concurrency``
lists differ in their prompts' hash and in the engine options that follow the list's top; a level of theirs
is paired when both files hold the target alone's outputs there and those agree output for output (the same
prompts, decoded the same way), and a level whose outputs disagree is named and left out.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Sequence

from serving.speedup import TOP_CONCURRENCY_OPTIONS
from serving.speedup_report import PLAIN, read_results, write_json
from serving.usage import PlainHelp

SAME = ("target", "max_new_tokens")  # conditions a paired comparison needs equal, beside the engine options and the prompts


def request_taus(level: dict) -> list[float | None]:
    """Each request's τ in prompt order (None for a request without a verify step)."""
    return [r["tokens"] / r["verify_ct"] if r.get("verify_ct") else None for r in level["requests"]]


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def paired(base: list[float | None], other: list[float | None]) -> dict:
    """Over the prompts both have a τ for: their count, each file's mean τ, the mean of other − base and its
    standard error (NaN for fewer than two pairs)."""
    pairs = [(b, o) for b, o in zip(base, other) if b is not None and o is not None]
    diffs = [o - b for b, o in pairs]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    means = {"base_mean_tau": mean([b for b, _ in pairs]), "other_mean_tau": mean([o for _, o in pairs])}
    return {"pairs": len(pairs)} | means | {"diff": mean(diffs), "diff_se": se}


def engine_options(conditions: dict) -> dict:
    """The engine options that do not follow the top of the file's ``--concurrency``."""
    return {k: v for k, v in conditions.get("engine", {}).items() if k not in TOP_CONCURRENCY_OPTIONS}


def plain_outputs(data: dict, set_name: str, c: str) -> list[list[int]] | None:
    """The target alone's output ids at one level, in prompt order; None where the file holds none."""
    level = data["runs"].get(PLAIN, {}).get("sets", {}).get(set_name, {}).get(c)
    if level is None:
        return None
    outputs = [r.get("output_ids") for r in level["requests"]]
    return None if any(o is None for o in outputs) else outputs


def same_prompts(base: dict, other: dict, set_name: str, c: str) -> bool:
    """Whether both files decoded this level on the same prompts: their prompts' hash agrees, or the target
    alone's outputs there agree output for output."""
    if base["conditions"].get("prompts") == other["conditions"].get("prompts"):
        return True
    theirs = plain_outputs(base, set_name, c)
    return theirs is not None and theirs == plain_outputs(other, set_name, c)


def compare(base_path: Path, base: dict, other_path: Path, other: dict) -> list[dict]:
    """One row per draft setting, prompt set and concurrency that both files measured on the same prompts."""
    changed = [k for k in SAME if base["conditions"].get(k) != other["conditions"].get(k)]
    changed += ["engine"] if engine_options(base["conditions"]) != engine_options(other["conditions"]) else []
    if changed:
        raise ValueError(f"{other_path} was measured under other conditions than {base_path} ({', '.join(changed)} differ)")
    rows, unpaired = [], []
    for name, run in other["runs"].items():
        if name == PLAIN or name not in base["runs"]:
            continue
        for set_name, levels in run["sets"].items():
            for c, level in levels.items():
                theirs = base["runs"][name]["sets"].get(set_name, {}).get(c)
                if theirs is None:
                    continue
                if not same_prompts(base, other, set_name, c):
                    unpaired.append(f"{name} {set_name} c={c}")
                    continue
                row = {"other": str(other_path), "setting": name, "set": set_name, "concurrency": int(c)}
                rows.append(row | paired(request_taus(theirs), request_taus(level)))
    why = "the prompts' hashes differ and the target alone's outputs there do not agree"
    if unpaired and not rows:
        raise ValueError(f"{other_path} and {base_path}: no level measured on the same prompts ({why}: {', '.join(unpaired)})")
    if unpaired:
        print(f"{other_path}: not paired with {base_path}: {', '.join(unpaired)} ({why})", file=sys.stderr)
    if not rows:
        raise ValueError(f"{other_path} and {base_path} share no draft setting, prompt set and concurrency")
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'other':<36} {'setting':<8} {'set':<20} {'c':>3} {'base':>6} {'other':>6} {'diff':>7} {'se':>6} {'z':>5} {'n':>3}"]
    for r in rows:
        z = r["diff"] / r["diff_se"] if r["diff_se"] > 0 else float("nan")
        lines.append(
            f"{Path(r['other']).parent.name or r['other']:<36.36} {r['setting']:<8} {r['set']:<20.20} {r['concurrency']:>3} "
            f"{r['base_mean_tau']:>6.3f} {r['other_mean_tau']:>6.3f} {r['diff']:>+7.3f} {r['diff_se']:>6.3f} {z:>+5.1f} {r['pairs']:>3}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.speedup_compare", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    p.add_argument("base", type=Path, help="the results file every other is compared with")
    p.add_argument("others", type=Path, nargs="+", metavar="other", help="results files of other exports on the same prompts")
    p.add_argument("--json", type=Path, default=None, help="write the rows here too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        base = read_results(args.base)
        rows = [row for path in args.others for row in compare(args.base, base, path, read_results(path))]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"tau paired by prompt against {args.base} (diff = other - base, se its standard error, z = diff / se, n prompts)")
    print(table(rows))
    if args.json:
        write_json(args.json, {"base": str(args.base), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
