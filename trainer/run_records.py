"""The run's records in Hydra's output dir, the config files (``.hydra/``) and the log (``<job>.log``):
written once the run has started (``start``), never by a start that fails, so that a failed start in an
existing run dir leaves that run's records as they were, and one in a new dir leaves no dir.

conf/config.yaml sets ``hydra.output_subdir: null`` (Hydra would write the config files before the
app runs), makes ``RunLog`` the log's handler and registers ``NoteNewDirs``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = ".hydra"  # Hydra's name for it: trainer/report/runlog.py reads config.yaml there
NEW_DIRS: list[Path] = []  # the run dir and its parents this start made (NoteNewDirs), until the run starts


class NoteNewDirs(Callback):
    """Notes, before Hydra makes the run dir, which of it and its parents do not exist yet."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = Path(config.hydra.run.dir).resolve()  # `now` is cached: the dir Hydra makes next
        NEW_DIRS[:] = [p for p in (run_dir, *run_dir.parents) if not p.exists()]


class RunLog(logging.FileHandler):
    """The run dir's log (appended to): records are held in memory until the run starts, then written
    with every record after them; a start that fails opens no file."""

    def __init__(self, filename: str) -> None:
        super().__init__(filename, delay=True)
        self.held: list[logging.LogRecord] | None = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is None:
            super().emit(record)
        else:
            self.held.append(record)

    def write_held(self) -> None:
        held, self.held = self.held or [], None
        for record in held:
            super().emit(record)


def start(task_cfg: DictConfig) -> None:
    """The run has started: write Hydra's three config files (``task_cfg``: the app's config) and the log so far."""
    hydra_cfg = HydraConfig.instance().cfg
    out = Path(hydra_cfg.hydra.runtime.output_dir) / CONFIG_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, cfg in (("config.yaml", task_cfg), ("hydra.yaml", hydra_cfg), ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        (out / name).write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RunLog):
            handler.write_held()
    NEW_DIRS.clear()  # the run's now


def remove_new_dirs() -> None:
    """After a failed start: remove the dirs this start made (``NEW_DIRS``), deepest first, while they are empty."""
    for path in NEW_DIRS:
        if not path.is_dir() or any(path.iterdir()):
            return
        path.rmdir()
