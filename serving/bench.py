"""``python -m serving.bench``: drive an OpenAI-compatible server with a prompt file at a chosen
concurrency; output tokens/s, latency percentiles and the server's accept length, against the
same server without a draft.

Two ways to get the comparison: ``--url`` (with draft) and ``--baseline-url`` (without) for
servers already running, or ``--engine/--target/--draft`` to launch one, measure it, stop
it, and launch the target alone on the same port (``serving/launch.py``).

The server's accept length comes from where each engine reports it:
* SGLang 0.5.14: ``GET /server_info`` -> ``internal_states[i].avg_spec_accept_length``
  (scheduler ``spec_total_num_accept_tokens / spec_total_num_forward_ct``, since start);
* vLLM 0.33.0: ``GET /metrics`` counters ``vllm:spec_decode_num_accepted_tokens_total`` and
  ``vllm:spec_decode_num_drafts_total``, read before and after the run: 1 + accepted / drafts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from serving.formats import DEFAULT_SPECULATIVE_TOKENS
from serving.launch import ServerError
from serving.prompts import PromptSpec, read_prompt_file
from serving.usage import PlainHelp

VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    latency_s: float
    output_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class BenchResult:
    url: str
    requests: int
    errors: int
    concurrency: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    server_accept_length: float | None


def _http(url: str, body: dict | None = None, timeout: float = 60.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def served_model(base_url: str, timeout: float = 30.0) -> str:
    """The first model id of ``GET /v1/models``."""
    models = json.loads(_http(f"{base_url}/v1/models", timeout=timeout)).get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


def chat_request(base_url: str, model: str, messages: list[dict], max_tokens: int, timeout: float) -> RequestResult:
    """One greedy chat completion; the output token count is the server's ``usage``."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    start = time.perf_counter()
    try:
        reply = json.loads(_http(f"{base_url}/v1/chat/completions", body, timeout))
        tokens = int(reply["usage"]["completion_tokens"])
    except (urllib.error.URLError, OSError, KeyError, TypeError, ValueError) as e:
        return RequestResult(False, time.perf_counter() - start, 0, f"{type(e).__name__}: {e}")
    return RequestResult(True, time.perf_counter() - start, tokens)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of ``values`` (nan when empty)."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


# --------------------------------------------------------------------------- accept length


def _vllm_counters(base_url: str) -> tuple[float, float] | None:
    try:
        text = _http(f"{base_url}/metrics", timeout=10).decode()
    except (urllib.error.URLError, OSError):
        return None
    sums = {}
    for name in (VLLM_ACCEPTED, VLLM_DRAFTS):
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)$", text, flags=re.M)
        if not values:
            return None
        sums[name] = sum(float(v) for v in values)
    return sums[VLLM_ACCEPTED], sums[VLLM_DRAFTS]


def _sglang_accept_length(base_url: str) -> float | None:
    try:
        info = json.loads(_http(f"{base_url}/server_info", timeout=10))
    except (urllib.error.URLError, OSError, ValueError):
        return None
    values = [s["avg_spec_accept_length"] for s in info.get("internal_states", []) if "avg_spec_accept_length" in s]
    return sum(values) / len(values) if values else None


def accept_length_probe(base_url: str):
    """A callable returning the server's accept length over what ran since the probe was made."""
    before = _vllm_counters(base_url)

    def probe() -> float | None:
        after = _vllm_counters(base_url)
        if before is not None and after is not None and after[1] > before[1]:
            return 1.0 + (after[0] - before[0]) / (after[1] - before[1])
        return _sglang_accept_length(base_url)

    return probe


# --------------------------------------------------------------------------- runs


def first_turns(prompts: list[PromptSpec]) -> list[list[dict]]:
    """The request of each prompt: its context up to the first answer (follow-ups need answers)."""
    return [list(p.context) for p in prompts]


