"""Stand-in answer files for timing the data preparation on a machine without a GPU: every prompt of a
``trainer.corpora prepare`` prompt file as a conversation (``trainer.regenerate``'s records), each assistant
turn a random 200-650 characters cut from the prompts' own text (seeded), not a model's answer:

    python lab/standin_answers.py outputs/corpora/train_prompts.jsonl.gz --out /tmp/standin
    python lab/bench_prepare.py --out prepare.json -- +experiment=h200_quality \\
        data.sources.openai.path=/tmp/standin/answered.jsonl data.sources.sampled.path=/tmp/standin/sampled.jsonl

``answered.jsonl`` holds every prompt, ``sampled.jsonl`` the ShareGPT ones (the recipe's second pass), so
the two files have the recipe's shape: the counts of conversations and turns, answers near its lengths.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout: no install needed

from launch.recipe import SAMPLED_SOURCES  # noqa: E402
from trainer.datagen.record_ids import record_id  # noqa: E402
from trainer.regenerate import prompt_conversations  # noqa: E402


def write_standins(prompts: Path, out: Path, seed: int = 0) -> dict[str, int]:
    """``out``/answered.jsonl and ``out``/sampled.jsonl; the conversations each holds."""
    rng = random.Random(seed)
    convs, extras = prompt_conversations(prompts)
    text = " ".join(m["content"] for c in convs[:3000] for m in c if m["role"] == "user")
    if len(text) < 1000:
        raise ValueError(f"{prompts}: {len(text)} characters of prompts; stand-in answers are cut from at least 1,000")

    def answer() -> str:
        start = rng.randrange(len(text) - 650)
        return text[start : start + rng.randint(200, 650)]

    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, keep in (("answered", lambda e: True), ("sampled", lambda e: e.get("source") in SAMPLED_SOURCES)):
        counts[name] = 0
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for conv, extra in zip(convs, extras):
                if keep(extra):
                    messages = [dict(m, content=answer()) if m["role"] == "assistant" else m for m in conv]
                    record = extra | {"id": record_id(conv), "messages": messages, "generation": {"standin": True}}
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                    counts[name] += 1
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", type=Path, help="a trainer.corpora prepare prompt file (train_prompts.jsonl.gz)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, n in write_standins(args.prompts, args.out, args.seed).items():
        print(f"{args.out / name}.jsonl: {n} conversations")


if __name__ == "__main__":
    main()
