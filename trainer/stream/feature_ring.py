"""A ring of preallocated feature slots shared by an engine process and the trainer.

Every slot holds one batch's features at the largest size the run allows (``tokens`` =
B x T of the largest batch): the aux features ``[tokens, num_aux * H]``, the final hidden
state ``[tokens, H]``, and the token tensors ``input_ids`` / ``loss_mask`` / ``doc_ids``
``[tokens]`` and ``lengths`` ``[tokens]`` (a batch has at most ``tokens`` rows; ``doc_ids`` is
read only for a packed batch). The trainer allocates the
ring once, on its device, and sends it once to the engine process:

- on a GPU the tensors travel as CUDA IPC handles (``torch.multiprocessing``): both
  processes address the same device memory, nothing is copied between them;
- on a CPU they are shared-memory tensors (``share_memory_()``, pages in ``/dev/shm``);

one code path for both. A batch of shape ``[B, T]`` occupies the first ``B * T`` rows of a
slot, and ``Slot.view`` hands the trainer contiguous ``[B, T, ...]`` views of them.

Ordering on a GPU uses two inter-process CUDA events per slot (the engine's copy and the
trainer's reads run on different streams of different processes):

- ``ready``: the engine records it on its stream after copying a batch into the slot; the
  trainer's stream waits for it before the first read (a GPU-side wait, the host does not
  block);
- ``free``: the trainer records it on its stream once it has issued the last work that
  reads the slot; the engine's stream waits for it before overwriting the slot.

On a CPU every copy and read is synchronous, so the host messages that carry a slot
index (``ready`` after the copy, ``free`` after the step) are the ordering.

Sending CUDA tensors makes torch write a reference-count file of the sender's,
``/dev/shm/torch_<pid>_<n>_<k>`` (80 KB), which torch unlinks when the sender exits normally.
A trainer killed by SIGKILL cannot, so the trainer registers the file with multiprocessing's
resource tracker (``track_ipc_files``), a process that outlives it briefly and unlinks what is
still registered once the trainer and its engine are gone; a normal stop unregisters it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path

import torch
from torch import Tensor

from models.batch import FeatureBatch, TokenBatch


@dataclass(frozen=True)
class RingSpec:
    """Sizes of a feature ring; ``tokens`` is the capacity of one slot (B x T)."""

    slots: int
    tokens: int  # largest B * T a slot holds
    aux_width: int  # num_aux * H_target
    hidden: int  # H_target
    dtype: torch.dtype  # feature dtype (the target's)

    def __post_init__(self) -> None:
        if self.slots < 2:
            raise ValueError(f"a feature ring needs at least 2 slots (one the trainer reads, one the engine fills), got {self.slots}")
        if self.tokens < 1:
            raise ValueError(f"ring slot capacity must be at least 1 token, got {self.tokens}")
        if self.aux_width < 1 or self.hidden < 1:
            raise ValueError(f"feature widths must be positive, got aux {self.aux_width}, hidden {self.hidden}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"features must be floating point, got {self.dtype}")


@dataclass
class Slot:
    """One preallocated batch buffer of the ring (see the module docstring)."""

    index: int
    aux: Tensor  # [tokens, num_aux * H]
    final: Tensor  # [tokens, H]
    input_ids: Tensor  # [tokens] long
    loss_mask: Tensor  # [tokens] bool
    lengths: Tensor  # [tokens] long; the first B entries are used
    doc_ids: Tensor  # [tokens] long; packed batches only
    ready: torch.cuda.Event | None  # GPU: recorded by the engine after its copy
    free: torch.cuda.Event | None  # GPU: recorded by the trainer after its last read

    @property
    def capacity(self) -> int:
        return self.aux.shape[0]

    def check_fits(self, b: int, t: int) -> None:
        if b * t > self.capacity:
            raise ValueError(
                f"a batch of {b} x {t} = {b * t} tokens does not fit a feature ring slot of {self.capacity} tokens: "
                f"raise engine.slot_tokens (it defaults to data.max_tokens) or lower the batch size"
            )

    def write(self, fb: FeatureBatch) -> tuple[int, int]:
        """Copy ``fb`` into the slot's first B*T rows; returns (B, T). Runs on the caller's stream.
        A packed batch's ``doc_ids`` go along; ``view(b, t, packed=True)`` reads them back."""
        b, t = fb.tokens.input_ids.shape
        self.check_fits(b, t)
        n = b * t
        if fb.aux.shape != (b, t, self.aux.shape[1]) or fb.final.shape != (b, t, self.final.shape[1]):
            raise ValueError(
                f"features of shape aux {tuple(fb.aux.shape)}, final {tuple(fb.final.shape)} do not match the ring's "
                f"[{b}, {t}, {self.aux.shape[1]}] / [{b}, {t}, {self.final.shape[1]}]"
            )
        if fb.aux.dtype != self.aux.dtype or fb.final.dtype != self.final.dtype:
            raise ValueError(f"features are {fb.aux.dtype}/{fb.final.dtype}, the ring holds {self.aux.dtype}")
        self.aux[:n].view(b, t, -1).copy_(fb.aux, non_blocking=True)
        self.final[:n].view(b, t, -1).copy_(fb.final, non_blocking=True)
        self.input_ids[:n].view(b, t).copy_(fb.tokens.input_ids, non_blocking=True)
        self.loss_mask[:n].view(b, t).copy_(fb.tokens.loss_mask, non_blocking=True)
        self.lengths[:b].copy_(fb.tokens.lengths, non_blocking=True)
        if fb.tokens.doc_ids is not None:
            self.doc_ids[:n].view(b, t).copy_(fb.tokens.doc_ids, non_blocking=True)
        return b, t

    def view(self, b: int, t: int, packed: bool) -> FeatureBatch:
        """The batch in the slot as contiguous ``[B, T, ...]`` views (no copy); ``packed``: with its doc ids."""
        self.check_fits(b, t)
        n = b * t
        doc_ids = self.doc_ids[:n].view(b, t) if packed else None
        tokens = TokenBatch(self.input_ids[:n].view(b, t), self.loss_mask[:n].view(b, t), self.lengths[:b], doc_ids)
        return FeatureBatch(tokens=tokens, aux=self.aux[:n].view(b, t, -1), final=self.final[:n].view(b, t, -1))


