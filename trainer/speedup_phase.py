"""The run's last phase (``trainer.speedup.enabled``): how much faster SGLang serves the target with
the final SGLang export than without it, measured by ``serving.speedup`` on the held-out prompt files.

Checked before anything heavy starts (a CUDA GPU, SGLang importable, the prompt files there), run
on rank 0 after the export, its table printed, its best settings written into the export's
``serving.json`` and summarised in ``summary.json`` under ``speedup``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from serving.speedup import main as speedup_main
from trainer.config import Config

RESULTS_FILE = "speedup.json"


def prompt_files(cfg: Config) -> list[str]:
    """``trainer.speedup.prompts_files``, else the serving eval's prompt file and the held-out prompt files."""
    given = cfg.trainer.speedup.prompts_files
    if given:
        return list(given)
    first = [cfg.trainer.eval_prompts_file] if cfg.trainer.eval_prompts_file else []
    return first + list(cfg.data.heldout_prompt_files)


def check_speedup(cfg: Config) -> None:
    """ValueError naming the key when the phase is on but cannot run on this machine or target (its prompt
    files are checked with the run's other inputs, ``trainer.preflight``)."""
    if not cfg.trainer.speedup.enabled:
        return
    off = "set trainer.speedup.enabled=false to train without it"
    if not torch.cuda.is_available():
        raise ValueError(f"config trainer.speedup.enabled: the speedup is measured in SGLang on a CUDA GPU, and there is none; {off}")
    if importlib.util.find_spec("sglang") is None:
        raise ValueError(f"config trainer.speedup.enabled: SGLang is not installed (pip install 'streamdraft[sglang]'); {off}")
    if cfg.target.path is not None and Path(cfg.target.path).is_file():
        raise ValueError(f"config target.path: SGLang serves a transformers dir, not the file {cfg.target.path}; {off}")
    if not prompt_files(cfg):
        raise ValueError("config trainer.speedup.prompts_files: no prompt file (nor trainer.eval_prompts_file, data.heldout_prompt_files)")


def measure_speedup(cfg: Config, export_dir: Path, target_dir: Path, run_dir: Path) -> dict:
    """``serving.speedup`` on the export; the summary's ``speedup`` entry (an empty dict when off)."""
    sc = cfg.trainer.speedup
    if not sc.enabled:
        return {}
    results = run_dir / RESULTS_FILE
    argv = [str(export_dir), "--prompts", *prompt_files(cfg), "--target", str(target_dir), "--json", str(results)]
    argv += ["--settings", *sc.settings, "--concurrency", *map(str, sc.concurrency), "--max-new-tokens", str(sc.max_new_tokens)]
    argv += ["--repeats", str(sc.repeats)]
    code = speedup_main(argv)
    data = json.loads(results.read_text()) if results.is_file() else {}
    best, failed = data.get("best", {}), sorted(data.get("failed", {}))
    return {"speedup": {"results": str(results), "exit_code": code, "best": best, "failed": failed}}
