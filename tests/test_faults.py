"""Faults on purpose, on the CPU: the co-located engine process (the CPU stand-in for SGLang's)
killed or stopped."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import pytest

from tests.tiny import tiny_config
from tests.toy_target import ToyTarget, make_batches
from trainer.config import EngineConfig
from trainer.stream.engine_process import EngineError
from trainer.stream.feature_stream import TargetSource, open_feature_stream


@dataclass
class Settings:
    """The engine config fields a stream reads, with a short wait."""

    mode: str = "colocated"
    slots: int = 2
    slot_tokens: int = 64
    start_timeout_s: float = 120.0
    wait_timeout_s: float = 5.0


def state_letter(pid: int) -> str | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def wait_state(pid: int, states: str, timeout_s: float = 30.0) -> None:
    """Until ``pid`` is in one of the kernel states ``states`` (Z: dead, not yet reaped; T: stopped)."""
    deadline = time.monotonic() + timeout_s
    while state_letter(pid) not in tuple(states):
        assert time.monotonic() < deadline, f"process {pid} is {state_letter(pid)}, not {states}"
        time.sleep(0.05)


def test_the_wait_timeout_is_a_checked_config_key():
    assert tiny_config().engine.wait_timeout_s == 600.0 and tiny_config("engine.wait_timeout_s=30").engine.wait_timeout_s == 30.0
    with pytest.raises(ValueError, match="config engine.wait_timeout_s: must be positive"):
        EngineConfig(wait_timeout_s=0)


def test_a_stopped_engine_is_killed_at_the_wait_timeout_naming_the_process_and_the_wait():
    with TargetSource(ToyTarget()) as source:
        with open_feature_stream(Settings(), source, make_batches(50), "cpu") as stream:
            next(stream)
            pid = source.process.pid
            os.kill(pid, signal.SIGSTOP)
            wait_state(pid, "T")
            with pytest.raises(EngineError) as err:
                for _ in stream:  # the batches the engine made before it stopped, then the wait
                    pass
        message = str(err.value)
        assert message.startswith(
            f"the engine process {pid} (ToyTarget on cpu) gave no answer within 5 s (engine.wait_timeout_s) "
            "while the trainer waited for the features of batch "
        )
        assert message.endswith("; the kernel said it was stopped by a signal (SIGSTOP, SIGTSTP); the trainer killed it")
        assert state_letter(pid) in (None, "Z", "X") and not source.process.alive


def test_a_killed_engine_names_itself_and_what_the_trainer_waited_for():
    with TargetSource(ToyTarget()) as source:
        with open_feature_stream(Settings(wait_timeout_s=120.0), source, make_batches(50), "cpu") as stream:
            next(stream)
            pid = source.process.pid
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineError) as err:
                for _ in stream:
                    pass
    assert str(err.value).startswith(
        f"the engine process {pid} (ToyTarget on cpu) was killed by signal 9 (SIGKILL) without reporting an error "
        "(killed? out of memory?); the trainer needed it for the features of batch "
    )
