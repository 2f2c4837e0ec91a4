"""Regeneration mechanics on a tiny random Llama with the real SmolLM2 tokenizer (seconds on a CPU).

The run on the real embedded target is measured in docs/DATA.md, not here: it takes minutes.
"""

import json

import pytest
import torch

from models import generation
from models.backends.hf import generate as HF
from models.backends.sglang import generate as SG
from tests.fixtures.tiny_generator import save_tiny_generator
from trainer import regenerate as R
from trainer.data import read_source
from trainer.datagen import gen_backend as G
from trainer.datagen.record_ids import done_ids, record_id

CONVS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "bye"},
    ],
    [{"role": "user", "content": "Tell me a much longer story about a dragon, please."}, {"role": "assistant", "content": "Once..."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "And a number?"}, {"role": "assistant", "content": "Seven."}],
]
SETTINGS = R.GenerationSettings(max_new_tokens=6, batch_size=2)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A 2-layer random Llama over SmolLM2's vocabulary, saved as a transformers dir."""
    return save_tiny_generator(tmp_path_factory.mktemp("tiny_target"))


def open_tiny(target, **kw) -> HF.HFGenerator:
    return G.open_backend(G.GeneratorSettings(target=str(target), device="cpu", dtype="float32", **kw))


@pytest.fixture(scope="module")
def generator(tiny_target):
    return open_tiny(tiny_target)


