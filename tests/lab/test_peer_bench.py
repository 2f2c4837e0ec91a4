"""lab/peer_bench: both sides' command lines from the arguments (SpecForge's against its own CLI parser and run-config
schema, read from an unpacked specforge 0.2.0 wheel at $STREAMDRAFT_SPECFORGE_SRC), its failure paths, its writer."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from lab.peer_bench import commands as C
from lab.peer_bench import report, run
from models.embedded import embedded_target_dir

SOURCE_ENV = "STREAMDRAFT_SPECFORGE_SRC"


def _specforge_on_path(monkeypatch):
    src = os.environ.get(SOURCE_ENV)
    if not src or not (Path(src) / "cli.py").is_file():
        pytest.skip(f"no SpecForge source: set {SOURCE_ENV} to an unpacked specforge 0.2.0 wheel's specforge/")
    pytest.importorskip("pydantic")
    monkeypatch.syspath_prepend(str(Path(src).parent))
    from specforge import cli
    from specforge.config import schema

    return cli, schema


def _help(cli, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return out.getvalue()


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_specforge_train_and_export_flags_exist_in_its_parser(monkeypatch, tmp_path):
    cli, _ = _specforge_on_path(monkeypatch)
    paths = C.PeerPaths(tmp_path)
    train = C.train_argv(["specforge"], paths.config("minutes5"))
    export = C.export_argv(["specforge"], paths, "minutes5")
    assert train[1:3] == ["train", "--config"] and export[1:4] == ["export", "--to", "sglang"]
    for argv in (train, export):
        text = _help(cli, [argv[1]])
        missing = [f for f in _flags(argv) if f not in text]
        assert not missing, f"specforge {argv[1]} has no {missing}"
    with pytest.raises(SystemExit):  # the parser does refuse a flag it lacks
        with contextlib.redirect_stderr(io.StringIO()):
            cli.main(["export", "--to", "sglang", "--no-such-flag"])


def test_the_peer_run_config_validates_in_specforges_schema(monkeypatch, tmp_path):
    _, schema = _specforge_on_path(monkeypatch)
    config = C.run_config(embedded_target_dir(), C.PeerPaths(tmp_path), "minutes5", 1234)
    parsed = schema.Config.model_validate(config)
    assert parsed.mode == "offline" and parsed.deployment.mode == "local_colocated"
    assert parsed.training.max_steps == 1234 and parsed.training.learning_rate == 1e-4 and parsed.training.ttt_length == 7
    with pytest.raises(Exception, match="no_such_key"):
        schema.Config.model_validate(config | {"training": config["training"] | {"no_such_key": 1}})


def test_the_draft_config_follows_the_target(tmp_path):
    config = C.draft_config(embedded_target_dir())
    target = json.loads((embedded_target_dir() / "config.json").read_text())
    assert config["hidden_size"] == target["hidden_size"] and config["vocab_size"] == target["vocab_size"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["rope_theta"] == target["rope_parameters"]["rope_theta"]
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="vocab_size"):
        C.draft_config(tmp_path)


def test_streamdraft_and_measurement_command_lines(tmp_path):
    argv = C.streamdraft_argv(tmp_path / "sd", tmp_path / "corpora", None, 300)
    assert argv[1].endswith("launch/recipe.py") and Path(argv[1]).is_file() and argv[argv.index("--train-s") + 1] == "300"
    assert argv[argv.index("--phases") + 1] == "training" and "trainer.speedup.enabled=false" in argv
    speed = C.speedup_argv(
        tmp_path / "e", [tmp_path / "a.jsonl"], tmp_path / "t", ["6/1/7", "6/8/32"], [1, 16], 0.3, tmp_path / "r.json", None
    )
    assert speed[2] == "serving.speedup" and "--plain-from" not in speed
    assert speed[speed.index("--concurrency") + 1 : speed.index("--concurrency") + 3] == ["1", "16"]
    capture = C.capture_argv(tmp_path / "scripts", tmp_path / "t", C.PeerPaths(tmp_path), 0.4)
    assert capture[1].endswith("prepare_hidden_states.py") and "--is-preformatted" in capture


def _inputs(tmp_path: Path) -> list[str]:
    corpora = tmp_path / "corpora"
    corpora.mkdir()
    for name in ("heldout_sharegpt.jsonl", "heldout_codeio.jsonl"):
        (corpora / name).write_text(json.dumps({"prompt": "hi"}) + "\n")
    answer = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    for name in ("answered.jsonl", "sampled.jsonl"):
        (tmp_path / name).write_text(json.dumps(answer) + "\n")
    return ["--corpora", str(corpora), "--answered", str(tmp_path / "answered.jsonl"), "--sampled", str(tmp_path / "sampled.jsonl"),
            "--specforge-scripts", str(tmp_path / "scripts"), "--minutes", "1", "2", "--out", str(tmp_path / "out")]  # fmt: skip


def _fake_streamdraft(monkeypatch):
    """StreamDraft's side as run.py reads it, without its GPU training and the measurement."""
    monkeypatch.setattr(run, "streamdraft_side", lambda args, out: [
        {"side": "streamdraft", "minutes": m, "failed": None, "steps": 10, "train_s": m * 60, "tokens_per_s": 1000,
         "first_step_s": 30.0, "peak_gpu_mem_gb": 10.0, "export": "x", "commands": []} for m in args.minutes])  # fmt: skip
    monkeypatch.setattr(run, "measure", lambda args, records, out: None)


