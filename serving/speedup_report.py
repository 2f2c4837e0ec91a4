"""What ``serving.speedup`` makes of its engines' records: per setting, prompt set and concurrency
the throughput, latency, τ and speedup over the target alone, the outputs that differ from plain
greedy, the fastest setting per concurrency, the cost model, the table, and ``serving.json``.

Definitions (one request = one prompt decoded greedily to ``max_new_tokens`` or its stop token):

* ``tokens_per_s``: output tokens of the level / its wall time (first request sent to last answer);
* ``request_tokens_per_s``: the median request's output tokens / its latency;
* ``tpot_ms`` (median, p90): a request's latency / its output tokens (its prefill included);
* ``tau``: output tokens / verify steps over the level's requests (the bonus token counted);
* ``cycle_ms``: the median request's latency / its verify steps (one draft-and-verify cycle);
* ``speedup``: ``tokens_per_s`` over the target alone's at the same prompts and concurrency;
* ``identical``: outputs equal to the target alone's, token for token, at the same concurrency.

Cost model (from the chains, at each concurrency): the target alone emits one token per step of
``step_ms`` (its median ``tpot_ms``); a chain of k draft steps costs ``cycle_ms(k) = k · draft_ms +
verify_ms``. Two chains give ``draft_ms`` (the slope) and ``verify_ms`` (the rest: the target's
verify forward and the scheduler's work). Then ``speedup ≈ τ · step_ms / cycle_ms``, the same draft
free would give ``τ · step_ms / verify_ms`` (the ceiling a cheaper draft could approach), and τ
itself bounds any setting whose verify costs one plain step.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Sequence

from serving.eval import ratio_se

PLAIN = "plain"  # the target alone: the baseline every setting is compared with
SERVING_FILE = "serving.json"  # the measured best settings, written into the export dir


def setting_name(setting: Sequence[int]) -> str:
    """(steps, topk, draft tokens) as its name: ``"6/1/7"`` (a shell and Hydra take it unquoted)."""
    return "/".join(str(v) for v in setting)


def setting_of(name: str) -> tuple[int, int, int]:
    """A setting's name back as (steps, topk, draft tokens)."""
    steps, topk, tokens = (int(v) for v in name.split("/"))
    return steps, topk, tokens


def describe(name: str) -> str:
    if name == PLAIN:
        return "target alone"
    steps, topk, tokens = setting_of(name)
    return f"chain of {steps}" if topk == 1 else f"tree: {steps} steps, top-{topk}, {tokens} tokens"


