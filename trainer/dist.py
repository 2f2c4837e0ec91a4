"""Process-group set-up for DeepSpeed, handed around as a ``Parallel`` object.

Under the ``deepspeed`` launcher the rank variables are set; a plain ``python -m trainer``
runs as a world of one. On a machine without CUDA the DeepSpeed accelerator is the CPU
and the backend gloo.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parallel:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("config trainer.device: cuda asked for, but torch sees no GPU")
    return name


def init_parallel(device: str) -> Parallel:
    """Join (or create) the default process group; safe to call more than once."""
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed  # after DS_ACCELERATOR: deepspeed picks its accelerator at import

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False)
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    return Parallel(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size(), local_rank=local_rank, device=dev)
