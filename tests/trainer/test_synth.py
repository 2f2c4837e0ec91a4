"""Prompt synthesis: filters and MinHash dedup on hand-written strings; the pipeline (batches,
follow-ups, dedup against the source, resume, answering) on a tiny random Llama with the real
SmolLM2 tokenizer. A random model writes token soup, so the pipeline tests turn the language
check off and judge mechanics, not text."""

import json
from argparse import Namespace
from collections import Counter

import pytest

from tests.fixtures.tiny_generator import save_tiny_generator
from trainer import regenerate as R
from trainer import synthesize
from trainer.data import first_prompt_key, read_chatterbot, read_source
from trainer.data.dedup import NearDupIndex, shingles
from trainer.datagen import gen_backend as G
from trainer.datagen.synth.filters import FilterSettings, clean, echoes, rejection
from trainer.datagen.synth.instructions import Example, Planner
from trainer.datagen.synth.pipeline import Synthesizer, SynthSettings, rejected_path

EN = FilterSettings()
LOOSE = FilterSettings(min_chars=1, max_chars=100_000, min_words=1, min_ascii=0.0, min_stopwords=0.0)
POOL = (
    Example("a", "What is AI?", "A field of computer science.", "Is it dangerous?"),
    Example("b", "Tell me a joke"),
    Example("c", "Do you like music?", "I do.", "Which kind?"),
)


@pytest.mark.parametrize(
    "raw, kept",
    [
        ('Question: "What is the capital of France?"', "What is the capital of France?"),
        ("How do plants grow?\n\nThey use sunlight.", "How do plants grow?"),
        ("  User - tell me a story  ", "tell me a story"),
    ],
)
def test_clean_strips_labels_quotes_and_what_follows_the_first_paragraph(raw, kept):
    assert clean(raw) == kept


@pytest.mark.parametrize(
    "text, finished, stage",
    [
        ("What is the capital of France?", True, None),
        ("I cannot sleep at night, what should I do?", True, None),
        ("Can you write a short poem about the sea?", True, None),
        ("What is the capital of France?", False, "length"),  # the generator did not finish it
        ("Hi?", True, "length"),
        ("word " * 100, True, "length"),
        ("Quelle est la capitale de la France ?", True, "language"),
        ("Was ist die Hauptstadt von Frankreich?", True, "language"),
        ("Столица Франции — это что?", True, "language"),
        ("xq7 zzkv plorb wibble", True, "language"),
        ("I'm sorry, but I can't write that message for you.", True, "refusal"),
        ("As an AI, I do not have feelings about the weather.", True, "refusal"),
        ("Sure, here is a question: what is the best pizza?", True, "refusal"),
        ("Here is a new message about the user and the weather.", True, "refusal"),
        ("What does <|im_start|> mean in the chat?", True, "refusal"),
    ],
)
def test_rejection_names_the_first_failing_check(text, finished, stage):
    assert rejection(text, finished, EN) == stage


def test_echo_of_the_prompt_or_answer_is_caught():
    answer = "The capital of France is Paris, a city on the Seine."
    assert echoes("The capital of France is Paris", ["What is the capital?", answer])
    assert not echoes("And what about Germany?", ["What is the capital of France?", answer])


def test_near_duplicates_are_caught_and_distinct_prompts_kept():
    index = NearDupIndex()
    for key, text in [
        ("name", "What is your name?"),
        ("cats", "Tell me a joke about cats"),
        ("france", "Can you tell me what is the capital of France?"),
        ("bread", "How do I bake sourdough bread at home with a starter?"),
    ]:
        index.add(key, text)
    assert index.find("what is your NAME") == "name"  # case and punctuation
    assert index.find("Tell me what is the capital of France") == "france"  # a word or two dropped
    assert index.find("How do I bake sourdough bread at home with starter?") == "bread"
    for distinct in ("What is your job?", "Tell me a joke about dogs", "Explain quantum physics to me", "Who won the world cup?"):
        assert index.find(distinct) is None, distinct


def test_minhash_is_deterministic_and_keys_unique():
    a, b = NearDupIndex(), NearDupIndex()
    s = shingles("how many legs does a spider have", 2)
    assert (a.signature(s) == b.signature(s)).all() and a.signature(s).dtype.name == "uint64"
    assert not (a.signature(s) == NearDupIndex(seed=2).signature(s)).all()
    a.add("x", "some text here")
    with pytest.raises(ValueError, match="added twice"):
        a.add("x", "other text")


def test_jobs_are_a_pure_function_of_seed_and_index():
    planner = Planner({"food": "food", "music": "music"}, POOL, seed=3, shots=2, follow_up_fraction=0.5)
    assert [planner.job(i) for i in range(20)] == [planner.job(i) for i in range(20)]
    jobs = [planner.job(i) for i in range(40)]
    assert 5 < sum(j.follow_up for j in jobs) < 35
    assert all(e.next is not None for j in jobs for e in j.follow_examples)
    chat = planner.prompt_request(jobs[0])
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant", "user"]
    assert {chat[1]["content"], chat[3]["content"]} <= {e.text for e in POOL}


