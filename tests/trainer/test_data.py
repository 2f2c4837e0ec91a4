"""Chatterbot source, held-out split, chat templates and loss masks, length policy, batches.

On the real corpus and the real SmolLM2 tokenizer (CPU); other template families run on the
same vocabulary with their template (and special tokens) swapped in. Figures worth knowing
are printed (run with -s to see them).
"""

import collections
import copy
import random
import time

import pytest
import torch

from models.embedded import embedded_target_dir
from models.target import load_tokenizer
from trainer import data
from trainer.data import EncodedSample, MaskPolicy

# A Qwen2.5-like ChatML template (default system prompt when none is given).
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-3's template: bos first, headers, trimmed content, <|eot_id|> and no newline after it.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# DeepSeek-V3's template (tools left out): bos, the system prompt bare, then <｜User｜> / <｜Assistant｜>
# markers with no newlines; an assistant turn ends in <｜end▁of▁sentence｜>.
DEEPSEEK_V3 = (
    "{{ '<｜begin▁of▁sentence｜>' }}{% set ns = namespace(system_prompt='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}"
    "{% endif %}{% endfor %}{{ ns.system_prompt }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# Kimi-K2's template (tools left out): <|im_system|> / <|im_user|> / <|im_assistant|> role markers,
# <|im_middle|> before the content, <|im_end|> after it, a default system prompt, no newlines.
KIMI_K2 = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# Qwen3's reasoning template (tools left out): an assistant turn after the last user turn shows its
# thinking (reasoning_content, or <think>...</think> inside content); earlier turns lose it.
QWEN3 = (
    "{%- set ns = namespace(searching=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.searching and message.role == 'user' %}{%- set ns.searching = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is defined and message.reasoning_content is not none %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in message.content %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\n') %}"
    "{%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# DeepSeek-R1-0528 style: the generation prompt opens the thinking, so a turn's span starts inside it.
THINK_OPEN_IN_PROMPT = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'").replace(
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}",
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n<think>\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}",
)

FAMILIES = {  # name: (template or None for SmolLM2's own, special tokens to add, end-of-turn text)
    "smollm2": (None, [], "<|im_end|>"),
    "chatml": (CHATML, [], "<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "deepseek_v3": (
        DEEPSEEK_V3,
        ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
        "<｜end▁of▁sentence｜>",
    ),
    "kimi_k2": (KIMI_K2, ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"], "<|im_end|>"),
}

CONV = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Write a loop in Python."},
    {"role": "assistant", "content": "Here it is:\n\n```\nfor i in range(3):\n    print(i)\n```"},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
THINKING = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\nAdd them: 2 + 3 = 5.\n</think>\n\nIt is 5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "<think>\n5 * 4 = 20.\n</think>\n\n20."},
]


@pytest.fixture(scope="module")
def tokenizer():
    start = time.perf_counter()
    tok = load_tokenizer(embedded_target_dir())  # the cached dir: 0.3 s (the GGUF's tokenizer: ~13 s)
    print(f"\nSmolLM2 tokenizer: {time.perf_counter() - start:.1f} s")
    return tok


@pytest.fixture(scope="module")
def english():
    return data.read_chatterbot("english")


def _with_template(tok, template, specials=()):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    return tok


def _family(tok, name):
    template, specials, _ = FAMILIES[name]
    return tok if template is None else _with_template(tok, template, specials)


def _masked_runs(tok, sample: EncodedSample) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, masked in zip(sample.input_ids + [None], sample.loss_mask + [False]):
        if masked:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tok.decode(run, clean_up_tokenization_spaces=False) for run in runs]


# --------------------------------------------------------------------------- chatterbot source


def test_chatterbot_english(english):
    convs, stats = english
    turns = sum(len(c) for c in convs)
    firsts = {c[0]["content"] for c in convs}
    print(
        f"\nchatterbot english: {stats.conversations} conversations, {turns} turns, {len(firsts)} distinct first "
        f"prompts; skipped {stats.malformed} malformed, {stats.no_assistant} without assistant, "
        f"{stats.duplicates} exact duplicates"
    )
    # chatterbot-corpus 1.3.3 is pinned: these are its figures
    assert (stats.conversations, turns, len(firsts)) == (898, 2077, 748)
    assert (stats.malformed, stats.no_assistant, stats.duplicates) == (1, 0, 1127)
    assert len(convs) == stats.conversations
    assert len({tuple(m["content"] for m in c) for c in convs}) == len(convs)
    for conv in convs:
        assert [m["role"] for m in conv] == [("user", "assistant")[i % 2] for i in range(len(conv))]
        assert any(m["role"] == "assistant" for m in conv)
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in conv)
    assert data.chatterbot_conversations() == convs  # deterministic