def _written(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "peer_bench.json").read_text())


def test_peer_absent_keeps_streamdrafts_side(tmp_path, monkeypatch, capsys):
    _fake_streamdraft(monkeypatch)
    code = run.main([*_inputs(tmp_path), "--specforge", "no-such-specforge-command"])
    data = _written(tmp_path)
    assert code == 1
    peer = [r for r in data["rows"] if r["side"] == "peer"]
    assert len(peer) == 2 and all("not on PATH" in r["failed"]["message"] for r in peer)
    assert [r["failed"] for r in data["rows"] if r["side"] == "streamdraft"] == [None, None]
    assert "FAILED: find specforge" in capsys.readouterr().out


def _fake_specforge(tmp_path: Path, body: str) -> list[str]:
    """A command that stands where SpecForge's console script would, doing ``body`` (a shell line)."""
    script = tmp_path / "specforge-fake"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    (tmp_path / "scripts").mkdir(exist_ok=True)
    (tmp_path / "scripts" / "prepare_hidden_states.py").write_text("import sys\nsys.exit(0)\n")
    return ["--specforge", str(script)]


def test_peer_exit_code_names_its_stage_and_its_last_lines(tmp_path, monkeypatch):
    _fake_streamdraft(monkeypatch)
    args = _inputs(tmp_path) + _fake_specforge(tmp_path, 'echo "ValueError: the peer says no" >&2; exit 3')
    assert run.main(args) == 1
    rows = _written(tmp_path)["rows"]
    peer = [r for r in rows if r["side"] == "peer"][0]["failed"]
    assert peer["stage"] == "specforge train calibrate50" and "exit code 3" in peer["message"] and "the peer says no" in peer["message"]
    assert all(r["failed"] is None for r in rows if r["side"] == "streamdraft")


def test_peer_without_an_export_is_named(tmp_path, monkeypatch):
    _fake_streamdraft(monkeypatch)
    args = _inputs(tmp_path) + _fake_specforge(tmp_path, "exit 0")  # trains and exports 'successfully', writes nothing
    assert run.main(args) == 1
    peer = [r for r in _written(tmp_path)["rows"] if r["side"] == "peer"]
    assert [r["failed"]["stage"] for r in peer] == ["specforge export", "specforge export"]
    assert "wrote no" in peer[0]["failed"]["message"]


def _speedup(tau_chain: float, tau_tree: float) -> dict:
    rows = []
    for c in (1, 16):
        rows.append({"setting": "plain", "set": "s", "concurrency": c, "output_tokens": 100, "wall_s": 1.0})
        rows.append({"setting": "6/1/7", "set": "s", "concurrency": c, "output_tokens": 100, "wall_s": 0.5, "tau": tau_chain})
        rows.append({"setting": "6/8/32", "set": "s", "concurrency": c, "output_tokens": 100, "wall_s": 0.4, "tau": tau_tree})
        rows.append({"setting": "5/4/8", "set": "s", "concurrency": c, "output_tokens": 100, "wall_s": 0.6, "tau": tau_tree - 0.5})
    return {"rows": rows}


def test_the_writer_makes_the_table_json_and_plot(tmp_path):
    records = [
        {"side": "streamdraft", "minutes": m, "failed": None, "train_s": 60.0 * m, "steps": 5, "tokens_per_s": 9000,
         "peak_gpu_mem_gb": 12.0, "first_step_s": 30.0, "speedup": _speedup(2.5 + m / 10, 3.5)} for m in (5, 10)
    ] + [{"side": "peer", "minutes": 5, "failed": {"stage": "specforge capture", "message": "boom"}}]  # fmt: skip
    text = report.write(tmp_path, records, ["5/4/8", "6/8/32"], {"argv": ["x"]})
    rows = json.loads((tmp_path / "peer_bench.json").read_text())["rows"]
    assert rows[0]["tau_chain"] == pytest.approx(3.0) and rows[0]["best_tree"] == "6/8/32" and rows[0]["tau_tree"] == 3.5
    assert rows[0]["speedup_chain_c1"] == pytest.approx(2.0) and rows[0]["speedup_tree_c16"] == pytest.approx(2.5)
    assert rows[2]["tau_chain"] is None and "FAILED: specforge capture" in text.splitlines()[-1]
    assert (tmp_path / "tau_vs_minutes.png").stat().st_size > 0


@pytest.mark.gpu
def test_one_minute_of_both_sides_on_a_gpu(tmp_path):
    """The whole bench on a GPU host with SpecForge installed ($STREAMDRAFT_PEER_ARGS: its --corpora, --answered,
    --sampled and --specforge-scripts)."""
    extra = os.environ.get("STREAMDRAFT_PEER_ARGS")
    if not extra:
        pytest.skip("set STREAMDRAFT_PEER_ARGS to the bench's input arguments")
    code = run.main([*extra.split(), "--minutes", "1", "--out", str(tmp_path)])
    assert code == 0, (tmp_path / "peer_bench.json").read_text()