def run_bench(
    base_url: str, requests: list[list[dict]], concurrency: int, max_tokens: int, model: str | None = None, timeout: float = 300.0
) -> BenchResult:
    """Send every request (a message list) with ``concurrency`` in flight; one result."""
    if concurrency < 1 or not requests:
        raise ValueError(f"need concurrency >= 1 and at least one request, got {concurrency} and {len(requests)}")
    model = model or served_model(base_url)
    probe = accept_length_probe(base_url)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda m: chat_request(base_url, model, m, max_tokens, timeout), requests))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    latencies = [r.latency_s for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    return BenchResult(
        base_url,
        len(results),
        len(results) - len(ok),
        concurrency,
        wall,
        tokens,
        tokens / wall if wall > 0 else 0.0,
        percentile(latencies, 50),
        percentile(latencies, 90),
        percentile(latencies, 99),
        probe(),
    )


def format_comparison(draft: BenchResult, baseline: BenchResult | None) -> str:
    rows = [("", "with draft", "without draft")] if baseline else [("", "result", "")]
    pairs = [
        ("requests (errors)", lambda r: f"{r.requests} ({r.errors})"),
        ("output tokens/s", lambda r: f"{r.output_tokens_per_s:.1f}"),
        ("latency p50 s", lambda r: f"{r.latency_p50_s:.3f}"),
        ("latency p90 s", lambda r: f"{r.latency_p90_s:.3f}"),
        ("latency p99 s", lambda r: f"{r.latency_p99_s:.3f}"),
        ("server accept length", lambda r: "n/a" if r.server_accept_length is None else f"{r.server_accept_length:.2f}"),
    ]
    rows += [(name, f(draft), f(baseline) if baseline else "") for name, f in pairs]
    lines = [f"{a:<22}{b:>14}{c:>16}" for a, b, c in rows]
    if baseline and baseline.output_tokens_per_s > 0:
        lines.append(f"speedup (tokens/s): {draft.output_tokens_per_s / baseline.output_tokens_per_s:.2f}x")
    return "\n".join(lines)


def _launched_pair(args, requests) -> tuple[BenchResult, BenchResult]:
    from serving.launch import ServerSpec, start_server

    spec = ServerSpec(args.engine, args.target, args.draft, port=args.port, num_steps=args.num_steps, cuda_graph=not args.no_cuda_graph)
    results = []
    for s, name in ((spec, "draft"), (spec.without_draft(), "baseline")):
        server = start_server(s, Path(args.log_dir) / f"{args.engine}-{name}.log", args.launch_timeout)
        try:
            results.append(run_bench(s.base_url, requests, args.concurrency, args.max_tokens, args.model))
        finally:
            server.stop()
    return results[0], results[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.bench", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--url", help="server with the draft")
    p.add_argument("--baseline-url", help="the same target served without a draft")
    p.add_argument("--engine", choices=("sglang", "vllm"), help="launch mode: engine to start")
    p.add_argument("--target", help="launch mode: target model")
    p.add_argument("--draft", help="launch mode: export dir for the engine")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--num-steps", type=int, default=DEFAULT_SPECULATIVE_TOKENS)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default="bench-logs")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not (args.url or (args.engine and args.target and args.draft)):
        p.error("give --url [--baseline-url], or --engine, --target and --draft to launch")
    try:
        requests = first_turns(read_prompt_file(args.prompts, args.limit))
        if args.url:
            draft = run_bench(args.url, requests, args.concurrency, args.max_tokens, args.model)
            baseline = run_bench(args.baseline_url, requests, args.concurrency, args.max_tokens, args.model) if args.baseline_url else None
        else:
            draft, baseline = _launched_pair(args, requests)
    except (ValueError, ServerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_comparison(draft, baseline))
    if args.json:
        args.json.write_text(json.dumps({"draft": asdict(draft), "baseline": asdict(baseline) if baseline else None}, indent=2) + "\n")
    return 1 if draft.errors or (baseline and baseline.errors) else 0


if __name__ == "__main__":
    sys.exit(main())