def test_chatterbot_all_languages():
    convs, stats = data.read_chatterbot(data.chatterbot_languages())
    print(f"\nchatterbot, {len(data.chatterbot_languages())} languages: {stats}")
    assert stats.conversations == len(convs) > 6000
    assert stats.no_assistant == 2  # single-turn entries exist in other languages
    assert all(len(c) >= 2 for c in convs)


def test_chatterbot_unknown_language():
    with pytest.raises(ValueError, match="available: .*english"):
        data.chatterbot_conversations(("klingon",))


def test_turns_are_read_as_written():
    assert data.chatterbot_turns(["yes", "007"]) == [
        {"role": "user", "content": "yes"},
        {"role": "assistant", "content": "007"},
    ]
    assert data.chatterbot_turns("a - b") is None
    assert data.chatterbot_turns(["hi", ""]) is None


# --------------------------------------------------------------------------- held-out split


def test_split_disjoint_by_prompt_and_deterministic(english):
    convs, _ = english
    train, held = data.split_holdout(convs, 0.1, seed=0)
    assert len(train) + len(held) == len(convs)
    assert 0.05 < len(held) / len(convs) < 0.15
    first = lambda c: " ".join(c[0]["content"].split()).casefold()  # noqa: E731
    assert not {first(c) for c in train} & {first(c) for c in held}
    assert data.split_holdout(convs, 0.1, seed=0) == (train, held)
    assert data.split_holdout(convs, 0.1, seed=1)[1] != held
    # stable when the corpus grows: a sub-corpus splits the same way
    sub_train, sub_held = data.split_holdout(convs[::3], 0.1, seed=0)
    assert sub_held == [c for c in held if any(c is s for s in convs[::3])]


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5, True])
def test_split_fraction_validated(fraction):
    with pytest.raises(ValueError, match="fraction"):
        data.split_holdout([CONV], fraction, seed=0)


# --------------------------------------------------------------------------- loss mask


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("system", [False, True])
def test_mask_is_exactly_assistant_turns(tokenizer, family, system):
    tok, eot = _family(tokenizer, family), FAMILIES[family][2]
    conv = ([SYSTEM] if system else []) + CONV
    sample = data.encode_conversation(tok, conv, max_len=4096)
    text = tok.apply_chat_template(conv, tokenize=False)
    assert tok.decode(sample.input_ids, clean_up_tokenization_spaces=False) == text
    assert _masked_runs(tok, sample) == [m["content"] + eot for m in conv if m["role"] == "assistant"]
    assert sample.boundary_tokens == 0 and not sample.truncated
    unmasked = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])
    assert all(m["content"] in unmasked for m in conv if m["role"] != "assistant")
    if family == "llama3":  # header tokens are never masked
        assert "assistant<|end_header_id|>" in unmasked


def test_template_markers_unknown_to_the_tokenizer_are_counted(tokenizer):
    """Llama-3 markers on SmolLM2's vocabulary without adding them as tokens: '.<' and '><'
    merge across the end of an assistant span; those tokens stay unmasked and are counted."""
    tok = _with_template(tokenizer, LLAMA3)
    sample = data.encode_conversation(tok, CONV, 4096)
    assert sample.boundary_tokens == 2
    assert _masked_runs(tok, sample)[0] == "Paris is the capital of France.<|eot_id|"


def test_mask_keeps_content_whitespace_and_drops_template_newline(tokenizer, english):
    convs, _ = english
    code = next(c for c in convs if c[1]["content"].endswith("```\n"))  # chatterbot coding answers end in "\n"
    sample = data.encode_conversation(tokenizer, code, max_len=4096)
    assert _masked_runs(tokenizer, sample) == [m["content"] + "<|im_end|>" for m in code if m["role"] == "assistant"]


