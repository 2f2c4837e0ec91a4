"""launch/train.py that also records, as each rank exits, what the run's report needs of it.

    STREAMDRAFT_MEASURE_DIR=out/ deepspeed --num_gpus 2 --no_local_rank lab/train_measured.py engine=sglang ...

Each rank writes ``$STREAMDRAFT_MEASURE_DIR/rank<RANK>.json``: its pid, its GPU's peak memory
allocated and reserved by PyTorch in this process (``torch.cuda.max_memory_allocated``: every
rank's, where the metrics log rank 0's only), when the process started (``created_epoch``), and its
``/proc/self/io`` counters at start and exit (``write_bytes``: bytes sent to storage; ``wchar``: bytes passed to write()).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

import psutil  # noqa: E402
import torch  # noqa: E402

from trainer.__main__ import main  # noqa: E402


def io_counters() -> dict[str, int]:
    """This process's /proc/self/io counters (Linux)."""
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


def record(out: Path, start_io: dict[str, int]) -> None:
    rank = int(os.environ.get("RANK", "0"))
    row = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "pid": os.getpid(),
        "created_epoch": psutil.Process().create_time(),  # the clock of the run's phases starts here (trainer.phases)
        "io_start": start_io,
        "io_end": io_counters(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        row |= {
            "device": device,
            "max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device),
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    where = os.environ.get("STREAMDRAFT_MEASURE_DIR")
    if not where:
        raise SystemExit("lab/train_measured.py: set STREAMDRAFT_MEASURE_DIR (where each rank writes rank<RANK>.json)")
    atexit.register(record, Path(where), io_counters())
    main()
