"""``python -m trainer``: the Hydra app (typed by trainer/config.py, groups in conf/)."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trainer.config import register_schema, to_config
from trainer.loop import run

register_schema()
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # beside the packages, in a checkout or site-packages


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(to_config(cfg), Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