def _walked_mask(offsets, spans):
    """The token-by-token walk the mask is defined by (a reference for the vectorised one)."""
    mask, straddling, k = [], 0, 0
    for start, end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        inside = k < len(spans) and spans[k][0] <= start and end <= spans[k][1] and end > start
        straddling += k < len(spans) and not inside and start < spans[k][1] and end > spans[k][0]
        mask.append(inside)
    return mask, straddling


def test_the_vectorised_mask_is_the_walk_over_random_offsets():
    rng = random.Random(5)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, 80), rng.randrange(0, 9)))
        spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
        offsets, pos = [], 0
        for _ in range(rng.randrange(0, 40)):
            start = max(0, pos - rng.choice([0, 0, 0, 1, 3]))  # mostly ascending; byte tokens share or step back
            end = start + rng.choice([0, 1, 1, 2, 3, 5])  # zero-width tokens too
            offsets.append((start, end))
            pos = end
        assert data.chat._mask_from_offsets(offsets, spans) == _walked_mask(offsets, spans), (offsets, spans)


def test_conversations_encoded_together_equal_each_alone(tokenizer, english, monkeypatch):
    convs = english[0][:40]
    monkeypatch.setattr(data.chat, "ENCODE_CHUNK", 7)  # several tokenizer calls, the last one short
    together, _ = data.encode_conversations(tokenizer, convs, max_len=4096)
    assert together == [data.encode_conversation(tokenizer, c, max_len=4096) for c in convs]


def test_a_tokenizer_pool_encodes_and_cuts_as_this_process_does(tokenizer, english, monkeypatch):
    from trainer.data import tokenizer_pool

    convs = english[0][:40]
    monkeypatch.setattr(data.chat, "ENCODE_CHUNK", 7)
    monkeypatch.setattr(tokenizer_pool, "PARALLEL_MIN", 10)  # these 40 go to the workers
    serial, serial_stats = data.encode_conversations(tokenizer, convs, max_len=256)
    cut, cut_count = data.cut_answers(tokenizer, convs, 8)
    with tokenizer_pool.TokenizerPool(tokenizer, 2) as pool:
        pooled, pooled_stats = data.encode_conversations(tokenizer, convs, max_len=256, pool=pool)
        assert pool._pool is not None  # the workers did run
        spilled = pool._file  # the tokenizer the workers loaded, as a file: their start arguments stay small
        assert spilled.is_file()
        assert data.cut_answers(tokenizer, convs, 8, pool) == (cut, cut_count)
        small = data.encode_conversations(tokenizer, convs[:9], max_len=256, pool=pool)[0]  # under PARALLEL_MIN: here
    assert pooled == serial and pooled_stats == serial_stats and small == serial[:9]
    assert cut_count > 0 and pool._pool is None and not spilled.exists()  # closed, its file removed
    with pytest.raises(ValueError, match="workers must be >= 1"):
        tokenizer_pool.TokenizerPool(tokenizer, 0)


def test_trailing_user_turn_is_not_rendered(tokenizer):
    assert data.encode_conversation(tokenizer, CONV[:3], 4096) == data.encode_conversation(tokenizer, CONV[:2], 4096)


def test_truncation(tokenizer):
    full = data.encode_conversation(tokenizer, CONV, max_len=4096)
    cut = data.encode_conversation(tokenizer, CONV, max_len=len(full.input_ids) - 5)
    assert cut.truncated and len(cut.input_ids) == len(full.input_ids) - 5
    assert (cut.input_ids, cut.loss_mask) == (full.input_ids[:-5], full.loss_mask[:-5])
    first_masked = full.loss_mask.index(True)
    assert data.encode_conversation(tokenizer, CONV, max_len=first_masked) is None
    samples, stats = data.encode_conversations(tokenizer, [CONV, CONV], max_len=first_masked + 1)
    assert (stats.samples, stats.truncated, stats.masked_tokens) == (2, 2, 2)
    samples, stats = data.encode_conversations(tokenizer, [CONV], max_len=first_masked)
    assert (samples, stats.no_masked_token) == ([], 1)


