"""The two export formats, as config dicts: SGLang's ``LlamaForCausalLMEagle3`` and vLLM's
speculators ``eagle3`` (DESIGN contracts 1, 2, 3, 5). Building them, and reading them back.

Both formats hold the same tensors under the same names (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``; see ``expected_tensor_shapes``). They differ in the config:

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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from models.draft import DraftShape

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_ARCHITECTURE = "Eagle3Speculator"
ENGINES = ("sglang", "vllm")
FORMAT_VERSION = 2
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
AUX_ID_SEMANTICS = {
    "sglang": (
        "id k = output of decoder layer k (0-based) = transformers output_hidden_states[k + 1]; "
        "SGLang reads eagle_aux_hidden_state_layer_ids the same way (it captures the input of layer k + 1)"
    ),
    "vllm": (
        "id k = input of decoder layer k (0-based) = output of layer k - 1 = transformers "
        "output_hidden_states[k]: vLLM's semantics, StreamDraft's training ids + 1"
    ),
}
DEFAULT_SPECULATIVE_TOKENS = 5


@dataclass(frozen=True)
class ExportConfig:
    """An export's config, normalised: what every consumer needs, in StreamDraft's semantics."""

    engine: str  # "sglang" | "vllm"
    shape: DraftShape
    aux_layer_ids: list[int]  # output of decoder layer k (StreamDraft / training semantics)
    engine_aux_layer_ids: list[int]  # as written for the engine
    norm_output: bool
    target_architecture: str | None
    target_num_layers: int | None
    num_speculative_tokens: int | None
    raw: dict


def embedding_is_shared(shape: DraftShape) -> bool:
    """Both engines replace the draft embedding with the target's only when the widths agree."""
    return shape.hidden_size == shape.target_hidden_size


def carries_d2t(shape: DraftShape, engine: str) -> bool:
    """vLLM has no ``draft_id_to_target_id`` parameter when the vocabularies are equal."""
    return engine == "sglang" or shape.draft_vocab_size != shape.vocab_size


def expected_tensor_shapes(shape: DraftShape, engine: str = "sglang") -> dict[str, tuple[int, ...]]:
    """Every tensor of an export for ``engine``, by name, with its shape."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    shapes = {
        "fc.weight": (h, shape.num_aux * shape.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (shape.draft_vocab_size, h),
        "d2t": (shape.draft_vocab_size,),
        "t2d": (shape.vocab_size,),
    }
    if not carries_d2t(shape, engine):
        del shapes["d2t"]
    if not embedding_is_shared(shape):
        shapes["embed_tokens.weight"] = (shape.vocab_size, h)
    return shapes


# --------------------------------------------------------------------------- checks


def check_heads(shape: DraftShape) -> None:
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({shape.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({shape.num_key_value_heads})"
        )


def check_fc_reachable(shape: DraftShape) -> None:
    """SGLang runs ``fc`` only when the incoming width differs from the embedding width."""
    if shape.num_aux * shape.target_hidden_size == shape.hidden_size:
        raise ValueError(
            f"num_aux * target_hidden_size == hidden_size ({shape.hidden_size}): SGLang applies fc only when the "
            "incoming width differs from the embedding width, so it would skip fc silently"
        )


def check_aux_ids(ids, num_aux: int, target_num_layers: int | None) -> list[int]:
    """Our ids (output of layer k): ``num_aux`` of them, increasing, at most ``N - 2``."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"aux layer ids must be a list of ints, got {ids!r}")
    ids = list(ids)
    if len(ids) != num_aux:
        raise ValueError(f"{len(ids)} aux layer ids {ids} for a draft whose fc reads {num_aux} aux states")
    if ids[0] < 0 or any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"aux layer ids {ids} must be non-negative and strictly increasing (SGLang concatenates the "
            "captured layers in layer order)"
        )
    if target_num_layers is not None and ids[-1] > target_num_layers - 2:
        raise ValueError(
            f"aux layer id {ids[-1]} is out of range for a {target_num_layers}-layer target: SGLang captures "
            f"the output of layer k at the input of layer k + 1, so ids must be <= {target_num_layers - 2}"
        )
    return ids


