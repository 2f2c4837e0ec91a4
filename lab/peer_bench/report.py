"""The bench's records as a printed table, ``peer_bench.json`` and ``tau_vs_minutes.png``."""

from __future__ import annotations

import json
from pathlib import Path

SIDES = ("streamdraft", "peer")
CHAIN = "6/1/7"


def tau_of(speedup: dict | None, setting: str, concurrency: int) -> float | None:
    """Token-weighted τ over the prompt sets of one setting at one concurrency (serving.speedup's rows)."""
    rows = [r for r in (speedup or {}).get("rows", []) if r["setting"] == setting and r["concurrency"] == concurrency and "tau" in r]
    tokens = sum(r["output_tokens"] for r in rows)
    return sum(r["tau"] * r["output_tokens"] for r in rows) / tokens if tokens else None


def speedup_of(speedup: dict | None, setting: str, concurrency: int) -> float | None:
    """Output tokens/s over the target alone's, over every prompt set, at one concurrency."""
    rows = [r for r in (speedup or {}).get("rows", []) if r["concurrency"] == concurrency]
    ours = [r for r in rows if r["setting"] == setting]
    plain = [r for r in rows if r["setting"] == "plain"]
    if not ours or not plain:
        return None
    return (sum(r["output_tokens"] for r in ours) / sum(r["wall_s"] for r in ours)) / (
        sum(r["output_tokens"] for r in plain) / sum(r["wall_s"] for r in plain)
    )


def best_tree(speedup: dict | None, trees: list[str]) -> str | None:
    """The tree setting of highest τ at concurrency 1."""
    scored = [(t, tau_of(speedup, t, 1)) for t in trees]
    scored = [(t, v) for t, v in scored if v is not None]
    return max(scored, key=lambda tv: tv[1])[0] if scored else None


def summarise(record: dict, trees: list[str]) -> dict:
    """One side at one minutes value: its figures and the τ / speedup of the chain and its best tree."""
    s = record.get("speedup")
    tree = best_tree(s, trees)
    row = {"side": record["side"], "minutes": record["minutes"], "failed": record.get("failed")}
    row |= {k: record.get(k) for k in ("train_s", "steps", "tokens_per_s", "peak_gpu_mem_gb", "first_step_s")}
    row |= {"tau_chain": tau_of(s, CHAIN, 1), "best_tree": tree, "tau_tree": tau_of(s, tree, 1) if tree else None}
    for c in (1, 16):
        row[f"speedup_chain_c{c}"] = speedup_of(s, CHAIN, c)
        row[f"speedup_tree_c{c}"] = speedup_of(s, tree, c) if tree else None
    return row


def _cell(value, width: int, digits: int = 2) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, float):
        return f"{value:>{width}.{digits}f}"
    return f"{str(value):>{width}.{width}}"


COLUMNS = (("side", 11), ("minutes", 7), ("train_s", 8), ("tokens_per_s", 12), ("peak_gpu_mem_gb", 8), ("first_step_s", 8),
           ("tau_chain", 9), ("best_tree", 9), ("tau_tree", 8), ("speedup_chain_c1", 8), ("speedup_chain_c16", 9),
           ("speedup_tree_c1", 8), ("speedup_tree_c16", 9))  # fmt: skip
HEADERS = ("side", "minutes", "train s", "tokens/s", "mem GB", "1st step", "tau chain", "tree", "tau tree", "x c1", "x c16",
           "tree c1", "tree c16")  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = [" ".join(f"{h:>{w}}" for h, (_, w) in zip(HEADERS, COLUMNS))]
    for r in rows:
        line = " ".join(_cell(r[k], w, 0 if k == "tokens_per_s" else 2) for k, w in COLUMNS)
        lines.append(line + (f"  FAILED: {r['failed']['stage']}" if r["failed"] else ""))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """τ (6-step chain and best tree, concurrency 1) against training minutes, one line per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for side in SIDES:
        for key, style in (("tau_chain", "-o"), ("tau_tree", "--s")):
            points = sorted((r["minutes"], r[key]) for r in rows if r["side"] == side and r[key] is not None)
            if points:
                ax.plot([m for m, _ in points], [t for _, t in points], style, label=f"{side} {key.removeprefix('tau_')}")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("τ (accepted tokens per verify step)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: Path, records: list[dict], trees: list[str], extra: dict) -> str:
    """The JSON (every record, the summary rows, ``extra``), the plot; returns the table."""
    rows = [summarise(r, trees) for r in records]
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_bench.json").write_text(json.dumps(extra | {"rows": rows, "records": records}, indent=1) + "\n")
    plot(rows, out / "tau_vs_minutes.png")
    return table(rows)
