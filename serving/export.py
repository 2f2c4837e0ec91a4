"""Write and read export directories for SGLang and vLLM: aux ids in each engine's numbering, the
weight names each engine loads, a checked vocab map, and the feedback state the draft was trained on.

An export is a directory with ``config.json`` and ``model.safetensors``; the two formats
and the engine facts behind them are described in ``serving/formats.py``. What the writer
and reader guarantee, for both engines:

* The engines skip (SGLang) or refuse (vLLM) tensor names they do not know, so the file
  holds exactly the names of its format's ``expected_tensors`` (the draft's parameter names:
  ``fc``, ``midlayer.*`` (both engines rename it to ``layers.0``), ``norm``, ``lm_head``,
  plus ``d2t`` and ``t2d``), and ``load_export`` refuses anything else, by name.
* ``d2t`` becomes ``hot_token_id = d2t + arange`` (SGLang) or ``draft_id_to_target_id``
  (vLLM) with no check; the map is validated here, on write and on read.
* The embedding is shared from the target only when ``target_hidden_size == hidden_size``;
  otherwise the export carries it as ``embed_tokens.weight``.
* The ``ExportSpec`` carries StreamDraft's aux layer ids (output of layer k, the ids the draft
  was trained on); each format writes them in its engine's semantics.
* ``norm_output`` picks what is fed back at draft steps after the first (``serving/formats.py``
  says when the key is written).
* The directory and its files get the modes the umask gives any new file (0755 / 0644 under the
  usual 022): a server running as another user can read the export. (``save_file`` alone
  leaves the weights 0600.)
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

from models.aux_ids import AuxLayerIds
from models.draft import DraftShape, Eagle3Draft
from models.embedded import share_with_umask
from models.vocab_map import VocabMap
from serving.formats import (
    CONFIG_FILE,
    EXPORT_FORMATS,
    WEIGHTS_FILE,
    ExportConfig,
    ExportFormat,
    ExportSpec,
    embedding_is_shared,
    format_named,
    parse_export_config,
    read_config_file,
)

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}  # safetensors dtype names
_ALLOWED_DTYPES = {"d2t": {"I64"}, "t2d": {"BOOL"}}


# --------------------------------------------------------------------------- writing


def export_draft(out_dir: str | os.PathLike, engine: str, draft: Eagle3Draft, vocab: VocabMap, spec: ExportSpec) -> Path:
    """Write ``out_dir/{config.json, model.safetensors}`` in ``engine``'s format; returns ``out_dir``.

    ``spec.aux_layer_ids`` are the ids the draft was trained on; the format writes them in its
    engine's numbering. The directory is built next to ``out_dir`` and renamed into place; an
    existing ``out_dir`` must be empty or an earlier StreamDraft export, and is replaced whole.
    """
    fmt = format_named(engine)
    return _write(out_dir, fmt, fmt.write_config(draft.shape, spec), draft, vocab, spec.dtype)


def export_both(root: str | os.PathLike, draft: Eagle3Draft, vocab: VocabMap, spec: ExportSpec) -> dict[str, Path]:
    """``root/<engine>`` for every format of ``EXPORT_FORMATS``, from the same draft."""
    return {engine: export_draft(Path(root) / engine, engine, draft, vocab, spec) for engine in EXPORT_FORMATS}


def _tensors(fmt: ExportFormat, draft: Eagle3Draft, vocab: VocabMap, dtype: torch.dtype) -> dict[str, Tensor]:
    shape = draft.shape
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
    if fmt.carries_d2t(shape):
        tensors["d2t"] = vocab.d2t.detach().cpu().contiguous()
    tensors["t2d"] = vocab.t2d.detach().cpu().contiguous()
    problems = _compare(tensors.keys(), {k: tuple(v.shape) for k, v in tensors.items()}, fmt.expected_tensors(shape))
    if problems:
        raise ValueError(f"draft state does not match the {fmt.name} export tensor names: {'; '.join(problems)}")
    return tensors


def _write(out_dir, fmt: ExportFormat, config: dict, draft: Eagle3Draft, vocab: VocabMap, dtype: torch.dtype) -> Path:
    tensors = _tensors(fmt, draft, vocab, dtype)
    out = Path(out_dir)
    _check_overwritable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    tmp = out.with_name(f".{out.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        share_with_umask(tmp)
        _swap_into_place(tmp, out, tag)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _swap_into_place(tmp: Path, out: Path, tag: str) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{tag}")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old)


# --------------------------------------------------------------------------- reading


def load_export(
    export_dir: str | os.PathLike, embed_weight: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Draft, VocabMap, dict]:
    """Read an export (either engine) back strictly: (draft in ``dtype``, vocab map, config dict).

    ``embed_weight`` [V_t, H] is the target's embedding, installed as the shared draft
    embedding; pass None for an export that carries its own (hidden != target hidden).
    Missing, unexpected, mis-shaped or mis-typed tensors are one ValueError naming them all.
    """
    export_dir = Path(export_dir)
    config = read_config_file(export_dir / CONFIG_FILE)
    draft, vocab, _ = _load(export_dir, config, embed_weight, dtype)
    return draft, vocab, config


def load_draft(
    path: str | os.PathLike, embed_weight: Tensor | None, target_num_layers: int, dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Draft, VocabMap, ExportConfig]:
    """An existing EAGLE-3 draft to train on, read as strictly as ``load_export``: an SGLang or vLLM
    (speculators) export, or a SpecForge checkpoint, whose ``config.json`` may leave out what SGLang
    fills in (``with_sglang_defaults``). Returns the draft, its vocab map and its normalised config."""
    path = Path(path)
    config = read_config_file(path / CONFIG_FILE)
    return _load(path, with_sglang_defaults(config, target_num_layers), embed_weight, dtype)


def with_sglang_defaults(config: dict, target_num_layers: int) -> dict:
    """A ``LlamaForCausalLMEagle3`` config as SGLang reads it, the keys SpecForge configs leave out filled
    in: ``target_hidden_size`` = ``hidden_size``, ``head_dim`` = hidden / heads, ``eagle_config`` with the
    default aux ids of a ``target_num_layers`` target (what SGLang captures without one). Its
    ``tie_word_embeddings`` is read as false: the checkpoint carries the draft's own ``lm_head``."""
    if "speculators_config" in config or config.get("architectures") != [format_named("sglang").architecture]:
        return config
    ids = AuxLayerIds.default(target_num_layers).sglang_argument
    defaults = {
        "target_hidden_size": config.get("hidden_size"),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }
    if "hidden_size" in config and "num_attention_heads" in config:
        defaults["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return defaults | config | {"tie_word_embeddings": False}


def _load(export_dir: Path, config: dict, embed_weight: Tensor | None, dtype: torch.dtype) -> tuple[Eagle3Draft, VocabMap, ExportConfig]:
    config_path, weights_path = export_dir / CONFIG_FILE, export_dir / WEIGHTS_FILE
    parsed = parse_export_config(config, str(config_path))
    shape = parsed.shape
    tensors = _read_tensors(weights_path, EXPORT_FORMATS[parsed.engine].expected_tensors(shape), config_path.name)
    d2t = tensors.pop("d2t", None)
    if d2t is None:  # vLLM export of a full-vocab draft: the identity map
        d2t = torch.zeros(shape.draft_vocab_size, dtype=torch.int64)
    vocab = VocabMap(d2t, tensors.pop("t2d")).validate(str(weights_path))
    tensors["embed_tokens.weight"] = _embedding(export_dir, shape, embed_weight, tensors.pop("embed_tokens.weight", None))
    draft = Eagle3Draft(shape).to(dtype)
    draft.load_state_dict(tensors, strict=True)
    return draft, vocab, parsed


def _read_tensors(weights_path: Path, expected: dict[str, tuple[int, ...]], config_name: str) -> dict[str, Tensor]:
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
                    f"{weights_path}: does not match the EAGLE-3 checkpoint described by {config_name}: " + "; ".join(problems)
                )
            return {k: f.get_tensor(k) for k in keys}
    except SafetensorError as e:
        raise ValueError(f"{weights_path}: not a readable safetensors file ({e})") from e


def _embedding(export_dir: Path, shape: DraftShape, embed_weight: Tensor | None, carried: Tensor | None) -> Tensor:
    if not embedding_is_shared(shape):
        if embed_weight is not None:
            raise ValueError(
                f"{export_dir}: this export carries its own embedding (hidden_size {shape.hidden_size} != "
                f"target_hidden_size {shape.target_hidden_size}, so the engines do not share the target's); "
                "do not pass embed_weight"
            )
        return carried
    if embed_weight is None:
        raise ValueError(f"{export_dir}: the draft shares the target embedding; pass embed_weight [V_t, H]")
    if tuple(embed_weight.shape) != (shape.vocab_size, shape.hidden_size):
        raise ValueError(f"embed_weight has shape {tuple(embed_weight.shape)}, the export needs ({shape.vocab_size}, {shape.hidden_size})")
    return embed_weight.detach()


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
