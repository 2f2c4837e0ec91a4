"""The seam between feature engine and trainer: an iterator of feature batches.

Two modes (``engine.mode``), one interface (``open_feature_stream``):

- ``inprocess``: each token batch goes through the target on the trainer's device when
  the trainer asks for it (``feature_stream``);
- ``colocated``: an engine process that the trainer owns (``trainer.stream.engine_process``)
  runs the target on the same device, ahead of the trainer, and fills a ring of shared
  slots (``trainer.stream.feature_ring``); the trainer reads features where the engine wrote
  them. Nothing is copied between the processes and nothing touches the disk.

Both streams are iterators and context managers::

    with open_feature_stream(cfg.engine, source, batches, device) as stream:
        for fb in stream:
            train_step(fb)

**Lifetime of a colocated FeatureBatch.** It is a view of a ring slot. The slot is handed
back to the engine when the trainer asks for the next batch (or calls ``release()``, or
closes the stream), so a FeatureBatch is valid until then; clone what must outlive it.
Release comes after the whole train step on purpose: the features are read in the
forward (``fc(aux)``, the embeddings of ``input_ids``, the masks), the labels are computed
from ``final`` before the backward, and autograd keeps ``aux`` for the backward (the
weight gradient of ``fc`` reads it). On a GPU the release records the slot's ``free``
event on the trainer's current stream, after every kernel the step has enqueued
(forward, backward, optimizer), and the engine's overwrite waits for that event: the
host never has to wait for the step to finish before releasing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from models.batch import FeatureBatch, TokenBatch
from models.engines import FeatureEngine, TargetFactory
from trainer.stream.engine_process import Cancelled, EngineError, EngineProcess, Ready, concrete_device
from trainer.stream.feature_ring import Slot

if TYPE_CHECKING:
    from models.target import TargetInfo

MODES = ("inprocess", "colocated")  # engine.mode: the streams open_feature_stream opens


def feature_stream(engine, batches: Iterable[TokenBatch], device: torch.device) -> Iterator[FeatureBatch]:
    for tokens in batches:
        yield engine.features(tokens.to(device))


@dataclass
class StreamStats:
    """Trainer-side figures of one stream (host clock)."""

    batches: int = 0
    tokens: int = 0  # padded tokens (B x T)
    wait_s: float = 0.0  # host time inside next() waiting for features (inprocess: the target's forward)
    message_latency_s: float = 0.0  # colocated: summed time Ready messages waited for the trainer (the engine's lead)


class InProcessStream:
    """``feature_stream`` as a context manager with stats; the features belong to the trainer."""

    def __init__(self, engine: FeatureEngine, batches: Iterable[TokenBatch], device: torch.device):
        self._it = feature_stream(engine, batches, device)
        self.stats = StreamStats()

    def __iter__(self) -> "InProcessStream":
        return self

    def __next__(self) -> FeatureBatch:
        t0 = time.perf_counter()
        fb = next(self._it)
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.batches += 1
        self.stats.tokens += fb.aux.shape[0] * fb.aux.shape[1]
        return fb

    def release(self) -> None:
        """Nothing to hand back: in-process features are fresh tensors."""

    def close(self) -> None:
        self._it.close()

    def __enter__(self) -> "InProcessStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ColocatedStream:
    """Feature batches from an engine process, read in place from its ring (see the module docstring).

    The stream keeps the engine supplied with up to ``slots + 1`` token batches beyond the
    one the trainer holds, so the engine always has the next batch when a slot frees up.
    Closing early cancels the batches the engine has not made yet and hands back the
    slots of those it has made, so the next stream on the same engine starts clean.
    """

    def __init__(self, process: EngineProcess, batches: Iterable[TokenBatch], device: torch.device):
        self._process, self._device = process, concrete_device(device)
        if self._device != process.device:
            raise ValueError(f"a colocated stream on {self._device} cannot read the ring of an engine on {process.device}")
        self._batches = iter(batches)
        self._lookahead = len(process.ring) + 1
        self._submitted = 0  # batches sent to the engine: seqs 0 .. submitted-1
        self._received = 0  # batches handed to the trainer
        self._exhausted = False
        self._held: Slot | None = None
        self._closed = False
        self.stats = StreamStats()
        self._id = process.open_stream(self)

    def __iter__(self) -> "ColocatedStream":
        return self

    def __next__(self) -> FeatureBatch:
        if self._closed:
            raise StopIteration
        if not self._process.alive:
            raise self._process.stopped_error(self._awaited())
        self.release()
        self._top_up()
        if self._received == self._submitted:
            self.close()
            raise StopIteration
        t0 = time.perf_counter()
        msg = self._process.receive(self._awaited())
        received_at = time.monotonic()
        self.stats.wait_s += time.perf_counter() - t0
        assert isinstance(msg, Ready) and msg.stream == self._id and msg.seq == self._received, f"out of order: {msg!r}"
        slot = self._process.ring[msg.slot]
        if slot.ready is not None:  # GPU: the trainer's reads wait for the engine's copy, on the GPU
            torch.cuda.current_stream(self._device).wait_event(slot.ready)
        self._held, self._received = slot, self._received + 1
        self.stats.batches += 1
        self.stats.tokens += msg.b * msg.t
        self.stats.message_latency_s += received_at - msg.sent_at
        return slot.view(msg.b, msg.t, msg.packed)

    def _awaited(self) -> str:
        return f"the features of batch {self._received} of stream {self._id}"

    def _top_up(self) -> None:
        while not self._exhausted and self._submitted - self._received < self._lookahead:
            tokens = next(self._batches, None)
            if tokens is None:
                self._exhausted = True
                return
            self._process.ring[0].check_fits(*tokens.input_ids.shape)
            self._process.submit(self._id, self._submitted, tokens)
            self._submitted += 1

    def release(self) -> None:
        """Hand the slot of the last batch back to the engine (done by ``next`` and ``close``)."""
        if self._held is not None:
            self._process.release(self._held)
            self._held = None

    def close(self) -> None:
        """Release, cancel what the engine has not made, hand back what it has; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._process.alive:
            self.release()
            outstanding = self._submitted - self._received
            if outstanding:
                self._process.cancel(self._id)
            answered = not outstanding  # the engine answers a cancel once, with no seqs when it had made them all
            while outstanding or not answered:
                msg = self._process.receive(f"the engine to cancel stream {self._id}")
                if isinstance(msg, Ready):
                    self._process.release(self._process.ring[msg.slot])
                    outstanding -= 1
                else:
                    assert isinstance(msg, Cancelled) and msg.stream == self._id, f"unexpected {msg!r}"
                    outstanding, answered = outstanding - len(msg.seqs), True
        self._held = None
        self._process.stream_closed(self)

    def __enter__(self) -> "ColocatedStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FeatureEngineSettings(Protocol):
    """The fields of ``trainer.config.EngineConfig`` that streams read."""

    mode: str
    slots: int
    slot_tokens: int | None
    start_timeout_s: float
    wait_timeout_s: float