def allocate_ring(spec: RingSpec, device: torch.device) -> list[Slot]:
    """``spec.slots`` slots on ``device``: CUDA memory with inter-process events, or CPU shared memory."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"a feature ring lives on a cuda or cpu device, got {device}")
    slots = []
    for index in range(spec.slots):
        tensors = [
            torch.empty(spec.tokens, spec.aux_width, dtype=spec.dtype, device=device),
            torch.empty(spec.tokens, spec.hidden, dtype=spec.dtype, device=device),
            torch.zeros(spec.tokens, dtype=torch.long, device=device),
            torch.zeros(spec.tokens, dtype=torch.bool, device=device),
            torch.zeros(spec.tokens, dtype=torch.long, device=device),
            torch.zeros(spec.tokens, dtype=torch.long, device=device),
        ]
        if device.type == "cpu":
            tensors = [t.share_memory_() for t in tensors]
            ready = free = None
        else:
            with torch.cuda.device(device):
                ready, free = (torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True) for _ in range(2))
                ready.ipc_handle(), free.ipc_handle()  # create the events on this device now
        slots.append(Slot(index, *tensors, ready=ready, free=free))
    return slots


SHM_DIR = Path("/dev/shm")
_tracked: set[str] = set()  # the names this process has registered with its resource tracker


def track_ipc_files(pid: int) -> list[str]:
    """Register the shared-memory files torch made for process ``pid``'s CUDA IPC sends
    (``/dev/shm/torch_<pid>_*``) with the resource tracker, which unlinks them if ``pid`` dies
    without its own cleanup; the names newly registered (``/torch_...``, as ``shm_unlink`` takes them)."""
    names = sorted(f"/{path.name}" for path in SHM_DIR.glob(f"torch_{pid}_*")) if SHM_DIR.is_dir() else []
    new = [name for name in names if name not in _tracked]
    for name in new:
        resource_tracker.register(name, "shared_memory")
        _tracked.add(name)
    return new


def untrack_ipc_files(names: list[str]) -> None:
    """Take ``names`` back from the resource tracker (those still registered): torch unlinks them itself at a normal exit."""
    for name in names:
        if name in _tracked:
            resource_tracker.unregister(name, "shared_memory")
            _tracked.discard(name)
