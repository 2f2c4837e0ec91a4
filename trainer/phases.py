"""The run's phases, in the order a run enters them, and ``StopSignals``: the phase the run is in,
the wall seconds each took, and the stop signal (SIGINT, SIGTERM) received."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from trainer import checkpoint as ckpt

STARTUP, START_EVAL, TRAINING = "start-up", "start-of-run held-out eval", "training"
END_EVAL, SERVING_EVAL, REPORT = "end-of-run held-out eval", "end-of-run export, verify and serving eval", "summary and report"
SPEEDUP = "speedup measurement (trainer.speedup)"
PHASES = (STARTUP, START_EVAL, TRAINING, END_EVAL, SERVING_EVAL, SPEEDUP, REPORT)
PERIODIC_EVAL = "serving eval between training steps (trainer.export_every)"  # a stop cuts it and the training short


def process_start() -> float:
    """When this process started (its imports are part of the start-up), on the clock the phases are timed by."""
    return time.perf_counter() - (time.time() - psutil.Process().create_time())


class Stop(Exception):
    """A stop signal (SIGINT, SIGTERM) ended the run: after the current step while training, at once otherwise."""


@dataclass
class StopSignals:
    """The run's phase and the stop signal received, shared by the signal handlers and the trainer.

    While training, a first signal stops the run after the current step (which saves a
    checkpoint); in every other phase, or on a second signal, ``Stop`` is raised at once."""

    phase: str = STARTUP
    received: str | None = None
    previous: dict = field(default_factory=dict)  # the handlers ``install`` replaced
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds spent in it so far
    since: float = field(default_factory=time.perf_counter)  # when the current phase was entered

    def enter(self, phase: str) -> None:
        """Begin ``phase``; Stop if a signal came while training deferred it."""
        self.switch(phase)
        if self.received is not None:
            raise Stop()

    def switch(self, phase: str) -> None:
        """Begin ``phase``, adding the wall time since the last switch to the phase it ends."""
        now = time.perf_counter()
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self.since
        self.phase, self.since = phase, now

    def phase_seconds(self) -> dict[str, float]:
        """Each phase's wall seconds so far, the current one up to now, in the order the run entered them."""
        self.switch(self.phase)
        return dict(self.seconds)

    def install(self) -> None:
        """Make SIGTERM / SIGINT stop the run."""
        self.previous = {s: signal.signal(s, self.handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handler(self, signum, frame) -> None:
        first, self.received = self.received is None, signal.Signals(signum).name
        if self.phase != TRAINING or not first:
            raise Stop()

    def exit_code(self) -> int:
        return 128 + signal.Signals[self.received].value  # what a shell reports for a process the signal ended

    def message(self, ckpt_root: Path, run_dir: Path, by: str | None = None) -> str:
        """What the stop skipped, the checkpoint kept and how to resume; ``by``: a cause other than the signal received."""
        during = TRAINING if self.phase == PERIODIC_EVAL else self.phase
        skipped = [f"the rest of the {during}", *PHASES[PHASES.index(during) + 1 :]]
        if self.phase == PERIODIC_EVAL:
            skipped.insert(0, f"the rest of the {PERIODIC_EVAL}")
        head = f"stopped by {by or self.received} during the {self.phase}: skipped {'; '.join(skipped)}"
        kept = ckpt.latest(ckpt_root)
        if kept is None:
            return f"{head}.\nNo checkpoint yet: run the same command again to start over."
        step = ckpt.read_meta(kept)["position"]["step"]
        return (
            f"{head}.\nCheckpoint step {step} kept: {kept}\nResume (it redoes what was skipped) with the same overrides "
            f"plus: trainer.resume=auto hydra.run.dir={run_dir}"
        )
