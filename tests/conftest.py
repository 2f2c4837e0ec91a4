"""Test-session environment: offline wandb and hub, cached DeepSpeed helper and embedded target."""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("STREAMDRAFT_CACHE", str(ROOT / ".cache" / "streamdraft"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing fetched from a hub, as the command-line tools set it


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