class CallLog:
    """The real backend, recording how many prompts each generate call got."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []
        self.name, self.path, self.tokenizer, self.stop_ids = backend.name, backend.path, backend.tokenizer, backend.stop_ids
        self.context_len = backend.context_len

    def generate(self, prompts, settings, seed):
        self.calls.append(len(prompts))
        return self.backend.generate(prompts, settings, seed)

    def close(self):
        self.backend.close()


def first_prompts():
    return [c[: next(i for i, m in enumerate(c) if m["role"] == "assistant")] for c in CONVS]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batched_left_padded_generation_equals_one_at_a_time(generator):
    assert generator.tokenizer.padding_side == "left"
    prompts = [G.chat_ids(generator.tokenizer, p) for p in first_prompts()]
    together = generator.generate(prompts, SETTINGS, 0)  # batches of 2 by length, answers in prompt order
    alone = [generator.generate([p], SETTINGS, 0)[0] for p in prompts]
    assert together == alone
    assert all(r.new_tokens == 6 and r.finish == "length" for r in together)  # a random model does not stop by itself
    assert all(r.text == generator.tokenizer.decode(r.tokens) for r in together)


def test_static_cache_gives_the_dynamic_cache_greedy_tokens(tiny_target, generator):
    static = open_tiny(tiny_target, static_cache=True)
    prompts = [G.chat_ids(generator.tokenizer, p) for p in first_prompts()]
    want = [r.tokens for r in generator.generate(prompts, SETTINGS, 0)]
    assert [r.tokens for r in static.generate(prompts, SETTINGS, 0)] == want
    # one batch of 5 rows padded to 8 (a power of two, at most the batch size) with copies of its first; batches of 4 and 1
    for batch in (8, 4):
        assert [r.tokens for r in static.generate(prompts, generation.GenerationSettings(max_new_tokens=6, batch_size=batch), 0)] == want
    with pytest.raises(ValueError, match="--compile compiles the static-cache decode step"):
        G.GeneratorSettings(compile=True)


def test_each_wave_is_one_backend_call(generator, tmp_path):
    log = CallLog(generator)
    report = R.regenerate(CONVS, log, tmp_path / "w.jsonl", R.GenerationSettings(max_new_tokens=2, batch_size=5), {}, progress=False)
    assert log.calls == [5, 1] and report.turns == 6  # wave 0: every first assistant turn; wave 1: the second one
    log.calls.clear()
    R.regenerate(CONVS, log, tmp_path / "w2.jsonl", R.GenerationSettings(max_new_tokens=2, batch_size=2), {}, progress=False)
    assert sorted(log.calls) == [1, 1, 2, 2]  # chunks of 2 (the two-turn conversation is longest: last, alone, in two waves)


def test_regenerated_records_are_read_by_the_openai_source(generator, tmp_path):
    out = tmp_path / "regen.jsonl"
    report = R.regenerate(CONVS, generator, out, SETTINGS, R.generation_meta(generator, SETTINGS), progress=False)
    assert (report.records, report.written, report.skipped_done, report.turns) == (5, 5, 0, 6)
    assert report.new_tokens == 36 and report.stopped_by_length == 6
    records = {r["id"]: r for r in _lines(out)}
    convs, stats = read_source("openai", out)
    assert stats.conversations == 5 and stats.malformed == 0
    for conv in CONVS:
        record = records[record_id(conv)]
        assert record["generation"]["engine"] == "hf" and record["generation"]["max_new_tokens"] == 6
        assert record["generation"]["finish"] == ["length"] * sum(m["role"] == "assistant" for m in conv)
        last = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
        kept = conv[: last + 1]  # the trailing user turn is dropped
        assert [m["role"] for m in record["messages"]] == [m["role"] for m in kept]
        assert [m["content"] for m in record["messages"] if m["role"] != "assistant"] == [
            m["content"] for m in kept if m["role"] != "assistant"
        ]
        assert all(m["content"] != o["content"] for m, o in zip(record["messages"], kept) if m["role"] == "assistant")


def test_a_model_that_stops_gives_stop_and_clean_text(tiny_target, tmp_path):
    model, tokenizer = HF.load_generator(tiny_target, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # every logit 0: greedy picks token 0, which the generation config names a stop token
        model.lm_head.weight.zero_()
    model.generation_config.eos_token_id = [0, 2]
    backend = HF.HFGenerator(model, tokenizer, tiny_target)
    assert backend.stop_ids == [0, 2]
    out = tmp_path / "stop.jsonl"
    report = R.regenerate(CONVS[:2], backend, out, SETTINGS, {}, progress=False)
    assert report.stopped_by_length == 0 and report.new_tokens == 0
    # every answer is empty: both conversations are dropped and counted, none written
    assert (report.empty, report.written, report.turns, out.read_text()) == (2, 0, 2, "")
    assert "2 dropped for an empty answer" in report.line()
    assert G.generate_chats(backend, [CONVS[0][:1]], SETTINGS, 0) == [generation.Reply([], "", "stop")]


def test_a_turn_that_does_not_fit_the_context_is_refused_and_its_conversation_dropped(generator, tmp_path):
    """The tiny target takes 1,024 positions: a prompt of about 1,100 tokens is refused unsent, and
    a conversation whose second turn outgrows the context is dropped after its first answer."""
    long_ask = " ".join(["word"] * 1100)
    grows = [{"role": "user", "content": " ".join(["word"] * 900)}, {"role": "assistant", "content": ""}]
    grows += [{"role": "user", "content": "and more " * 80}, {"role": "assistant", "content": ""}]
    convs = [CONVS[0], [{"role": "user", "content": long_ask}, {"role": "assistant", "content": ""}], grows]
    assert generator.context_len == 1024 == SG.target_context(generator.path)  # what the SGLang backend reads
    assert SG.target_context(generator.path, [("context_length", 512), ("cuda_graph_max_bs", 8)]) == 512
    log = CallLog(generator)
    out = tmp_path / "refused.jsonl"
    report = R.regenerate(convs, log, out, R.GenerationSettings(max_new_tokens=6, batch_size=8), {}, progress=False)
    assert (report.refused, report.written, report.turns) == (2, 1, 2)  # CONVS[0] and grows' first turn were generated
    assert log.calls == [2]  # the long prompt was never sent; grows' second turn neither
    assert [r["messages"][0]["content"] for r in _lines(out)] == ["Hi"]
    assert "2 refused" in report.line()


def test_restart_skips_done_records_and_cuts_a_torn_line(generator, tmp_path):
    out = tmp_path / "regen.jsonl"
    R.regenerate(CONVS, generator, out, SETTINGS, {}, progress=False)
    complete = out.read_text()
    first_three = "".join(complete.splitlines(keepends=True)[:3])
    out.write_text(first_three + complete.splitlines(keepends=True)[3][:25])  # a crash mid-write
    report = R.regenerate(CONVS, generator, out, SETTINGS, {}, progress=False)
    assert (report.skipped_done, report.written) == (3, 2)
    records = _lines(out)
    assert sorted(r["id"] for r in records) == sorted(record_id(c) for c in CONVS)
    assert sorted(out.read_text().splitlines()) == sorted(complete.splitlines())  # greedy: the same records
    again = R.regenerate(CONVS, generator, out, SETTINGS, {}, progress=False)
    assert (again.skipped_done, again.written) == (5, 0)


def test_a_foreign_line_in_the_output_is_an_error(tmp_path):
    out = tmp_path / "mine.jsonl"
    out.write_text('{"id": "a", "messages": []}\n{"text": "not ours"}\n{"id": "b", "messages": []}\n')
    with pytest.raises(ValueError, match="mine.jsonl:2: not a regenerated record"):
        done_ids(out)


def test_done_ids_read_records_whose_text_holds_unicode_line_breaks(tmp_path):
    # the writer keeps non-ASCII raw (ensure_ascii=False): U+2028, U+0085 and \x1c are inside strings, not line ends
    out = tmp_path / "answered.jsonl"
    rows = [{"id": f"r{k}", "messages": [{"role": "assistant", "content": f"a{sep}b"}]} for k, sep in enumerate("\u2028\x85\x1c")]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert done_ids(out) == {"r0", "r1", "r2"}


def test_cli_on_a_file_source(tiny_target, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS))
    out = tmp_path / "out.jsonl"
    args = [
        "--format",
        "openai",
        "--path",
        str(source),
        "--target",
        str(tiny_target),
        "--output",
        str(out),
        "--max-new-tokens",
        "3",
        "--batch-size",
        "4",
        "--limit",
        "3",
        "--device",
        "cpu",
    ]
    report = R.main(args)
    assert report.written == 3 and len(_lines(out)) == 3
    if not torch.cuda.is_available():  # auto: hf without a GPU; a static cache changes no greedy token
        again = R.main([*args, "--engine", "auto", "--static-cache", "--output", str(tmp_path / "auto.jsonl")])
        assert again.written == 3 and sorted(_lines(tmp_path / "auto.jsonl"), key=lambda r: r["id"]) == sorted(
            _lines(out), key=lambda r: r["id"]
        )
    with pytest.raises(ValueError, match="add --static-cache"):
        R.main([*args, "--compile"])
    with pytest.raises(ValueError, match="temperature"):
        R.GenerationSettings(temperature=-1)


def test_sources_pick_the_records_of_a_prepared_prompt_file(tmp_path):
    """--sources keeps the records of the named corpora sources, in file order, with their keys."""
    records = [
        {"id": "sharegpt:a_0", "source": "sharegpt", "turns": ["Hi", "And then?"]},
        {"id": "evals:x:1", "source": "evals", "task": "x", "prompt": "2+2?"},
        {"id": "sharegpt_followups:b_1:0", "source": "sharegpt_followups", "prompt": "Shorter, please."},
    ]
    path = tmp_path / "train_prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    convs, extras = R.prompt_conversations(path, ["sharegpt", "sharegpt_followups"])
    assert [c[0]["content"] for c in convs] == ["Hi", "Shorter, please."] and len(convs[0]) == 4
    assert extras == [{"source": "sharegpt"}, {"source": "sharegpt_followups"}]
    assert len(R.prompt_conversations(path)[0]) == 3
    with pytest.raises(ValueError, match=r"train_prompts.jsonl: no record of source codeio"):
        R.prompt_conversations(path, ["codeio"])
    path.write_text(json.dumps({"prompt": "no source here"}) + "\n")
    with pytest.raises(ValueError, match=r"train_prompts.jsonl:1: --sources needs a 'source' key"):
        R.prompt_conversations(path, ["sharegpt"])
    with pytest.raises(ValueError, match="give --prompts"):
        R.main(["--output", str(tmp_path / "o.jsonl"), "--sources", "sharegpt"])


def test_greedy_generates_a_repeated_prompt_once(generator, tmp_path):
    again = [CONVS[0][0], {"role": "assistant", "content": "Another original answer."}]
    greedy = R.regenerate([CONVS[0], again, CONVS[3]], generator, tmp_path / "g.jsonl", SETTINGS, {}, progress=False)
    assert (greedy.written, greedy.same_prompts) == (2, 1)
    sampled = R.GenerationSettings(max_new_tokens=6, batch_size=2, temperature=0.8)
    report = R.regenerate([CONVS[0], again], generator, tmp_path / "s.jsonl", sampled, {}, progress=False)
    assert (report.written, report.same_prompts) == (2, 0)


def sglang_result(output_ids, finish_reason):
    """One ``sglang.Engine.generate`` result with ``skip_tokenizer_init`` (SGLang 0.5.14's
    TokenizerManager: BatchTokenIDOutput branch; finish reasons from FINISH_*.to_json)."""
    meta = {
        "id": "f3a1",
        "finish_reason": finish_reason,
        "prompt_tokens": 12,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
    }
    return {"output_ids": output_ids, "meta_info": meta}


def test_sglang_results_become_replies(generator, caplog):
    tok = generator.tokenizer
    hello = tok("Hello there", add_special_tokens=False)["input_ids"]
    stopped = SG.sglang_reply(sglang_result(hello + [2], {"type": "stop", "matched": 2}), tok)
    assert (stopped.tokens, stopped.text, stopped.finish, stopped.new_tokens) == (hello, "Hello there", "stop", len(hello))
    cut = SG.sglang_reply(sglang_result(hello, {"type": "length", "length": len(hello)}), tok)
    assert (cut.tokens, cut.finish) == (hello, "length")
    empty = SG.sglang_reply(sglang_result([2], {"type": "stop", "matched": 2}), tok)
    assert (empty.tokens, empty.text, empty.finish) == ([], "", "stop")
    aborted = {"type": "abort", "message": "prompt too long", "status_code": 400, "err_type": None}
    assert SG.sglang_reply(sglang_result([], aborted), tok) == generation.REFUSED
    assert "SGLang aborted a request (its conversation is dropped): prompt too long" in caplog.text
    with pytest.raises(RuntimeError, match="unknown"):
        SG.sglang_reply(sglang_result([], {"type": "unknown"}), tok)


def test_sglang_requests_carry_the_settings():
    params = SG.sglang_sampling(R.GenerationSettings(max_new_tokens=7, temperature=0.7, top_p=0.9), [2, 0], 3)
    assert params == [{"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": [2, 0]}] * 3
    assert params[0] is not params[1]


def test_engine_choice_and_batch_defaults_on_the_cpu():
    assert G.resolve_generator("auto") == ("sglang" if torch.cuda.is_available() and G.importlib.util.find_spec("sglang") else "hf")
    assert (
        G.default_batch_size("hf", "cpu") == 16
        and G.default_batch_size("hf", "cuda") == 256
        and G.default_batch_size("sglang", "cuda") == 2048
    )
    assert generation.cut_at_stop([5, 6, 2, 9], [2]) == ([5, 6], "stop") and generation.cut_at_stop([5, 6], [2]) == ([5, 6], "length")
    with pytest.raises(ValueError, match="--engine must be one of"):
        G.GeneratorSettings(name="vllm")
    with pytest.raises(ValueError, match="options of --engine hf"):
        G.GeneratorSettings(name="sglang", static_cache=True)


def test_sglang_in_float32_is_refused_before_anything_loads(tmp_path):
    """SGLang's CUDA RMSNorm has no float32 kernel: its scheduler dies capturing the prefill graph and
    kills the calling process; the project refuses the setting first."""
    with pytest.raises(ValueError, match="--dtype float32: SGLang runs float16 or bfloat16 only"):
        G.open_backend(G.GeneratorSettings(name="sglang", target=str(tmp_path), dtype="float32"))


def test_sglang_args_are_typed_checked_and_reach_the_settings():
    assert [G.sglang_arg(a) for a in ("cuda_graph_max_bs_decode=512", "schedule_conservativeness=0.3", "enable_metrics=False")] == [
        ("cuda_graph_max_bs_decode", 512),
        ("schedule_conservativeness", 0.3),
        ("enable_metrics", False),
    ]
    assert G.sglang_arg("log_level=warning") == ("log_level", "warning")
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        G.sglang_arg("cuda_graph_max_bs_decode")
    with pytest.raises(ValueError, match="mem_fraction_static: use --mem-fraction-static"):
        G.GeneratorSettings(name="sglang", sglang_args=(("mem_fraction_static", 0.5),))
    with pytest.raises(ValueError, match="add --engine sglang"):
        G.GeneratorSettings(name="hf", sglang_args=(("log_level", "info"),))
    args = R._parser().parse_args(["--output", "o.jsonl", "--engine", "sglang", "--sglang-arg", "max_running_requests=4096"])
    assert R.generator_of(args).sglang_args == (("max_running_requests", 4096),)
    known = ["cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill", "max_running_requests"]
    SG.check_sglang_args((("max_running_requests", 1),), known, "0.5.14")
    with pytest.raises(ValueError, match=r"cuda_graph_max_bs: not a field of SGLang 0.5.14's ServerArgs \(close: cuda_graph_max_bs_"):
        SG.check_sglang_args((("cuda_graph_max_bs", 512),), known, "0.5.14")