def _check_args(norm_output, dtype) -> None:
    if not isinstance(norm_output, bool):
        raise ValueError(f"norm_output must be a bool, got {norm_output!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"export dtype must be a floating torch dtype, got {dtype!r}")


# --------------------------------------------------------------------------- building


def layer_config(shape: DraftShape, dtype: torch.dtype) -> dict:
    """The transformers Llama fields of the draft's one decoder layer."""
    return {
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _provenance(engine: str, shape: DraftShape, ids: list[int], target_architecture, target_num_layers, k) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "engine": engine,
        "trained_aux_layer_ids": ids,
        "target_architecture": target_architecture,
        "target_num_layers": target_num_layers,
        "num_speculative_tokens": k,
        "aux_layer_id_semantics": AUX_ID_SEMANTICS[engine],
        "embedding": "shared from the target" if embedding_is_shared(shape) else "carried (hidden_size != target_hidden_size)",
    }


NORM_OUTPUT_NOTE = (
    "the draft feeds back its pre-norm output (norm_output false), so the norm_output key is left out: SGLang "
    "reads a missing key as false, and SpecForge 0.2.0 reads an explicit false as 'no final norm before lm_head'"
)


def sglang_config(
    shape: DraftShape,
    aux_layer_ids: list[int],
    norm_output: bool,
    dtype: torch.dtype,
    target_architecture: str | None = None,
    target_num_layers: int | None = None,
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
) -> dict:
    """SGLang's ``config.json``; ``aux_layer_ids`` are ours (output of layer k), written unchanged."""
    check_heads(shape)
    check_fc_reachable(shape)
    ids = check_aux_ids(aux_layer_ids, shape.num_aux, target_num_layers)
    _check_args(norm_output, dtype)
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **layer_config(shape, dtype),
        "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": shape.target_hidden_size,
        **({"norm_output": True} if norm_output else {}),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "streamdraft": _provenance("sglang", shape, ids, target_architecture, target_num_layers, num_speculative_tokens)
        | ({} if norm_output else {"norm_output_key": NORM_OUTPUT_NOTE}),
    }


def vllm_config(
    shape: DraftShape,
    aux_layer_ids: list[int],
    norm_output: bool,
    dtype: torch.dtype,
    target_architecture: str | None = None,
    target_num_layers: int | None = None,
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    target_path: str | None = None,
) -> dict:
    """vLLM's speculators ``config.json``; ids written as ours + 1 (input of layer k + 1)."""
    check_heads(shape)
    ids = check_aux_ids(aux_layer_ids, shape.num_aux, target_num_layers)
    _check_args(norm_output, dtype)
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {num_speculative_tokens!r}")
    layer = {**layer_config(shape, dtype), "num_aux_hidden_states": shape.num_aux}
    return {
        "architectures": [VLLM_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": shape.target_hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": norm_output,
        "eagle_aux_hidden_state_layer_ids": [k + 1 for k in ids],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens, "accept_tolerance": 0.0, "verifier_accept_k": 1}
            ],
            "verifier": {"name_or_path": target_path, "architectures": [target_architecture] if target_architecture else []},
        },
        "streamdraft": _provenance("vllm", shape, ids, target_architecture, target_num_layers, num_speculative_tokens),
    }


# --------------------------------------------------------------------------- reading


def read_config_file(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path}: export has no config file")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config must be a JSON object")
    return config


def engine_of(config: dict) -> str:
    """"vllm" for a speculators config, else "sglang"."""
    return "vllm" if "speculators_config" in config else "sglang"


def _require(config: dict, need: set[str], where: str) -> None:
    missing = sorted(need - config.keys())
    if missing:
        raise ValueError(f"{where}: config lacks field(s) {missing}")


def _fail_first(checks: list[tuple[bool, str]], where: str) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(f"{where}: {message}")


LAYER_FIELDS = {
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_hidden_layers", "hidden_act", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
    "tie_word_embeddings",
}  # fmt: skip


def _layer_checks(layer: dict) -> list[tuple[bool, str]]:
    return [
        (layer["num_hidden_layers"] == 1, "num_hidden_layers must be 1"),
        (layer["hidden_act"] == "silu", "hidden_act must be 'silu'"),
        (layer["tie_word_embeddings"] is False, "tie_word_embeddings must be false (the engine would tie lm_head to the full-vocab embedding)"),
        (not layer.get("attention_bias") and not layer.get("bias") and not layer.get("mlp_bias"), "biases are not supported"),
        (layer.get("rope_scaling") is None, "rope_scaling must be null"),
    ]  # fmt: skip


