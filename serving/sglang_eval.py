"""``python -m serving.sglang_eval EXPORT_DIR --prompts FILE``: the acceptance length an exported
draft gets in SGLang's own EAGLE-3 speculative decoding (the number a server delivers).

SGLang 0.5.14's offline ``sglang.Engine`` serves the target with the export as its EAGLE-3 draft
(a chain: ``speculative_eagle_topk=1``, ``k`` draft tokens per verify step;
``models/backends/sglang/spec_decode.py``), decodes every prompt
greedily, and reports per request ``spec_verify_ct`` (verify steps), ``completion_tokens`` and
``spec_correct_drafts_histogram`` (verify steps that accepted 0, 1, ... k draft tokens). From
them, over all prompts:

* ``accept_len`` τ = completion tokens / verify steps (the bonus token counted; 1 = nothing accepted);
* ``accept_rate[i]``: share of verify steps that accepted at least i + 1 draft tokens.

Each ``--k`` starts its own engine (the chain length is an engine setting). Prompts are rendered
with the target tokenizer's chat template (``serving/prompts.py``); MT-bench-style follow-ups are
asked after the engine's own answer to the turn before. Needs a CUDA GPU and SGLang.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from models import hub
from models.backends.sglang.spec_decode import chain_engine, tally
from serving.eval import ratio_se
from serving.prompts import Message, PromptSpec, read_prompt_file, render
from serving.usage import PlainHelp


@dataclass
class SpecResult:
    k: int
    accept_len: float  # τ
    accept_len_se: float  # its standard error over requests
    accept_rate: list[float]  # [k]
    verify_steps: int
    new_tokens: int
    turns: int
    wall_s: float

    def summary(self) -> str:
        rates = " / ".join(f"{r:.3f}" for r in self.accept_rate)
        return (
            f"k = {self.k}: tau = {self.accept_len:.3f} ± {self.accept_len_se:.3f} "
            f"({self.verify_steps} verify steps, {self.new_tokens} tokens, "
            f"{self.turns} turns, {self.wall_s:.1f} s); accept rate per position {rates}"
        )


def result_of(metas: list[dict], k: int, turns: int, wall: float) -> SpecResult:
    units, hist = tally(metas, k)
    steps, tokens = sum(d for _, d in units), sum(n for n, _ in units)
    if steps == 0:
        raise ValueError("no verify step was recorded: nothing was decoded")
    rate = [sum(hist[i + 1 :]) / steps for i in range(k)]
    return SpecResult(k, tokens / steps, ratio_se(units), rate, steps, tokens, turns, wall)


def decode_all(engine, tokenizer, prompts: list[PromptSpec], sampling: dict) -> tuple[list[dict], int]:
    """Every turn of every prompt, a turn of all prompts per ``generate`` call. Returns the
    requests' ``meta_info`` and the number of turns."""
    convs: list[list[Message]] = [list(p.context) for p in prompts]
    metas, turns = [], 0
    for t in range(max(p.turns for p in prompts)):
        live = [i for i, p in enumerate(prompts) if t < p.turns]
        for i in live:
            if t > 0:
                convs[i].append({"role": "user", "content": prompts[i].follow_ups[t - 1]})
        outs = engine.generate(input_ids=[render(tokenizer, convs[i]) for i in live], sampling_params=sampling)
        for i, out in zip(live, outs):
            metas.append(out["meta_info"])
            convs[i].append({"role": "assistant", "content": tokenizer.decode(out["output_ids"], skip_special_tokens=True)})
        turns += len(live)
    return metas, turns


def evaluate(
    export_dir: Path,
    target: Path,
    sets: dict[str, list[PromptSpec]],
    k: int,
    max_new_tokens: int,
    backend: str,
    mem: float,
    load_format: str = "auto",
) -> dict[str, SpecResult]:
    """One engine with a ``k``-token chain; each prompt set decoded and tallied apart."""
    from models.target import load_tokenizer

    tokenizer = load_tokenizer(target)
    # SGLang stops on the eos ids of config.json and generation_config.json; the tokenizer's eos is added
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    engine = chain_engine(export_dir, target, k, backend, mem, load_format)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": stop}
    results = {}
    try:
        for name, prompts in sets.items():
            start = time.perf_counter()
            metas, turns = decode_all(engine, tokenizer, prompts, sampling)
            results[name] = result_of(metas, k, turns, time.perf_counter() - start)
    finally:
        engine.shutdown()
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.sglang_eval", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    p.add_argument("export_dir", type=Path, help="an SGLang export (RUN/export/sglang)")
    p.add_argument("--prompts", type=Path, required=True, nargs="+", help="prompt jsonl files (serving/prompts.py), each reported apart")
    p.add_argument("--target", type=Path, default=None, help="target transformers dir (default: the embedded target's cache dir)")
    p.add_argument("--k", type=int, nargs="+", default=[6], help="draft tokens per verify step (chain); one engine per value")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--load-format", default="auto", help="SGLang's load_format for the target (dummy: random weights of its shapes)")
    p.add_argument("--json", type=Path, default=None, help="write {file: {k: result}} here")
    return p


def main(argv: list[str] | None = None) -> int:
    hub.offline()
    args = _parser().parse_args(argv)
    from models.embedded import embedded_target_dir

    target = args.target if args.target is not None else embedded_target_dir()
    sets = {str(f): read_prompt_file(f, args.limit) for f in args.prompts}
    results: dict[str, dict[int, dict]] = {f: {} for f in sets}
    for k in args.k:
        if k < 1:
            raise ValueError(f"--k must be >= 1, got {k}")
        for f, r in evaluate(
            args.export_dir, target, sets, k, args.max_new_tokens, args.attention_backend, args.mem_fraction_static, args.load_format
        ).items():
            print(f"{f} ({len(sets[f])} prompts): {r.summary()}", flush=True)
            results[f][k] = asdict(r)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
