"""SGLang 0.5.14's offline ``sglang.Engine`` as a generator (``--engine sglang``; ``skip_tokenizer_init``: ids in,
ids out). One ``generate`` call takes a whole chunk of prompts and the engine's scheduler batches them
continuously. It starts subprocesses (spawn): the calling script needs an ``if __name__ == "__main__":``
guard. Sampling is seeded once, at engine start (``random_seed``).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from pathlib import Path
from typing import Sequence

from models.backends.sglang.target import TOKEN_IDS_ENGINE, import_sglang
from models.generation import FINISHES, REFUSED, GenerationSettings, GeneratorOptions, Reply, stop_ids_of

log = logging.getLogger(__name__)

SGLANG_SET = {  # ServerArgs fields the backend sets itself, and how to change them
    "model_path": "the target is --target",
    "skip_tokenizer_init": "always true here (token ids in and out)",
    "enable_multimodal": "always false here (token ids in and out)",
    "attention_backend": "use --attention-backend",
    "mem_fraction_static": "use --mem-fraction-static (replicas share it)",
    "random_seed": "use --seed",
    "dtype": "use --dtype",
}


def open_sglang_generator(path: Path, settings: GeneratorOptions) -> SGLangGenerator:
    """SGLang's engine on the target dir ``path``; ValueError for a file or float32, which it cannot run."""
    from models.target import load_tokenizer

    if path.is_file():
        raise ValueError(f"--engine sglang needs a transformers dir as --target, got the file {path}")
    if settings.dtype == "float32":
        raise ValueError("--dtype float32: SGLang runs float16 or bfloat16 only (its CUDA RMSNorm, sgl_kernel, has no float32)")
    return SGLangGenerator(path, load_tokenizer(path), settings)


def target_context(path: Path, sglang_args: Sequence[tuple[str, object]] = ()) -> int:
    """SGLang's ``context_length`` when ``--sglang-arg`` sets it, else the target config's
    ``max_position_embeddings`` (of its text model)."""
    from transformers import AutoConfig

    given = dict(sglang_args).get("context_length")
    return int(given) if given is not None else AutoConfig.from_pretrained(path).get_text_config().max_position_embeddings


def sglang_sampling(settings: GenerationSettings, stop_ids: Sequence[int], n: int) -> list[dict]:
    """Engine.generate's ``sampling_params``, one dict per prompt (SGLang's SamplingParams
    keywords; temperature 0 is greedy there too)."""
    params = {
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "stop_token_ids": list(stop_ids),
    }
    return [dict(params) for _ in range(n)]


def sglang_reply(out: dict, tokenizer) -> Reply:
    """A Reply from one Engine.generate result (``skip_tokenizer_init``: no text in it):
    ``output_ids`` holds the ids through the stop token, ``meta_info.finish_reason`` is
    ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or, for a request
    the scheduler refused, ``{"type": "abort", "message": ...}``."""
    reason = out["meta_info"]["finish_reason"] or {}
    kind = reason.get("type")
    if kind == "abort":
        log.warning("SGLang aborted a request (its conversation is dropped): %s", reason.get("message"))
        return REFUSED
    if kind not in FINISHES:
        raise RuntimeError(f"SGLang ended a request with {reason!r} (expected a stop or length finish)")
    tokens = list(out["output_ids"])
    if kind == "stop" and tokens and tokens[-1] == reason.get("matched"):
        tokens = tokens[:-1]
    return Reply(tokens, tokenizer.decode(tokens, skip_special_tokens=False), kind)


def check_sglang_args(args: Sequence[tuple[str, object]], known: Sequence[str], version: str) -> None:
    """ValueError for the first ``--sglang-arg`` name that is not in ``known`` (ServerArgs' fields)."""
    for key, _ in args:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            raise ValueError(f"--sglang-arg {key}: not a field of SGLang {version}'s ServerArgs (close: {', '.join(close) or 'none'})")


class SGLangGenerator:
    """SGLang's offline engine: one ``generate`` call per chunk of prompts."""

    name = "sglang"

    def __init__(self, path: Path, tokenizer, settings: GeneratorOptions):
        from transformers import GenerationConfig

        sglang = import_sglang("--engine sglang")
        self.path, self.tokenizer = Path(path), tokenizer
        generation_config = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None
        self.stop_ids = stop_ids_of(generation_config, tokenizer)
        self.context_len = target_context(path, settings.sglang_args)
        from sglang.srt.server_args import ServerArgs

        check_sglang_args(settings.sglang_args, [f.name for f in dataclasses.fields(ServerArgs)], sglang.__version__)
        options = {"sampling_backend": "pytorch", "log_level": "error"} | dict(settings.sglang_args)
        self.engine = sglang.Engine(
            model_path=str(path),
            attention_backend=settings.attention_backend,
            mem_fraction_static=settings.mem_fraction_static,
            random_seed=settings.seed,
            dtype=settings.dtype,
            **TOKEN_IDS_ENGINE,
            **options,
        )

    def generate(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings, seed: int) -> list[Reply]:
        if not prompts:
            return []
        outs = self.engine.generate(
            input_ids=[list(p) for p in prompts], sampling_params=sglang_sampling(settings, self.stop_ids, len(prompts))
        )
        return [sglang_reply(o, self.tokenizer) for o in outs]

    def close(self) -> None:
        self.engine.shutdown()
