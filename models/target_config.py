"""A target model dir's ``config.json``: its architecture and its language model's fields.

A multimodal config keeps its language model's sizes in ``text_config`` (Kimi-K2.5), the
architecture at the top level (the class a serving engine loads), as SGLang reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_FILE = "config.json"


def read_json_object(file: Path, missing: str) -> dict:
    """The JSON object in ``file``; ValueError ``missing`` when there is no file, else naming the file."""
    if not file.is_file():
        raise ValueError(missing)
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must hold a JSON object")
    return config


def read_text_config(path: str | Path) -> tuple[str, dict]:
    """(``architectures[0]``, the text model's config fields) of model dir ``path``; ValueError
    naming the file when it is missing or lacks the architecture, layer count or hidden size."""
    file = Path(path).expanduser() / CONFIG_FILE
    config = read_json_object(file, f"target path {str(path)!r} has no {CONFIG_FILE}: pass a local model dir")
    archs = config.get("architectures") or []
    text = dict(config if "num_hidden_layers" in config else config.get("text_config", {}))
    if not archs or "num_hidden_layers" not in text or "hidden_size" not in text:
        raise ValueError(f"{file}: needs architectures and num_hidden_layers / hidden_size (top level or in text_config)")
    return archs[0], text
