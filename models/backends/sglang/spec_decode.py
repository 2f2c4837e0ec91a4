"""SGLang's own EAGLE-3 speculative decoding, as ``serving.sglang_eval`` measures τ in it: the engine that serves
the target with an export as its draft (a chain), and the counters SGLang reports per request."""

from __future__ import annotations

from pathlib import Path

from models.backends.sglang.target import TOKEN_IDS_ENGINE


def chain_engine(export_dir: Path, target: Path, k: int, backend: str, mem: float, load_format: str = "auto"):
    """SGLang's offline ``sglang.Engine`` on ``target`` with the export at ``export_dir`` as its EAGLE-3 draft,
    ``k`` draft tokens a verify step (``speculative_eagle_topk=1``), CUDA graphs off, token ids in and out."""
    import sglang

    return sglang.Engine(
        model_path=str(target),
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(export_dir),
        speculative_num_steps=k,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=k + 1,
        attention_backend=backend,
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        mem_fraction_static=mem,
        load_format=load_format,
        random_seed=0,
        log_level="error",
        **TOKEN_IDS_ENGINE,
    )


def tally(metas: list[dict], k: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Per request (completion tokens, verify steps), and the histogram of accepted drafts [k + 1]
    summed over requests. A request that ended on its first token (the prefill's) had no verify
    step, and SGLang reports no speculative fields for it: it counts (1, 0)."""
    units, hist = [], [0] * (k + 1)
    for meta in metas:
        if "spec_verify_ct" not in meta:
            if meta["completion_tokens"] > 1:
                raise ValueError(f"SGLang reported no speculative decoding for a request (meta_info keys: {sorted(meta)})")
            units.append((meta["completion_tokens"], 0))
            continue
        units.append((meta["completion_tokens"], meta["spec_verify_ct"]))
        for accepted, count in enumerate(meta.get("spec_correct_drafts_histogram") or []):
            hist[accepted] += count
    return units, hist