def nearest_rank(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def level_stats(level: dict) -> dict:
    """A level's throughput, latency and τ from its requests' records."""
    reqs = level["requests"]
    tokens = sum(r["tokens"] for r in reqs)
    per_token = [r["latency_s"] / r["tokens"] for r in reqs if r["tokens"] > 0]
    stats = {
        "requests": len(reqs),
        "output_tokens": tokens,
        "wall_s": level["wall_s"],
        "tokens_per_s": tokens / level["wall_s"],
        "request_tokens_per_s": statistics.median(r["tokens"] / r["latency_s"] for r in reqs),
        "tpot_ms": 1e3 * statistics.median(per_token),
        "tpot_p90_ms": 1e3 * nearest_rank(per_token, 0.9),
    }
    verified = [r for r in reqs if r["verify_ct"]]
    if verified:
        steps = sum(r["verify_ct"] for r in verified)
        hist = [sum(h) for h in zip(*(r["histogram"] for r in verified))]
        stats |= {
            "tau": sum(r["tokens"] for r in verified) / steps,
            "tau_se": ratio_se([(r["tokens"], r["verify_ct"]) for r in verified]),
            "accept_rate": [sum(hist[i + 1 :]) / steps for i in range(len(hist) - 1)],
            "cycle_ms": 1e3 * statistics.median(r["latency_s"] / r["verify_ct"] for r in verified),
        }
    return stats


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two outputs differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergences(plain: list[dict], other: list[dict], decode) -> list[dict]:
    """Every request whose output differs from the target alone's: where, and the text around it."""
    out = []
    for i, (p, o) in enumerate(zip(plain, other, strict=True)):
        at = first_difference(p["output_ids"], o["output_ids"])
        if at is not None:
            lo = max(0, at - 8)
            out.append(
                {
                    "prompt": i,
                    "at_token": at,
                    "plain": decode(p["output_ids"][lo : at + 8]),
                    "draft": decode(o["output_ids"][lo : at + 8]),
                }
            )
    return out


def check_counters(name: str, run: dict) -> None:
    """ValueError when a draft setting's engine left a request of more than its first token without
    SGLang's speculative counters (it would drop out of τ unseen)."""
    for set_name, levels in run["sets"].items():
        for c, level in levels.items():
            for i, r in enumerate(level["requests"]):
                if r["tokens"] > 1 and (r["verify_ct"] is None or r["histogram"] is None):
                    raise ValueError(
                        f"setting {name}, {set_name} at concurrency {c}, prompt {i}: SGLang reported no speculative counters "
                        f"(spec_verify_ct, spec_correct_drafts_histogram) for a request of {r['tokens']} tokens"
                    )


def compact(run: dict, plain: dict | None, decode) -> dict:
    """A measured setting as the results file keeps it: the target alone keeps its output ids (every
    later setting is compared with them); a draft setting keeps its divergences from them instead."""
    sets = {}
    for name, levels in run["sets"].items():
        sets[name] = {}
        for c, level in levels.items():
            kept = dict(level)
            if plain is not None:
                kept["divergences"] = divergences(plain["sets"][name][c]["requests"], level["requests"], decode)
                kept["requests"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in level["requests"]]
            sets[name][c] = kept
    return run | {"sets": sets}


def analyse(runs: dict[str, dict]) -> list[dict]:
    """One row per (setting, prompt set, concurrency), the target alone's rows first."""
    plain = runs[PLAIN]
    rows = []
    for name, run in runs.items():
        for set_name, levels in run["sets"].items():
            for c, level in levels.items():
                base = plain["sets"][set_name][c]
                row = {"setting": name, "set": set_name, "concurrency": int(c)} | level_stats(level)
                row["speedup"] = row["tokens_per_s"] / level_stats(base)["tokens_per_s"]
                if name == PLAIN:
                    first = plain["sets"][set_name][min(levels, key=int)]["requests"]
                    same = sum(first_difference(a["output_ids"], b["output_ids"]) is None for a, b in zip(first, level["requests"]))
                    row |= {"identical": len(level["requests"]), "identical_to_concurrency_1": same}
                else:
                    row["identical"] = len(level["requests"]) - len(level["divergences"])
                rows.append(row)
    return rows


def best_by_concurrency(rows: list[dict]) -> dict[str, dict]:
    """Per concurrency, the draft setting with the highest mean speedup over the prompt sets (fewer
    draft tokens on a tie)."""
    best = {}
    for c in sorted({r["concurrency"] for r in rows}):
        by_setting: dict[str, list[dict]] = {}
        for r in rows:
            if r["concurrency"] == c and r["setting"] != PLAIN:
                by_setting.setdefault(r["setting"], []).append(r)
        if not by_setting:
            continue

        def score(item: tuple[str, list[dict]]) -> tuple[float, int]:
            return statistics.mean(r["speedup"] for r in item[1]), -setting_of(item[0])[2]

        name, picked = max(by_setting.items(), key=score)
        steps, topk, tokens = setting_of(name)
        best[str(c)] = {
            "setting": name,
            "num_steps": steps,
            "topk": topk,
            "num_draft_tokens": tokens,
            "speedup": statistics.mean(r["speedup"] for r in picked),
            "by_set": {r["set"]: {"speedup": r["speedup"], "tau": r["tau"]} for r in picked},
        }
    return best


def cost_model(rows: list[dict]) -> dict[str, dict]:
    """Per (prompt set, concurrency): the target alone's step, the draft step and verify cost fitted to
    the two chains with the most different lengths, and per setting τ, the measured speedup, the
    model's, and the draft-free ceiling."""
    out = {}
    for key in sorted({(r["set"], r["concurrency"]) for r in rows}):
        here = [r for r in rows if (r["set"], r["concurrency"]) == key]
        plain = next(r for r in here if r["setting"] == PLAIN)
        chains = sorted((setting_of(r["setting"])[0], r) for r in here if r["setting"] != PLAIN and setting_of(r["setting"])[1] == 1)
        if len(chains) < 2 or chains[0][0] == chains[-1][0]:
            continue
        (k1, r1), (k2, r2) = chains[0], chains[-1]
        draft_ms = (r2["cycle_ms"] - r1["cycle_ms"]) / (k2 - k1)
        verify_ms = r1["cycle_ms"] - k1 * draft_ms
        settings = {}
        for r in here:
            if r["setting"] != PLAIN:
                settings[r["setting"]] = {
                    "tau": r["tau"],
                    "speedup": r["speedup"],
                    "model": r["tau"] * plain["tpot_ms"] / r["cycle_ms"],
                    "draft_free": r["tau"] * plain["tpot_ms"] / verify_ms if verify_ms > 0 else None,
                }
        out[f"{key[0]} @ {key[1]}"] = {"step_ms": plain["tpot_ms"], "draft_ms": draft_ms, "verify_ms": verify_ms, "settings": settings}
    return out


def table(rows: list[dict], starts: dict[str, float]) -> str:
    """The rows as a text table, a block per prompt set."""
    head = f"{'setting':<24} {'c':>3} {'tau':>6} {'tok/s':>9} {'req tok/s':>9} {'tpot ms':>8} {'p90':>7} {'speedup':>7} {'same':>9}"
    lines = []
    for set_name in dict.fromkeys(r["set"] for r in rows):
        lines += [f"{set_name}", head]
        for r in (r for r in rows if r["set"] == set_name):
            tau = f"{r['tau']:.3f}" if "tau" in r else "-"
            lines.append(
                f"{r['setting']:<24} {r['concurrency']:>3} {tau:>6} {r['tokens_per_s']:>9.0f} {r['request_tokens_per_s']:>9.1f} "
                f"{r['tpot_ms']:>8.2f} {r['tpot_p90_ms']:>7.2f} {r['speedup']:>6.2f}x {r['identical']:>4}/{r['requests']:<4}"
            )
        lines.append("")
    lines.append("engine start (s, apart from the decode times): " + ", ".join(f"{k} {v:.0f}" for k, v in starts.items()))
    return "\n".join(lines)


def divergence_lines(runs: dict[str, dict]) -> list[str]:
    """Every output that differs from the target alone's, one line each."""
    lines = []
    for name, run in runs.items():
        for set_name, levels in run["sets"].items():
            for c, level in levels.items():
                for d in level.get("divergences", []):
                    lines.append(f"{name} {set_name} c={c} prompt {d['prompt']} token {d['at_token']}: {d['plain']!r} -> {d['draft']!r}")
    return lines


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def serving_choice(export_dir: str | Path, concurrency: int) -> dict | None:
    """The measured best setting for ``concurrency`` in the export's ``serving.json`` (the measured
    concurrency nearest to it, the lower on a tie); None when the export has no such file."""
    path = Path(export_dir) / SERVING_FILE
    if not path.is_file():
        return None
    try:
        best = json.loads(path.read_text())["best"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a serving.speedup result ({e}); rerun python -m serving.speedup or delete it") from None
    if not best:
        return None
    c = min(best, key=lambda k: (abs(int(k) - concurrency), int(k)))
    return best[c] | {"concurrency": int(c), "file": str(path)}
