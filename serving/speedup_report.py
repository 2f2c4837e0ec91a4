"""What ``serving.speedup`` makes of its engines' records: per setting, prompt set and concurrency
the throughput, latency, τ and speedup over the target alone, the outputs that differ from plain
greedy, the fastest setting per concurrency, the cost model, the table, and ``serving.json``.

Definitions (one request = one prompt decoded greedily to ``max_new_tokens`` or its stop token):

* ``tokens_per_s``: output tokens of the level / its wall time (first request sent to last answer);
* ``request_tokens_per_s``: the median request's output tokens / its latency;
* ``tpot_ms`` (median, p90): a request's latency / its output tokens (its prefill included);
* ``tau``: output tokens / verify steps over the level's requests (the bonus token counted);
* ``cycle_ms``: the median request's latency / its verify steps (one draft-and-verify cycle);
  ``cycle_p10_ms`` the 10th percentile's (at concurrency 1 a cycle drifts between a fast and a slow mode);
* ``speedup``: ``tokens_per_s`` over the target alone's at the same prompts and concurrency;
* ``identical``: outputs equal to the target alone's, token for token, at the same concurrency;
* ``margin`` of a divergence: the target alone's log probability of its own token minus that of the
  token the other output took there, read from its top-logprob pass over the lowest level's prompts
  (where that pass decoded the same prefix); a bf16 near-tie has a margin near 0;
* ``noise_floor`` of a prompt set (on the target alone's rows): the largest margin at which the target alone's own outputs at other
  concurrencies left its outputs at the lowest one (batch shapes alone, no draft); ``near_ties``: a
  setting's divergences at a margin within it either way (negative: the target alone at that concurrency
  took a token its lowest-level pass ranked below the other's).

Cost model (from the chains, at each concurrency): the target alone emits one token per step of
``step_ms`` (its median ``tpot_ms``); a chain of k draft steps costs ``cycle_ms(k) = k · draft_ms +
verify_ms``. Two chains give ``draft_ms`` (the slope) and ``verify_ms`` (the rest: the target's
verify forward and the scheduler's work). Then ``speedup ≈ τ · step_ms / cycle_ms``, the same draft
free would give ``τ · step_ms / verify_ms`` (the ceiling a cheaper draft could approach), and τ
itself bounds any setting whose verify costs one plain step.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
from pathlib import Path
from typing import Sequence

from serving.eval import ratio_se

PLAIN = "plain"  # the target alone: the baseline every setting is compared with
SERVING_FILE = "serving.json"  # the measured best settings, written into the export dir
TOP_LOGPROBS = 5  # tokens per position of the target alone's top-logprob pass
# log-probability gaps come back through fp32 arithmetic: one bf16 gap can read 0.25 in one place and
# 0.2500000000000001 in another (seen on the H200), so a near tie is held to the noise floor with this slack
TIE_SLACK = 1e-6


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
    if "repeat_wall_s" in level:  # decoded more than once (--repeats): this is the median-time repeat
        stats["repeat_wall_s"] = level["repeat_wall_s"]
    verified = [r for r in reqs if r["verify_ct"]]
    if verified:
        steps = sum(r["verify_ct"] for r in verified)
        hist = [sum(h) for h in zip(*(r["histogram"] for r in verified))]
        stats |= {
            "tau": sum(r["tokens"] for r in verified) / steps,
            "tau_se": ratio_se([(r["tokens"], r["verify_ct"]) for r in verified]),
            "accept_rate": [sum(hist[i + 1 :]) / steps for i in range(len(hist) - 1)],
            "cycle_ms": 1e3 * statistics.median(r["latency_s"] / r["verify_ct"] for r in verified),
            "cycle_p10_ms": 1e3 * nearest_rank([r["latency_s"] / r["verify_ct"] for r in verified], 0.1),
        }
    return stats


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two outputs differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def margin_at(top: dict | None, plain_ids: Sequence[int], other_ids: Sequence[int], at: int) -> dict:
    """The target alone's margin where two outputs part at token ``at``, from its top-logprob record of
    the prompt: ``margin`` (None where the record decoded another prefix or either output ended there) and
    ``beyond_top`` (the other token was not among its top tokens: the margin is a lower bound)."""
    unknown = {"margin": None, "beyond_top": False}
    if top is None or at >= min(len(plain_ids), len(other_ids), len(top["top"])) or top["output_ids"][:at] != list(plain_ids[:at]):
        return unknown
    logprob = {token: lp for token, lp in top["top"][at]}
    mine, theirs = plain_ids[at], other_ids[at]
    if mine not in logprob:
        return unknown
    if theirs in logprob:
        return {"margin": logprob[mine] - logprob[theirs], "beyond_top": False}
    return {"margin": logprob[mine] - min(logprob.values()), "beyond_top": True}


def near_tie(margin: float | None, floor: float | None) -> bool:
    """A divergence's margin within the target alone's noise floor, either way (False where either is unknown)."""
    return margin is not None and floor is not None and abs(margin) <= floor + TIE_SLACK


def partings(plain: list[dict], other: list[dict], tops: list[dict]) -> list[tuple[int, int, dict]]:
    """(prompt, first differing token, the target's margin there) of every request whose output differs
    from the target alone's (``tops``: its top-logprob records of the first prompts)."""
    out = []
    for i, (p, o) in enumerate(zip(plain, other, strict=True)):
        at = first_difference(p["output_ids"], o["output_ids"])
        if at is not None:
            out.append((i, at, margin_at(tops[i] if i < len(tops) else None, p["output_ids"], o["output_ids"], at)))
    return out


def divergences(plain: list[dict], other: list[dict], decode, tops: list[dict]) -> list[dict]:
    """Every request whose output differs from the target alone's: where, the text around it, and the
    target's margin there."""
    out = []
    for i, at, margin in partings(plain, other, tops):
        lo = max(0, at - 8)
        text = {"plain": decode(plain[i]["output_ids"][lo : at + 8]), "draft": decode(other[i]["output_ids"][lo : at + 8])}
        out.append({"prompt": i, "at_token": at} | text | margin)
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
    """A measured setting as the results file keeps it: the target alone keeps its output ids and its
    top-logprob records (every later setting is compared with them); a draft setting keeps its
    divergences from them instead."""
    sets = {}
    for name, levels in run["sets"].items():
        sets[name] = {}
        for c, level in levels.items():
            kept = dict(level)
            if plain is not None:
                base = plain["sets"][name][c]["requests"]
                kept["divergences"] = divergences(base, level["requests"], decode, plain["top_logprobs"][name])
                kept["requests"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in level["requests"]]
            sets[name][c] = kept
    return run | {"sets": sets}


def self_margins(plain: dict, set_name: str, c: str) -> list[float]:
    """The margins at which the target alone's outputs at concurrency ``c`` left its own at the lowest
    level (the batch shapes' noise, no draft), where its top-logprob records know them."""
    levels = plain["sets"][set_name]
    first = levels[min(levels, key=int)]["requests"]
    found = partings(first, levels[c]["requests"][: len(first)], plain["top_logprobs"][set_name])
    return [m["margin"] for _, _, m in found if m["margin"] is not None and not m["beyond_top"]]


def analyse(runs: dict[str, dict]) -> list[dict]:
    """One row per (setting, prompt set, concurrency), the target alone's rows first."""
    plain = runs[PLAIN]
    own = {set_name: {c: self_margins(plain, set_name, c) for c in levels} for set_name, levels in plain["sets"].items()}
    floors = {set_name: max((m for ms in by_c.values() for m in ms), default=None) for set_name, by_c in own.items()}
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
                    row |= {"self_margins": own[set_name][c], "noise_floor": floors[set_name]}
                else:
                    floor, margins = floors[set_name], [d["margin"] for d in level["divergences"] if not d["beyond_top"]]
                    row["identical"] = len(level["requests"]) - len(level["divergences"])
                    row["near_ties"] = sum(near_tie(m, floor) for m in margins)
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
    head = f"{'setting':<24} {'c':>3} {'tau':>6} {'tok/s':>9} {'req tok/s':>9} {'tpot ms':>8} {'p90':>7} {'speedup':>7}"
    head += f" {'same':>9} {'tie':>4}"
    lines = []
    for set_name in dict.fromkeys(r["set"] for r in rows):
        lines += [f"{set_name}", head]
        for r in (r for r in rows if r["set"] == set_name):
            tau = f"{r['tau']:.3f}" if "tau" in r else "-"
            ties = r["near_ties"] if "near_ties" in r else "-"
            lines.append(
                f"{r['setting']:<24} {r['concurrency']:>3} {tau:>6} {r['tokens_per_s']:>9.0f} {r['request_tokens_per_s']:>9.1f} "
                f"{r['tpot_ms']:>8.2f} {r['tpot_p90_ms']:>7.2f} {r['speedup']:>6.2f}x {r['identical']:>4}/{r['requests']:<4} {ties:>4}"
            )
        lines += [noise_line(rows, set_name), ""]
    lines.append("engine start (s, apart from the decode times): " + ", ".join(f"{k} {v:.0f}" for k, v in starts.items()))
    return "\n".join(lines)


def noise_line(rows: list[dict], set_name: str) -> str:
    """What ``tie`` counts in a set: the target alone's own divergences across concurrency and their margins."""
    plain = [r for r in rows if r["set"] == set_name and r["setting"] == PLAIN]
    own = [m for r in plain for m in r["self_margins"]]
    if not own:
        return "tie: no margin of the target alone's own divergences known, so no divergence counts as a near tie"
    return (
        f"tie: divergences at a margin within {plain[0]['noise_floor']:.3f}, the largest at which the target alone left its own "
        f"outputs across concurrency ({len(own)} times, median {statistics.median(own):.3f})"
    )


def divergence_lines(runs: dict[str, dict]) -> list[str]:
    """Every output that differs from the target alone's, one line each."""
    lines = []
    for name, run in runs.items():
        for set_name, levels in run["sets"].items():
            for c, level in levels.items():
                for d in level.get("divergences", []):
                    margin = "margin unknown" if d["margin"] is None else f"margin {'> ' if d['beyond_top'] else ''}{d['margin']:.3f}"
                    lines.append(
                        f"{name} {set_name} c={c} prompt {d['prompt']} token {d['at_token']} ({margin}): {d['plain']!r} -> {d['draft']!r}"
                    )
    return lines


def read_results(path: Path) -> dict:
    """A ``serving.speedup`` results file (gzipped or not); ValueError naming the file when it is not one."""
    try:
        with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as f:
            data = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a results file of serving.speedup ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict) or not isinstance(data.get("conditions"), dict):
        raise ValueError(f"{path}: not a results file of serving.speedup (no conditions or runs)")
    return data


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
