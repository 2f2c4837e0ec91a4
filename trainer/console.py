"""What a run prints: quiet by default (libraries' chatter off, a user error in one to three
lines), everything with ``--verbose`` or ``STREAMDRAFT_VERBOSE=1``.

The run's own log (summary, warnings, a failure with its full traceback) also goes to
``<run dir>/<job>.log`` through Hydra's job logging (``hydra.job_logging`` in conf/config.yaml).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import fields, is_dataclass

from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from tqdm import tqdm

from trainer.config import did_you_mean

VERBOSE_ENV = "STREAMDRAFT_VERBOSE"
SHORT_ERRORS_ENV = "STREAMDRAFT_SHORT_ERRORS"  # set by the entry point unless full traces were asked for
USER_ERRORS = (ValueError, HydraException, OmegaConfBaseException)  # bad config or input: a short message
TORCH_GLOO_NOTICE = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"  # DeepSpeed's ZeRO calls it each step
DEEPSPEED_OP_NOTICE = re.compile(r"^DeepSpeed \S+ built successfully$")  # printed by every init_distributed on a CPU


def verbose() -> bool:
    """True after ``--verbose`` (``take_verbose_flag``) or with STREAMDRAFT_VERBOSE=1."""
    return os.environ.get(VERBOSE_ENV, "0") not in ("", "0")


def take_verbose_flag(argv: list[str]) -> None:
    """Remove ``--verbose`` from ``argv`` (Hydra rejects it) and set STREAMDRAFT_VERBOSE=1 for
    this process and the processes it starts."""
    if "--verbose" in argv:
        argv.remove("--verbose")
        os.environ[VERBOSE_ENV] = "1"


def quiet_libraries() -> None:
    """Unless verbose: wandb prints nothing but errors, and the deprecation notice torch gives
    every rank of a gloo run is filtered (by its exact text). DeepSpeed's logger and the C
    compiler probes (logged at INFO on the root logger) stay below the root level of
    ``hydra.job_logging``."""
    if verbose():
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    warnings.filterwarnings("ignore", message=TORCH_GLOO_NOTICE, category=FutureWarning)


def log_levels() -> None:
    """In the Hydra job: with verbose, the root logger (libraries, DeepSpeed's compiler probes)
    at INFO; warnings into the log either way. Unless verbose, a rank other than 0 shows only
    errors on the console (rank 0 says the rest once) and no weight-loading bar; its log file keeps all."""
    logging.captureWarnings(True)
    if verbose():
        logging.getLogger().setLevel(logging.INFO)
    elif os.environ.get("RANK", "0") != "0":
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.ERROR)
        import transformers

        transformers.utils.logging.disable_progress_bar()


@contextlib.contextmanager
def without_notices(pattern: re.Pattern = DEEPSPEED_OP_NOTICE) -> Iterator[None]:
    """Drop the stdout lines that match ``pattern`` (a library's notice, by its exact text) printed
    inside the block; every other line is printed as it was. Verbose: nothing is dropped."""
    if verbose():
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True) if not pattern.match(line.rstrip("\n"))]
        sys.stdout.write("".join(kept))


def show(line: str, err: bool = True) -> None:
    """Print ``line`` on the console (stderr, or stdout: ``err=False``) above any progress bar, and put it
    in the run dir's log: at DEBUG, which the console handler leaves out, so the console shows it once."""
    tqdm.write(line, file=sys.stderr if err else sys.stdout)
    logging.getLogger("trainer.console").debug(line)


def exit_if_short(e: BaseException) -> None:
    """A user error when short errors are on: print it in a few lines to stderr and exit 1."""
    if isinstance(e, USER_ERRORS) and os.environ.get(SHORT_ERRORS_ENV) == "1":
        print(short_error(e), file=sys.stderr)
        raise SystemExit(1) from None


def short_error(e: BaseException) -> str:
    """A user error in one to three lines: its message (for Hydra's and OmegaConf's errors the
    first line and the first line of the cause, with the fix: a config group's options, the
    schema key a misspelt one is closest to), and where the full trace is."""
    if isinstance(e, MissingConfigException) and e.options:
        group, _, name = e.missing_cfg_file.rpartition("/")
        lines = [f"Could not find '{e.missing_cfg_file}'{did_you_mean(name, e.options)} (options in '{group}': {', '.join(e.options)})"]
    elif isinstance(e, (HydraException, OmegaConfBaseException)):
        lines = [str(e).splitlines()[0].rstrip(".:")]
        # a key Hydra could not set from an override is the cause; from a config file, the context it raised in
        cause = (e.__cause__ or e.__context__) if isinstance(e, HydraException) else e
        if cause is not e and isinstance(cause, OmegaConfBaseException) and str(cause):
            lines[0] += f": {str(cause).splitlines()[0]}"
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and is_dataclass(cause.object_type):
            prefix = cause.full_key[: -len(str(cause.key))] if cause.full_key else ""
            lines[0] += did_you_mean(str(cause.key), [f.name for f in fields(cause.object_type)], prefix)
    else:
        lines = str(e).splitlines() or [type(e).__name__]
    return "\n".join(["error: " + lines[0], *lines[1:], "(full trace: add --verbose or set HYDRA_FULL_ERROR=1)"])
