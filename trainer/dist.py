"""Process-group set-up for DeepSpeed, handed around as a ``Parallel`` object, and the collective
helpers every rank calls (``all_reduce_scalar``, ``all_agree``, ``group_port``, ``shared_run_dir``).

Under the ``deepspeed`` launcher the rank variables are set; a plain ``python -m trainer``
runs as a world of one. On a machine without CUDA the DeepSpeed accelerator is the CPU
and the backend gloo.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import console


@dataclass(frozen=True)
class Parallel:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A 127.0.0.1 port free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_port(par: Parallel, group_size: int) -> int:
    """A port free on this node, picked by the first rank of each group of ``group_size``
    consecutive local ranks and shared with its group (every rank calls)."""
    ports: list[int | None] = [None] * par.world
    torch.distributed.all_gather_object(ports, free_port())
    return ports[par.rank - par.local_rank % group_size]


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("config trainer.device: cuda asked for, but torch sees no GPU")
    return name


def announce_op_build() -> str | None:
    """DeepSpeed's first init on a CPU JIT-builds its shared-memory helper (about a minute, silent):
    say so on stderr when it is not built yet; returns the line printed, or None."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory  # where torch's JIT build (and DeepSpeed's) puts it

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    built = Path(_get_build_directory(builder.NAME, verbose=False)) / f"{builder.NAME}.so"
    if built.is_file():
        return None
    line = f"building DeepSpeed's CPU helper {builder.NAME} in {built.parent} (first run only, about a minute)"
    console.show(line)
    return line


def init_parallel(device: str) -> Parallel:
    """Join (or create) the default process group; safe to call more than once."""
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed  # after DS_ACCELERATOR: deepspeed picks its accelerator at import

    if not torch.distributed.is_initialized():
        announce_op_build()
        with console.without_notices():  # DeepSpeed's "... built successfully" on every CPU start
            deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False)
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    return Parallel(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size(), local_rank=local_rank, device=dev)


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (timings that must include it); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def shared_run_dir(run_dir: Path) -> Path:
    """Every rank writes under rank 0's run dir (Hydra's timestamped dir may differ by rank)."""
    box = [str(run_dir)]
    torch.distributed.broadcast_object_list(box, src=0)
    return Path(box[0])


def all_reduce_scalar(value: float, device: torch.device, op: torch.distributed.ReduceOp) -> float:
    """``value`` reduced over every rank by ``op`` (every rank calls)."""
    t = torch.tensor([value], device=device, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=op)
    return t.item()


def all_agree(ok: bool, device: torch.device) -> bool:
    """True when ``ok`` holds on every rank (every rank calls)."""
    return bool(all_reduce_scalar(1.0 if ok else 0.0, device, torch.distributed.ReduceOp.MIN))
