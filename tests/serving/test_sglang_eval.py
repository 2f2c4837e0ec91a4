"""serving.sglang_eval's arithmetic on SGLang 0.5.14's per-request meta_info (the keys
tokenizer_manager._calculate_spec_decoding_metrics writes), and its turn-by-turn decoding."""

import pytest

from serving.prompts import PromptSpec
from serving.sglang_eval import decode_all, result_of


def meta(verify: int, tokens: int, hist: list[int]) -> dict:
    return {"spec_verify_ct": verify, "completion_tokens": tokens, "spec_correct_drafts_histogram": hist}


def test_tau_counts_the_bonus_token_and_rates_come_from_the_histogram():
    # request 1: 4 verify steps accepting 0, 1, 3, 3 drafts -> 1 + 2 + 4 + 4 = 11 tokens
    # request 2: 2 verify steps accepting 2, 0 -> 3 + 1 = 4 tokens; its histogram stops at index 2
    r = result_of([meta(4, 11, [1, 1, 0, 2]), meta(2, 4, [1, 0, 1])], k=3, turns=2, wall=1.0)
    assert r.verify_steps == 6 and r.new_tokens == 15
    assert r.accept_len == pytest.approx(15 / 6)
    assert r.accept_rate == pytest.approx([4 / 6, 3 / 6, 2 / 6])  # >= 1, >= 2, >= 3 accepted
    assert r.accept_len == pytest.approx(1 + sum(r.accept_rate))  # holds when no request stops mid-chain


def test_a_request_without_speculative_counters_is_an_error():
    with pytest.raises(ValueError, match="no speculative decoding"):
        result_of([{"completion_tokens": 5}], k=3, turns=1, wall=0.0)


def test_a_request_that_ended_on_its_prefill_token_adds_a_token_and_no_verify_step():
    r = result_of([meta(4, 11, [1, 1, 0, 2]), {"completion_tokens": 1}], k=3, turns=2, wall=1.0)
    assert (r.verify_steps, r.new_tokens) == (4, 12)


def test_the_standard_error_is_the_delta_method_one_over_requests():
    # per-request tau 3 and 1 over one verify step each: the SE of the mean of (3, 1) is 1
    r = result_of([meta(1, 3, [0, 0, 1]), meta(1, 1, [1])], k=2, turns=2, wall=1.0)
    assert r.accept_len == pytest.approx(2.0) and r.accept_len_se == pytest.approx(1.0)


class EchoEngine:
    """Answers each prompt with its own length as one token id; records the calls."""

    def __init__(self):
        self.calls = []

    def generate(self, input_ids, sampling_params):
        self.calls.append(len(input_ids))
        return [{"output_ids": [len(ids)], "meta_info": meta(1, 1, [1])} for ids in input_ids]


class CharTokenizer:
    chat_template = "chars"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens):
        return f"answer{ids[0]}"


def test_follow_up_turns_are_asked_after_the_engines_answer_in_waves():
    engine = EchoEngine()
    prompts = [PromptSpec(({"role": "user", "content": "a"},), ("b", "c")), PromptSpec(({"role": "user", "content": "x"},))]
    metas, turns = decode_all(engine, CharTokenizer(), prompts, {})
    assert engine.calls == [2, 1, 1] and turns == 4 and len(metas) == 4
