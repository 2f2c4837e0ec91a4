"""The engine process: a target feature engine in its own process, filling the trainer's ring.

The trainer starts it (``EngineProcess``, spawn start method, one per trainer device),
owns it and stops it. The engine process builds its own target from a picklable target factory
(``models.engines``), reports the target's ``TargetInfo``, receives the feature
ring the trainer allocated (once), then serves token batches in the order they arrive.

Messages (small dataclasses over two ``multiprocessing`` queues; features never travel
through them, only slot indices):

    trainer -> engine   Ring(slots) once, Submit(stream, seq, tokens), Free(slot), Cancel(stream), Stop()
    engine -> trainer   Started(info, dtype), Ready(stream, seq, slot, b, t, packed), Cancelled(stream, seqs), Failed(traceback)

The engine computes a batch only when it holds a free slot (backpressure: with every slot
full it waits for ``Free``), copies the features into the slot and sends ``Ready``. On a
GPU the copy first waits (GPU side) for the slot's ``free`` event and is followed by the
slot's ``ready`` event (see ``trainer.stream.feature_ring``).

Failure and shutdown:
- any exception in the engine process is sent to the trainer as ``Failed`` with the
  engine's formatted traceback; the engine then exits with code 1, and the trainer raises
  ``EngineError`` carrying that traceback, led by its cause and the setting to change when the
  traceback shows a known one (``FAILURE_CAUSES``: GPU memory, a missing FlashAttention-3, a
  failed JIT kernel build);
- an engine that dies without a word (killed, out of memory) is noticed by the trainer
  within ``POLL_S`` while it waits (or at its next wait), and raises ``EngineError`` with the
  exit code, the engine's pid and role and what the trainer was waiting for;
- an engine that gives no answer for ``wait_timeout_s`` (``engine.wait_timeout_s``: stopped,
  deadlocked) is killed, and the trainer raises ``EngineError`` naming it, what it waited for
  and the state the kernel reports for it;
- the trainer stops the engine with ``Stop`` (then terminate, then kill); a
  ``multiprocessing.util.Finalize`` does the same when the handle is collected or the
  trainer's interpreter exits (before multiprocessing joins its children);
- when the trainer dies without cleaning up (SIGKILL), the engine gets SIGKILL from the
  kernel (``PR_SET_PDEATHSIG``, Linux, set when started from the main thread) and also
  notices its parent is gone within ``POLL_S`` whenever it waits for messages;
- the engine ignores SIGINT: Ctrl-C reaches the trainer, which stops the engine.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.util
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as tmp  # registers the CUDA-IPC / shared-memory pickling of tensors and events
from torch import Tensor

from models.batch import TokenBatch
from models.engines import FeatureEngine, TargetFactory
from trainer.stream.feature_ring import RingSpec, Slot, allocate_ring, track_ipc_files, untrack_ipc_files

POLL_S = 0.5  # how often a waiting side checks that the other side is alive
STOP_TIMEOUT_S = 30.0  # from Stop to terminate
# the line an engine process logs once its target is built (describe()'s words): lab/ scripts wait for it
TARGET_BUILT = re.compile(r"^the engine process \d+ \(.*\): target built in ", re.MULTILINE)
PROCESS_STATES = {  # the state letter of /proc/PID/stat (Linux)
    "R": "running",
    "S": "sleeping (waiting for an event)",
    "D": "in uninterruptible sleep (a driver or disk call)",
    "T": "stopped by a signal (SIGSTOP, SIGTSTP)",
    "t": "stopped by a debugger",
}
log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine process failed or died; the message carries its traceback or exit code."""


