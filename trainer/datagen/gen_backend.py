"""The generators of ``trainer.regenerate`` and ``trainer.synthesize``, chosen by ``--engine`` and its
options (``GeneratorSettings``): token-id prompts in, one reply per prompt out.

Every backend of ``models.backends.registry.BACKENDS`` with ``generation`` is one (``hf``: transformers
``generate``, ``models/backends/hf/generate.py``; ``sglang``: SGLang's offline engine,
``models/backends/sglang/generate.py``), and ``auto`` is ``sglang`` when it is importable and a GPU is
present, else ``hf``. They take prompts as token ids, the chat template applied by our tokenizer
(``chat_ids``), so they see the same ids; a prompt whose ids and ``max_new_tokens`` do not fit the
target's context is never sent (``generate_chats``: its reply is ``REFUSED``). The types every
generator shares are in ``models.generation``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from models.backends.registry import able
from models.backends.sglang.generate import SGLANG_SET
from models.generation import DTYPES, REFUSED, GenerationSettings, Generator, Reply, generation_device

GENERATORS = (*able("generation"), "auto")  # the backends a generator runs on (--engine)


def sglang_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` (``--sglang-arg``) as (KEY, VALUE): an int, a float, true / false, or the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--sglang-arg {text!r}: expected KEY=VALUE, e.g. cuda_graph_max_bs=512")
    for kind in (int, float):
        try:
            return key.strip(), kind(value)
        except ValueError:
            pass
    return key.strip(), {"true": True, "false": False}.get(value.lower(), value)


@dataclass(frozen=True)
class GeneratorSettings:
    """Which backend generates, on what, and how (``--engine`` and its options)."""

    name: str = "hf"  # a name of GENERATORS
    target: str | None = None  # local transformers dir (or .gguf: hf only); None: the embedded SmolLM2
    device: str = "auto"  # hf: auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU (sglang: the checkpoint's)
    static_cache: bool = False  # hf
    compile: bool = False  # hf, with static_cache
    attention_backend: str = "triton"  # sglang
    mem_fraction_static: float = 0.8  # sglang
    seed: int = 0  # sglang: the engine's random seed
    replicas: int | None = 1  # generators at once, each in its own process; None: as many as fit (trainer.datagen.replicas)
    sglang_args: tuple[tuple[str, object], ...] = ()  # sglang: more ServerArgs fields, (name, value) pairs

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.sglang_args and self.name == "hf":
            raise ValueError("--sglang-arg sets SGLang engine options: add --engine sglang (or auto)")
        for key, _ in self.sglang_args:
            if key in SGLANG_SET:
                raise ValueError(f"--sglang-arg {key}: {SGLANG_SET[key]}")
        if self.name not in GENERATORS:
            raise ValueError(f"--engine must be one of {GENERATORS}, got {self.name!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.compile and not self.static_cache:
            raise ValueError("--compile compiles the static-cache decode step: add --static-cache")
        if self.name == "sglang" and self.static_cache:
            raise ValueError("--static-cache and --compile are options of --engine hf (SGLang manages its own KV cache)")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")


def chat_ids(tokenizer, conversation: Sequence[dict]) -> list[int]:
    """The prompt ids of ``conversation`` with the assistant's turn opened (chat template)."""
    text = tokenizer.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_chats(backend: Generator, chats: Sequence[Sequence[dict]], settings: GenerationSettings, seed: int) -> list[Reply]:
    """One reply per chat (a conversation ending before the assistant's turn); ``REFUSED``, unsent,
    for a chat whose prompt ids and ``max_new_tokens`` reach the target's context (SGLang
    refuses such a request by failing the whole call)."""
    ids = [chat_ids(backend.tokenizer, c) for c in chats]
    fits = [k for k, p in enumerate(ids) if len(p) + settings.max_new_tokens < backend.context_len]
    replies = [REFUSED] * len(ids)
    if fits:
        for k, reply in zip(fits, backend.generate([ids[k] for k in fits], settings, seed)):
            replies[k] = reply
    return replies


def default_batch_size(generator: str, device: str) -> int:
    """sglang: 2048 prompts per engine call; hf: 256 prompts a batch on a GPU, 16 on the CPU."""
    if generator == "sglang":
        return 2048
    return 256 if generation_device(device).type == "cuda" else 16


def resolve_generator(name: str) -> str:
    """``auto``: sglang when it is importable and a GPU is present, else hf."""
    if name != "auto":
        return name
    return "sglang" if torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None else "hf"


def target_path(settings: GeneratorSettings) -> Path:
    """The target ``settings`` name: ``--target``, or the embedded SmolLM2 dir (built on first use)."""
    return Path(settings.target).expanduser() if settings.target is not None else _embedded_dir()


def open_backend(settings: GeneratorSettings) -> Generator:
    """The one generator ``settings.name`` names (``auto`` resolved), loaded and ready in this
    process (``settings.replicas`` is ``trainer.datagen.replicas``' concern)."""
    return able("generation")[resolve_generator(settings.name)](target_path(settings), settings)


def _embedded_dir() -> Path:
    from models.embedded import embedded_target_dir

    return embedded_target_dir()
