"""transformers ``generate`` as a generator (``--engine hf``): prompts sorted by length, in left-padded
batches of ``batch_size``; optionally a static KV cache, whose decode step transformers compiles on a
GPU (``compile``; with a static cache and no ``compile`` it runs eagerly). With a static cache few
shapes occur, so few compilations: prompts are padded to a multiple of ``STATIC_PAD`` tokens, and a
short batch gets copies of its first prompt up to a power of two rows (their replies are dropped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from models.generation import DTYPES, GenerationSettings, GeneratorOptions, Reply, cut_at_stop, generation_device, stop_ids_of

STATIC_PAD = 64  # static cache: prompts padded to a multiple of this, so compiled shapes repeat


def open_hf_generator(path: Path, settings: GeneratorOptions) -> HFGenerator:
    """The transformers generator of the target at ``path``, loaded on ``settings.device``."""
    dev = generation_device(settings.device)
    dtype = DTYPES.get(settings.dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    model, tokenizer = load_generator(path, dev, dtype)
    return HFGenerator(model, tokenizer, path, settings.static_cache, settings.compile)


def load_generator(path: str | Path, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) of a local transformers dir or .gguf file, tokenizer padding left."""
    from transformers import AutoModelForCausalLM

    from models.target import load_tokenizer

    path = Path(path).expanduser()
    tokenizer = load_tokenizer(path)
    directory, kwargs = (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{path}: the tokenizer has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


class HFGenerator:
    """transformers ``generate``: prompts sorted by length, left-padded batches of ``batch_size``."""

    name = "hf"

    def __init__(self, model, tokenizer, path: Path, static_cache: bool = False, compile: bool = False):
        if compile and not static_cache:
            raise ValueError("compile needs static_cache: transformers compiles the static-cache decode step")
        self.model, self.tokenizer, self.path = model, tokenizer, Path(path)
        self.static_cache, self.compile = static_cache, compile
        self.stop_ids = stop_ids_of(model.generation_config, tokenizer)
        self.context_len = model.config.get_text_config().max_position_embeddings

    def generate(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings, seed: int) -> list[Reply]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less left padding
        replies: list[Reply | None] = [None] * len(prompts)
        for b in range(0, len(order), settings.batch_size):
            rows = order[b : b + settings.batch_size]
            torch.manual_seed(seed + b)
            for i, reply in zip(rows, self._batch([prompts[i] for i in rows], settings)):
                replies[i] = reply
        return replies  # type: ignore[return-value]

    @torch.no_grad()
    def _batch(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings) -> list[Reply]:
        rows = [list(p) for p in prompts]
        if self.static_cache:
            rows += [rows[0]] * (min(1 << (len(rows) - 1).bit_length(), settings.batch_size) - len(rows))
        pad = STATIC_PAD if self.static_cache else None
        enc = self.tokenizer.pad({"input_ids": rows}, padding=True, pad_to_multiple_of=pad, return_tensors="pt")
        enc = enc.to(self.model.device)  # input_ids, attention_mask [B, L], left-padded
        sampling = (
            {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p}
            if settings.temperature > 0
            else {"do_sample": False}
        )
        cache = {"cache_implementation": "static", "disable_compile": not self.compile} if self.static_cache else {}
        out = self.model.generate(
            **enc,
            max_new_tokens=settings.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            top_k=None,
            **sampling,
            **cache,
        )  # [B, L + new]
        replies = []
        for row in out[: len(prompts), enc["input_ids"].shape[1] :].tolist():
            tokens, finish = cut_at_stop(row, self.stop_ids)
            replies.append(Reply(tokens, self.tokenizer.decode(tokens, skip_special_tokens=False), finish))
        return replies

    def close(self) -> None:
        pass
