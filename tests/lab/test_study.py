"""Held-out categories, the training-time cap, eval-prompt provenance, and the study runner on a
two-point grid with a step cap, both points at once (real embedded target, tiny config)."""

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading

import pytest

import lab.study as study
from serving.prompts import read_prompt_file
from tests.fixtures.tiny import ROOT, TINY, tiny_config
from trainer.config import DataConfig, DataSourceConfig, TrainConfig
from trainer.data import first_prompt_key, read_chatterbot
from trainer.data_setup import Holdout
from trainer.loop import run
from trainer.report import metrics as M
from trainer.report.report import describe_eval_prompts

CATS = ["food", "sports"]


def test_category_holdout_keeps_every_prompt_of_those_categories_out_of_training():
    cfg = DataConfig(sources={"chatterbot": DataSourceConfig()}, holdout_categories=CATS)
    holdout = Holdout.of(cfg, seed=0)
    convs, _ = read_chatterbot()
    train, held = holdout.split("chatterbot", convs)
    category_keys = {first_prompt_key(c) for c in read_chatterbot(categories=CATS)[0]}
    assert {first_prompt_key(c) for c in held} == category_keys
    assert not {first_prompt_key(c) for c in train} & category_keys and len(train) + len(held) == len(convs)
    assert "food, sports" in holdout.describe() and "never trained on" in holdout.describe()
    with pytest.raises(ValueError, match="unknown chatterbot categories"):
        Holdout.of(DataConfig(sources={"chatterbot": DataSourceConfig()}, holdout_categories=["cooking"]), 0)


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: DataConfig(holdout_categories=[]), "data.holdout_categories"),
        (lambda: DataConfig(sources={"c": DataSourceConfig(holdout_fraction=0.2)}, holdout_categories=CATS), "data.holdout_categories"),
        (lambda: TrainConfig(max_time_s=0), "trainer.max_time_s"),
    ],
)
def test_config_checks(make, key):
    with pytest.raises(ValueError, match=key):
        make()


@pytest.mark.slow
def test_time_cap_stops_training_and_the_summary_names_the_eval_prompts(tmp_path, caplog):
    cfg = tiny_config("trainer.max_time_s=0.001", f"data.holdout_categories=[{','.join(CATS)}]")
    with caplog.at_level(logging.INFO, logger="trainer"):
        summary = run(cfg, tmp_path)
    assert summary["steps"] == 1 and summary["stopped_by"] == "trainer.max_time_s"
    assert re.search(r"training stopped by trainer\.max_time_s=0\.001: [\d.]+ s trained, step 1 of 3", caplog.text), caplog.text
    assert summary["tokens_seen"] > 0 and 0 < summary["train_time_s"] < summary["wall_time_s"]
    origin = summary["eval_prompts"]
    assert origin["kind"] == "heldout" and origin["sources"] == {"chatterbot": 2} and origin["prompts"] == 2
    assert "food, sports" in origin["split"] and "food, sports" in describe_eval_prompts(origin)
    written = read_prompt_file(tmp_path / "eval_prompts.jsonl")  # what `serving.eval --prompts` re-runs
    assert len(written) == origin["prompts"] and sum(p.turns for p in written) == origin["turns"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1][M.TOKENS_SEEN] == summary["tokens_seen"] and M.EVAL_ACCEPT_LEN in rows[-1]


def test_grid_file_flags_and_budget(tmp_path):
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text("sizes: [1, 2]\nregimes: {a: [schedule=cosine], b: [schedule=constant]}\nmax_steps: 10\noverrides: [x=1]\n")
    args = study._parser().parse_args(
        ["--out", str(tmp_path), "--grid", str(grid_file), "--sizes", "1", "4", "--regimes", "b", "--", "y=2"]
    )
    grid = study.load_grid(args)
    assert (grid.sizes, grid.regimes, grid.max_steps, grid.overrides) == ([1, 4], {"b": ["schedule=constant"]}, 10, ["x=1", "y=2"])
    with pytest.raises(ValueError, match="budget"):
        study.load_grid(study._parser().parse_args(["--out", str(tmp_path)]))
    grid_file.write_text("epochs: 3\n")
    with pytest.raises(ValueError, match="unknown keys"):
        study.load_grid(study._parser().parse_args(["--out", str(tmp_path), "--grid", str(grid_file), "--max-steps", "5"]))
    failed = {"name": "4x-b", "size": 4, "regime": "b", "overrides": [], "error": "exit 1", "log_tail": []}
    assert "| 4x-b | failed: exit 1 |" in study.table([failed])
    with pytest.raises(ValueError, match="--parallel 0"):
        study.main(["--out", str(tmp_path), "--max-steps", "5", "--parallel", "0"])


def test_tau_cell_shows_the_standard_error_when_the_run_reported_one():
    assert study.tau_cell({"accept_len": 1.23456, "accept_len_se": 0.0678}) == "1.235 ± 0.068"
    assert study.tau_cell({"accept_len": 1.23456, "accept_len_se": None}) == "1.235"  # a point from an older run


