"""The frozen target model as a feature engine: aux-layer capture with forward hooks.

An aux layer id ``k`` means *the output of decoder layer k* (0-based); ``models/aux_ids.py``
validates the ids and says how each engine numbers the same tensor.

``HFTargetEngine.features`` runs only the decoder body (never the lm_head: no
``[tokens, vocab]`` tensor is ever built), copies the aux layers' outputs into one
preallocated ``[B, T, num_aux * H]`` tensor from forward hooks that live for exactly one
call, and returns the body's final normed hidden state beside it.

A packed batch (``TokenBatch.doc_ids``, several documents a row) runs with position ids that
restart at each document and a block-diagonal causal 4D mask, so every document's features
are those it has alone (tests/trainer/test_packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from models.attention import document_causal_mask
from models.aux_ids import AuxLayerIds
from models.batch import FeatureBatch, TokenBatch


@dataclass(frozen=True)
class TargetInfo:
    """What the rest of StreamDraft needs to know about a target model."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of the lm_head
    aux_layer_ids: tuple[int, ...]
    source: str  # where it was loaded from ("<in-memory>" for a model handed in)

    @classmethod
    def of(cls, architecture: str, text_config: PretrainedConfig, vocab_size: int, aux_layer_ids, source: str) -> "TargetInfo":
        """The facts of a target from its text model's transformers config (a multimodal
        config's ``get_text_config()``); ``aux_layer_ids`` None: the default ids."""
        num_layers = text_config.num_hidden_layers
        return cls(
            architecture=architecture,
            model_type=text_config.model_type,
            num_layers=num_layers,
            hidden_size=text_config.hidden_size,
            vocab_size=vocab_size,
            aux_layer_ids=AuxLayerIds.resolve(aux_layer_ids, num_layers).ids,
            source=source,
        )


def _decoder_layers(model: PreTrainedModel, architecture: str) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder body of a causal LM and its list of decoder layers."""
    body = model.get_decoder()
    if body is model:
        raise ValueError(f"cannot find the decoder body of architecture {architecture}")
    layers = body._modules.get("layers")
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"cannot capture aux hidden states for architecture {architecture}: its decoder body "
            f"{type(body).__name__} has no decoder-layer list `layers`"
        )
    return body, layers


def _architecture(model: PreTrainedModel) -> str:
    archs = model.config.architectures
    return archs[0] if archs else type(model).__name__


def resolve_target_path(path: str | Path) -> tuple[Path, str | None]:
    """(directory to load from, GGUF file name or None) for a local model dir or .gguf file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"target model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target model file {str(path)!r} is not a .gguf file; pass a transformers dir")
        return path.parent, path.name
    if not (path / "config.json").is_file():
        raise ValueError(f"target model dir {str(path)!r} has no config.json: not a transformers model dir")
    return path, None


def _from_pretrained(what: str, path: str | Path, load):
    """``load()``, transformers' ``from_pretrained`` of a local target; its OSError or ValueError (a
    missing weights file, a tokenizer it cannot build) as one ValueError line naming the target."""
    try:
        return load()
    except (OSError, ValueError) as e:
        said = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"target {path}: transformers cannot load its {what}: {said}") from e


def load_tokenizer(path: str | Path):
    """The tokenizer (with its chat template) of a local transformers dir or ``.gguf`` file."""
    directory, gguf_file = resolve_target_path(path)
    kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    return _from_pretrained("tokenizer", path, lambda: AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs))


class HFTargetEngine:
    """A frozen transformers causal LM that hands out aux + final hidden states."""

    def __init__(
        self,
        model: PreTrainedModel,
        aux_layer_ids: list[int] | tuple[int, ...] | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        source: str = "<in-memory>",
    ):
        architecture = _architecture(model)
        self._body, self._layers = _decoder_layers(model, architecture)
        num_layers = model.config.get_text_config().num_hidden_layers
        if len(self._layers) < num_layers:
            raise ValueError(f"{architecture}: config says {num_layers} layers, body has {len(self._layers)}")
        if model.get_output_embeddings() is None:
            raise ValueError(f"{architecture} has no lm_head: the target must be a causal LM")
        first = next(model.parameters())
        self.device = torch.device(device) if device is not None else first.device
        self.dtype = dtype if dtype is not None else first.dtype
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.embed_weight = model.get_input_embeddings().weight.detach()  # [V, H]
        self.lm_head_weight = model.get_output_embeddings().weight.detach()  # [V, H] (tied: same tensor)
        self.info = TargetInfo.of(architecture, model.config.get_text_config(), self.lm_head_weight.shape[0], aux_layer_ids, source)

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        aux_layer_ids: list[int] | tuple[int, ...] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "HFTargetEngine":
        """Load a local transformers dir or ``.gguf`` file (dequantised); never touches a hub."""
        directory, gguf_file = resolve_target_path(path)
        kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
        model = _from_pretrained(
            "model", path, lambda: AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True, **kwargs)
        )
        return cls(model, aux_layer_ids, device=device, dtype=dtype, source=str(Path(path).expanduser()))

    def _document_mask(self, doc_ids: Tensor) -> Tensor:
        """[B, 1, T, T] additive mask (0 or the dtype's min): causal within each document of doc_ids [B, T]."""
        config = self.model.config
        if config._attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"packed batches need sdpa or eager attention in the target, it runs {config._attn_implementation}")
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
            raise ValueError(f"{self.info.architecture} has sliding-window layers: packed batches (data.packing) need full attention")
        allowed = document_causal_mask(doc_ids.shape[1], self.device, doc_ids)[:, None]  # [B, 1, T, T]
        mask = torch.zeros(allowed.shape, device=self.device, dtype=self.dtype)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    @torch.no_grad()
    def features(self, tokens: TokenBatch) -> FeatureBatch:
        """Aux-layer outputs and the final normed hidden state for a right-padded or packed batch."""
        tokens = tokens.to(self.device)
        B, T = tokens.input_ids.shape
        H, ids = self.info.hidden_size, self.info.aux_layer_ids
        if tokens.doc_ids is None:
            attention_mask = (torch.arange(T, device=self.device)[None, :] < tokens.lengths[:, None]).long()  # [B, T]
        else:
            attention_mask = self._document_mask(tokens.doc_ids)  # [B, 1, T, T]
        aux = torch.empty(B, T, len(ids) * H, device=self.device, dtype=self.dtype)  # [B, T, A*H]
        filled: set[int] = set()

        def hook_for(slot: int):
            def hook(module: nn.Module, args, output) -> None:
                hidden = output if isinstance(output, Tensor) else output[0]  # [B, T, H]
                aux[..., slot * H : (slot + 1) * H].copy_(hidden)
                filled.add(slot)

            return hook

        handles = [self._layers[k].register_forward_hook(hook_for(slot)) for slot, k in enumerate(ids)]
        try:
            out = self._body(input_ids=tokens.input_ids, attention_mask=attention_mask, position_ids=tokens.positions(), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        assert filled == set(range(len(ids))), f"aux hooks fired for slots {sorted(filled)} of {len(ids)}"
        final = out.last_hidden_state  # [B, T, H], final-normed
        return FeatureBatch(tokens=tokens, aux=aux, final=final)
