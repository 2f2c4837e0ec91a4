"""What every generator shares, whichever backend runs it (``models.backends``): token-id prompts in, one
``Reply`` per prompt out, under ``GenerationSettings``.

A reply is the generated ids without the stop token, their text and the finish reason (``stop``: the
model ended it, ``length``: ``max_new_tokens`` did, ``refused``: the prompt was never sent or the engine
aborted it). ``stop_ids_of`` is the one stop rule of the generators and of the serving evals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

FINISHES = ("stop", "length")  # a generation's ends; REFUSED is the reply to a prompt that got none
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    batch_size: int = 16  # hf: prompts per generate batch; sglang: prompts per engine call
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {self.max_new_tokens}, {self.batch_size}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")


@dataclass(frozen=True)
class Reply:
    tokens: list[int]  # generated ids, without the stop token
    text: str  # their text (special tokens kept)
    finish: str  # stop | length | refused

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)


REFUSED = Reply([], "", "refused")


class Generator(Protocol):
    name: str
    path: Path  # the target
    tokenizer: object
    stop_ids: list[int]
    context_len: int  # the longest prompt + new tokens the target takes

    def generate(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings, seed: int) -> list[Reply]: ...

    def close(self) -> None: ...


class GeneratorOptions(Protocol):
    """What a backend opens its generator with: the fields of ``trainer.datagen.gen_backend.GeneratorSettings``."""

    device: str  # hf: auto | cpu | cuda[:N]
    dtype: str  # auto | a name of DTYPES
    static_cache: bool  # hf
    compile: bool  # hf
    attention_backend: str  # sglang
    mem_fraction_static: float  # sglang
    seed: int  # sglang
    sglang_args: tuple[tuple[str, object], ...]  # sglang


def cut_at_stop(row: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], str]:
    """(the ids before the first stop id, ``stop``) or (all of ``row``, ``length``)."""
    end = next((k for k, t in enumerate(row) if t in stop_ids), None)
    return (list(row), "length") if end is None else (list(row[:end]), "stop")


def stop_ids_of(generation_config, tokenizer) -> list[int]:
    """The ids that end a reply: the generation config's eos ids and the tokenizer's eos."""
    ids = generation_config.eos_token_id if generation_config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the target names no end-of-sequence token: generation could not stop")
    return ids


def generation_device(name: str) -> torch.device:
    """``auto``: the GPU when there is one, else the CPU; any other name as torch reads it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
