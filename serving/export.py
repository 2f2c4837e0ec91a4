"""Write and read the SGLang ``LlamaForCausalLMEagle3`` draft directory (DESIGN contracts 1, 3, 5).

An export is a directory with ``config.json`` and ``model.safetensors``. What SGLang's
loader (``sglang/srt/models/llama_eagle3.py``) does with it, and what follows for us:

* It silently skips tensor names it does not know, so the file holds exactly the names of
  ``expected_tensor_shapes`` (the draft's parameter names, which are SGLang's: ``fc``,
  ``midlayer.*`` (SGLang renames it to ``layers.0``), ``norm``, ``lm_head``, plus ``d2t`` and
  ``t2d``), and ``load_export`` refuses anything else, by name.
* ``tie_word_embeddings`` true makes ``lm_head`` the full-vocab embedding and drops our
  ``lm_head.weight``; ``draft_vocab_size`` null makes it load the target's full lm_head. Both
  are written explicitly (false, V_d).
* ``d2t`` becomes ``hot_token_id = d2t + arange`` with no check; ``t2d`` is ignored. The map
  is validated here, on write and on read.
* ``fc`` runs only when the incoming hidden width differs from the embedding width, so
  ``num_aux * target_hidden_size == hidden_size`` would skip it silently: refused.
* The embedding is shared from the target (``set_embed``) only when ``target_hidden_size ==
  hidden_size``; otherwise SGLang keeps the draft's own ``embed_tokens``, so the export must
  carry it (and does, as ``embed_tokens.weight``), or SGLang would run on an unset embedding.
* Aux ids are captured at the *input* of layer ``id + 1`` (= output of layer ``id``, our
  semantics) in layer order, concatenated in that order: ids must be strictly increasing
  and at most ``N - 2`` (``N - 1`` would never be captured). ``fc_norm`` / ``use_aux_norm`` /
  ``bias`` keys would change the architecture; they are never written.
* ``norm_output`` picks what is fed back at draft steps after the first (normed or pre-norm
  residual sum); it is always written explicitly.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from models.draft import DraftShape, Eagle3Draft
from models.vocab_map import VocabMap

ARCHITECTURE = "LlamaForCausalLMEagle3"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
AUX_ID_SEMANTICS = (
    "id k = output of decoder layer k (0-based) = transformers output_hidden_states[k + 1]; "
    "SGLang reads eagle_aux_hidden_state_layer_ids the same way (it captures the input of layer k + 1)"
)
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}  # safetensors dtype names
_ALLOWED_DTYPES = {"d2t": {"I64"}, "t2d": {"BOOL"}}


def embedding_is_shared(shape: DraftShape) -> bool:
    """SGLang replaces the draft embedding with the target's only when the widths agree."""
    return shape.hidden_size == shape.target_hidden_size


