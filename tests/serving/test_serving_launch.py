"""Server commands, readiness waiting with real processes, and the benchmark client against a
local OpenAI-compatible HTTP server on 127.0.0.1 (bounded requests, stops by itself)."""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.bench import first_turns, percentile, run_bench
from serving.bench import main as bench_main
from serving.launch import Server, ServerError, ServerSpec, ready_url, server_command
from serving.prompts import PromptSpec
from trainer.dist import free_port


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_sglang_command_with_and_without_draft():
    spec = ServerSpec("sglang", "/models/t", "/exports/sglang", port=31000, num_steps=4, tp=2, mem_fraction=0.8, cuda_graph=False)
    cmd = server_command(spec)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == "/models/t" and _flag(cmd, "--port") == "31000" and _flag(cmd, "--tp-size") == "2"
    assert _flag(cmd, "--speculative-algorithm") == "EAGLE3"
    assert _flag(cmd, "--speculative-draft-model-path") == "/exports/sglang"
    assert (
        _flag(cmd, "--speculative-num-steps"),
        _flag(cmd, "--speculative-eagle-topk"),
        _flag(cmd, "--speculative-num-draft-tokens"),
    ) == ("4", "1", "5")
    assert _flag(cmd, "--cuda-graph-backend-decode") == "disabled" and _flag(cmd, "--mem-fraction-static") == "0.8"
    baseline = server_command(spec.without_draft())
    assert not any(a.startswith("--speculative") for a in baseline) and _flag(baseline, "--model-path") == "/models/t"
    assert ready_url(spec) == "http://127.0.0.1:31000/health_generate"


def test_vllm_command_with_and_without_draft():
    spec = ServerSpec("vllm", "/models/t", "/exports/vllm", num_steps=3, cuda_graph=False, extra=("--max-model-len", "4096"))
    cmd = server_command(spec)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and _flag(cmd, "--model") == "/models/t"
    assert json.loads(_flag(cmd, "--speculative-config")) == {"method": "eagle3", "model": "/exports/vllm", "num_speculative_tokens": 3}
    assert "--enforce-eager" in cmd and cmd[-2:] == ["--max-model-len", "4096"]
    assert "--speculative-config" not in server_command(spec.without_draft())
    assert ready_url(spec).endswith("/health")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"engine": "tgi"}, "engine must be one of"),
        ({"engine": "vllm", "topk": 4}, "drafts a chain"),
        ({"num_draft_tokens": 9}, "num_draft_tokens = num_steps \\+ 1"),
        ({"num_steps": 0}, "must be >= 1"),
    ],
)
def test_server_spec_refuses_inconsistent_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerSpec(**{"engine": "sglang", "target": "t", "draft": "d", **kwargs})


READY_AFTER_A_SECOND = """
import sys, time, http.server
time.sleep(1.0)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == '/health' else 404); self.end_headers()
    def log_message(self, *a): pass
print('listening', flush=True)
s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H)
s.timeout = 0.5
deadline = time.time() + 60
while time.time() < deadline:
    s.handle_request()
"""


def test_wait_ready_returns_once_the_server_answers(tmp_path):
    port = free_port()
    with Server([sys.executable, "-c", READY_AFTER_A_SECOND, str(port)], tmp_path / "ok.log") as server:
        waited = server.wait_ready(f"http://127.0.0.1:{port}/health", timeout=30, poll=0.2)
        assert 0.5 < waited < 30
    assert server.proc.poll() is not None  # stopped on exit


def test_a_server_that_dies_shows_its_log_tail(tmp_path):
    crash = "print('Capturing CUDA graphs'); print('RuntimeError: CUDA graph capture failed'); raise SystemExit(3)"
    with Server([sys.executable, "-c", crash], tmp_path / "crash.log") as server:
        with pytest.raises(ServerError) as err:
            server.wait_ready(f"http://127.0.0.1:{free_port()}/health", timeout=30, poll=0.2)
    assert "exited with code 3" in str(err.value) and "CUDA graph capture failed" in str(err.value)


def test_a_server_that_hangs_times_out_with_its_log_tail(tmp_path):
    hang = "import time; print('Capturing batches (bs=160)', flush=True); time.sleep(60)"
    with Server([sys.executable, "-c", hang], tmp_path / "hang.log") as server:
        with pytest.raises(ServerError) as err:
            server.wait_ready(f"http://127.0.0.1:{free_port()}/health", timeout=1.5, poll=0.2)
    assert "not ready" in str(err.value) and "Capturing batches" in str(err.value)
    assert server.proc.poll() is not None


# --------------------------------------------------------------------------- benchmark client


