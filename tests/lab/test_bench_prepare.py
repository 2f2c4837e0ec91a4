"""lab/bench_prepare.py: the trainer's data preparation timed on a config, its samples digested."""

from __future__ import annotations

import json

import pytest

from lab.bench_prepare import digest, main
from models.embedded import embedded_target_dir
from models.target import load_tokenizer
from trainer import data


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_target_dir())


def test_bench_prepare_times_the_runs_data_and_digests_its_samples(tmp_path, tokenizer):
    row = main(["--out", str(tmp_path / "p.json"), "data.max_conversations=30", "data.max_eval_conversations=5"])
    assert json.loads((tmp_path / "p.json").read_text()) == row
    assert row["samples"] == 35 and row["tokens"] > 0 and row["seconds"] > 0
    again = [data.encode_conversation(tokenizer, c, 4096) for c in data.chatterbot_conversations(["english"])[:3]]
    assert digest(again) != digest(again[:2]) and digest(again) == digest(list(again))
