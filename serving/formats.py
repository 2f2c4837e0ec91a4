"""The export formats, one class each, in the registry ``EXPORT_FORMATS``: SGLang's
``LlamaForCausalLMEagle3`` and vLLM's speculators ``eagle3``. A format writes its config from
an ``ExportSpec``, parses it back, names the tensors an export holds, writes the aux layer ids
in its engine's numbering and replays its engine's weight loader (``serving/loaders.py``).

Both formats hold the same tensors under the same names (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``; see ``tensor_shapes``). They differ in the config:

* **SGLang** (``sglang/srt/models/llama_eagle3.py`` and ``model_runner.py``, 0.5.14): a
  transformers-style Llama config with ``architectures: [LlamaForCausalLMEagle3]``;
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` are *outputs of layer k* (SGLang adds 1
  and captures the input of layer k + 1), so our ids are written unchanged. ``fc`` runs only
  when the incoming width differs from the embedding width. ``norm_output`` selects the fed
  back state; SGLang reads a missing key as false. SpecForge 0.2.0 reads the same key as "a
  final norm before lm_head" (``LlamaForCausalLMEagle3.compute_logits``, default true), so an
  explicit false would drop the norm there: the key is written only when it is true, and a
  missing key reads as false. ``tie_word_embeddings`` true or ``draft_vocab_size`` null would
  replace our ``lm_head``; both are written explicitly.
* **vLLM** (``vllm/transformers_utils/configs/speculators/algos.py``, ``llama_eagle3.py``,
  ``gpu_model_runner.py``, 0.33.0): a speculators config (no top-level ``model_type``, a
  ``speculators_config`` block, the layer config under ``transformer_layer_config``). Its
  top-level ``eagle_aux_hidden_state_layer_ids`` are *inputs of layer k*
  (``EagleModelMixin`` appends the residual stream after layer k - 1 under id k), so we
  write ours + 1. vLLM's defaults differ from ours and are written explicitly:
  ``norm_before_residual`` defaults to **true** for speculators configs (ours is false:
  the residual is the un-normed hidden), ``num_aux_hidden_states`` defaults to 3.
  ``draft_id_to_target_id`` exists only when the draft vocab is smaller than the target's,
  so ``d2t`` is omitted when they are equal (vLLM would refuse the unknown tensor).
  SGLang cannot load this config (unknown architecture), which is the point: the ids are
  in vLLM's semantics.

A draft of the **mla layout** (``models.draft.MLAShape``) is ``Eagle3DeepseekV2ForCausalLM`` in both engines
(SGLang 0.5.14 ``kimi_k25_eagle3.py``, vLLM 0.33.0 ``deepseek_eagle3.py``): a DeepSeek-V3 layer config
(``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, interleaved
RoPE) and the MLA tensors under ``midlayer.self_attn.`` (``attention_shapes``). SGLang's config keeps the
aux ids in ``eagle_config``; vLLM's is a transformers config too (no speculators block), its ids (ours + 1)
at the top level, which is how the two are told apart. ``fc_norm`` (an RMSNorm per aux state before
``fc``, EAGLE-3.1) is written when the draft has it, for either layout.

``serving/export.py`` and ``serving/verify.py`` take a format from
``EXPORT_FORMATS`` (by engine name) or ``format_of`` (by config) and never branch on the name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from models.aux_ids import AuxLayerIds
from models.draft import DraftShape, MLAShape
from models.target_config import read_json_object
from serving.loaders import Replay, replay_sglang, replay_vllm

FORMAT_VERSION = 2
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_SPECULATIVE_TOKENS = 5


@dataclass(frozen=True)
class ExportSpec:
    """What an export says besides the draft's weights and shape, in StreamDraft's semantics."""

    aux_layer_ids: AuxLayerIds  # the ids the draft was trained on; num_layers = the target's, when known
    norm_output: bool
    dtype: torch.dtype = torch.bfloat16
    target_architecture: str | None = None
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    target_path: str | None = None  # vLLM's verifier name_or_path
    eval_max_new_tokens: int | None = None  # tokens a turn of the trainer's serving eval generates (serving.eval's default)

    def __post_init__(self) -> None:
        if not isinstance(self.norm_output, bool):
            raise ValueError(f"norm_output must be a bool, got {self.norm_output!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"export dtype must be a floating torch dtype, got {self.dtype!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")

    @classmethod
    def of(
        cls,
        aux_layer_ids,
        norm_output: bool,
        dtype: torch.dtype = torch.bfloat16,
        target_architecture: str | None = None,
        target_num_layers: int | None = None,
        num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
        target_path: str | None = None,
        eval_max_new_tokens: int | None = None,
    ) -> "ExportSpec":
        """A spec from plain values; ``target_num_layers``, when given, bounds the aux ids."""
        ids = AuxLayerIds.of(aux_layer_ids, target_num_layers)
        return cls(ids, norm_output, dtype, target_architecture, num_speculative_tokens, target_path, eval_max_new_tokens)

    @property
    def target_num_layers(self) -> int | None:
        return self.aux_layer_ids.num_layers


@dataclass(frozen=True)
class ExportConfig:
    """An export's config, normalised: what every consumer needs, in StreamDraft's semantics."""

    engine: str  # a key of EXPORT_FORMATS
    shape: DraftShape
    aux_layer_ids: list[int]  # output of decoder layer k (StreamDraft / training semantics)
    engine_aux_layer_ids: list[int]  # as written for the engine
    norm_output: bool
    target_architecture: str | None
    target_num_layers: int | None
    num_speculative_tokens: int | None
    eval_max_new_tokens: int | None  # the trainer's serving eval's tokens a turn (provenance; None: not a StreamDraft run's)
    raw: dict


def embedding_is_shared(shape: DraftShape) -> bool:
    """Both engines replace the draft embedding with the target's only when the widths agree."""
    return shape.hidden_size == shape.target_hidden_size


