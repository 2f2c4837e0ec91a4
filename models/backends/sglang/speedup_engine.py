"""One engine of ``serving.speedup``: ``python -m models.backends.sglang.speedup_engine JOB.json RESULT.json``.

Starts one SGLang 0.5.14 offline ``sglang.Engine`` with CUDA graphs on (the target alone, or the
target with an EAGLE-3 draft at one setting), times the start, warms it up, then decodes each
prompt set greedily at each concurrency level: at most ``c`` requests in flight
(``async_generate`` under a semaphore), the prefix cache flushed before each level so every level
starts cold. Per request it records the client-side latency, the output ids and SGLang's
speculative counters (``spec_verify_ct``, ``spec_correct_drafts_histogram``). The result is
written to RESULT.json (atomically) for the parent, which compares and tabulates.

The job (written by ``serving.speedup``) names the target, the draft (null: the target alone),
the setting, the engine options and the prompt token ids per set and level. With ``top_logprobs`` N
(the target alone's job), the engine then decodes each set's lowest level once more, one request at a
time, returning its N most likely tokens and their log probabilities at every output position: the
margins the report reads where another engine's output left the target's. Runs in its own
process: SGLang ends the process that started an engine whose scheduler fails, so the parent
survives to name the setting. Needs a CUDA GPU and SGLang.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from models.backends.sglang.target import TOKEN_IDS_ENGINE


def engine_options(job: dict) -> dict:
    """``sglang.Engine`` keywords of a job: the engine options plus, with a draft, EAGLE-3 at its setting."""
    options = {
        "model_path": job["target"],
        **TOKEN_IDS_ENGINE,
        "sampling_backend": "pytorch",
        "random_seed": 0,
        "log_level": "error",
        **job["engine"],
    }
    if job["draft"] is not None:
        steps, topk, tokens = job["setting"]
        options |= {
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": job["draft"],
            "speculative_num_steps": steps,
            "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": tokens,
        }
    return options


def request_record(latency_s: float, out: dict) -> dict:
    """What the parent keeps of one request."""
    meta = out["meta_info"]
    return {
        "latency_s": latency_s,
        "tokens": meta["completion_tokens"],
        "verify_ct": meta.get("spec_verify_ct"),
        "histogram": meta.get("spec_correct_drafts_histogram"),
        "output_ids": list(out["output_ids"]),
    }


async def top_logprob_pass(engine, prompts: list[list[int]], sampling: dict, top: int) -> list[dict]:
    """Each prompt once more, one request at a time (untimed): its output ids and, per output position, the
    ``top`` most likely tokens as [token id, log probability] pairs."""
    records = []
    for ids in prompts:
        out = await engine.async_generate(input_ids=ids, sampling_params=sampling, return_logprob=True, top_logprobs_num=top)
        positions = out["meta_info"]["output_top_logprobs"]  # per position: [(logprob, token id, text or None), ...]
        pairs = [[[t, round(lp, 4)] for lp, t, _ in pos or []] for pos in positions]
        records.append({"output_ids": list(out["output_ids"]), "top": pairs})
    return records


async def decode_level(engine, prompts: list[list[int]], concurrency: int, sampling: dict) -> dict:
    """Every prompt, at most ``concurrency`` in flight; the level's wall time and one record per prompt."""
    gate = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> dict:
        async with gate:
            start = time.perf_counter()
            out = await engine.async_generate(input_ids=ids, sampling_params=sampling)
            return request_record(time.perf_counter() - start, out)

    start = time.perf_counter()
    records = await asyncio.gather(*(one(ids) for ids in prompts))
    return {"wall_s": time.perf_counter() - start, "requests": list(records)}


def median_repeat(repeats: list[dict]) -> dict:
    """The level as reported from its repeats (in the order run): the one of median wall time (the faster of two),
    with every repeat's wall time beside it."""
    ranked = sorted(repeats, key=lambda level: level["wall_s"])
    return ranked[(len(ranked) - 1) // 2] | {"repeat_wall_s": [level["wall_s"] for level in repeats]}


def measure(job: dict) -> dict:
    """Start the engine, warm it up, decode every set at every level (``repeats`` times each); the engine is shut
    down after."""
    import sglang
    import torch

    sampling = {"max_new_tokens": job["max_new_tokens"], "temperature": 0.0, "stop_token_ids": job["stop_ids"]}
    start = time.perf_counter()
    engine = sglang.Engine(**engine_options(job))
    start_s = time.perf_counter() - start
    try:
        top = max(job["concurrency"])
        warm = [ids for level in next(iter(job["sets"].values())).values() for ids in level][:top]
        engine.loop.run_until_complete(decode_level(engine, warm, top, sampling))
        engine.loop.run_until_complete(decode_level(engine, warm[:2], 1, sampling))
        sets = {}
        for name, levels in job["sets"].items():
            sets[name] = {}
            for c in job["concurrency"]:
                repeats = []
                for _ in range(job["repeats"]):
                    engine.flush_cache()
                    repeats.append(engine.loop.run_until_complete(decode_level(engine, levels[str(c)], c, sampling)))
                sets[name][str(c)] = median_repeat(repeats)
        lowest, tops = str(min(job["concurrency"])), {}
        if job["top_logprobs"]:
            for name, levels in job["sets"].items():
                engine.flush_cache()  # as before the timed level: its prompts' prefill not served from the cache
                tops[name] = engine.loop.run_until_complete(top_logprob_pass(engine, levels[lowest], sampling, job["top_logprobs"]))
    finally:
        engine.shutdown()
    device = torch.cuda.get_device_name(0)
    return {"start_s": start_s, "sglang": sglang.__version__, "device": device, "sets": sets, "top_logprobs": tops}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m models.backends.sglang.speedup_engine JOB.json RESULT.json", file=sys.stderr)
        return 2
    job, out = json.loads(Path(args[0]).read_text()), Path(args[1])
    result = measure(job)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