def _shape(layer: dict, top: dict, num_aux: int) -> DraftShape:
    return DraftShape(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"],
        target_hidden_size=top["target_hidden_size"],
        num_aux=num_aux,
        vocab_size=layer["vocab_size"],
        draft_vocab_size=top["draft_vocab_size"],
        rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_theta=float(layer["rope_theta"]),
        max_position_embeddings=layer["max_position_embeddings"],
    )


def _provenance_of(config: dict) -> dict:
    provenance = config.get("streamdraft")  # optional: exports from elsewhere lack it
    return provenance if isinstance(provenance, dict) else {}


SGLANG_FIELDS = {"draft_vocab_size", "target_hidden_size", "eagle_config"}  # norm_output: missing means false


def _read_sglang(config: dict, where: str) -> ExportConfig:
    _require(config, {"architectures", "model_type", *LAYER_FIELDS, *SGLANG_FIELDS}, where)
    _fail_first([
        (config["architectures"] == [SGLANG_ARCHITECTURE], f"architectures must be [{SGLANG_ARCHITECTURE!r}]"),
        *_layer_checks(config),
        (not config.get("fc_norm") and not config.get("use_aux_norm"), "fc_norm / use_aux_norm are not supported"),
        (isinstance(config.get("norm_output", False), bool), "norm_output must be true or false"),
    ], where)  # fmt: skip
    eagle = config["eagle_config"]
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if not ids or eagle.get("use_aux_hidden_state") is not True:
        raise ValueError(f"{where}: eagle_config needs eagle_aux_hidden_state_layer_ids and use_aux_hidden_state: true")
    shape = _shape(config, config, len(ids))
    return _normalised("sglang", shape, ids, list(ids), config, where)


VLLM_FIELDS = {"speculators_model_type", "transformer_layer_config", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"}
NORM_BEFORE_RESIDUAL = (
    "norm_before_residual must be false (vLLM's speculators default is true: the residual would be the normed hidden)"
)
NUM_AUX = "transformer_layer_config.num_aux_hidden_states must equal the number of aux layer ids (vLLM sizes fc by it, default 3)"


def _read_vllm(config: dict, where: str) -> ExportConfig:
    _require(config, VLLM_FIELDS, where)
    layer = config["transformer_layer_config"]
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: transformer_layer_config must be an object")
    _require(layer, LAYER_FIELDS, f"{where} (transformer_layer_config)")
    ids = config["eagle_aux_hidden_state_layer_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be a non-empty list of ints, got {ids!r}")
    _fail_first([
        (config["speculators_model_type"] == "eagle3", "speculators_model_type must be 'eagle3'"),
        (layer.get("model_type", "llama") == "llama", "transformer_layer_config.model_type must be 'llama'"),
        *_layer_checks(layer),
        (config.get("norm_before_residual", True) is False, NORM_BEFORE_RESIDUAL),
        (not config.get("norm_before_fc") and not config.get("fc_norm"), "norm_before_fc / fc_norm are not supported"),
        (isinstance(config.get("norm_output", False), bool), "norm_output must be true or false"),
        (layer.get("num_aux_hidden_states", 3) == len(ids), NUM_AUX),
    ], where)  # fmt: skip
    shape = _shape(layer, config, len(ids))
    return _normalised("vllm", shape, [k - 1 for k in ids], list(ids), config, where)


def _normalised(engine: str, shape: DraftShape, ours: list[int], written: list[int], config: dict, where: str) -> ExportConfig:
    provenance = _provenance_of(config)
    target_num_layers = provenance.get("target_num_layers")
    try:
        check_heads(shape)
        if engine == "sglang":
            check_fc_reachable(shape)
        check_aux_ids(ours, shape.num_aux, target_num_layers)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    k = provenance.get("num_speculative_tokens")
    if engine == "vllm":
        methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
        k = methods[0].get("speculative_tokens", k)
    return ExportConfig(
        engine=engine,
        shape=shape,
        aux_layer_ids=ours,
        engine_aux_layer_ids=written,
        norm_output=bool(config.get("norm_output", False)),
        target_architecture=provenance.get("target_architecture"),
        target_num_layers=target_num_layers,
        num_speculative_tokens=k,
        raw=config,
    )


def parse_export_config(config: dict, where: str) -> ExportConfig:
    """Normalise a config dict of either format; ValueError naming ``where`` on any problem."""
    return _read_vllm(config, where) if engine_of(config) == "vllm" else _read_sglang(config, where)


def read_export_config(export_dir: str | Path) -> ExportConfig:
    path = Path(export_dir) / CONFIG_FILE
    return parse_export_config(read_config_file(path), str(path))