# What an engine's traceback shows -> its cause and the setting to change; the first match wins.
FAILURE_CAUSES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("Not enough memory. Please try to increase --mem-fraction-static", "Loaded weights leave no GPU memory for the KV cache"),
        "SGLang's weights leave no room for its KV pool: raise engine.sglang.mem_fraction_static (its share of the free GPU "
        "memory for weights + KV pool), or give the target more GPUs (engine.sglang.tp_size); SGLang counts any memory "
        "another process took on the GPU while the weights loaded as theirs, so start two runs on one GPU one after the other",
    ),
    (
        ("torch.OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory"),
        "the engine ran out of GPU memory: lower data.max_tokens (the tokens one batch prefills; engine.slot_tokens follows it) "
        "or, with engine=sglang, engine.sglang.mem_fraction_static (SGLang's static share: weights + KV pool)",
    ),
    (
        ("Can not import FA3 in sgl_kernel",),
        "this SGLang install has no FlashAttention-3 (sgl_kernel/flash_ops*.so): set engine.sglang.attention_backend=triton, "
        "or null to use a backend the install carries",
    ),
    (
        (
            "Ninja build failed",
            "ninja exited with status",
            "Error building extension",
            "Could not find CUDA installation",
            "Could not find nvcc",
            "nvcc not found",
        ),
        "a JIT kernel build failed in the engine (SGLang and flashinfer compile kernels with nvcc on first use): put CUDA's "
        "nvcc on PATH or set CUDA_HOME, or restore the kernel caches ~/.cache/tvm-ffi and ~/.cache/flashinfer (docs/SGLANG.md); "
        "engine.sglang.attention_backend=triton avoids flashinfer's attention builds",
    ),
)


def process_state(pid: int) -> str:
    """What the kernel says process ``pid`` is doing (``/proc``, Linux), or ``unknown``."""
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return PROCESS_STATES.get(letter, f"state {letter}")


def _signal_name(number: int) -> str:
    """`` (SIGKILL)`` for 9: the name of a signal Python knows, in parentheses; empty otherwise."""
    try:
        return f" ({signal.Signals(number).name})"
    except ValueError:
        return ""


def failure_cause(traceback: str) -> str | None:
    """The cause and the setting to change for an engine's traceback, when it shows a known one."""
    return next((cause for marks, cause in FAILURE_CAUSES if any(m in traceback for m in marks)), None)


def failure_message(traceback: str) -> str:
    """The EngineError text for an engine that reported ``traceback``: the cause first and last, when known."""
    cause = failure_cause(traceback)
    if cause is None:
        return f"the engine process failed; its traceback:\n{traceback}"
    return f"the engine process failed: {cause}\nits traceback:\n{traceback}\ncause: {cause}"


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class PackedTokens:
    """A TokenBatch as numpy arrays: pickled through the queue's pipe (9 bytes a token, 17 packed)."""

    input_ids: np.ndarray  # [B, T] int64
    loss_mask: np.ndarray  # [B, T] bool
    lengths: np.ndarray  # [B] int64
    doc_ids: np.ndarray | None  # [B, T] int64, packed batches

    @classmethod
    def of(cls, tokens: TokenBatch) -> "PackedTokens":
        doc_ids = tokens.doc_ids.detach().cpu().numpy().astype(np.int64, copy=False) if tokens.doc_ids is not None else None
        return cls(
            tokens.input_ids.detach().cpu().numpy().astype(np.int64, copy=False),
            tokens.loss_mask.detach().cpu().numpy().astype(np.bool_, copy=False),
            tokens.lengths.detach().cpu().numpy().astype(np.int64, copy=False),
            doc_ids,
        )

    def unpack(self) -> TokenBatch:
        doc_ids = torch.from_numpy(self.doc_ids) if self.doc_ids is not None else None
        return TokenBatch(torch.from_numpy(self.input_ids), torch.from_numpy(self.loss_mask), torch.from_numpy(self.lengths), doc_ids)


@dataclass(frozen=True)
class Ring:
    slots: list[Slot]


@dataclass(frozen=True)
class Submit:
    stream: int
    seq: int
    tokens: PackedTokens


@dataclass(frozen=True)
class Free:
    slot: int


@dataclass(frozen=True)
class Cancel:
    stream: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Started:
    info: object  # the target's TargetInfo
    dtype: torch.dtype
    pid: int


@dataclass(frozen=True)
class Ready:
    stream: int
    seq: int
    slot: int
    b: int
    t: int
    packed: bool  # the slot holds doc ids
    sent_at: float  # time.monotonic() in the engine (system-wide clock)


@dataclass(frozen=True)
class Cancelled:
    stream: int
    seqs: list[int]


@dataclass(frozen=True)
class Failed:
    traceback: str


# --------------------------------------------------------------------------- engine statistics