def test_answers_cut_to_their_first_tokens(tokenizer, monkeypatch):
    lengths = [len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in CONV[1::2]]
    n = sorted(lengths)[1]  # an answer of exactly n tokens is kept whole; the longest is cut
    assert sorted(lengths)[0] < n < sorted(lengths)[2]
    before = copy.deepcopy(CONV)
    monkeypatch.setattr(data.chat, "ENCODE_CHUNK", 2)  # answers of several conversations over two tokenizer calls
    convs, cut = data.cut_answers(tokenizer, [CONV, CONV[:2]], n)
    assert cut == 1 + (lengths[0] > n) and convs[1][0] == CONV[0]
    for conv in convs:
        for got, was in zip(conv, CONV):
            if was["role"] != "assistant":
                assert got == was
                continue
            ids = tokenizer(got["content"], add_special_tokens=False)["input_ids"]
            assert len(ids) == min(n, len(tokenizer(was["content"], add_special_tokens=False)["input_ids"]))
            assert was["content"].startswith(got["content"])
    masked = _masked_runs(tokenizer, data.encode_conversation(tokenizer, convs[0], 4096))
    assert masked == [m["content"] + "<|im_end|>" for m in convs[0][1::2]]
    assert CONV == before and convs[0][3] != CONV[3]  # cut in a copy
    with pytest.raises(ValueError, match="max_tokens"):
        data.cut_answers(tokenizer, [CONV], 0)


def test_no_chat_template_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        data.encode_conversation(_with_template(tokenizer, None), CONV, 4096)


def test_template_whose_generation_prompt_is_not_a_prefix(tokenizer):
    thinking = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    with pytest.raises(ValueError, match="chat template problem.*not a prefix"):
        data.encode_conversation(_with_template(tokenizer, thinking), CONV, 4096)


def test_conversation_without_assistant_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="assistant"):
        data.encode_conversation(tokenizer, CONV[:1], 4096)


def test_overlong_drop_is_counted(tokenizer):
    full = data.encode_conversation(tokenizer, CONV, max_len=4096)
    n = len(full.input_ids)
    assert data.encode_conversation(tokenizer, CONV, max_len=n, overlong="drop") == full
    assert data.encode_conversation(tokenizer, CONV, max_len=n - 1, overlong="drop") is None
    samples, stats = data.encode_conversations(tokenizer, [CONV, CONV[:2]], max_len=n - 1, overlong="drop")
    assert len(samples) == 1 and (stats.overlong_dropped, stats.truncated, stats.samples) == (1, 0, 1)
    with pytest.raises(ValueError, match="overlong"):
        data.encode_conversation(tokenizer, CONV, max_len=n, overlong="wrap")


def test_only_last_turn(tokenizer):
    for family in FAMILIES:
        tok, eot = _family(tokenizer, family), FAMILIES[family][2]
        sample = data.encode_conversation(tok, CONV, 4096, policy=MaskPolicy(last_turn_only=True))
        assert _masked_runs(tok, sample) == [CONV[-1]["content"] + eot], family
        full = data.encode_conversation(tok, CONV, 4096)
        assert sample.input_ids == full.input_ids  # same tokens, fewer of them masked


def test_weight_zero_turn_is_context_only(tokenizer):
    conv = [dict(m) for m in CONV]
    conv[1]["weight"] = 0
    sample = data.encode_conversation(tokenizer, conv, 4096)
    assert _masked_runs(tokenizer, sample) == [m["content"] + "<|im_end|>" for m in conv[3::2]]


@pytest.mark.parametrize("family", ["chatml", "deepseek_v3", "kimi_k2"])
def test_thinking_kept_or_dropped(tokenizer, family):
    """<think>...</think> inside the content of every turn, on templates that keep it in history."""
    tok, eot = _family(tokenizer, family), FAMILIES[family][2]
    kept = data.encode_conversation(tok, THINKING, 4096)
    assert _masked_runs(tok, kept) == [m["content"] + eot for m in THINKING[1::2]] and kept.thinking_tokens == 0
    dropped = data.encode_conversation(tok, THINKING, 4096, policy=MaskPolicy(train_thinking=False))
    assert _masked_runs(tok, dropped) == ["It is 5." + eot, "20." + eot]
    assert dropped.input_ids == kept.input_ids and dropped.boundary_tokens == 0
    assert dropped.thinking_tokens == sum(kept.loss_mask) - sum(dropped.loss_mask) > 0


