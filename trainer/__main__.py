"""``python -m trainer``: the Hydra app (typed by trainer/config.py, groups in conf/).

A config or input error prints one to three lines; ``--verbose`` (or STREAMDRAFT_VERBOSE=1)
prints full traces and the libraries' output, HYDRA_FULL_ERROR=1 full traces. The run dir's
``__main__.log`` holds the run's log, a failure's full trace included. A run that fails before it
starts training writes nothing (trainer/run_records.py): no run dir, and in an existing one no change.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from models import hub
from trainer import console, run_records
from trainer.config import register_schema, to_config
from trainer.help import help_text
from trainer.loop import run
from trainer.phases import StopSignals, process_start

register_schema()
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # beside the packages, in a checkout or site-packages
log = logging.getLogger("trainer")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hub.offline()
    console.log_levels()
    try:
        signals = StopSignals(since=process_start())  # the start-up phase counts from the process's start
        run(to_config(cfg), Path(HydraConfig.get().runtime.output_dir), lambda: run_records.start(cfg), signals)
    except BaseException as e:
        log.debug("the run failed", exc_info=True)  # the run dir's log only (the console shows INFO and up)
        run_records.remove_new_dirs()  # a failed start: the dirs Hydra made for it (a started run's stay)
        console.exit_if_short(e)
        raise


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
