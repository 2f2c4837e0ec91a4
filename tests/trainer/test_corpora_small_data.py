"""A small valid data set: the split sizes are checked before any service (wandb, DeepSpeed,
the engine process) starts, and the error names the setting to change."""

from __future__ import annotations

import json

import pytest

from models.embedded import embedded_target_dir
from models.target import load_tokenizer
from tests.fixtures.tiny import tiny_config
from trainer.config import DataConfig, DataSourceConfig
from trainer.data import split_holdout
from trainer.data_setup import prepare_data
from trainer.loop import run


def _conversations(n: int, held: int, seed: int = 0) -> list[list[dict]]:
    """``n`` tiny conversations, exactly ``held`` of which fall in a 10% held-out split."""
    out, taken, i = [], 0, 0
    while len(out) < n:
        conv = [{"role": "user", "content": f"What is {i} times {i + 1}?"}, {"role": "assistant", "content": f"It is {i * (i + 1)}."}]
        is_held = bool(split_holdout([conv], 0.1, seed)[1])
        if (is_held and taken < held) or (not is_held and len(out) - taken < n - held):
            out.append(conv)
            taken += is_held
        i += 1
    return out


def _sharegpt_file(path, convs) -> str:
    records = [
        {"id": f"c{i}", "conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in c]}
        for i, c in enumerate(convs)
    ]
    path.write_text(json.dumps(records))
    return str(path)


def test_forty_conversations_with_an_empty_heldout_split_fail_before_wandb(tmp_path):
    data = _sharegpt_file(tmp_path / "sg.json", _conversations(40, held=0))
    cfg = tiny_config(
        "data=sharegpt", f"data.sources.sharegpt.path={data}", "data.max_conversations=null", "data.max_eval_conversations=null"
    )
    run_dir = tmp_path / "run"
    with pytest.raises(
        ValueError,
        match=(
            r"data.sources.sharegpt: the held-out split is empty \(sharegpt: 40 train / 0 held out; holdout_fraction 0.1\)"
            r".*Raise data.sources.sharegpt.holdout_fraction \(or data.holdout_fraction\)"
        ),
    ):
        run(cfg, run_dir)
    assert not list(run_dir.rglob("wandb")) and not list(run_dir.rglob("metrics.jsonl"))


def test_a_small_nonempty_heldout_split_prepares(tmp_path):
    convs = _conversations(40, held=2)
    data = _sharegpt_file(tmp_path / "sg.json", convs)
    prepared = prepare_data(
        DataConfig(sources={"sg": DataSourceConfig(format="sharegpt", path=data)}, max_len=64), load_tokenizer(embedded_target_dir()), 0
    )
    assert len(prepared.eval["sg"]) == 2 and len(prepared.train["sg"]) + len(prepared.eval["sg"]) == 40
    with pytest.raises(ValueError, match=r"or data.max_eval_conversations \(it is 0\)"):
        prepare_data(
            DataConfig(sources={"sg": DataSourceConfig(format="sharegpt", path=data)}, max_eval_conversations=0),
            load_tokenizer(embedded_target_dir()),
            0,
        )
