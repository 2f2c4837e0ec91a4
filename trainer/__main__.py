"""``python -m trainer``: the Hydra app (typed by trainer/config.py, groups in conf/).

A config or input error prints one to three lines; ``--verbose`` (or STREAMDRAFT_VERBOSE=1)
prints full traces and the libraries' output, HYDRA_FULL_ERROR=1 full traces. The run dir's
``__main__.log`` holds the run's log, a failure's full trace included; a run that fails before it
writes anything of its own leaves no run dir.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from models import hub
from trainer import console
from trainer.config import register_schema, to_config
from trainer.help import help_text
from trainer.loop import run

register_schema()
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # beside the packages, in a checkout or site-packages
log = logging.getLogger("trainer")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hub.offline()
    console.log_levels()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        run(to_config(cfg), run_dir)
    except BaseException as e:
        log.debug("the run failed", exc_info=True)  # the run dir's log only (the console shows INFO and up)
        remove_unstarted(run_dir, {hydra_cfg.output_subdir, f"{hydra_cfg.job.name}.log"})
        console.exit_if_short(e)
        raise


def remove_unstarted(run_dir: Path, hydra_files: set[str]) -> None:
    """Remove the run dir of a run that failed before it wrote anything (only ``hydra_files`` in it:
    the composed config and the job log Hydra writes at start), and its parents left empty, up to the
    working dir: failed starts leave no empty run dirs behind."""
    if not run_dir.is_dir() or any(p.name not in hydra_files for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir)
    cwd, parent = Path.cwd().resolve(), run_dir.resolve().parent
    while parent != cwd and cwd in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def cli() -> None:
    """``main`` with short user errors. Hydra raises its own errors instead of printing them
    (HYDRA_FULL_ERROR=1) and they are shortened here."""
    console.take_verbose_flag(sys.argv)
    if {"--help", "-h"} & set(sys.argv[1:]):  # the groups and every key with its meaning (Hydra's own: --hydra-help)
        print(help_text(CONF_DIR, [a for a in sys.argv[1:] if not a.startswith("-")]))
        return
    console.quiet_libraries()
    if not (console.verbose() or os.environ.get("HYDRA_FULL_ERROR") == "1"):
        os.environ[console.SHORT_ERRORS_ENV] = "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except console.USER_ERRORS as e:
        console.exit_if_short(e)
        raise


if __name__ == "__main__":
    cli()