class TargetSource:
    """Where features come from, for either mode.

    ``factory`` is the picklable target factory an engine process builds the target from
    (``PathTarget``, ``RandomTarget``); ``engine`` is the trainer's own target for the
    ``inprocess`` mode (built from ``factory`` on first use when not given). The engine
    process of the ``colocated`` mode is started by the first colocated stream and serves
    every later one (epochs, evaluations); ``close()`` stops it. ``info`` is the target the
    trainer assumes (a ``TargetHead``'s, when it holds no engine; default: ``engine``'s): the
    engine process must have built the same one.
    """

    def __init__(self, factory: TargetFactory, engine: FeatureEngine | None = None, info: TargetInfo | None = None):
        self.factory, self._engine = factory, engine
        self._info = info if info is not None or engine is None else engine.info  # None: nothing to compare with
        self._process: EngineProcess | None = None
        self.start_s = 0.0  # wall seconds spent starting engine processes (every start of this source)

    def inprocess(self, device: torch.device) -> FeatureEngine:
        if self._engine is None:
            self._engine = self.factory.build(torch.device(device))
        return self._engine

    def colocated(self, cfg: FeatureEngineSettings, device: torch.device) -> EngineProcess:
        """The running engine process for ``device``, started if there is none."""
        if cfg.slot_tokens is None:
            raise ValueError("config engine.slot_tokens: the colocated mode needs a slot size (conf/engine sets it to ${data.max_tokens})")
        device = concrete_device(device)
        process = self._process
        if process is not None and process.alive:
            if (process.device, process.spec.slots, process.spec.tokens) != (device, cfg.slots, cfg.slot_tokens):
                raise ValueError(
                    f"the engine process runs on {process.device} with {process.spec.slots} x {process.spec.tokens}-token slots; "
                    f"a stream asked for {device} with {cfg.slots} x {cfg.slot_tokens}: close the source first"
                )
            return process
        started = time.perf_counter()
        self._process = EngineProcess(self.factory, device, cfg.slots, cfg.slot_tokens, cfg.start_timeout_s, cfg.wait_timeout_s)
        self.start_s += time.perf_counter() - started
        if self._info is not None:
            self._check_same_target(self._info, self._process.info)
        return self._process

    def _check_same_target(self, mine, engine) -> None:
        """The engine process must capture what the trainer (and the export) assume: same aux ids, layers, width."""
        fields = ("aux_layer_ids", "num_layers", "hidden_size")
        differ = [
            f"{f}: trainer {getattr(mine, f)!r}, engine {getattr(engine, f)!r}" for f in fields if getattr(mine, f) != getattr(engine, f)
        ]
        if differ:
            self.close()
            raise ValueError("the engine process built a different target than the trainer's: " + "; ".join(differ))

    @property
    def process(self) -> EngineProcess | None:
        return self._process

    def close(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def __enter__(self) -> "TargetSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_feature_stream(
    cfg_engine: FeatureEngineSettings, target_source: TargetSource, batches: Iterable[TokenBatch], device: torch.device
) -> InProcessStream | ColocatedStream:
    """The feature stream of ``cfg_engine.mode`` over ``batches`` (an iterator and a context manager)."""
    if cfg_engine.mode == "inprocess":
        return InProcessStream(target_source.inprocess(device), batches, torch.device(device))
    if cfg_engine.mode == "colocated":
        return ColocatedStream(target_source.colocated(cfg_engine, device), batches, torch.device(device))
    raise ValueError(f"config engine.mode: unknown mode {cfg_engine.mode!r} (known: {', '.join(MODES)})")


__all__ = [
    "ColocatedStream",
    "EngineError",
    "FeatureEngineSettings",
    "InProcessStream",
    "StreamStats",
    "TargetSource",
    "feature_stream",
    "open_feature_stream",
]
