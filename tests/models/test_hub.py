"""Offline mode is the command-line tools' choice: importing a module leaves the environment as it was."""

import os
import subprocess
import sys

import huggingface_hub.constants

from models import hub
from tests.fixtures.tiny import ROOT

LOADERS = (
    "models.target",
    "models.embedded",
    "models.backends.hf.generate",
    "models.backends.sglang.generate",
    "trainer.datagen.gen_backend",
    "trainer.regenerate",
)


def test_importing_the_target_and_generation_modules_leaves_the_environment_unchanged(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}  # torch writes its default there otherwise
    script = (
        "import importlib, os, sys\n"
        "before = dict(os.environ)\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *LOADERS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_offline_sets_the_variable_and_the_hub_constant_read_at_import(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub.offline()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE is True


def test_offline_keeps_a_value_the_environment_sets(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub.offline()
    assert os.environ["HF_HUB_OFFLINE"] == "0" and huggingface_hub.constants.HF_HUB_OFFLINE is False
