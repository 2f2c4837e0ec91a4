"""lab/standin_answers.py: the recipe's two answer files, shaped as trainer.regenerate writes them."""

from __future__ import annotations

import json

import pytest

from lab.standin_answers import write_standins
from trainer.data.sources import read_source


def prompt_file(path, n, words=40):
    with open(path, "w") as f:
        for i in range(n):
            source = "sharegpt" if i % 2 else "evals"
            f.write(json.dumps({"id": f"{source}:{i}", "source": source, "prompt": " ".join(f"word{i}x{k}" for k in range(words))}) + "\n")
    return path


def test_standins_answer_every_prompt_and_the_sampled_file_holds_the_sharegpt_ones(tmp_path):
    counts = write_standins(prompt_file(tmp_path / "p.jsonl", 20), tmp_path / "out")
    assert counts == {"answered": 20, "sampled": 10}
    answered = [json.loads(line) for line in (tmp_path / "out" / "answered.jsonl").open()]
    sampled = [json.loads(line) for line in (tmp_path / "out" / "sampled.jsonl").open()]
    assert {r["source"] for r in sampled} == {"sharegpt"} and len({r["id"] for r in answered}) == 20
    for r in answered:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] and 200 <= len(r["messages"][1]["content"]) <= 650
    convs = read_source("openai", tmp_path / "out" / "answered.jsonl")[0]
    assert len(convs) == 20  # the trainer reads them as it reads generated answers
    again = write_standins(tmp_path / "p.jsonl", tmp_path / "again")
    assert again == counts and (tmp_path / "again" / "answered.jsonl").read_text() == (tmp_path / "out" / "answered.jsonl").read_text()


def test_too_little_prompt_text_is_refused_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"p.jsonl: .* characters of prompts"):
        write_standins(prompt_file(tmp_path / "p.jsonl", 2, words=3), tmp_path / "out")