def expected_tensor_shapes(shape: DraftShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of an export, by name, with its shape: exactly what SGLang consumes."""
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
    if not embedding_is_shared(shape):
        shapes["embed_tokens.weight"] = (shape.vocab_size, h)
    return shapes


def sglang_config(
    shape: DraftShape,
    aux_layer_ids: list[int],
    norm_output: bool,
    dtype: torch.dtype,
    target_architecture: str | None = None,
    target_num_layers: int | None = None,
) -> dict:
    """The ``config.json`` of an export (checked: aux ids, fc reachability, dtype)."""
    _check_shape(shape)
    ids = _check_aux_ids(aux_layer_ids, shape.num_aux, target_num_layers)
    if not isinstance(norm_output, bool):
        raise ValueError(f"norm_output must be a bool, got {norm_output!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"export dtype must be a floating torch dtype, got {dtype!r}")
    return {
        "architectures": [ARCHITECTURE],
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
        "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": shape.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "norm_output": norm_output,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "streamdraft": {
            "format_version": FORMAT_VERSION,
            "target_architecture": target_architecture,
            "target_num_layers": target_num_layers,
            "aux_layer_id_semantics": AUX_ID_SEMANTICS,
            "embedding": "shared from the target" if embedding_is_shared(shape) else "carried (hidden_size != target_hidden_size)",
        },
    }


def export_sglang(
    out_dir: str | os.PathLike,
    draft: Eagle3Draft,
    vocab: VocabMap,
    aux_layer_ids: list[int],
    norm_output: bool,
    dtype: torch.dtype = torch.bfloat16,
    target_architecture: str | None = None,
    target_num_layers: int | None = None,
) -> Path:
    """Write ``out_dir/{config.json, model.safetensors}`` for SGLang; returns ``out_dir``.

    ``aux_layer_ids`` are the ids the draft was trained on (output of layer k, which is
    SGLang's semantics too: written unchanged). ``target_num_layers``, when given, bounds
    them. The directory is built next to ``out_dir`` and renamed into place; an existing
    ``out_dir`` must be empty or an earlier StreamDraft export, and is replaced whole.
    """
    shape = draft.shape
    config = sglang_config(shape, aux_layer_ids, norm_output, dtype, target_architecture, target_num_layers)
    vocab.validate("exported vocab map")
    if (vocab.draft_vocab_size, vocab.target_vocab_size) != (shape.draft_vocab_size, shape.vocab_size):
        raise ValueError(
            f"vocab map ({vocab.draft_vocab_size} draft / {vocab.target_vocab_size} target tokens) does not fit "
            f"the draft ({shape.draft_vocab_size} / {shape.vocab_size})"
        )
    state = draft.trainable_state_dict()
    if not embedding_is_shared(shape):
        state["embed_tokens.weight"] = draft.embed_tokens.weight
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    tensors["d2t"] = vocab.d2t.detach().cpu().contiguous()
    tensors["t2d"] = vocab.t2d.detach().cpu().contiguous()
    problems = _compare(tensors.keys(), {k: tuple(v.shape) for k, v in tensors.items()}, expected_tensor_shapes(shape))
    if problems:
        raise ValueError(f"draft state does not match the {ARCHITECTURE} tensor names: {'; '.join(problems)}")

    out = Path(out_dir)
    _check_overwritable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    tmp = out.with_name(f".{out.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tag}")
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except OSError:
                os.replace(old, out)
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def load_export(
    export_dir: str | os.PathLike, embed_weight: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Draft, VocabMap, dict]:
    """Read an export back strictly: (draft in ``dtype``, validated vocab map, config dict).

    ``embed_weight`` [V_t, H] is the target's embedding, installed as the shared draft
    embedding; pass None for an export that carries its own (hidden != target hidden).
    Missing, unexpected, mis-shaped or mis-typed tensors are one ValueError naming them all.
    """
    export_dir = Path(export_dir)
    config_path, weights_path = export_dir / CONFIG_FILE, export_dir / WEIGHTS_FILE
    config = _read_config(config_path)
    shape = draft_shape_from_config(config, str(config_path))
    expected = expected_tensor_shapes(shape)
    if not weights_path.is_file():
        raise ValueError(f"{weights_path}: export has no weights file")
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            keys = list(f.keys())
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
            dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
            problems = _compare(keys, shapes, expected)
            for k in sorted(set(keys) & set(expected)):
                allowed = _ALLOWED_DTYPES.get(k, _FLOAT_DTYPES)
                if dtypes[k] not in allowed:
                    problems.append(f"{k} has dtype {dtypes[k]}, expected {' or '.join(sorted(allowed))}")
            if problems:
                raise ValueError(
                    f"{weights_path}: does not match the {ARCHITECTURE} checkpoint described by {config_path.name}: "
                    + "; ".join(problems)
                )
            tensors = {k: f.get_tensor(k) for k in keys}
    except SafetensorError as e:
        raise ValueError(f"{weights_path}: not a readable safetensors file ({e})") from e

    vocab = VocabMap(tensors.pop("d2t"), tensors.pop("t2d")).validate(str(weights_path))
    if embedding_is_shared(shape):
        if embed_weight is None:
            raise ValueError(f"{export_dir}: the draft shares the target embedding; pass embed_weight [V_t, H]")
        if tuple(embed_weight.shape) != (shape.vocab_size, shape.hidden_size):
            raise ValueError(
                f"embed_weight has shape {tuple(embed_weight.shape)}, the export needs "
                f"({shape.vocab_size}, {shape.hidden_size})"
            )
        tensors["embed_tokens.weight"] = embed_weight.detach()
    elif embed_weight is not None:
        raise ValueError(
            f"{export_dir}: this export carries its own embedding (hidden_size {shape.hidden_size} != "
            f"target_hidden_size {shape.target_hidden_size}, so SGLang does not share the target's); "
            "do not pass embed_weight"
        )
    draft = Eagle3Draft(shape).to(dtype)
    draft.load_state_dict(tensors, strict=True)
    return draft, vocab, config


def draft_shape_from_config(config: dict, where: str) -> DraftShape:
    """Rebuild ``DraftShape`` from an export's config, refusing what the draft cannot be."""
    need = {
        "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_hidden_layers", "hidden_act", "rms_norm_eps", "rope_theta",
        "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size",
        "tie_word_embeddings", "norm_output", "eagle_config",
    }  # fmt: skip
    missing = sorted(need - config.keys())
    if missing:
        raise ValueError(f"{where}: config lacks field(s) {missing}")
    checks = [
        (config["architectures"] == [ARCHITECTURE], f"architectures must be [{ARCHITECTURE!r}]"),
        (config["num_hidden_layers"] == 1, "num_hidden_layers must be 1"),
        (config["hidden_act"] == "silu", "hidden_act must be 'silu'"),
        (config["tie_word_embeddings"] is False, "tie_word_embeddings must be false (SGLang would tie lm_head to the full-vocab embedding)"),
        (not config.get("attention_bias") and not config.get("bias") and not config.get("mlp_bias"), "biases are not supported"),
        (not config.get("fc_norm") and not config.get("use_aux_norm"), "fc_norm / use_aux_norm are not supported"),
        (config.get("rope_scaling") is None, "rope_scaling must be null"),
        (isinstance(config["norm_output"], bool), "norm_output must be true or false"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(f"{where}: {message}")
    eagle = config["eagle_config"]
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if not ids or eagle.get("use_aux_hidden_state") is not True:
        raise ValueError(f"{where}: eagle_config needs eagle_aux_hidden_state_layer_ids and use_aux_hidden_state: true")
    shape = DraftShape(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        target_hidden_size=config["target_hidden_size"],
        num_aux=len(ids),
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=float(config["rope_theta"]),
        max_position_embeddings=config["max_position_embeddings"],
    )
    provenance = config.get("streamdraft")  # optional: exports from elsewhere lack it
    target_num_layers = provenance.get("target_num_layers") if isinstance(provenance, dict) else None
    try:
        _check_shape(shape)
        _check_aux_ids(ids, shape.num_aux, target_num_layers)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    return shape


def _check_shape(shape: DraftShape) -> None:
    if shape.num_aux * shape.target_hidden_size == shape.hidden_size:
        raise ValueError(
            f"num_aux * target_hidden_size == hidden_size ({shape.hidden_size}): SGLang applies fc only when the "
            "incoming width differs from the embedding width, so it would skip fc silently"
        )
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({shape.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({shape.num_key_value_heads})"
        )


def _check_aux_ids(ids, num_aux: int, target_num_layers: int | None) -> list[int]:
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


def _compare(keys, shapes: dict, expected: dict) -> list[str]:
    keys = set(keys)
    problems = []
    missing, unexpected = sorted(set(expected) - keys), sorted(keys - set(expected))
    if missing:
        problems.append(f"missing tensor(s) {missing}")
    if unexpected:
        problems.append(f"unexpected tensor(s) {unexpected}")
    for k in sorted(keys & set(expected)):
        if shapes[k] != expected[k]:
            problems.append(f"{k} has shape {shapes[k]}, expected {expected[k]}")
    return problems


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path}: export has no config file")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config must be a JSON object")
    return config


def _check_overwritable(out: Path) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{out}: export target exists and is not a directory")
    if not any(out.iterdir()):
        return
    config = out / CONFIG_FILE
    try:
        ours = "streamdraft" in json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        ours = False
    if not ours:
        raise ValueError(f"{out}: refusing to overwrite a non-empty directory that is not a StreamDraft export")