def test_reasoning_template_that_strips_history_needs_last_turn_only(tokenizer):
    tok = _with_template(tokenizer, QWEN3)
    with pytest.raises(ValueError, match="renders differently.*train_only_last_turn"):
        data.encode_conversation(tok, THINKING, 4096)
    last = data.encode_conversation(tok, THINKING, 4096, policy=MaskPolicy(last_turn_only=True))
    assert _masked_runs(tok, last) == ["<think>\n5 * 4 = 20.\n</think>\n\n20.<|im_end|>"]
    answer = data.encode_conversation(tok, THINKING, 4096, policy=MaskPolicy(last_turn_only=True, train_thinking=False))
    assert _masked_runs(tok, answer) == ["20.<|im_end|>"]
    # reasoning given apart from the content (messages records' reasoning_content) renders the same
    split = THINKING[:3] + [{"role": "assistant", "content": "20.", "reasoning_content": "5 * 4 = 20."}]
    assert data.encode_conversation(tok, split, 4096, policy=MaskPolicy(last_turn_only=True)) == last


def test_thinking_opened_by_the_generation_prompt(tokenizer):
    tok = _with_template(tokenizer, THINK_OPEN_IN_PROMPT)
    conv = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "Add: 5.\n</think>\n\nIt is 5."}]
    assert _masked_runs(tok, data.encode_conversation(tok, conv, 4096)) == [conv[1]["content"] + "<|im_end|>"]
    dropped = data.encode_conversation(tok, conv, 4096, policy=MaskPolicy(train_thinking=False))
    assert _masked_runs(tok, dropped) == ["It is 5.<|im_end|>"]


def test_thinking_spans_edge_cases():
    tags = ("<think>", "</think>")
    text = "P<think>a</think> b<think>c"
    assert data.thinking_spans(text, [(1, len(text))], tags) == [(1, 18), (19, len(text))]  # unclosed runs to the end
    assert data.thinking_spans("x</think>\ny", [(0, 11)], tags) == [(0, 10)]
    assert data.thinking_spans("no thinking", [(0, 11)], tags) == []
    with pytest.raises(ValueError, match="think_tags"):
        MaskPolicy(think_tags=("<t>", "<t>"))


def test_english_corpus_figures(tokenizer, english):
    convs, source_stats = english
    start = time.perf_counter()
    samples, stats = data.encode_conversations(tokenizer, convs, max_len=2048, stats=source_stats)
    seconds = time.perf_counter() - start
    counts = collections.Counter(t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m)
    print(f"\nencoded english in {seconds:.2f} s: {stats.as_dict()}; distinct masked token ids {len(counts)}")
    assert stats.conversations == stats.samples == len(samples) == len(convs)
    assert stats.tokens == sum(len(s.input_ids) for s in samples)
    assert stats.masked_tokens == sum(counts.values())
    assert stats.truncated == stats.boundary_tokens == stats.no_masked_token == 0
    assert max(counts) < len(tokenizer)


# --------------------------------------------------------------------------- batches


