"""Regeneration mechanics on a tiny random Llama with the real SmolLM2 tokenizer (seconds on a CPU).

The run on the real embedded target is measured in docs/DATA.md, not here: it takes minutes.
"""

import json

import pytest
import torch

from tests.tiny_generator import save_tiny_generator
from trainer import regenerate as R
from trainer.data import read_source

CONVS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}, {"role": "user", "content": "bye"}],
    [{"role": "user", "content": "Tell me a much longer story about a dragon, please."}, {"role": "assistant", "content": "Once..."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "And a number?"}, {"role": "assistant", "content": "Seven."}],
]  # fmt: skip
SETTINGS = R.GenerationSettings(max_new_tokens=6, batch_size=2)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A 2-layer random Llama over SmolLM2's vocabulary, saved as a transformers dir."""
    return save_tiny_generator(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="module")
def generator(tiny_target):
    return R.load_generator(tiny_target, torch.device("cpu"), torch.float32)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batched_left_padded_generation_equals_one_at_a_time(generator):
    model, tokenizer = generator
    assert tokenizer.padding_side == "left"
    prompts = [c[: next(i for i, m in enumerate(c) if m["role"] == "assistant")] for c in CONVS]
    stop = R._stop_ids(model, tokenizer)
    together = R.generate_replies(model, tokenizer, prompts, SETTINGS, stop)
    alone = [R.generate_replies(model, tokenizer, [p], SETTINGS, stop)[0] for p in prompts]
    assert together == alone
    assert all(n == 6 and not stopped for _, stopped, n in together)  # a random model does not stop by itself


def test_regenerated_records_are_read_by_the_openai_source(generator, tmp_path):
    model, tokenizer = generator
    out = tmp_path / "regen.jsonl"
    report = R.regenerate(CONVS, model, tokenizer, out, SETTINGS, {"target": "tiny"}, progress=False)
    assert (report.records, report.written, report.skipped_done, report.turns) == (5, 5, 0, 6)
    assert report.new_tokens == 36 and report.stopped_by_length == 6
    records = {r["id"]: r for r in _lines(out)}
    convs, stats = read_source("openai", out)
    assert stats.conversations == 5 and stats.malformed == 0
    for conv in CONVS:
        record = records[R.record_id(conv)]
        assert record["generation"]["finish"] == ["length"] * sum(m["role"] == "assistant" for m in conv)
        last = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
        kept = conv[: last + 1]  # the trailing user turn is dropped
        assert [m["role"] for m in record["messages"]] == [m["role"] for m in kept]
        assert [m["content"] for m in record["messages"] if m["role"] != "assistant"] == [m["content"] for m in kept if m["role"] != "assistant"]
        assert all(m["content"] != o["content"] for m, o in zip(record["messages"], kept) if m["role"] == "assistant")


def test_a_model_that_stops_gives_stop_and_clean_text(tiny_target, tmp_path):
    model, tokenizer = R.load_generator(tiny_target, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # every logit 0: greedy picks token 0, which the generation config names a stop token
        model.lm_head.weight.zero_()
    model.generation_config.eos_token_id = [0, 2]
    assert R._stop_ids(model, tokenizer) == [0, 2]
    out = tmp_path / "stop.jsonl"
    report = R.regenerate(CONVS[:2], model, tokenizer, out, SETTINGS, {}, progress=False)
    assert report.stopped_by_length == 0 and report.new_tokens == 0
    assert all(r["generation"]["finish"] == ["stop"] * len(r["generation"]["finish"]) for r in _lines(out))
    assert all(m["content"] == "" for r in _lines(out) for m in r["messages"] if m["role"] == "assistant")


def test_restart_skips_done_records_and_cuts_a_torn_line(generator, tmp_path):
    model, tokenizer = generator
    out = tmp_path / "regen.jsonl"
    R.regenerate(CONVS, model, tokenizer, out, SETTINGS, {}, progress=False)
    complete = out.read_text()
    first_three = "".join(complete.splitlines(keepends=True)[:3])
    out.write_text(first_three + complete.splitlines(keepends=True)[3][:25])  # a crash mid-write
    report = R.regenerate(CONVS, model, tokenizer, out, SETTINGS, {}, progress=False)
    assert (report.skipped_done, report.written) == (3, 2)
    records = _lines(out)
    assert sorted(r["id"] for r in records) == sorted(R.record_id(c) for c in CONVS)
    assert sorted(out.read_text().splitlines()) == sorted(complete.splitlines())  # greedy: the same records
    again = R.regenerate(CONVS, model, tokenizer, out, SETTINGS, {}, progress=False)
    assert (again.skipped_done, again.written) == (5, 0)


def test_a_foreign_line_in_the_output_is_an_error(tmp_path):
    out = tmp_path / "mine.jsonl"
    out.write_text('{"id": "a", "messages": []}\n{"text": "not ours"}\n{"id": "b", "messages": []}\n')
    with pytest.raises(ValueError, match="mine.jsonl:2: not a regenerated record"):
        R.done_ids(out)


def test_cli_on_a_file_source(tiny_target, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS))
    out = tmp_path / "out.jsonl"
    args = ["--format", "openai", "--path", str(source), "--target", str(tiny_target), "--output", str(out),
            "--max-new-tokens", "3", "--batch-size", "4", "--limit", "3", "--device", "cpu"]  # fmt: skip
    report = R.main(args)
    assert report.written == 3 and len(_lines(out)) == 3
    with pytest.raises(ValueError, match="temperature"):
        R.GenerationSettings(temperature=-1)


def test_greedy_generates_a_repeated_prompt_once(generator, tmp_path):
    model, tokenizer = generator
    again = [CONVS[0][0], {"role": "assistant", "content": "Another original answer."}]
    greedy = R.regenerate([CONVS[0], again, CONVS[3]], model, tokenizer, tmp_path / "g.jsonl", SETTINGS, {}, progress=False)
    assert (greedy.written, greedy.same_prompts) == (2, 1)
    sampled = R.GenerationSettings(max_new_tokens=6, batch_size=2, temperature=0.8)
    report = R.regenerate([CONVS[0], again], model, tokenizer, tmp_path / "s.jsonl", sampled, {}, progress=False)
    assert (report.written, report.same_prompts) == (2, 0)
