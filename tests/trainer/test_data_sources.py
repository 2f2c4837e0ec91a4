"""Every source format from small files the tests write, each class of bad input, and
prepare_data over a mix of file sources (with the real SmolLM2 tokenizer)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from models.embedded import embedded_target_dir
from models.target import load_tokenizer
from trainer import data
from trainer.config import DataConfig, DataSourceConfig, register_schema, to_config
from trainer.data import DatasetStats
from trainer.data_setup import prepare_data

# The expected conversations, and the same content in each schema.
EXPECTED = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ],
]


def _sharegpt(conv, system_key=False):
    record = {"id": "x", "conversations": []}
    for m in conv:
        if m["role"] == "system" and system_key:
            record["system"] = m["content"]
            continue
        speaker = {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]]
        record["conversations"].append({"from": speaker, "value": m["content"]})
    return record


def _messages(conv):
    return {"prompt": conv[0]["content"], "prompt_id": "abc", "messages": [dict(m) for m in conv]}


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _read(fmt, path, **kw):
    return data.read_source(fmt, path, **kw)


# --------------------------------------------------------------------------- formats


def test_sharegpt_json_array_and_jsonl(tmp_path):
    records = [_sharegpt(EXPECTED[0]), _sharegpt(EXPECTED[1], system_key=True)]
    array = tmp_path / "sg.json"
    array.write_text(json.dumps(records, indent=2))
    lines = _jsonl(tmp_path / "sg.jsonl", records)
    lines_named_json = _jsonl(tmp_path / "lines.json", records)
    for path in (array, lines, lines_named_json):
        convs, stats = _read("sharegpt", path)
        assert convs == EXPECTED and stats.conversations == 2, path


def test_sharegpt_speaker_names_and_leading_assistant(tmp_path):
    record = {
        "conversations": [
            {"from": "gpt", "value": "Welcome! Ask me anything."},  # the assistant speaks first: no prompt for it
            {"from": "user", "value": "Hi"},
            {"from": "chatgpt", "value": "Hello!"},
        ]
    }
    convs, stats = _read("sharegpt", _jsonl(tmp_path / "a.jsonl", [record]))
    assert convs == [EXPECTED[0]] and stats.leading_turns_dropped == 1


def test_ultrachat_jsonl_and_parquet(tmp_path):
    records = [_messages(c) for c in EXPECTED]
    convs, _ = _read("ultrachat", _jsonl(tmp_path / "uc.jsonl", records))
    assert convs == EXPECTED
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "uc.parquet")
    convs, stats = _read("ultrachat", tmp_path / "uc.parquet")
    assert convs == EXPECTED and stats.conversations == 2


def test_directory_of_files_in_name_order(tmp_path):
    pq.write_table(pa.Table.from_pylist([_messages(EXPECTED[1])]), tmp_path / "train-00001.parquet")
    pq.write_table(pa.Table.from_pylist([_messages(EXPECTED[0])]), tmp_path / "train-00000.parquet")
    (tmp_path / "README.md").write_text("not data")
    assert _read("ultrachat", tmp_path)[0] == EXPECTED


def test_openai_messages(tmp_path):
    record = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
            {"role": "assistant", "content": "4", "weight": 0},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "3 and 3"},
        ],
        "metadata": {"anything": 1},
    }
    convs, _ = _read("openai", _jsonl(tmp_path / "o.jsonl", [record]))
    assert convs == [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "weight": 0},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "3 and 3"},
        ]
    ]


def test_hf_disk_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")  # a dependency (setup.cfg); skip only on a broken install
    datasets.Dataset.from_list([_messages(c) for c in EXPECTED]).save_to_disk(str(tmp_path / "msgs"))
    assert _read("hf_disk", tmp_path / "msgs")[0] == EXPECTED
    sharegpt = datasets.Dataset.from_list([_sharegpt(c) for c in EXPECTED])
    datasets.DatasetDict({"train": sharegpt, "test": sharegpt.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert _read("hf_disk", tmp_path / "dd")[0] == EXPECTED  # split train by default
    assert _read("hf_disk", tmp_path / "dd", split="test")[0] == EXPECTED[:1]
    with pytest.raises(ValueError, match="no split 'dev'.*train, test"):
        _read("hf_disk", tmp_path / "dd", split="dev")
    with pytest.raises(ValueError, match="use format hf_disk"):
        _read("sharegpt", tmp_path / "dd")
    datasets.Dataset.from_list([{"text": "plain"}]).save_to_disk(str(tmp_path / "text"))
    with pytest.raises(ValueError, match="'messages'.*'conversations'.*it has text"):
        _read("hf_disk", tmp_path / "text")


def test_duplicates_and_no_assistant_are_skipped_and_counted(tmp_path):
    records = [
        _messages(EXPECTED[0]),
        _messages(EXPECTED[0]),
        {"messages": [{"role": "user", "content": "alone"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "unprompted"}]},
    ]
    convs, stats = _read("openai", _jsonl(tmp_path / "d.jsonl", records))
    assert convs == [EXPECTED[0]] and (stats.duplicates, stats.no_assistant, stats.conversations) == (1, 2, 1)


# --------------------------------------------------------------------------- bad input


BAD_LINES = {
    "not utf-8": ('{"messages": "\xe0"}'.encode("latin-1"), r"not UTF-8 \(byte 0xe0 at column 15: invalid continuation byte\)"),
    "not json": ("{not json", "not valid JSON"),
    "not an object": ("[1, 2]", "must be an object"),
    "missing key": ('{"msgs": []}', "needs key 'messages'"),
    "content not text": ('{"messages": [{"role": "user", "content": 3}]}', "content must be a str"),
    "system not first": ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}', "only the first"),
    "bad weight": ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 2}]}', "weight"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_malformed_line_names_file_and_line(tmp_path, case):
    line, message = BAD_LINES[case]
    path = tmp_path / "bad.jsonl"
    line = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(
        json.dumps(_messages(EXPECTED[0])).encode() + b"\n\n" + line + b"\n" + json.dumps(_messages(EXPECTED[1])).encode() + b"\n"
    )
    with pytest.raises(ValueError, match=f"bad.jsonl:3: .*{message}"):
        _read("openai", path)
    convs, stats = _read("openai", path, on_error="skip")
    assert convs == EXPECTED and stats.malformed == 1


def test_a_line_cut_off_in_a_string_says_where_the_string_starts(tmp_path):
    (tmp_path / "cut.jsonl").write_text('{"messages": "nope')  # the last line of a file cut off mid-write
    with pytest.raises(ValueError, match=r"cut.jsonl:1: not valid JSON \(Unterminated string starting at column 14\)"):
        _read("openai", tmp_path / "cut.jsonl")


def test_malformed_sharegpt_turn(tmp_path):
    path = _jsonl(tmp_path / "s.jsonl", [_sharegpt(EXPECTED[0]), {"conversations": [{"from": "human"}]}])
    with pytest.raises(ValueError, match="s.jsonl:2: turn 0 needs 'from' and 'value'"):
        _read("sharegpt", path)
    assert _read("sharegpt", path, on_error="skip")[1].malformed == 1


def test_json_array_errors(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"conversations": []},\n  {"conversations": [}\n]')
    with pytest.raises(ValueError, match=r"a.json:3:\d+: not valid JSON"):
        _read("sharegpt", path, on_error="skip")  # an array cannot be read past a syntax error
    path.write_text('[\n  {"conversations": []},\n  "text"\n]')
    with pytest.raises(ValueError, match="a.json:3: a ShareGPT record must be an object"):
        _read("sharegpt", path)
    path.write_bytes(b'[\n  {"conversations": []},\n  "\xff"\n]')
    with pytest.raises(ValueError, match=r"a.json:3: not UTF-8 \(byte 0xff at column 4: invalid start byte\); a JSON array cannot"):
        _read("sharegpt", path, on_error="skip")


@pytest.mark.parametrize(
    "fmt, record, role",
    [
        ("sharegpt", {"conversations": [{"from": "narrator", "value": "x"}]}, "narrator"),
        ("openai", {"messages": [{"role": "tool", "content": "x"}]}, "tool"),
    ],
)
def test_unknown_role_is_always_an_error(tmp_path, fmt, record, role):
    path = _jsonl(tmp_path / "r.jsonl", [record])
    for on_error in ("raise", "skip"):
        with pytest.raises(data.UnknownRole, match=f"r.jsonl:1: unknown role '{role}'"):
            _read(fmt, path, on_error=on_error)


def test_paths_and_formats_refused(tmp_path):
    with pytest.raises(ValueError, match="not a local path"):
        _read("sharegpt", "https://example.com/sg.json")
    with pytest.raises(ValueError, match="does not exist"):
        _read("sharegpt", tmp_path / "missing.json")
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        _read("sharegpt", tmp_path / "data.csv")
    with pytest.raises(ValueError, match="unknown format 'csv'"):
        _read("csv", tmp_path / "data.csv")
    with pytest.raises(ValueError, match="needs a path"):
        _read("openai", None)
    with pytest.raises(ValueError, match="on_error"):
        _read("openai", _jsonl(tmp_path / "x.jsonl", []), on_error="ignore")


# --------------------------------------------------------------------------- prepare_data


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_target_dir())


def _corpus(tmp_path, n):
    """n distinct two-turn conversations as ShareGPT and UltraChat files."""
    convs = [
        [{"role": "user", "content": f"Question {i}: what is {i} squared?"}, {"role": "assistant", "content": f"{i} squared is {i * i}."}]
        for i in range(n)
    ]
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([_sharegpt(c) for c in convs]))
    pq.write_table(pa.Table.from_pylist([_messages(c) for c in convs[: n // 2]]), tmp_path / "uc.parquet")
    return sg, tmp_path / "uc.parquet"


def test_prepare_data_mix_of_file_sources(tmp_path, tokenizer):
    sg, uc = _corpus(tmp_path, 200)
    cfg = DataConfig(
        sources={
            "sharegpt": DataSourceConfig(format="sharegpt", path=str(sg)),
            "ultrachat": DataSourceConfig(format="ultrachat", path=str(uc), holdout_fraction=0.3),
        },
        mix={"sharegpt": 0.3, "ultrachat": 0.7},
        max_len=64,
        max_tokens=256,
    )
    prepared = prepare_data(cfg, tokenizer, seed=0)
    assert prepared.mix.names == ("sharegpt", "ultrachat")
    n_sg, n_uc = len(prepared.train["sharegpt"]), len(prepared.train["ultrachat"])
    assert 160 < n_sg < 200 and 50 < n_uc < 90  # 10% and 30% held out
    assert n_sg + len(prepared.eval["sharegpt"]) == 200 and n_uc + len(prepared.eval["ultrachat"]) == 100
    assert prepared.mix.quotas == (round(0.3 * (n_sg + n_uc)), (n_sg + n_uc) - round(0.3 * (n_sg + n_uc)))
    total = prepared.total_stats
    assert isinstance(total, DatasetStats) and total.conversations == 300 and total.samples == n_sg + n_uc
    # a prompt never lands on both sides of a source's split
    for name in ("sharegpt", "ultrachat"):
        train_ids = {tuple(s.input_ids) for s in prepared.train[name]}
        assert not train_ids & {tuple(s.input_ids) for s in prepared.eval[name]}
    report = prepared.report()
    assert report["samples"] == n_sg + n_uc and report["sources"]["ultrachat"]["samples"] == n_uc
    assert report["mix"] == pytest.approx({"sharegpt": 0.3, "ultrachat": 0.7}, abs=1 / (n_sg + n_uc))
    assert len(prepared.eval_samples()) == len(prepared.eval["sharegpt"]) + len(prepared.eval["ultrachat"])


def test_prepare_data_reports_length_policy(tmp_path, tokenizer):
    sg, _ = _corpus(tmp_path, 40)
    source = {"sg": DataSourceConfig(format="sharegpt", path=str(sg))}
    lengths = [len(s.input_ids) for s in prepare_data(DataConfig(sources=source, max_len=512), tokenizer, 0).train["sg"]]
    cut = sorted(lengths)[len(lengths) // 2]
    dropped = prepare_data(DataConfig(sources=source, max_len=cut, overlong="drop"), tokenizer, 0)
    truncated = prepare_data(DataConfig(sources=source, max_len=cut), tokenizer, 0)
    longer = sum(n > cut for n in lengths)
    assert dropped.stats["sg"].overlong_dropped == longer > 0 and truncated.stats["sg"].truncated == longer
    assert len(dropped.train["sg"]) == len(lengths) - longer and len(truncated.train["sg"]) == len(lengths)


def test_prepare_data_errors(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="data.sources: no source"):
        prepare_data(DataConfig(), tokenizer, 0)
    with pytest.raises(ValueError, match="config data.mix: must be a non-empty"):
        DataConfig(sources={"c": DataSourceConfig()}, mix={})
    with pytest.raises(ValueError, match="data.mix is empty"):
        data.Mix({"c": 10}, {}, seed=0)
    with pytest.raises(ValueError, match=r"data.mix.c: weight must be a positive"):
        DataConfig(sources={"c": DataSourceConfig()}, mix={"c": 0})
    with pytest.raises(ValueError, match="data.sources.s.path: format sharegpt needs a local path"):
        DataConfig(sources={"s": DataSourceConfig(format="sharegpt")})
    bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": "nope"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*\n\(data.on_error=skip skips malformed records and counts them\)$"):
        prepare_data(DataConfig(sources={"o": DataSourceConfig(format="openai", path=str(bad))}), tokenizer, 0)
    with pytest.raises(ValueError) as err:
        prepare_data(DataConfig(sources={"o": DataSourceConfig(format="openai", path=str(bad))}, on_error="skip"), tokenizer, 0)
    assert str(err.value) == (
        f"data.sources.o ({bad}): no training sample left of 0 conversations read "
        "(0 on the training side after the held-out split; 1 malformed records skipped)"
    )
    (tmp_path / "none.json").write_text("[]")
    with pytest.raises(ValueError, match=r"^data.sources.o \(.*none.json\): holds no conversation: nothing to train on$"):
        prepare_data(DataConfig(sources={"o": DataSourceConfig(format="openai", path=str(tmp_path / "none.json"))}), tokenizer, 0)


# --------------------------------------------------------------------------- conf/data groups

CONF = Path(__file__).resolve().parents[2] / "conf"


def _compose(*overrides):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides))).data


@pytest.mark.parametrize("group", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_every_data_group_composes(group):
    names = {"chatterbot": [], "mix": ["sharegpt", "ultrachat"], "corpora": ["sharegpt_wheel", "evals", "codeio"]}.get(group, [group])
    cfg = _compose(f"data={group}", *[f"data.sources.{name}.path=/data/{name}" for name in names])
    assert set(cfg.sources) == set(names or ["chatterbot"]) and all(src.format in data.DATA_FORMATS for src in cfg.sources.values())


def test_data_groups_combine_and_mix_overrides_replace():
    cfg = _compose("data=mix", "data.sources.sharegpt.path=/a", "data.sources.ultrachat.path=/b")
    assert cfg.mix == {"sharegpt": 0.3, "ultrachat": 0.7} and set(cfg.sources) == {"sharegpt", "ultrachat"}
    cfg = _compose("data=[chatterbot,openai]", "data.sources.openai.path=/r.jsonl", "data.mix={chatterbot: 1, openai: 3}")
    assert cfg.mix == {"chatterbot": 1, "openai": 3} and cfg.sources["openai"].format == "openai"
    cfg = _compose("data=[openai,sampled]", "data.sources.openai.path=/greedy.jsonl", "data.sources.sampled.path=/t06.jsonl")
    assert {n: (c.format, c.path) for n, c in cfg.sources.items()} == {
        "openai": ("openai", "/greedy.jsonl"),
        "sampled": ("openai", "/t06.jsonl"),
    }
    with pytest.raises(ValueError, match="data.sources.sharegpt.path: format sharegpt needs a local path"):
        _compose("data=sharegpt")
    with pytest.raises(ValueError, match="data.mix: must be a non-empty"):
        _compose("data.mix={}")


def test_prepare_data_cuts_answers_on_both_sides(tmp_path, tokenizer):
    sg, _ = _corpus(tmp_path, 60)
    source = {"sg": DataSourceConfig(format="sharegpt", path=str(sg))}
    whole = prepare_data(DataConfig(sources=source, holdout_fraction=0.2), tokenizer, 0)
    cut = prepare_data(DataConfig(sources=source, holdout_fraction=0.2, answer_tokens=3), tokenizer, 0)
    assert cut.stats["sg"].answers_cut == len(cut.train["sg"]) == len(whole.train["sg"])  # every answer is longer than 3
    for side in ("train", "eval"):
        for short, full in zip(getattr(cut, side)["sg"], getattr(whole, side)["sg"]):
            assert sum(short.loss_mask) == 3 + 1  # three answer tokens and the end of turn
            assert short.input_ids[: short.loss_mask.index(True) + 3] == full.input_ids[: full.loss_mask.index(True) + 3]
    assert cut.report()["answers_cut"] == len(cut.train["sg"])
    with pytest.raises(ValueError, match="data.answer_tokens"):
        DataConfig(sources=source, answer_tokens=0)


def test_greedy_and_sampled_answers_of_a_prompt_fall_on_one_side(tmp_path, tokenizer):
    """Two answer files to the same prompts (conf/data/sampled.yaml): the split keys on the first user
    turn, so a prompt held out of one source is held out of the other."""
    files = {}
    for name, answer in (("openai", "The answer is {i}."), ("sampled", "Well, it is {i}, I think.")):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text(
            "".join(
                json.dumps(
                    {"messages": [{"role": "user", "content": f"Prompt number {i}?"}, {"role": "assistant", "content": answer.format(i=i)}]}
                )
                + "\n"
                for i in range(80)
            )
        )
    sources = {name: DataSourceConfig(format="openai", path=str(path)) for name, path in files.items()}
    prepared = prepare_data(DataConfig(sources=sources, holdout_fraction=0.2, max_len=64, max_tokens=256), tokenizer, 0)
    held = {name: sorted(c[0]["content"] for c in prepared.eval_conversations[name]) for name in files}
    assert held["openai"] == held["sampled"] and 0 < len(held["openai"]) < 80
    assert len(prepared.train["openai"]) == len(prepared.train["sampled"]) == 80 - len(held["openai"])