@dataclass
class EngineStats:
    """Counters the engine process keeps in a shared-memory tensor; read by the trainer."""

    batches: float = 0.0  # batches written to the ring
    tokens: float = 0.0  # padded tokens (B x T) written
    copy_s: float = 0.0  # time copying features into slots (GPU: measured by CUDA events)
    full_wait_s: float = 0.0  # time the engine had work but every slot was full (backpressure)
    full_waits: float = 0.0  # how often it waited so (counted when a wait starts)
    peak_memory_bytes: float = 0.0  # the engine process's peak allocated GPU memory

    @staticmethod
    def shared_tensor() -> Tensor:
        return torch.zeros(len(fields(EngineStats)), dtype=torch.float64).share_memory_()

    @classmethod
    def read(cls, tensor: Tensor) -> "EngineStats":
        return cls(*tensor.tolist())


def _stat_index(name: str) -> int:
    return [f.name for f in fields(EngineStats)].index(name)


# --------------------------------------------------------------------------- the engine process


@dataclass(frozen=True)
class EngineLaunch:
    """Everything the engine process needs at start (pickled once, at spawn)."""

    factory: TargetFactory
    device: str
    threads: int  # CPU: torch threads, the trainer's count (same kernels, same bits)
    parent_pid: int
    die_with_parent: bool  # PR_SET_PDEATHSIG: only safe when the spawning thread lives as long as the trainer


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent thread exits (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def engine_main(launch: EngineLaunch, inbox, outbox, stats: Tensor) -> None:
    """Entry point of the engine process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if launch.die_with_parent:
            _die_with_parent()
        if os.getppid() != launch.parent_pid:  # the trainer died before prctl took effect
            return
        device = torch.device(launch.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(launch.threads)
        engine = launch.factory.build(device)
        outbox.put(Started(info=engine.info, dtype=engine.dtype, pid=os.getpid()))
        _EngineLoop(engine, inbox, outbox, stats, device, launch.parent_pid).run()
    except BaseException:  # forwarded whole to the trainer, which raises EngineError with it
        outbox.put(Failed(traceback.format_exc()))
        outbox.close()
        outbox.join_thread()
        sys.exit(1)
    outbox.close()
    outbox.join_thread()


class _CopyTimer:
    """Time of the copies into slots: CUDA timing events read once done, or the host clock on CPU."""

    def __init__(self, device: torch.device, stats: Tensor):
        self.device, self.stats, self.pending = device, stats, deque()
        self.index = _stat_index("copy_s")

    def start(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start) -> None:
        if self.device.type != "cuda":
            self.stats[self.index] += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((start, end))
        while self.pending and self.pending[0][1].query():
            s, e = self.pending.popleft()
            self.stats[self.index] += s.elapsed_time(e) / 1000.0


class _EngineLoop:
    """Receive messages; fill a free slot whenever a batch is pending; stop on Stop or parent death."""

    def __init__(self, engine: FeatureEngine, inbox, outbox, stats: Tensor, device: torch.device, parent_pid: int):
        self.engine, self.inbox, self.outbox, self.stats = engine, inbox, outbox, stats
        self.device, self.parent_pid = device, parent_pid
        self.ring: list[Slot] = []
        self.free: deque[int] = deque()
        self.pending: deque[Submit] = deque()
        self.stopping = False
        self.timer = _CopyTimer(device, stats)

    def _can_produce(self) -> bool:
        return bool(self.pending) and bool(self.free)

    def run(self) -> None:
        while not self.stopping:
            self._receive(block=not self._can_produce())
            if not self.stopping and self._can_produce():
                self._produce(self.pending.popleft(), self.free.popleft())

    def _receive(self, block: bool) -> None:
        """Handle every queued message; when ``block``, first wait for one (polling the parent)."""
        waited_full = block and bool(self.pending) and not self.free
        if waited_full:
            self.stats[_stat_index("full_waits")] += 1
        t0 = time.perf_counter()
        while block:
            try:
                self._handle(self.inbox.get(timeout=POLL_S))
                break
            except queue.Empty:
                if os.getppid() != self.parent_pid:  # the trainer is gone: nobody reads what we make
                    self.stopping = True
                    return
        if waited_full:
            self.stats[_stat_index("full_wait_s")] += time.perf_counter() - t0
        while not self.stopping:
            try:
                self._handle(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, msg) -> None:
        if isinstance(msg, Submit):
            self.pending.append(msg)
        elif isinstance(msg, Free):
            self.free.append(msg.slot)
        elif isinstance(msg, Ring):
            if self.ring:
                raise ValueError("the engine received a second feature ring")
            self.ring, self.free = msg.slots, deque(range(len(msg.slots)))
        elif isinstance(msg, Cancel):
            dropped = [m.seq for m in self.pending if m.stream == msg.stream]
            self.pending = deque(m for m in self.pending if m.stream != msg.stream)
            self.outbox.put(Cancelled(msg.stream, dropped))
        elif isinstance(msg, Stop):
            self.stopping = True
        else:
            raise ValueError(f"engine process: unknown message {msg!r}")

    def _produce(self, job: Submit, index: int) -> None:
        slot = self.ring[index]
        fb = self.engine.features(job.tokens.unpack())  # [B, T, A*H], [B, T, H] on self.device
        if slot.free is not None:  # GPU: the trainer's last reads of this slot come first
            torch.cuda.current_stream(self.device).wait_event(slot.free)
        start = self.timer.start()
        b, t = slot.write(fb)
        self.timer.stop(start)
        if slot.ready is not None:
            slot.ready.record(torch.cuda.current_stream(self.device))
        self.stats[_stat_index("batches")] += 1  # counted before the Ready is sent: a trainer holding it sees the count
        self.stats[_stat_index("tokens")] += b * t
        if self.device.type == "cuda":
            self.stats[_stat_index("peak_memory_bytes")] = torch.cuda.max_memory_allocated(self.device)
        self.outbox.put(Ready(job.stream, job.seq, index, b, t, fb.tokens.doc_ids is not None, time.monotonic()))


# --------------------------------------------------------------------------- trainer side


def concrete_device(device: torch.device | str) -> torch.device:
    """``device`` with the CUDA index filled in (``cuda`` -> ``cuda:<current>``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _stop_process(process, inbox, outbox, ipc_files: list[str]) -> None:
    """Stop, then terminate, then kill; close the queues; hand the ring's IPC files back to torch. Safe to call more than once."""
    if process.pid is not None and process.exitcode is None:
        inbox.put(Stop())
        process.join(STOP_TIMEOUT_S)
        if process.exitcode is None:
            process.terminate()
            process.join(5.0)
        if process.exitcode is None:
            process.kill()
            process.join()
    for q in (inbox, outbox):
        q.cancel_join_thread()  # never block the trainer's exit on a pipe nobody reads
        q.close()
    untrack_ipc_files(ipc_files)
    ipc_files.clear()


class EngineProcess:
    """The trainer's handle on one engine process: start, ring, messages, stop.

    Starting builds the target in the child and waits (up to ``start_timeout_s``) for its
    ``TargetInfo``; the trainer then allocates the ring (``slots`` x ``slot_tokens``,
    widths from the info) on ``device`` and sends it once. Streams (``trainer.stream.feature_stream``)
    use ``submit`` / ``receive`` / ``release`` / ``cancel``; one stream at a time. Every later
    wait for the engine ends after ``wait_timeout_s`` without an answer.
    """

    def __init__(
        self,
        factory: TargetFactory,
        device: torch.device,
        slots: int,
        slot_tokens: int,
        start_timeout_s: float = 900.0,
        wait_timeout_s: float = 600.0,
    ):
        self.device, self.wait_timeout_s = concrete_device(device), wait_timeout_s
        self.role = f"{type(factory).__name__} on {self.device}"
        ctx = tmp.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._stats = EngineStats.shared_tensor()
        launch = EngineLaunch(
            factory=factory,
            device=str(self.device),
            threads=torch.get_num_threads(),
            parent_pid=os.getpid(),
            die_with_parent=threading.current_thread() is threading.main_thread(),
        )
        self._process = ctx.Process(
            target=engine_main, args=(launch, self._inbox, self._outbox, self._stats), name="streamdraft-engine", daemon=False
        )
        t0 = time.monotonic()
        self._process.start()
        self._ipc_files: list[str] = []  # torch's reference-count files of the ring's CUDA IPC send, once tracked
        self._ring_used = False  # the engine has written a batch into the ring (its send is complete)
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_process, args=(self._process, self._inbox, self._outbox, self._ipc_files), exitpriority=100
        )
        self._stream: object | None = None  # the open stream, if any
        self._next_stream_id = 0
        self._down = False  # shut down (stopped, failed or died)
        started = self.receive("the engine to build its target", start_timeout_s, "engine.start_timeout_s")
        if not isinstance(started, Started):
            raise EngineError(f"engine process: expected Started, got {started!r}")
        self.info = started.info
        width = len(self.info.aux_layer_ids) * self.info.hidden_size
        self.spec = RingSpec(slots=slots, tokens=slot_tokens, aux_width=width, hidden=self.info.hidden_size, dtype=started.dtype)
        self.ring = allocate_ring(self.spec, self.device)
        self._inbox.put(Ring(self.ring))
        log.info(f"{self.describe()}: target built in {time.monotonic() - t0:.1f} s; ring of {slots} x {slot_tokens} tokens")

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._down and self._process.exitcode is None

    def describe(self) -> str:
        """Which process this is, for messages: its pid and what it runs where."""
        return f"the engine process {self.pid} ({self.role})"

    def stopped_error(self, waiting_for: str) -> EngineError:
        """The error for an engine that is gone while the trainer waits for ``waiting_for``, naming how it
        ended; shuts the handle down."""
        code = self._process.exitcode
        self._shutdown()
        if code is None:
            return EngineError(f"{self.describe()} was shut down; the trainer needed it for {waiting_for}")
        how = f"was killed by signal {-code}{_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        return EngineError(
            f"{self.describe()} {how} without reporting an error (killed? out of memory?); the trainer needed it for {waiting_for}"
        )

    def stats(self) -> EngineStats:
        return EngineStats.read(self._stats)

    def open_stream(self, stream: object) -> int:
        """Register ``stream`` as the open one (closing a previous one left open); its id."""
        if self._stream is not None:
            self._stream.close()
        if not self.alive:
            raise self.stopped_error("a new stream")
        self._stream = stream
        self._next_stream_id += 1
        return self._next_stream_id

    def stream_closed(self, stream: object) -> None:
        if self._stream is stream:
            self._stream = None

    def submit(self, stream: int, seq: int, tokens: TokenBatch) -> None:
        self._inbox.put(Submit(stream, seq, PackedTokens.of(tokens)))

    def cancel(self, stream: int) -> None:
        self._inbox.put(Cancel(stream))

    def release(self, slot: Slot) -> None:
        """Hand ``slot`` back: every read of it the caller has issued comes before the engine's next write."""
        if not self.alive:
            return
        if slot.free is not None:
            slot.free.record(torch.cuda.current_stream(self.device))
        self._inbox.put(Free(slot.index))

    def receive(self, waiting_for: str = "features", timeout_s: float | None = None, setting: str = "engine.wait_timeout_s"):
        """The engine's next message; ``EngineError`` if it failed, died, or gave none within ``timeout_s``
        (default ``wait_timeout_s``; ``setting`` is the config key that sets it, for the message)."""
        timeout_s = self.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                if self._process.exitcode is not None:
                    msg = self._last_words(waiting_for)
                elif time.monotonic() > deadline:
                    raise self._hung(waiting_for, timeout_s, setting) from None
                else:
                    continue
            if isinstance(msg, Failed):
                self._shutdown()
                raise EngineError(failure_message(msg.traceback))
            if isinstance(msg, Ready) and not self._ring_used:
                self._ring_used = True
                if self.device.type == "cuda":  # the send made torch's reference-count file: unlinked even if we are killed
                    self._ipc_files.extend(track_ipc_files(os.getpid()))
            return msg

    def _last_words(self, waiting_for: str):
        """A message the engine sent just before it exited, or EngineError naming its exit code."""
        try:
            return self._outbox.get(timeout=POLL_S)
        except queue.Empty:
            raise self.stopped_error(waiting_for) from None

    def _hung(self, waiting_for: str, timeout_s: float, setting: str) -> EngineError:
        """Kill an engine that gave no answer (a Stop would wait on it too); the error says what it was doing."""
        state = process_state(self.pid)
        self._process.kill()
        self._process.join(STOP_TIMEOUT_S)
        self._shutdown()
        return EngineError(
            f"{self.describe()} gave no answer within {timeout_s:g} s ({setting}) while the trainer waited for {waiting_for}; "
            f"the kernel said it was {state}; the trainer killed it"
        )

    def stop(self) -> None:
        """Close the open stream (if any), then stop the engine process; idempotent."""
        if self._stream is not None and self.alive:
            self._stream.close()
        self._shutdown()

    def _shutdown(self) -> None:
        """Stop / terminate / kill the process without talking to streams (failure paths too)."""
        self._down = True
        self._stream = None
        self._finalizer()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