def test_examples_come_from_the_training_side_and_dedup_covers_held_out_prompts():
    cats = ["food", "sports"]
    args = Namespace(format="chatterbot", path=None, languages=["english"], holdout_fraction=0.1, split_seed=0, holdout_categories=cats)
    pool, known, split = synthesize.source_side(args)
    held = {first_prompt_key(c) for c in read_chatterbot(categories=cats)[0]}
    assert held and not any(first_prompt_key([{"role": "user", "content": e.text}]) in held for e in pool)
    known_texts = {t for _, t in known}
    assert all(c[0]["content"] in known_texts for c in read_chatterbot(categories=cats)[0])
    assert "food, sports" in split


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A 2-layer random Llama over SmolLM2's vocabulary that ends every generation at
    max_new_tokens with its eos token (forced), so the pipeline sees finished prompts."""
    return save_tiny_generator(tmp_path_factory.mktemp("tiny_synth_target"), forced_eos=True)


def _settings(n: int, batch: int = 4) -> SynthSettings:
    writer = R.GenerationSettings(max_new_tokens=6, temperature=0.9, top_p=0.95, batch_size=batch, seed=0)
    return SynthSettings(n, writer, R.GenerationSettings(max_new_tokens=4, batch_size=batch), LOOSE)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pipeline_counts_follow_ups_resume_and_dedup_against_the_source(tiny_target, tmp_path):
    backend = G.open_backend(G.GeneratorSettings(target=str(tiny_target), device="cpu", dtype="float32"))
    planner = Planner({"food": "food", "music": "music"}, POOL, seed=0, shots=2, follow_up_fraction=1.0)
    out = tmp_path / "p.jsonl"
    first = Synthesizer(backend, planner, _settings(5), [], {"generator": "tiny"}).run(out, progress=False)
    kept = _lines(out)
    assert first.kept == len(kept) == 5 and first.generated == 5 + sum(first.dropped.values())
    assert first.follow_ups + first.follow_ups_dropped == 5 and first.follow_ups >= 3
    assert all(len(r["turns"]) in (1, 2) and r["synthetic"]["generator"] == "tiny" and r["synthetic"]["seed_ids"] for r in kept)

    # a crash mid-write: the torn last line is cut and its job done again; asking for more resumes
    data = out.read_bytes()
    out.write_bytes(data[: data.rfind(b"\n", 0, len(data) - 1) + 1] + b'{"id": "synth-')
    second = Synthesizer(backend, planner, _settings(8), [], {"generator": "tiny"}).run(out, progress=False)
    again = _lines(out)
    ids = [r["id"] for r in again] + [r["id"] for r in _lines(rejected_path(out))]
    assert second.kept == len(again) == 8 and len(ids) == len(set(ids))
    assert second.resumed == 4 + sum(first.dropped.values()) and [r["id"] for r in again[:4]] == [r["id"] for r in kept[:4]]
    assert second.follow_ups + second.follow_ups_dropped == 8  # counted on from the file

    # the same jobs with the same seeds write the same prompts: all near-duplicates of the source now
    source = [(r["id"], r["turns"][0]) for r in kept]
    third = Synthesizer(backend, planner, _settings(5), source, {}).run(tmp_path / "q.jsonl", progress=False)
    stages = Counter(r["stage"] for r in _lines(tmp_path / "q.rejected.jsonl"))
    assert stages["near_dup_source"] >= 5 and third.dropped["near_dup_source"] == stages["near_dup_source"]
    assert all(r["duplicate_of"].startswith("source:") for r in _lines(tmp_path / "q.rejected.jsonl") if r["stage"] == "near_dup_source")


def test_cli_synthesizes_and_answers_into_an_openai_file(tiny_target, tmp_path):
    out, answered = tmp_path / "prompts.jsonl", tmp_path / "answered.jsonl"
    report = synthesize.main(
        [
            "--output",
            str(out),
            "--n-prompts",
            "4",
            "--target",
            str(tiny_target),
            "--device",
            "cpu",
            "--batch-size",
            "4",
            "--max-new-tokens",
            "6",
            "--answer-max-new-tokens",
            "4",
            "--follow-up-fraction",
            "0.5",
            "--holdout-categories",
            "food",
            "--min-stopwords",
            "0",
            "--min-ascii",
            "0",
            "--min-words",
            "1",
            "--min-chars",
            "1",
            "--max-chars",
            "100000",
            "--answer",
            str(answered),
        ]
    )
    assert report.kept == 4 and report.new_tokens > 0 and "tokens/s" in report.line()
    prompts = {r["id"]: r for r in _lines(out)}
    assert all(r["synthetic"]["category"] != "food" for r in prompts.values())
    convs, stats = read_source("openai", answered)
    assert stats.conversations == 4
    by_turns = {tuple(r["turns"]): r for r in prompts.values()}
    for record in _lines(answered):
        users = tuple(m["content"] for m in record["messages"] if m["role"] == "user")
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"] * len(users)
        assert record["synthetic"] == by_turns[users]["synthetic"] and len(record["generation"]["finish"]) == len(users)
        assert record["synthetic"]["engine"] == record["generation"]["engine"] == "hf"


def test_regenerate_answers_a_prompt_file_and_keeps_its_metadata(tiny_target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "p1", "turns": ["Hi there", "And then?"], "synthetic": {"category": "x"}})
        + "\n"
        + json.dumps({"prompt": "Name a colour."})
        + "\n"
    )
    out = tmp_path / "answered.jsonl"
    report = R.main(
        ["--prompts", str(prompts), "--output", str(out), "--target", str(tiny_target), "--device", "cpu", "--max-new-tokens", "3"]
    )
    assert (report.written, report.turns) == (2, 3)
    records = sorted(_lines(out), key=lambda r: len(r["messages"]))
    assert [m["role"] for m in records[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert records[1]["synthetic"] == {"category": "x"} and "synthetic" not in records[0]
    assert [m["content"] for m in records[1]["messages"] if m["role"] == "user"] == ["Hi there", "And then?"]


def test_the_pipeline_reads_back_records_whose_text_holds_unicode_line_breaks(tmp_path):
    from trainer.datagen.synth.pipeline import _records

    path = tmp_path / "answered.jsonl"
    rows = [{"prompt": f"a{sep}b", "stage": "kept"} for sep in "\u2028\x85\x1c"]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert _records(path) == rows
