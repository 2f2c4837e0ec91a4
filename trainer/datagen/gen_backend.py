"""Generation backends of ``trainer.regenerate`` and ``trainer.synthesize``: token-id prompts
in, one reply per prompt out.

Both backends take prompts as token ids, the chat template applied by our tokenizer
(``chat_ids``), so they see the same ids; each reply is the generated ids without the stop
token, their text, the finish reason (``stop``: the model ended it, ``length``:
``max_new_tokens`` did, ``refused``: the prompt and ``max_new_tokens`` do not fit the target's
context, so it was never sent, or SGLang aborted the request) and the new-token count.

* ``hf``: transformers ``generate`` in left-padded batches of ``batch_size`` prompts of
  similar length; optionally a static KV cache, whose decode step transformers compiles on a
  GPU (``compile``; with a static cache and no ``compile`` it runs eagerly). With a static
  cache few shapes occur, so few compilations: prompts are padded to a multiple of
  ``STATIC_PAD`` tokens, and a short batch gets copies of its first prompt up to a power of
  two rows (their replies are dropped).
* ``sglang``: SGLang 0.5.14's offline ``sglang.Engine`` (``skip_tokenizer_init``: ids in,
  ids out). One ``generate`` call takes a whole chunk of prompts and the engine's scheduler
  batches them continuously. It starts subprocesses (spawn): the calling script needs an
  ``if __name__ == "__main__":`` guard. Sampling is seeded once, at engine start
  (``random_seed``).
* ``auto``: ``sglang`` when it is importable and a GPU is present, else ``hf``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

from models.backends.sglang.target import TOKEN_IDS_ENGINE, import_sglang
from serving.prompts import stop_ids_of

log = logging.getLogger(__name__)

GENERATORS = ("hf", "sglang", "auto")  # the backends a generator runs on (--engine)
FINISHES = ("stop", "length")  # a generation's ends; REFUSED is the reply to a prompt that got none
STATIC_PAD = 64  # static cache: prompts padded to a multiple of this, so compiled shapes repeat
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SGLANG_SET = {  # ServerArgs fields the backend sets itself, and how to change them
    "model_path": "the target is --target",
    "skip_tokenizer_init": "always true here (token ids in and out)",
    "enable_multimodal": "always false here (token ids in and out)",
    "attention_backend": "use --attention-backend",
    "mem_fraction_static": "use --mem-fraction-static (replicas share it)",
    "random_seed": "use --seed",
    "dtype": "use --dtype",
}


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


@dataclass(frozen=True)
class Reply:
    tokens: list[int]  # generated ids, without the stop token
    text: str  # their text (special tokens kept)
    finish: str  # stop | length | refused

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)


REFUSED = Reply([], "", "refused")


class Backend(Protocol):
    name: str
    path: Path  # the target
    tokenizer: object
    stop_ids: list[int]
    context_len: int  # the longest prompt + new tokens the target takes

    def generate(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings, seed: int) -> list[Reply]: ...

    def close(self) -> None: ...


def chat_ids(tokenizer, conversation: Sequence[dict]) -> list[int]:
    """The prompt ids of ``conversation`` with the assistant's turn opened (chat template)."""
    text = tokenizer.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_chats(backend: Backend, chats: Sequence[Sequence[dict]], settings: GenerationSettings, seed: int) -> list[Reply]:
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


def target_context(path: Path, sglang_args: Sequence[tuple[str, object]] = ()) -> int:
    """SGLang's ``context_length`` when ``--sglang-arg`` sets it, else the target config's
    ``max_position_embeddings`` (of its text model)."""
    from transformers import AutoConfig

    given = dict(sglang_args).get("context_length")
    return int(given) if given is not None else AutoConfig.from_pretrained(path).get_text_config().max_position_embeddings


def cut_at_stop(row: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], str]:
    """(the ids before the first stop id, ``stop``) or (all of ``row``, ``length``)."""
    end = next((k for k, t in enumerate(row) if t in stop_ids), None)
    return (list(row), "length") if end is None else (list(row[:end]), "stop")


def default_batch_size(generator: str, device: str) -> int:
    """sglang: 2048 prompts per engine call; hf: 256 prompts a batch on a GPU, 16 on the CPU."""
    if generator == "sglang":
        return 2048
    return 256 if _device(device).type == "cuda" else 16


def resolve_generator(name: str) -> str:
    """``auto``: sglang when it is importable and a GPU is present, else hf."""
    if name != "auto":
        return name
    return "sglang" if torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None else "hf"


def target_path(settings: GeneratorSettings) -> Path:
    """The target ``settings`` name: ``--target``, or the embedded SmolLM2 dir (built on first use)."""
    return Path(settings.target).expanduser() if settings.target is not None else _embedded_dir()


def open_backend(settings: GeneratorSettings) -> Backend:
    """The one backend ``settings.name`` names (``auto`` resolved), loaded and ready in this
    process (``settings.replicas`` is ``trainer.datagen.replicas``' concern)."""
    from models.target import load_tokenizer

    path = target_path(settings)
    if resolve_generator(settings.name) == "sglang":
        if path.is_file():
            raise ValueError(f"--engine sglang needs a transformers dir as --target, got the file {path}")
        if settings.dtype == "float32":
            raise ValueError("--dtype float32: SGLang runs float16 or bfloat16 only (its CUDA RMSNorm, sgl_kernel, has no float32)")
        return SGLangBackend(path, load_tokenizer(path), settings)
    dev = _device(settings.device)
    dtype = DTYPES.get(settings.dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    model, tokenizer = load_generator(path, dev, dtype)
    return HFBackend(model, tokenizer, path, settings.static_cache, settings.compile)


def _embedded_dir() -> Path:
    from models.embedded import embedded_target_dir

    return embedded_target_dir()


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# --------------------------------------------------------------------------- transformers


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


class HFBackend:
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


# --------------------------------------------------------------------------- SGLang


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


class SGLangBackend:
    """SGLang's offline engine: one ``generate`` call per chunk of prompts."""

    name = "sglang"

    def __init__(self, path: Path, tokenizer, settings: GeneratorSettings):
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
