"""Time the trainer's data preparation (``trainer.data_setup.prepare_data``: read, split, leak
check, chat template, tokens and loss masks) for a config, as a run would do it.

    python lab/bench_prepare.py --out prepare.json -- +experiment=h200_quality data=openai \\
        data.sources.openai.path=outputs/corpora/answered.jsonl

Everything after ``--`` is a Hydra override of the trainer's config. Prints a table and writes
JSON: seconds, conversations and tokens per second, and a digest of the encoded samples (equal
digests: equal samples, so two versions of the code can be compared on the same data).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout: no install needed

from hydra import compose, initialize_config_dir  # noqa: E402

from models import hub  # noqa: E402
from models.embedded import embedded_target_dir  # noqa: E402
from models.target import load_tokenizer  # noqa: E402
from trainer.config import register_schema, to_config  # noqa: E402
from trainer.data_setup import prepare_data  # noqa: E402


def digest(samples) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(repr((s.input_ids, s.loss_mask, s.boundary_tokens, s.thinking_tokens)).encode())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict:
    hub.offline()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_prepare.json"))
    p.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    args = p.parse_args(argv)
    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=args.overrides))
    tokenizer = load_tokenizer(Path(cfg.target.path).expanduser() if cfg.target.path is not None else embedded_target_dir())
    start = time.perf_counter()
    data = prepare_data(cfg.data, tokenizer, cfg.trainer.seed, cfg.trainer.eval_prompts_file)
    seconds = time.perf_counter() - start
    samples = [s for name in data.train for s in data.train[name] + data.eval[name]]
    tokens = sum(len(s.input_ids) for s in samples)
    row = {
        "overrides": args.overrides,
        "cpus": os.cpu_count(),
        "samples": len(samples),
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "samples_per_s": round(len(samples) / seconds, 1),
        "tokens_per_s": round(tokens / seconds),
        "digest": digest(samples),
    }
    print(f"{'samples':>8} {'tokens':>11} {'seconds':>8} {'samples/s':>10} {'tokens/s':>10}  digest")
    print(f"{len(samples):>8} {tokens:>11} {seconds:>8.1f} {row['samples_per_s']:>10.1f} {row['tokens_per_s']:>10}  {row['digest']}")
    args.out.write_text(json.dumps(row, indent=2))
    return row


if __name__ == "__main__":
    main()