def attention_shapes(shape: DraftShape) -> dict[str, tuple[int, ...]]:
    """The attention tensors under ``midlayer.self_attn.``, by layout."""
    h, n, m = shape.hidden_size, shape.num_attention_heads, shape.mla
    if m is None:
        q, kv = n * shape.head_dim, shape.num_key_value_heads * shape.head_dim
        return {"q_proj.weight": (q, 2 * h), "k_proj.weight": (kv, 2 * h), "v_proj.weight": (kv, 2 * h), "o_proj.weight": (h, q)}
    return {
        "q_a_proj.weight": (m.q_lora_rank, 2 * h),
        "q_a_layernorm.weight": (m.q_lora_rank,),
        "q_b_proj.weight": (n * m.qk_head_dim, m.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, 2 * h),
        "kv_a_layernorm.weight": (m.kv_lora_rank,),
        "kv_b_proj.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        "o_proj.weight": (h, n * m.v_head_dim),
    }


def tensor_shapes(shape: DraftShape) -> dict[str, tuple[int, ...]]:
    """Every tensor an export may hold, by name, with its shape (``d2t`` whatever the format)."""
    h, i = shape.hidden_size, shape.intermediate_size
    shapes = {
        "fc.weight": (h, shape.num_aux * shape.target_hidden_size),
        **{f"fc_norm.{k}.weight": (shape.target_hidden_size,) for k in range(shape.num_aux) if shape.fc_norm},
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        **{f"midlayer.self_attn.{k}": v for k, v in attention_shapes(shape).items()},
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (shape.draft_vocab_size, h),
        "d2t": (shape.draft_vocab_size,),
        "t2d": (shape.vocab_size,),
    }
    if not embedding_is_shared(shape):
        shapes["embed_tokens.weight"] = (shape.vocab_size, h)
    return shapes


# --------------------------------------------------------------------------- checks


def check_heads(shape: DraftShape) -> None:
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({shape.num_attention_heads}) is not a multiple of num_key_value_heads ({shape.num_key_value_heads})"
        )


def check_fc_reachable(shape: DraftShape) -> None:
    """SGLang runs ``fc`` only when the incoming width differs from the embedding width."""
    if shape.num_aux * shape.target_hidden_size == shape.hidden_size:
        raise ValueError(
            f"num_aux * target_hidden_size == hidden_size ({shape.hidden_size}): SGLang applies fc only when the "
            "incoming width differs from the embedding width, so it would skip fc silently"
        )


# --------------------------------------------------------------------------- shared config parts


MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # the mla layout's class in SGLang 0.5.14 and vLLM 0.33.0
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def layer_config(shape: DraftShape, dtype: torch.dtype) -> dict:
    """The transformers fields of the draft's one decoder layer: a Llama config, or for the mla layout a
    DeepSeek-V3 one (interleaved RoPE, as both engines' MLA rotates by default)."""
    common = {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if shape.mla is None:
        return {"model_type": "llama", **common, "head_dim": shape.head_dim, "mlp_bias": False}
    mla = {name: getattr(shape.mla, name) for name in MLA_FIELDS}
    return {"model_type": "deepseek_v3", **common, **mla, "rope_interleave": True}


def read_config_file(path: Path) -> dict:
    return read_json_object(path, f"{path}: export has no config file")


def _require(config: dict, need: set[str], where: str) -> None:
    missing = sorted(need - config.keys())
    if missing:
        raise ValueError(f"{where}: config lacks field(s) {missing}")


def _fail_first(checks: list[tuple[bool, str]], where: str) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(f"{where}: {message}")


LAYER_FIELDS = {
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
}
LLAMA_FIELDS = {"num_key_value_heads", "head_dim"}


def is_mla(config: dict) -> bool:
    return config.get("architectures") == [MLA_ARCHITECTURE]


def _layer_checks(layer: dict, mla: bool) -> list[tuple[bool, str]]:
    return [
        (layer["num_hidden_layers"] == 1, "num_hidden_layers must be 1"),
        (layer["hidden_act"] == "silu", "hidden_act must be 'silu'"),
        (
            layer["tie_word_embeddings"] is False,
            "tie_word_embeddings must be false (the engine would tie lm_head to the full-vocab embedding)",
        ),
        (not layer.get("attention_bias") and not layer.get("bias") and not layer.get("mlp_bias"), "biases are not supported"),
        (layer.get("rope_scaling") is None, "rope_scaling must be null"),
        (not mla or layer.get("rope_interleave", True) is True, "rope_interleave must be true (the draft trains interleaved RoPE)"),
    ]


def _layer_fields(top: dict) -> set[str]:
    """The layer config's fields a draft of ``top``'s architecture needs."""
    return LAYER_FIELDS | (set(MLA_FIELDS) if is_mla(top) else LLAMA_FIELDS)


def _shape(layer: dict, top: dict, num_aux: int) -> DraftShape:
    mla = is_mla(top)
    heads = layer["num_attention_heads"]
    m = MLAShape(*(layer[name] for name in MLA_FIELDS)) if mla else None
    return DraftShape(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=heads if mla else layer["num_key_value_heads"],
        head_dim=m.qk_head_dim if mla else layer["head_dim"],
        target_hidden_size=top["target_hidden_size"],
        num_aux=num_aux,
        vocab_size=layer["vocab_size"],
        draft_vocab_size=top["draft_vocab_size"],
        rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_theta=float(layer["rope_theta"]),
        max_position_embeddings=layer["max_position_embeddings"],
        mla=m,
        fc_norm=bool(top.get("fc_norm") or top.get("use_aux_norm")),
    )


def _provenance_of(config: dict) -> dict:
    provenance = config.get("streamdraft")  # optional: exports from elsewhere lack it
    return provenance if isinstance(provenance, dict) else {}


# --------------------------------------------------------------------------- the formats


class ExportFormat(ABC):
    """One engine's export format."""

    name: str  # the engine's name, the key in EXPORT_FORMATS
    architecture: str  # the config's architectures[0] for a llama-layout draft
    aux_id_semantics: str  # what an id in this format's config means (written into the provenance)
    unknown_tensor: str  # what the engine's loader does with a tensor name it has no parameter for

    @abstractmethod
    def owns(self, config: dict) -> bool:
        """Whether ``config`` is in this format."""

    @abstractmethod
    def engine_aux_ids(self, ids: AuxLayerIds) -> list[int]:
        """``ids`` (ours) in this engine's numbering, as the config carries them."""

    @abstractmethod
    def write_config(self, shape: DraftShape, spec: ExportSpec) -> dict:
        """The ``config.json`` of an export of a ``shape`` draft; ValueError when the engine could not serve it."""

    @abstractmethod
    def parse(self, config: dict, where: str) -> ExportConfig:
        """Normalise a config in this format; ValueError naming ``where`` on any problem."""

    def carries_d2t(self, shape: DraftShape) -> bool:
        return True

    def expected_tensors(self, shape: DraftShape) -> dict[str, tuple[int, ...]]:
        """Every tensor of an export in this format, by name, with its shape."""
        shapes = tensor_shapes(shape)
        if not self.carries_d2t(shape):
            del shapes["d2t"]
        return shapes

    @abstractmethod
    def replay(self, config: dict, tensors: dict[str, tuple[int, ...]], target_vocab: int | None) -> Replay:
        """The engine's weight loader replayed over the checkpoint's names and shapes."""

    @abstractmethod
    def layer_range(self, engine_ids: list[int], num_layers: int) -> tuple[list[int], str]:
        """(the engine ids out of range for a ``num_layers`` target, the rule they break)."""

    @abstractmethod
    def no_capture(self, shape: DraftShape, version: str, architecture: str) -> str:
        """What goes wrong when the engine's class for ``architecture`` captures no aux states."""

    def architecture_of(self, shape: DraftShape) -> str:
        """The config's architectures[0] for a draft of ``shape``'s layout (both engines name the mla class alike)."""
        return self.architecture if shape.mla is None else MLA_ARCHITECTURE

    def draft_class(self, shape: DraftShape) -> str:
        """The engine's class that serves a draft of ``shape``'s layout (a name in its registry)."""
        return self.architecture_of(shape)

    def unknown_architecture(self, version: str) -> str:
        return f"{self.name} {version} has no model class for this architecture"

    def checks_fc_width(self) -> bool:
        """Whether the engine skips ``fc`` when the incoming width equals the embedding width."""
        return False

    def _provenance(self, shape: DraftShape, spec: ExportSpec) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "engine": self.name,
            "trained_aux_layer_ids": list(spec.aux_layer_ids.ids),
            "target_architecture": spec.target_architecture,
            "target_num_layers": spec.target_num_layers,
            "num_speculative_tokens": spec.num_speculative_tokens,
            **({"eval_max_new_tokens": spec.eval_max_new_tokens} if spec.eval_max_new_tokens is not None else {}),
            "aux_layer_id_semantics": self.aux_id_semantics,
            "embedding": "shared from the target" if embedding_is_shared(shape) else "carried (hidden_size != target_hidden_size)",
        }

    def _ids(self, shape: DraftShape, spec: ExportSpec) -> AuxLayerIds:
        check_heads(shape)
        if self.checks_fc_width():
            check_fc_reachable(shape)
        return spec.aux_layer_ids.check_count(shape.num_aux)

    def _normalised(self, shape: DraftShape, ours: AuxLayerIds, written: list[int], config: dict, k) -> ExportConfig:
        return ExportConfig(
            engine=self.name,
            shape=shape,
            aux_layer_ids=list(ours.ids),
            engine_aux_layer_ids=written,
            norm_output=bool(config.get("norm_output", False)),
            target_architecture=_provenance_of(config).get("target_architecture"),
            target_num_layers=ours.num_layers,
            num_speculative_tokens=k,
            eval_max_new_tokens=_provenance_of(config).get("eval_max_new_tokens"),
            raw=config,
        )


