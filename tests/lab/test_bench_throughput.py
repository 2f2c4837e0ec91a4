"""lab/bench_throughput.py on the CPU: the tiny run of every mode, both pointwise choices, the feature comparison."""

from __future__ import annotations

import json

import pytest

from lab.bench_throughput import compare, main, parse_args


def test_bench_throughput_tiny(tmp_path):
    report = main(["--tiny", "--out", str(tmp_path / "bench.json"), "--disk-dir", str(tmp_path)])
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["mode"] == "inprocess"
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"inprocess", "colocated", "offline"}
    assert report["skipped"] == {"sglang": "needs a CUDA GPU"}  # a default mode, skipped and said so on the CPU
    assert all(r["tokens_per_s"] > 0 and 0 <= r["stall_fraction"] <= 1 for r in rows.values())
    assert report["equivalence"]["colocated"] == {"features_equal": True, "max_checksum_diff": 0.0, "max_loss_diff": 0.0}
    assert report["equivalence"]["offline"]["features_equal"]
    feature_bytes_per_token = 4 * 4 * report["target_config"]["hidden_size"]  # (3 aux + final) x H x fp32
    # features never reach the disk: a spill would write >= 1024 bytes a token; the tiny run's 384 tokens may see a
    # few 4 KiB pages of other writes (11-64 bytes a token measured on the CPU machine)
    assert rows["colocated"]["disk_bytes_per_token"] < feature_bytes_per_token / 4
    assert rows["offline"]["feature_file_bytes_per_token"] >= feature_bytes_per_token
    assert report["flops_per_token"]["total"] > 0 and not list(tmp_path.glob("streamdraft-offline-*"))
    assert report["pointwise"] == ["eager"]  # as the trainer on the CPU


def test_bench_throughput_runs_each_mode_with_each_pointwise_choice(tmp_path):
    """--pointwise eager,compiled: before and after in one run, the same features, losses within fp32 rounding."""
    report = main(["--tiny", "--modes", "inprocess", "--pointwise", "eager,compiled", "--out", str(tmp_path / "b.json")])
    assert [(r["name"], r["pointwise"]) for r in report["rows"]] == [("inprocess+eager", "eager"), ("inprocess+compiled", "compiled")]
    same = report["equivalence"]["inprocess+compiled"]
    assert same["features_equal"] and same["max_loss_diff"] < 1e-4
    assert report["pointwise"] == ["eager", "compiled"]
    with pytest.raises(ValueError, match="--pointwise: unknown"):
        parse_args(["--tiny", "--out", "x.json", "--pointwise", "eager,fused"])


def test_bench_compares_features_without_the_sglang_mode():
    row = lambda mode, loss: {"mode": mode, "name": mode, "checksums": [[1.0, 2.0]], "losses": [loss]}  # noqa: E731
    rows = [{"mode": "sglang", "name": "sglang", "checksums": [[9.0, 9.0]], "losses": [5.0]}, row("inprocess", 1.0), row("colocated", 1.25)]
    assert compare(rows) == {"colocated": {"features_equal": True, "max_checksum_diff": 0.0, "max_loss_diff": 0.25}}
