"""Packing vs padding: training tokens/s (real tokens, not padding) on the same data.

    python lab/bench_packing.py --out bench_packing.json [OVERRIDE ...]

Builds the trainer of ``python -m trainer OVERRIDE ...`` once (default overrides:
``DEFAULTS``) and trains one epoch of the same samples both ways, padded (``PaddedBatcher``)
and packed (``PackedBatcher``, ``data.packing=true``), alternating a batch of each so that
a shared, busy machine slows both alike. A step is what the loop counts as training time:
the target's forward (in-process) plus the draft's train step (target labels, TTT forward,
backward, optimizer), each timed. One warm-up batch of each layout (from epoch 1) is not counted.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from models import hub  # noqa: E402
from trainer.config import register_schema, to_config  # noqa: E402
from trainer.data import PackedBatcher, PaddedBatcher  # noqa: E402
from trainer.loop import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = ["wandb.mode=disabled"]


def step_times(trainer: Trainer, tokens) -> tuple[float, float]:
    """Seconds of the target's forward and of the draft's train step for one batch."""
    start = time.perf_counter()
    fb = trainer.target.engine.features(tokens.to(trainer.par.device))
    mid = time.perf_counter()
    trainer.train_step(fb)
    return mid - start, time.perf_counter() - mid


def measure(trainer: Trainer, batchers: dict) -> dict[str, dict]:
    loaders = {name: trainer.data.train_loader(b, trainer.par.rank, trainer.par.world) for name, b in batchers.items()}
    for loader in loaders.values():
        step_times(trainer, next(loader.epoch_batches(1)))  # warm-up, not counted
    streams = {name: loader.epoch_batches(0) for name, loader in loaders.items()}
    stats = {name: {"steps": 0, "tokens": 0, "padded_tokens": 0, "target_s": 0.0, "draft_s": 0.0} for name in batchers}
    while streams:
        for name in list(streams):
            tokens = next(streams[name], None)
            if tokens is None:
                del streams[name]
                continue
            s = stats[name]
            target_s, draft_s = step_times(trainer, tokens)
            s["target_s"] += target_s
            s["draft_s"] += draft_s
            s["steps"] += 1
            s["tokens"] += int(tokens.lengths.sum())
            s["padded_tokens"] += tokens.input_ids.numel()
            print(f"{name} step {s['steps']} {tuple(tokens.input_ids.shape)}: target {target_s:.2f} s, draft {draft_s:.2f} s", flush=True)
    for s in stats.values():
        s["time_s"] = s["target_s"] + s["draft_s"]
        s["tokens_per_s"], s["padding_share"] = s["tokens"] / s["time_s"], 1 - s["tokens"] / s["padded_tokens"]
    return stats


def main() -> None:
    hub.offline()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_packing.json"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (after DEFAULTS)")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    overrides = [*DEFAULTS, *args.overrides]
    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=overrides))
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="bench_packing_")))
    pad_id, d = trainer.target.pad_id, cfg.data
    batchers = {"padded": PaddedBatcher(d.max_tokens, pad_id), "packed": PackedBatcher(d.max_tokens, d.max_len, pad_id)}
    load_before = os.getloadavg()
    stats = measure(trainer, batchers)
    assert stats["padded"]["tokens"] == stats["packed"]["tokens"], "the two layouts must carry the same epoch"
    print(f"\n{'layout':<8} {'steps':>6} {'tokens':>8} {'padding':>8} {'target s':>9} {'draft s':>8} {'tokens/s':>9}")
    for name, s in stats.items():
        print(
            f"{name:<8} {s['steps']:>6} {s['tokens']:>8} {s['padding_share']:>8.1%} {s['target_s']:>9.1f} {s['draft_s']:>8.1f} "
            f"{s['tokens_per_s']:>9.1f}"
        )
    gain = stats["packed"]["tokens_per_s"] / stats["padded"]["tokens_per_s"] - 1
    print(f"packing: {gain:+.1%} tokens/s")
    machine = {
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "device": str(trainer.par.device),
        "load_average_before_after": [load_before, os.getloadavg()],
    }
    args.out.write_text(json.dumps({"overrides": overrides, "layouts": stats, "gain": gain, "machine": machine}, indent=2))


if __name__ == "__main__":
    main()
