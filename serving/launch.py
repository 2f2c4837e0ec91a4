"""Server commands for target + EAGLE-3 draft in SGLang and vLLM; start one and wait until ready.

The flags are those of the pinned engines (read from their source):

* SGLang 0.5.14 (``sglang/srt/server_args.py``): ``python -m sglang.launch_server
  --model-path T --speculative-algorithm EAGLE3 --speculative-draft-model-path D
  --speculative-num-steps S --speculative-eagle-topk K --speculative-num-draft-tokens N``
  (with K = 1 SGLang forces N = S + 1); ``--disable-cuda-graph`` is deprecated there in
  favour of ``--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled``.
  Readiness: ``GET /health_generate`` (runs a real generation) or ``GET /health``.
* vLLM 0.33.0 (``vllm/config/speculative.py``, ``vllm/engine/arg_utils.py``): ``python -m
  vllm.entrypoints.openai.api_server --model T --speculative-config
  '{"method": "eagle3", "model": D, "num_speculative_tokens": S}'`` (chain drafting; the
  draft dir is a speculators export); ``--enforce-eager`` disables CUDA graphs.
  Readiness: ``GET /health``.

Without a draft the same command serves the target alone: the baseline for serving.bench. With an
SGLang draft and no ``--num-steps`` / ``--topk`` / ``--num-draft-tokens``, the setting is the fastest
that ``serving.speedup`` measured for ``--concurrency`` (the export's ``serving.json``), else a chain.
Before a command is printed, the draft's config must be an export for that engine (the two
formats of ``serving/formats.py``); starting a server also runs ``serving.verify`` on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from models.backends.registry import able
from serving.formats import DEFAULT_SPECULATIVE_TOKENS
from serving.speedup_report import serving_choice

SERVERS = tuple(able("serving"))  # the backends that serve an export (--engine)


@dataclass(frozen=True)
class ServerSpec:
    engine: str  # sglang | vllm
    target: str  # model path or hub id
    draft: str | None = None  # export dir for this engine; None: the target alone (baseline)
    host: str = "127.0.0.1"
    port: int = 30000
    num_steps: int = DEFAULT_SPECULATIVE_TOKENS  # draft tokens per chain: SGLang --speculative-num-steps, vLLM num_speculative_tokens
    topk: int = 1  # SGLang --speculative-eagle-topk (tree width); vLLM drafts a chain
    num_draft_tokens: int | None = None  # SGLang --speculative-num-draft-tokens (default: num_steps + 1)
    tp: int = 1
    mem_fraction: float | None = None  # SGLang --mem-fraction-static / vLLM --gpu-memory-utilization
    cuda_graph: bool = True
    extra: tuple[str, ...] = ()
    python: str = field(default=sys.executable)

    def __post_init__(self) -> None:
        if self.engine not in SERVERS:
            raise ValueError(f"engine must be one of {SERVERS}, got {self.engine!r}")
        if self.num_steps < 1 or self.topk < 1:
            raise ValueError(f"num_steps and topk must be >= 1, got {self.num_steps}, {self.topk}")
        if self.engine == "vllm" and self.topk != 1:
            raise ValueError("vLLM's eagle3 method drafts a chain: topk must be 1")
        if self.topk == 1 and self.num_draft_tokens not in (None, self.num_steps + 1):
            raise ValueError(
                f"with topk 1 SGLang sets num_draft_tokens = num_steps + 1 = {self.num_steps + 1}, got {self.num_draft_tokens}"
            )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def without_draft(self) -> "ServerSpec":
        return replace(self, draft=None)


def sglang_command(s: ServerSpec) -> list[str]:
    cmd = [
        s.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        s.target,
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--tp-size",
        str(s.tp),
        "--enable-metrics",
    ]
    if s.draft is not None:
        cmd += [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            s.draft,
            "--speculative-num-steps",
            str(s.num_steps),
            "--speculative-eagle-topk",
            str(s.topk),
            "--speculative-num-draft-tokens",
            str(s.num_draft_tokens or s.num_steps + 1),
        ]
    if s.mem_fraction is not None:
        cmd += ["--mem-fraction-static", str(s.mem_fraction)]
    if not s.cuda_graph:
        cmd += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    return cmd + list(s.extra)


def vllm_command(s: ServerSpec) -> list[str]:
    cmd = [
        s.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        s.target,
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--tensor-parallel-size",
        str(s.tp),
    ]
    if s.draft is not None:
        spec = {"method": "eagle3", "model": s.draft, "num_speculative_tokens": s.num_steps}
        cmd += ["--speculative-config", json.dumps(spec)]
    if s.mem_fraction is not None:
        cmd += ["--gpu-memory-utilization", str(s.mem_fraction)]
    if not s.cuda_graph:
        cmd += ["--enforce-eager"]
    return cmd + list(s.extra)


def server_command(s: ServerSpec) -> list[str]:
    return sglang_command(s) if s.engine == "sglang" else vllm_command(s)


def ready_url(s: ServerSpec) -> str:
    return s.base_url + able("serving")[s.engine].ready_path


def check_draft_engine(draft: str | Path, engine: str) -> None:
    """ValueError unless ``draft`` holds an export for ``engine``, naming the right directory."""
    from serving.formats import read_export_config

    found = read_export_config(draft).engine
    if found == engine:
        return
    sibling = Path(draft).parent / engine  # export_both writes RUN/export/sglang and RUN/export/vllm
    hint = f"use {sibling}" if sibling.is_dir() else f"use the {engine} export (python -m trainer writes RUN/export/{engine})"
    raise ValueError(f"{draft} was exported for {found}, not {engine}: its aux layer ids are in {found}'s numbering; {hint}")


# --------------------------------------------------------------------------- running


class ServerError(RuntimeError):
    """The server exited or never became ready; the message ends with its log tail."""


def log_tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return "(no log written)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(log is empty)"


class Server:
    """One server process (its own process group), logging to ``log_path``."""

    def __init__(self, command: list[str], log_path: str | Path, env: dict[str, str] | None = None):
        self.command, self.log_path, self.env = command, Path(log_path), env
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        return self

    def wait_ready(self, url: str, timeout: float, poll: float = 1.0) -> float:
        """Seconds until ``GET url`` answered 200; ServerError (with the log tail) if the
        process exits first or ``timeout`` passes."""
        assert self.proc is not None, "start() first"
        start = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    f"server exited with code {code} before it was ready; log tail ({self.log_path}):\n{log_tail(self.log_path)}"
                )
            if _answers(url, timeout=min(poll * 5, 10.0)):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise ServerError(
                    f"server not ready at {url} after {timeout:.0f} s; log tail ({self.log_path}):\n{log_tail(self.log_path)}"
                )
            time.sleep(poll)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "Server":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _answers(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start_server(spec: ServerSpec, log_path: str | Path, timeout: float, verify: bool = True) -> Server:
    """Verify the draft for the engine, start the server and wait until it is ready."""
    if verify and spec.draft is not None:
        from serving.verify import format_report, verify_export

        target_dir = spec.target if Path(spec.target).is_dir() else None
        report = verify_export(spec.draft, spec.engine, target_dir)
        if not report.ok:
            raise ValueError(f"refusing to serve a draft that fails verification:\n{format_report(report)}")
    server = Server(server_command(spec), log_path).start()
    try:
        server.wait_ready(ready_url(spec), timeout)
    except ServerError:
        server.stop()
        raise
    return server


def speculative_setting(args: argparse.Namespace) -> tuple[int, int, int | None]:
    """(steps, topk, draft tokens): those given, else the measured best of the draft's ``serving.json``
    for ``--concurrency`` (said on stderr), else a chain of DEFAULT_SPECULATIVE_TOKENS."""
    given = (args.num_steps, args.topk, args.num_draft_tokens)
    if args.draft is None or args.engine != "sglang" or any(v is not None for v in given):
        steps = DEFAULT_SPECULATIVE_TOKENS if args.num_steps is None else args.num_steps
        return steps, 1 if args.topk is None else args.topk, args.num_draft_tokens
    choice = serving_choice(args.draft, args.concurrency)
    if choice is None:
        return DEFAULT_SPECULATIVE_TOKENS, 1, None
    print(
        f"# measured best at concurrency {choice['concurrency']}: {choice['setting']} (steps/topk/draft tokens), "
        f"{choice['speedup']:.2f}x the target alone ({choice['file']})",
        file=sys.stderr,
    )
    if choice["speedup"] < 1:
        c = choice["concurrency"]
        print(f"# warning: no measured setting beat the target alone at concurrency {c}: serve it without --draft", file=sys.stderr)
    return choice["num_steps"], choice["topk"], choice["num_draft_tokens"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=SERVERS, required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None, help="export dir for this engine; omit for the target alone")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--num-steps", type=int, default=None, help=f"draft steps (default: the export's serving.json, else {DEFAULT_SPECULATIVE_TOKENS})"
    )
    p.add_argument("--topk", type=int, default=None, help="tree width (default: the export's serving.json, else 1: a chain)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tree size (default: serving.json's, else num_steps + 1)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight the server is for: picks serving.json's setting")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mem-fraction", type=float, default=None)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--run", action="store_true", help="start it, wait until ready, serve until interrupted")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for readiness")
    p.add_argument("--log", type=Path, default=Path("server.log"))
    args, extra = p.parse_known_args(argv)
    try:
        steps, topk, tokens = speculative_setting(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    spec = ServerSpec(
        args.engine,
        args.target,
        args.draft,
        args.host,
        args.port,
        steps,
        topk,
        tokens,
        args.tp,
        args.mem_fraction,
        not args.no_cuda_graph,
        tuple(extra),
    )
    if spec.draft is not None:
        try:
            check_draft_engine(spec.draft, spec.engine)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(shlex.join(server_command(spec)))
    if not args.run:
        return 0
    try:
        server = start_server(spec, args.log, args.timeout)
    except (ValueError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"ready: {spec.base_url} (log: {args.log})")
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