def test_plot_takes_a_point_from_before_the_standard_error(tmp_path):
    curve = [{"step": s, "train_time_s": s, "tokens_seen": 100 * s, "accept_len": 1 + s / 10} for s in (1, 2)]  # no SE key
    data = {"base_conversations": 10, "synthetic_conversations": 0}
    old = {"name": "1x-a", "size": 1, "regime": "a", "curve": curve, "accept_len": 1.2, "accept_len_se": None, "data": data}
    new = old | {"name": "2x-a", "size": 2, "curve": [c | {"accept_len_se": 0.05} for c in curve], "accept_len_se": 0.05}
    study.plot([old, new], tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 1000


def test_final_tau_by_size_gives_each_regime_its_points_by_conversations():
    def point(regime, synthetic, tau):
        data = {"base_conversations": 10, "synthetic_conversations": synthetic}
        return {"regime": regime, "data": data, "accept_len": tau, "accept_len_se": 0.01}

    results = [point("constant", 30, 1.7), point("cosine", 0, 1.1), point("constant", 0, 1.5), point("cosine", 30, 1.6)]
    results.append({"regime": "cosine", "error": "exit 1"})
    ends = study.final_tau_by_size(results)
    assert [(n, p["accept_len"]) for n, p in ends["constant"]] == [(10, 1.5), (40, 1.7)]
    assert [(n, p["accept_len"]) for n, p in ends["cosine"]] == [(10, 1.1), (40, 1.6)]


def _synthetic_file(path, n):
    records = [
        {
            "id": f"s{i}",
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i + 1}?"},
                {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}."},
            ],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.slow
def test_study_runs_a_two_point_grid_in_parallel_and_resumes(tmp_path):
    synthetic = tmp_path / "answered.jsonl"
    _synthetic_file(synthetic, 60)
    out = tmp_path / "study"
    tiny = [o for o in TINY if not o.startswith("trainer.max_steps")]
    cmd = [
        sys.executable,
        str(ROOT / "lab" / "study.py"),
        "--out",
        str(out),
        "--synthetic",
        str(synthetic),
        "--sizes",
        "1",
        "2",
        "--regimes",
        "cosine",
        "--max-steps",
        "2",
        "--parallel",
        "1",
        "--devices",  # one point on each of two devices: on the CPU, CUDA_VISIBLE_DEVICES names nothing that is used
        "0",
        "1",
        "--holdout-categories",
        *CATS,
        "--",
        *tiny,
    ]
    with socket.socket() as held:  # a port this process holds (as an earlier in-process run does): each run must pick its own
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_PORT=str(held.getsockname()[1]))
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    started = [i for i, line in enumerate(lines) if line.endswith(" ...") and ": 48 base" in line]
    ended = [i for i, line in enumerate(lines) if ": τ = " in line]
    assert len(started) == len(ended) == 2 and max(started) < min(ended), proc.stdout  # both trained at once
    study = json.loads((out / "study.json").read_text())
    assert [p["name"] for p in study["points"]] == ["1x-cosine", "2x-cosine"]  # plan order
    assert study["parallel"] == 1 and study["devices"] == ["0", "1"]
    assert sorted(p["device"] for p in study["points"]) == ["0", "1"]  # each on its own device
    points = {p["name"]: p for p in study["points"]}
    assert points["1x-cosine"]["data"] == {"base_conversations": 48, "synthetic_conversations": 0}
    assert points["2x-cosine"]["data"] == {"base_conversations": 48, "synthetic_conversations": 48}
    assert len((out / "data" / "synthetic_48.jsonl").read_text().splitlines()) == 48
    for p in points.values():
        assert "error" not in p, p.get("log_tail")
        assert p["steps"] == 2 and p["stopped_by"] == "trainer.max_steps" and p["tokens_seen"] > 0
        assert len(p["accept_rate"]) == 5 and len(p["train_acc"]) == 3 and p["curve"]
        # tau counts one target token per verify step plus the accepted drafts: 1 + the per-position rates
        assert p["accept_len"] == pytest.approx(1 + sum(p["accept_rate"]))
        assert all(a >= b for a, b in zip(p["accept_rate"], p["accept_rate"][1:]))  # reaching i + 1 needs i
        assert p["eval_prompts"]["sources"]["chatterbot"] == 2 and "food, sports" in p["eval_prompts"]["split"]
        summary = json.loads((out / "runs" / p["name"] / "summary.json").read_text())
        assert p["accept_len_se"] == summary["eval"][M.EVAL_ACCEPT_LEN_SE] == p["curve"][-1]["accept_len_se"] >= 0
    table = (out / "study.md").read_text()
    assert "| 2x-cosine | 48 base + 48 synthetic |" in table and "Serving-eval prompts: 2 prompts" in table
    assert table.startswith("Points trained 2 at a time on one machine: they shared it")
    for p in points.values():
        assert f"| {p['accept_len']:.3f} ± {p['accept_len_se']:.3f} |" in table
    assert (out / "study.png").stat().st_size > 1000
    # a rerun finds both points done and trains nothing
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.count("done earlier") == 2


def test_device_slots_deal_the_devices_in_turn_and_hold_a_point_back_until_one_is_free():
    slots = study.DeviceSlots(["0", "1"], per_device=2)
    assert slots.size == 4 and study.DeviceSlots(None, 3).size == 3
    taken = [slots.take() for _ in range(4)]
    assert [t.__enter__() for t in taken] == ["0", "1", "0", "1"]
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(slots.take().__enter__()))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # all four slots busy: the fifth point waits
    taken[1].__exit__(None, None, None)  # a point on device 1 ends
    waiter.join(5)
    assert got == ["1"]


def test_synthetic_subset_keeps_records_whose_strings_hold_unicode_line_breaks(tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028, U+0085 and \x1c raw: they end a line for str.splitlines
    records = [{"messages": [{"role": "user", "content": f"a{sep}b"}]} for sep in ("\u2028", "\x85", "\x1c", "\n")]
    source = tmp_path / "answered.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    subset = study.synthetic_subset(source, 3, tmp_path / "data")
    assert [json.loads(line) for line in subset.read_text(encoding="utf-8").split("\n") if line] == records[:3]
