"""Generation speed of the backends (``trainer.datagen.gen_backend``) on the same prompts, in one process.

    python lab/bench_generate.py --out bench_generate.json
    python lab/bench_generate.py --variants hf-b256 sglang --prompts outputs/synthetic/prompts.jsonl

Prompts: the first user turn of every distinct English chatterbot conversation (or of every
record of ``--prompts``), chat template applied by the target's tokenizer; greedy,
``--max-new-tokens`` each. Each variant opens its backend (timed: ``load_s``), generates a
warm-up batch (the shortest prompts, the full budget: builds kernels, compiles; ``warmup_s``),
then the timed run over its prompts (``VARIANTS``: a prompt count, the prompt list repeated to
reach it; ``-rN``: N replicas, ``trainer.datagen.replicas``, sharing each call's prompts).
New tokens exclude the stop token. Variants run in the order given; each row of the table and
JSON is written as soon as its variant ends, and the backend is closed before the next one
starts (SGLang last by default: its engine takes most of the GPU's memory).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

import torch  # noqa: E402

from models import hub  # noqa: E402
from models.generation import GenerationSettings  # noqa: E402
from trainer.data import read_source  # noqa: E402
from trainer.datagen.gen_backend import GeneratorSettings, chat_ids, sglang_arg  # noqa: E402
from trainer.datagen.replicas import fit_generator, open_generator  # noqa: E402
from trainer.regenerate import prompt_conversations  # noqa: E402


@dataclass(frozen=True)
class Variant:
    generator: GeneratorSettings
    batch_size: int
    prompts: int  # timed prompts (the prompt list cycled to reach it)
    warmup: int  # warm-up prompts


VARIANTS = {  # the warm-up of a static-cache variant is one full batch: it compiles the shape the timed run uses
    "hf-b16": Variant(GeneratorSettings(), 16, 96, 16),  # the old default batch
    "hf-b256": Variant(GeneratorSettings(), 256, 512, 16),
    "hf-b1024": Variant(GeneratorSettings(), 1024, 1024, 16),
    "hf-b256-static-compile": Variant(GeneratorSettings(static_cache=True, compile=True), 256, 512, 256),
    "hf-b256-r4": Variant(GeneratorSettings(replicas=4), 256, 2048, 64),  # 4 processes, each 512 prompts in batches of 256
    "sglang": Variant(GeneratorSettings(name="sglang"), 4096, 3004, 64),
    "sglang-r2": Variant(GeneratorSettings(name="sglang", replicas=2), 4096, 3004, 64),
    "sglang-r4": Variant(GeneratorSettings(name="sglang", replicas=4), 4096, 3004, 64),
}


def first_turns(prompts: Path | None) -> list[list[dict]]:
    """The chats to answer: each conversation up to its first assistant turn, distinct."""
    if prompts is not None:
        convs, _ = prompt_conversations(prompts)
    else:
        convs, _ = read_source("chatterbot", None, languages=["english"], on_error="skip", name="source chatterbot")
    seen, chats = set(), []
    for conv in convs:
        chat = conv[: next(i for i, m in enumerate(conv) if m["role"] == "assistant")]
        key = json.dumps(chat, sort_keys=True)
        if chat and key not in seen:
            seen.add(key)
            chats.append(chat)
    return chats


def measure(name: str, variant: Variant, chats: list[list[dict]], args: argparse.Namespace) -> dict:
    generator = replace(variant.generator, target=args.target, attention_backend=args.attention_backend)
    if generator.name == "sglang":
        generator = replace(generator, sglang_args=tuple(sglang_arg(a) for a in args.sglang_arg))
    generator = fit_generator(generator, sampled=False)  # greedy decoding
    start = time.perf_counter()
    backend = open_generator(generator)
    load_s = time.perf_counter() - start
    try:
        ids = [chat_ids(backend.tokenizer, c) for c in chats]
        timed = [ids[k % len(ids)] for k in range(variant.prompts)]
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=variant.batch_size)
        start = time.perf_counter()
        backend.generate(sorted(ids, key=len)[: variant.warmup], settings, 0)
        warmup_s = time.perf_counter() - start
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        replies = backend.generate(timed, settings, 0)
        wall_s = time.perf_counter() - start
    finally:
        backend.close()
        del backend
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    new = sum(r.new_tokens for r in replies)
    return {
        "variant": name,
        "engine": generator.name,
        "batch_size": variant.batch_size,
        "replicas": generator.replicas,
        "sglang_args": dict(generator.sglang_args),
        "static_cache": generator.static_cache,
        "compile": generator.compile,
        "prompts": len(timed),
        "new_tokens": new,
        "stopped": sum(r.finish == "stop" for r in replies),
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(new / wall_s, 1),
        "load_s": round(load_s, 1),
        "warmup_s": round(warmup_s, 1),
    }


def main() -> None:
    hub.offline()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_generate.json"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--prompts", type=Path, default=None, help="a prompt file (default: English chatterbot first turns)")
    p.add_argument("--target", default=None, help="local transformers dir (default: the embedded SmolLM2 target)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--attention-backend", default="triton", help="sglang")
    p.add_argument("--sglang-arg", action="append", default=[], metavar="KEY=VALUE", help="sglang variants: a ServerArgs field")
    args = p.parse_args()
    chats = first_turns(args.prompts)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"{len(chats)} distinct prompts, {args.max_new_tokens} new tokens at most, greedy; {device}")
    print(f"{'variant':<24} {'prompts':>7} {'new tokens':>10} {'stopped':>7} {'wall s':>7} {'tokens/s':>9} {'load s':>6} {'warmup s':>8}")
    rows = []
    for name in args.variants:
        row = measure(name, VARIANTS[name], chats, args)
        rows.append(row)
        print(
            f"{name:<24} {row['prompts']:>7} {row['new_tokens']:>10} {row['stopped']:>7} {row['wall_s']:>7.1f} "
            f"{row['tokens_per_s']:>9.1f} {row['load_s']:>6.1f} {row['warmup_s']:>8.1f}",
            flush=True,
        )
        args.out.write_text(
            json.dumps(
                {
                    "device": device,
                    "max_new_tokens": args.max_new_tokens,
                    "prompts_file": str(args.prompts),
                    "distinct_prompts": len(chats),
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