def _synthetic(n=300, seed=0):
    """Sample k is [k] * length (k identifies it), its mask covers the second half."""
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(5, 60), rng.randint(60, 400)]) for _ in range(n)]
    return [EncodedSample([k + 1] * n_, [i >= n_ // 2 for i in range(n_)]) for k, n_ in enumerate(lengths)]


def _ids(batches):
    return [int(row[0]) - 1 for b in batches for row in b.input_ids]


def test_batches_respect_budget_and_pad(tokenizer):
    samples = _synthetic() + [EncodedSample([301] * 3000, [True] * 3000)]
    batches = data.token_batches(samples, max_tokens=1024, seed=0, epoch=0, rank=0, world=1, pad_id=0)
    for b in batches:
        rows, width = b.input_ids.shape
        assert rows * width <= 1024 or rows == 1
        assert b.input_ids.dtype == torch.long and b.loss_mask.dtype == torch.bool and b.lengths.dtype == torch.long
        assert width == int(b.lengths.max())
        for row, length in zip(range(rows), b.lengths.tolist()):
            s = samples[int(b.input_ids[row, 0]) - 1]
            assert b.input_ids[row, :length].tolist() == s.input_ids and b.loss_mask[row, :length].tolist() == s.loss_mask
            assert not b.input_ids[row, length:].any() and not b.loss_mask[row, length:].any()
    assert any(b.input_ids.shape == (1, 3000) for b in batches)


def test_each_sample_once_per_epoch():
    samples = _synthetic()
    for epoch in range(3):
        batches = data.token_batches(samples, 2048, seed=0, epoch=epoch, rank=0, world=1, pad_id=0)
        assert sorted(_ids(batches)) == list(range(len(samples)))


def test_ranks_disjoint_and_in_step():
    samples = _synthetic()
    everything = data.token_batches(samples, 2048, seed=0, epoch=0, rank=0, world=1, pad_id=0)
    shards = [data.token_batches(samples, 2048, seed=0, epoch=0, rank=r, world=2, pad_id=0) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(everything) // 2
    assert not set(_ids(shards[0])) & set(_ids(shards[1]))
    assert len(samples) - len(_ids(shards[0]) + _ids(shards[1])) <= max(b.input_ids.shape[0] for b in everything)


def test_epochs_differ_and_seed_repeats():
    samples = _synthetic()
    run = lambda seed, epoch: _ids(data.token_batches(samples, 2048, seed, epoch, 0, 1, 0))  # noqa: E731
    assert run(0, 0) == run(0, 0)
    assert run(0, 0) != run(0, 1)
    assert run(0, 0) != run(1, 0)


def test_sharding_errors():
    samples = _synthetic(n=4)
    with pytest.raises(ValueError, match="rank"):
        data.token_batches(samples, 2048, 0, 0, rank=2, world=2, pad_id=0)
    with pytest.raises(ValueError, match="batch"):
        data.token_batches(samples, 100_000, 0, 0, rank=0, world=2, pad_id=0)


def test_english_batches(tokenizer, english):
    samples, _ = data.encode_conversations(tokenizer, english[0], max_len=2048)
    batches = data.token_batches(samples, 4096, seed=0, epoch=0, rank=0, world=1, pad_id=tokenizer.pad_token_id)
    padded = sum(b.input_ids.numel() for b in batches)
    real = sum(int(b.lengths.sum()) for b in batches)
    print(f"\nenglish, 4096-token batches: {len(batches)} batches, {real / padded:.0%} of padded tokens are real")
    assert real == sum(len(s.input_ids) for s in samples)
    assert all(b.input_ids.numel() <= 4096 for b in batches)


PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_chat_template_file_replaces_the_tokenizers(tokenizer, tmp_path):
    (tmp_path / "plain.jinja").write_text(PLAIN_TEMPLATE)
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = data.read_chat_template(tmp_path / "plain.jinja")
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text, spans = data.assistant_spans(plain, conv)
    assert text == "<|user|>hi<|end|>\n<|assistant|>hello<|end|>\n" and [text[a:b] for a, b in spans] == ["hello<|end|>"]
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"has no chat template: set data\.chat_template=FILE"):
        data.assistant_spans(plain, conv)


def test_a_chat_template_file_that_is_missing_or_broken_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"config data\.chat_template: .*none\.jinja is not a file"):
        data.read_chat_template(tmp_path / "none.jinja")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n")
    with pytest.raises(ValueError, match=r"config data\.chat_template: .*bad\.jinja:2: not a Jinja template"):
        data.read_chat_template(tmp_path / "bad.jinja")


def test_the_run_renders_its_data_and_eval_prompts_with_the_chat_template(tmp_path):
    from tests.fixtures.tiny import tiny_config
    from trainer.loop import Trainer

    (tmp_path / "plain.jinja").write_text(PLAIN_TEMPLATE)
    trainer = Trainer(tiny_config(f"data.chat_template={tmp_path / 'plain.jinja'}"), tmp_path / "run")
    try:
        tokenizer = trainer.target.head.tokenizer
        assert tokenizer.chat_template == PLAIN_TEMPLATE  # what the serving eval renders with
        first = trainer.built.data.train["chatterbot"][0]
        assert tokenizer.decode(first.input_ids).startswith("<|user|>")
    finally:
        trainer.close()