class FakeEngine:
    """What the client reads from SGLang (``server_info``) or vLLM (``metrics``) servers."""

    def __init__(self, flavour: str, tokens: int):
        self.flavour, self.tokens, self.requests, self.lock = flavour, tokens, 0, threading.Lock()

    def handler(self):
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, json.dumps({"data": [{"id": "smollm2"}]}).encode())
                if self.path == "/server_info" and engine.flavour == "sglang":
                    return self._send(200, json.dumps({"internal_states": [{"avg_spec_accept_length": 2.5}]}).encode())
                if self.path == "/metrics" and engine.flavour == "vllm":
                    n = engine.requests
                    text = (
                        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {10 * n}.0\n'
                        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {20 * n}.0\n'
                    )
                    return self._send(200, text.encode(), "text/plain")
                self._send(404, b"{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions" or body.get("temperature") != 0.0 or body["model"] != "smollm2":
                    return self._send(400, b'{"error": "bad request"}')
                with engine.lock:
                    engine.requests += 1
                reply = {"choices": [{"message": {"role": "assistant", "content": "hi"}}], "usage": {"completion_tokens": engine.tokens}}
                self._send(200, json.dumps(reply).encode())

            def log_message(self, *args):
                pass

        return Handler


@pytest.fixture
def fake_server():
    servers = []

    def start(flavour: str, tokens: int) -> tuple[str, FakeEngine]:
        engine = FakeEngine(flavour, tokens)
        server = ThreadingHTTPServer(("127.0.0.1", 0), engine.handler())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", engine

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


PROMPTS = [PromptSpec(({"role": "user", "content": f"question {i}"},), ("follow up",)) for i in range(12)]


def test_bench_against_an_sglang_style_server(fake_server):
    url, engine = fake_server("sglang", tokens=32)
    result = run_bench(url, first_turns(PROMPTS), concurrency=4, max_tokens=32)
    assert (result.requests, result.errors, engine.requests) == (12, 0, 12)
    assert result.output_tokens == 12 * 32 and result.output_tokens_per_s > 0
    assert 0 < result.latency_p50_s <= result.latency_p90_s <= result.latency_p99_s
    assert result.server_accept_length == 2.5


def test_bench_reads_vllm_counters_over_its_own_run(fake_server):
    url, engine = fake_server("vllm", tokens=8)
    engine.requests = 5  # earlier traffic: counters start at 50 drafts / 100 accepted
    result = run_bench(url, first_turns(PROMPTS[:6]), concurrency=3, max_tokens=8, model="smollm2")
    assert result.errors == 0 and result.output_tokens == 48
    assert result.server_accept_length == pytest.approx(1 + 120 / 60)  # this run only: +60 drafts, +120 accepted


def test_bench_counts_failed_requests(fake_server):
    url, _ = fake_server("sglang", tokens=4)
    result = run_bench(url, first_turns(PROMPTS[:3]), concurrency=2, max_tokens=4, model="not-served")
    assert result.errors == 3 and result.output_tokens == 0


def test_bench_cli_compares_with_the_baseline(fake_server, tmp_path, capsys):
    with_draft, _ = fake_server("sglang", tokens=40)
    baseline, _ = fake_server("sglang", tokens=20)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"q{i}"}) for i in range(4)) + "\n")
    out = tmp_path / "bench.json"
    code = bench_main(
        [
            "--prompts",
            str(prompts),
            "--url",
            with_draft,
            "--baseline-url",
            baseline,
            "--concurrency",
            "2",
            "--max-tokens",
            "40",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0 and "with draft" in printed and "speedup" in printed
    saved = json.loads(out.read_text())
    assert saved["draft"]["output_tokens"] == 160 and saved["baseline"]["output_tokens"] == 80


def test_percentile():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0], 99) == 1.0


def test_launch_refuses_an_export_for_the_other_engine_before_printing(tmp_path, capsys):
    from serving.export import export_both
    from serving.formats import ExportSpec
    from serving.launch import main as launch_main
    from tests.serving.test_export import AUX_IDS, CARRIED, _draft, _vocab

    dirs = export_both(tmp_path / "export", _draft(CARRIED), _vocab(CARRIED), ExportSpec.of(AUX_IDS, norm_output=False))
    assert launch_main(["--engine", "vllm", "--target", "/models/t", "--draft", str(dirs["sglang"])]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{dirs['sglang']} was exported for sglang, not vllm" in err and f"use {dirs['vllm']}" in err
    assert launch_main(["--engine", "sglang", "--target", "/models/t", "--draft", str(dirs["vllm"])]) == 2
    assert f"use {dirs['sglang']}" in capsys.readouterr().err
    assert launch_main(["--engine", "vllm", "--target", "/models/t", "--draft", str(dirs["vllm"])]) == 0
    assert "--speculative-config" in capsys.readouterr().out
    assert launch_main(["--engine", "vllm", "--target", "/models/t", "--draft", str(tmp_path)]) == 2
    assert f"{tmp_path / 'config.json'}: export has no config file" in capsys.readouterr().err
