"""What the trainer needs of a target besides its features: the tokenizer, the config facts,
the token embedding and the lm_head, read by tensor name from the checkpoint's safetensors.

The decoder layers are never read: ``TargetHead.from_path`` opens ``config.json``, the
tokenizer and the safetensors files that hold the two ``[V, H]`` matrices (the index's
``weight_map`` says which), and reads those two tensors with ``safe_open``. For a 1T-parameter
target (Kimi-K2.5) that is 2 x 163840 x 7168 bf16 values, 4.7 GB, of a 594 GB checkpoint.

Tensor names, in the order looked for (the names SGLang's and transformers' loaders map):

* embedding: ``model.embed_tokens.weight`` (Llama, Qwen, DeepSeek-V3, ...),
  ``language_model.model.embed_tokens.weight`` (Kimi-K2.5 and other vision wrappers),
  ``model.language_model.embed_tokens.weight`` (transformers v5 saves of such wrappers);
* lm_head: ``lm_head.weight``, ``language_model.lm_head.weight``; when the checkpoint has
  none and the text config says ``tie_word_embeddings``, the lm_head is the embedding.

A multimodal ``config.json`` keeps its language model's sizes in ``text_config`` (Kimi-K2.5):
the facts and the draft's shape come from there, the architecture from the top level (the
class a serving engine loads). Kimi's text config says ``model_type: kimi_k2``, which is
DeepSeek-V3's config (transformers' own ``KimiK25Config`` maps it the same way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import Tensor
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from models.target import HFTargetEngine, TargetInfo, load_tokenizer
from models.target_config import CONFIG_FILE, read_text_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EMBED_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
TEXT_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}  # text-config model types transformers registers under another name


def read_target_config(path: str | Path) -> tuple[str, PretrainedConfig]:
    """(``architectures[0]``, the text model's transformers config) of a model dir's config.json."""
    architecture, text = read_text_config(path)
    model_type = text.pop("model_type", None)
    model_type = TEXT_MODEL_TYPES.get(model_type, model_type)
    if model_type not in CONFIG_MAPPING:
        file = Path(path).expanduser() / CONFIG_FILE
        raise ValueError(
            f"{file}: the language model's model_type {model_type!r} is not a config transformers {transformers.__version__} knows"
        )
    return architecture, AutoConfig.for_model(model_type, **text)


def weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the index or the single ``model.safetensors``."""
    index = directory / INDEX_FILE
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = directory / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise ValueError(
        f"target dir {directory}: neither {INDEX_FILE} nor {SINGLE_FILE}: the trainer reads the embedding and lm_head from safetensors"
    )


def read_tensor(directory: Path, files: dict[str, str], name: str) -> Tensor:
    """The tensor ``name`` from the file ``files`` maps it to; only that tensor is read."""
    file = directory / files[name]
    if not file.is_file():
        raise ValueError(f"{file}: missing; {INDEX_FILE} maps tensor {name!r} to it")
    with safe_open(str(file), framework="pt") as f:
        if name not in f.keys():
            raise ValueError(f"{file}: has no tensor {name!r} (the index maps it to this file)")
        return f.get_tensor(name)


def checkpoint_bytes(path: str | Path) -> int:
    """Bytes of a target's weight files: its safetensors (a dir) or the ``.gguf`` file itself."""
    path = Path(path).expanduser()
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _first(files: dict[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in files), None)


@dataclass
class TargetHead:
    """The target as the trainer process holds it: no decoder layer."""

    info: TargetInfo
    config: PretrainedConfig  # the text model's config (the draft's shape comes from it)
    tokenizer: object
    embed_weight: Tensor  # [V, H]: initialises the draft's frozen embedding
    lm_head_weight: Tensor  # [V, H] on the trainer's device: the labels' logits (tied: the embedding)

    @classmethod
    def of_engine(cls, engine: HFTargetEngine, tokenizer) -> "TargetHead":
        """The head of a target already loaded in this process (its own tensors, no copy)."""
        config = engine.model.config.get_text_config()
        return cls(engine.info, config, tokenizer, engine.embed_weight, engine.lm_head_weight)

    @classmethod
    def from_path(
        cls, path: str | Path, aux_layer_ids=None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "TargetHead":
        """Read a local model dir's config, tokenizer, embedding and lm_head (on ``device``;
        the untied embedding stays on the CPU: only the draft's initialisation reads it)."""
        directory = Path(path).expanduser()
        if directory.suffix == ".gguf":
            raise ValueError(
                f"target {directory}: a .gguf file has no tensors to read by name; pass its transformers dir (or engine.mode=inprocess)"
            )
        architecture, config = read_target_config(directory)
        files = weight_map(directory)
        embed_name, head_name = _first(files, EMBED_NAMES), _first(files, LM_HEAD_NAMES)
        where = directory / (INDEX_FILE if (directory / INDEX_FILE).is_file() else SINGLE_FILE)
        if embed_name is None:
            raise ValueError(f"{where}: no embedding tensor (looked for {', '.join(EMBED_NAMES)})")
        if head_name is None and not config.tie_word_embeddings:
            raise ValueError(
                f"{where}: no lm_head tensor (looked for {', '.join(LM_HEAD_NAMES)}) and {CONFIG_FILE} does not tie it to the embedding"
            )
        embed = _checked(read_tensor(directory, files, embed_name), embed_name, config, where).to(dtype)  # [V, H]
        if head_name is None:
            lm_head = embed = embed.to(device)
        else:
            lm_head = _checked(read_tensor(directory, files, head_name), head_name, config, where).to(device, dtype)  # [V, H]
        info = TargetInfo.of(architecture, config, lm_head.shape[0], aux_layer_ids, str(directory))
        return cls(info, config, load_tokenizer(directory), embed, lm_head)


def _checked(t: Tensor, name: str, config: PretrainedConfig, where: Path) -> Tensor:
    if not t.is_floating_point() or t.dim() != 2 or t.shape[1] != config.hidden_size:
        raise ValueError(f"{where}: tensor {name!r} is {t.dtype} {list(t.shape)}; expected a float [vocab, {config.hidden_size}] matrix")
    return t
