"""Export -> verify -> evaluate, in one call: what the training loop runs every N steps and
at the end, so ``eval/accept_len`` is measured on the exported checkpoint
loaded back from disk, never on the in-memory draft.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from models.draft import Eagle3Draft
from models.target import TargetInfo
from models.vocab_map import VocabMap
from serving.eval import evaluate_export
from serving.export import export_both
from serving.formats import DEFAULT_SPECULATIVE_TOKENS, ExportSpec
from serving.prompts import PromptSpec
from serving.verify import format_report, verify_exports


def export_verify_eval(
    draft: Eagle3Draft,
    vocab: VocabMap,
    info: TargetInfo,
    target_model,
    tokenizer,
    prompts: list[PromptSpec],
    out_dir: str | os.PathLike,
    *,
    norm_output: bool,
    k: int = DEFAULT_SPECULATIVE_TOKENS,
    max_new_tokens: int = 64,
    target_dir: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.bfloat16,
    strict: bool = True,
) -> dict:
    """Export ``draft`` for SGLang and vLLM under ``out_dir``, verify both, evaluate the SGLang one.

    ``info`` names the target's architecture, layer count and the aux ids the draft was
    trained on; ``target_model`` (a transformers causal LM) runs the verification forwards,
    None skips the speculative decoding (export and verify only); ``target_dir`` is the
    target's transformers dir for the verifier's target checks (None: the export's provenance
    is used). A verification problem raises ValueError with the problem table when
    ``strict``; otherwise it is counted in ``eval/verify_problems``.

    Returns the wandb-ready metrics (``eval/accept_len``, ``eval/accept_rate_{i}``,
    ``eval/cond_accept_rate_{i}`` when decoded; ``eval/verify_problems``) plus ``export_dirs``,
    ``verify`` (the printed reports) and ``eval_wall_s`` (0 when not decoded).
    """
    spec = ExportSpec.of(
        info.aux_layer_ids,
        norm_output,
        dtype,
        info.architecture,
        info.num_layers,
        k,
        str(target_dir) if target_dir is not None else None,
        max_new_tokens,
    )
    dirs = export_both(out_dir, draft, vocab, spec)
    reports = verify_exports(dirs, target_dir)
    problems = sum(len(r.problems) for r in reports.values())
    if problems and strict:
        raise ValueError("exported draft fails verification:\n" + "\n".join(format_report(r) for r in reports.values()))
    result = evaluate_export(dirs["sglang"], target_model, tokenizer, prompts, k, max_new_tokens) if target_model is not None else None
    return {
        **(result.metrics("eval") if result is not None else {}),
        "eval/verify_problems": float(problems),
        "eval_wall_s": result.wall_s if result is not None else 0.0,
        "export_dirs": {engine: str(Path(p)) for engine, p in dirs.items()},
        "verify": {engine: format_report(r) for engine, r in reports.items()},
    }