NORM_OUTPUT_NOTE = (
    "the draft feeds back its pre-norm output (norm_output false), so the norm_output key is left out: SGLang "
    "reads a missing key as false, and SpecForge 0.2.0 reads an explicit false as 'no final norm before lm_head'"
)
SGLANG_FIELDS = {"draft_vocab_size", "target_hidden_size", "eagle_config"}  # norm_output: missing means false


class SGLangFormat(ExportFormat):
    name = "sglang"
    architecture = "LlamaForCausalLMEagle3"
    aux_id_semantics = (
        "id k = output of decoder layer k (0-based) = transformers output_hidden_states[k + 1]; "
        "SGLang reads eagle_aux_hidden_state_layer_ids the same way (it captures the input of layer k + 1)"
    )
    unknown_tensor = "skips it silently (the trained weights never load)"

    def owns(self, config: dict) -> bool:
        return not EXPORT_FORMATS["vllm"].owns(config)

    def engine_aux_ids(self, ids: AuxLayerIds) -> list[int]:
        return ids.sglang_argument

    def checks_fc_width(self) -> bool:
        return True

    def write_config(self, shape: DraftShape, spec: ExportSpec) -> dict:
        ids = self._ids(shape, spec)
        return {
            "architectures": [self.architecture_of(shape)],
            **layer_config(shape, spec.dtype),
            "draft_vocab_size": shape.draft_vocab_size,
            "target_hidden_size": shape.target_hidden_size,
            **({"fc_norm": True} if shape.fc_norm else {}),
            **({"norm_output": True} if spec.norm_output else {}),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.engine_aux_ids(ids), "use_aux_hidden_state": True},
            "streamdraft": self._provenance(shape, spec) | ({} if spec.norm_output else {"norm_output_key": NORM_OUTPUT_NOTE}),
        }

    def parse(self, config: dict, where: str) -> ExportConfig:
        _require(config, {"architectures", "model_type", *SGLANG_FIELDS}, where)
        known = [self.architecture, MLA_ARCHITECTURE]
        if config["architectures"] not in [[a] for a in known]:
            raise ValueError(f"{where}: architectures must be one of {[[a] for a in known]}")
        _require(config, _layer_fields(config), where)
        _fail_first(
            [
                *_layer_checks(config, is_mla(config)),
                (isinstance(config.get("norm_output", False), bool), "norm_output must be true or false"),
            ],
            where,
        )
        eagle = config["eagle_config"]
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        if not ids or eagle.get("use_aux_hidden_state") is not True:
            raise ValueError(f"{where}: eagle_config needs eagle_aux_hidden_state_layer_ids and use_aux_hidden_state: true")
        shape = _shape(config, config, len(ids))
        provenance = _provenance_of(config)
        try:
            check_heads(shape)
            check_fc_reachable(shape)
            ours = AuxLayerIds.of(ids, provenance.get("target_num_layers"), shape.num_aux)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        return self._normalised(shape, ours, list(ids), config, provenance.get("num_speculative_tokens"))

    def replay(self, config: dict, tensors: dict[str, tuple[int, ...]], target_vocab: int | None) -> Replay:
        return replay_sglang(config, tensors)

    def layer_range(self, engine_ids: list[int], num_layers: int) -> tuple[list[int], str]:
        # layers_to_capture = id + 1 among layer inputs 0..N-1
        bad = [i for i in engine_ids if not 0 <= i <= num_layers - 2]
        return bad, f"SGLang captures the input of layer id + 1: ids must lie in [0, {num_layers - 2}]"

    def unknown_architecture(self, version: str) -> str:
        return super().unknown_architecture(version) + ": it falls back to TransformersForCausalLM, which has no aux capture"

    def no_capture(self, shape: DraftShape, version: str, architecture: str) -> str:
        wired = (
            "the draft would get the final hidden state, SGLang would skip fc (incoming width == embedding width) and accept ~1.0"
            if shape.target_hidden_size == shape.hidden_size
            else "the draft would get the final hidden state and fail on the fc width"
        )
        return f"sglang {version}: {architecture} does not implement set_eagle3_layers_to_capture: no aux hidden-state capture; {wired}"


