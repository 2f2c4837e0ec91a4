"""A run's inputs checked before anything heavy starts (DeepSpeed, the target's weights): every
path the config names exists and is what its key says, so a typo costs a second, not a start-up;
and with ``trainer.speedup.enabled``, that the speedup phase can run here (a CUDA GPU, SGLang).

``check_inputs`` raises ``ValueError`` naming the key and the path; it reads no more than the
target's and the initial draft's ``config.json`` and the first bytes of each data file.
"""

from __future__ import annotations

from pathlib import Path

from models.aux_ids import AuxLayerIds
from models.backends.sglang.preflight import SGLangSource, find_sglang_source, quantization_problem
from models.target import resolve_target_path
from models.target_config import read_text_config
from serving.formats import CONFIG_FILE, WEIGHTS_FILE, read_config_file
from trainer import checkpoint as ckpt
from trainer.config import Config, DataConfig
from trainer.data.chat import read_chat_template
from trainer.data.files import data_files, local_path
from trainer.data.sources import CORPUS_FORMATS
from trainer.speedup_phase import check_speedup, prompt_files


def check_inputs(cfg: Config, ckpt_root: Path) -> None:
    """Every input path of ``cfg`` (``ckpt_root``: this run dir's checkpoints, for ``trainer.resume=auto``)."""
    check_target_path(cfg.target.path, cfg.target.aux_layer_ids)
    if cfg.engine.name == "sglang":
        check_sglang_format(cfg.target.path)
    check_draft_path(cfg.draft.init_from)
    check_data_paths(cfg.data)
    if cfg.data.chat_template is not None:
        read_chat_template(cfg.data.chat_template)
    check_prompt_file("trainer.eval_prompts_file", cfg.trainer.eval_prompts_file)
    for path in cfg.data.heldout_prompt_files:
        check_prompt_file("data.heldout_prompt_files", path)
    resume_path(cfg.trainer.resume, ckpt_root)
    check_speedup(cfg)
    for path in prompt_files(cfg) if cfg.trainer.speedup.enabled else ():
        check_prompt_file("trainer.speedup.prompts_files", path)


def check_target_path(path: str | None, aux_layer_ids: list[int] | None = None) -> None:
    """``target.path``: a transformers dir whose ``config.json`` reads, or a ``.gguf`` file (None: the embedded
    default); ``target.aux_layer_ids``, when set, within the depth that config gives."""
    if path is None:
        return
    try:
        directory, gguf_file = resolve_target_path(path)  # what loading it will resolve
        text = read_text_config(directory)[1] if gguf_file is None else None
    except ValueError as e:
        raise ValueError(f"config target.path: {e}") from None
    if text is not None and aux_layer_ids is not None:
        try:
            AuxLayerIds.of(aux_layer_ids, int(text["num_hidden_layers"]))
        except ValueError as e:
            raise ValueError(f"config target.aux_layer_ids: {e} ({directory / CONFIG_FILE})") from None


def check_sglang_format(path: str | None) -> None:
    """engine=sglang: the target's weights in a format SGLang builds (read from its source; without one, the
    engine's own start says SGLang is missing)."""
    source = find_sglang_source()
    if path is None or source is None:
        return
    directory, gguf_file = resolve_target_path(path)
    problem = quantization_problem(directory, SGLangSource.read(source)) if gguf_file is None else None
    if problem is not None:
        raise ValueError(f"config target.path: {problem}")


def check_draft_path(path: str | None) -> None:
    """``draft.init_from``: a draft dir with a ``config.json`` that reads and its ``model.safetensors``."""
    if path is None:
        return
    resolved = Path(path).expanduser()
    if not resolved.is_dir():
        raise ValueError(f"config draft.init_from: {path} is not a directory (an EAGLE-3 draft: config.json + {WEIGHTS_FILE})")
    try:
        read_config_file(resolved / CONFIG_FILE)
    except ValueError as e:
        raise ValueError(f"config draft.init_from: {e}") from None
    if not (resolved / WEIGHTS_FILE).is_file():
        raise ValueError(f"config draft.init_from: {path} has no {WEIGHTS_FILE}")


def check_data_paths(cfg: DataConfig) -> None:
    """The path of every source the mix reads exists and holds data: no empty file."""
    names = list(cfg.mix) if cfg.mix is not None else list(cfg.sources)
    for name in names:
        src, key = cfg.sources[name], f"config data.sources.{name}.path"
        if src.path is None:
            continue
        resolved = local_path(src.path, key)
        if src.format == "hf_disk" or src.format in CORPUS_FORMATS:  # a datasets dir, a wheel: their readers check them
            continue
        try:
            files = data_files(resolved)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        for file in files:
            if is_blank(file):
                raise ValueError(f"{key}: {file} is empty (no record); fill it or drop data.sources.{name} from the mix")


def is_blank(file: Path, probe: int = 1 << 16) -> bool:
    """True when ``file`` holds nothing but whitespace (read up to ``probe`` bytes at a time, stops at the first other byte)."""
    with file.open("rb") as f:
        while chunk := f.read(probe):
            if chunk.strip():
                return False
    return True


def check_prompt_file(key: str, path: str | None) -> None:
    if path is not None and not Path(path).expanduser().is_file():
        raise ValueError(f"config {key}: {path} is not a file (a prompt jsonl: serving/prompts.py)")


def resume_path(resume: str | None, ckpt_root: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` names: auto (``ckpt_root``'s latest, None when there is none), a checkpoint, or a run dir."""
    if resume is None:
        return None
    if resume == "auto":
        return ckpt.latest(ckpt_root)
    path = Path(resume).expanduser()
    if not path.exists():
        raise ValueError(f"config trainer.resume: {resume} does not exist (a checkpoint dir, a run dir with checkpoints/, or auto)")
    found = path if ckpt.is_complete(path) else ckpt.latest(path / "checkpoints")
    if found is None:
        raise ValueError(f"config trainer.resume: {path} is neither a checkpoint nor a run dir with checkpoints")
    return found