VLLM_FIELDS = {
    "speculators_model_type",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
}
VLLM_MLA_FIELDS = {"draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"}
NORM_BEFORE_RESIDUAL = "norm_before_residual must be false (vLLM's speculators default is true: the residual would be the normed hidden)"
NUM_AUX = "num_aux_hidden_states must equal the number of aux layer ids (vLLM sizes fc by it, default 3)"


class VLLMFormat(ExportFormat):
    name = "vllm"
    architecture = "Eagle3Speculator"
    aux_id_semantics = (
        "id k = input of decoder layer k (0-based) = output of layer k - 1 = transformers "
        "output_hidden_states[k]: vLLM's semantics, StreamDraft's training ids + 1"
    )
    unknown_tensor = "refuses it (load_weights raises)"

    def draft_class(self, shape: DraftShape) -> str:
        """vLLM maps a speculators eagle3 config to its ``Eagle3LlamaForCausalLM``."""
        return "Eagle3LlamaForCausalLM" if shape.mla is None else MLA_ARCHITECTURE

    def owns(self, config: dict) -> bool:
        """A speculators config, or an mla config with vLLM's top-level aux ids (SGLang's are in eagle_config)."""
        return "speculators_config" in config or (is_mla(config) and "eagle_config" not in config)

    def engine_aux_ids(self, ids: AuxLayerIds) -> list[int]:
        return ids.vllm

    def carries_d2t(self, shape: DraftShape) -> bool:
        """vLLM's llama class has no ``draft_id_to_target_id`` parameter when the vocabularies are equal; its mla
        class always has one."""
        return shape.mla is not None or shape.draft_vocab_size != shape.vocab_size

    def write_config(self, shape: DraftShape, spec: ExportSpec) -> dict:
        ids = self._ids(shape, spec)
        if shape.mla is not None:  # vLLM reads the mla class's config as a transformers one, no speculators block
            return {
                "architectures": [MLA_ARCHITECTURE],
                **layer_config(shape, spec.dtype),
                "num_aux_hidden_states": shape.num_aux,
                "draft_vocab_size": shape.draft_vocab_size,
                "target_hidden_size": shape.target_hidden_size,
                "norm_before_residual": False,
                "fc_norm": shape.fc_norm,
                "norm_output": spec.norm_output,
                "eagle_aux_hidden_state_layer_ids": self.engine_aux_ids(ids),
                "streamdraft": self._provenance(shape, spec),
            }
        layer = {**layer_config(shape, spec.dtype), "num_aux_hidden_states": shape.num_aux}
        k, arch = spec.num_speculative_tokens, spec.target_architecture
        return {
            "architectures": [self.architecture],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": shape.draft_vocab_size,
            "target_hidden_size": shape.target_hidden_size,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": shape.fc_norm,
            "norm_output": spec.norm_output,
            "eagle_aux_hidden_state_layer_ids": self.engine_aux_ids(ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": spec.target_path, "architectures": [arch] if arch else []},
            },
            "streamdraft": self._provenance(shape, spec),
        }

    def parse(self, config: dict, where: str) -> ExportConfig:
        mla = is_mla(config)
        _require(config, VLLM_MLA_FIELDS if mla else VLLM_FIELDS, where)
        layer = config if mla else config["transformer_layer_config"]
        if not isinstance(layer, dict):
            raise ValueError(f"{where}: transformer_layer_config must be an object")
        _require(layer, _layer_fields(config), where if mla else f"{where} (transformer_layer_config)")
        ids = config["eagle_aux_hidden_state_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be a non-empty list of ints, got {ids!r}")
        _fail_first(
            [
                (mla or config["speculators_model_type"] == "eagle3", "speculators_model_type must be 'eagle3'"),
                (mla or layer.get("model_type", "llama") == "llama", "transformer_layer_config.model_type must be 'llama'"),
                *_layer_checks(layer, mla),
                (config.get("norm_before_residual", not mla) is False, NORM_BEFORE_RESIDUAL),
                (not config.get("norm_before_fc"), "norm_before_fc is not supported"),
                (isinstance(config.get("norm_output", False), bool), "norm_output must be true or false"),
                (layer.get("num_aux_hidden_states", 3) == len(ids), NUM_AUX),
            ],
            where,
        )
        shape = _shape(layer, config, len(ids))
        provenance = _provenance_of(config)
        try:
            check_heads(shape)
            ours = AuxLayerIds.from_vllm(ids, provenance.get("target_num_layers"), shape.num_aux)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
        k = methods[0].get("speculative_tokens", provenance.get("num_speculative_tokens"))
        return self._normalised(shape, ours, list(ids), config, k)

    def replay(self, config: dict, tensors: dict[str, tuple[int, ...]], target_vocab: int | None) -> Replay:
        return replay_vllm(config, tensors, target_vocab)

    def layer_range(self, engine_ids: list[int], num_layers: int) -> tuple[list[int], str]:
        # EagleModelMixin captures after layer id - 1, and id 0 = the embeddings
        bad = [i for i in engine_ids if not 1 <= i <= num_layers]
        return bad, f"vLLM captures the input of layer id: ids must lie in [1, {num_layers}]"

    def no_capture(self, shape: DraftShape, version: str, architecture: str) -> str:
        return (
            f"vllm {version}: {architecture} does not implement SupportsEagle3: no aux hidden-state capture; "
            "vLLM refuses to start EAGLE-3 with it"
        )


EXPORT_FORMATS: dict[str, ExportFormat] = {f.name: f for f in (SGLangFormat(), VLLMFormat())}


def format_named(engine: str) -> ExportFormat:
    """The format of ``engine``; ValueError naming the known ones for any other name."""
    if engine not in EXPORT_FORMATS:
        raise ValueError(f"unknown export engine {engine!r}: known engines are {', '.join(EXPORT_FORMATS)}")
    return EXPORT_FORMATS[engine]


def format_of(config: dict) -> ExportFormat:
    """The format a config dict is in."""
    return next(f for f in EXPORT_FORMATS.values() if f.owns(config))


def parse_export_config(config: dict, where: str) -> ExportConfig:
    """Normalise a config dict of any format; ValueError naming ``where`` on any problem."""
    return format_of(config).parse(config, where)


def read_export_config(export_dir: str | Path) -> ExportConfig:
    path = Path(export_dir) / CONFIG_FILE
    return parse_export_config(read_config_file(path), str(path))
