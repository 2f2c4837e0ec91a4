"""Conversation -> the target's chat template -> tokens + assistant-only loss mask.

The conversation is rendered with the tokenizer's own template (``apply_chat_template``), or the
one ``data.chat_template`` names (``read_chat_template``) for a target whose tokenizer has none or the wrong one.
An assistant turn is located by rendering prefixes: for assistant message i, the text of
``messages[:i]`` with the generation prompt must be a prefix of the text of
``messages[:i+1]``, and that a prefix of the whole conversation; the difference is the turn
(content + end-of-turn token + template whitespace after it, which is trimmed). Tokens whose
characters lie wholly inside a located span are masked, found through the fast tokenizer's
offset mapping; a token straddling a span edge stays unmasked and is counted.

``cut_answers`` shortens every assistant turn to its first N tokens before encoding (training
on the openings of long answers). ``MaskPolicy`` narrows the mask: ``last_turn_only`` keeps only the last trainable assistant
turn (needed for templates that render earlier turns differently once later turns follow,
e.g. reasoning templates that strip past thinking); ``train_thinking=False`` removes
``<think>...</think>`` spans (and the whitespace after the closing tag) from the mask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from trainer.data.conversation import Conversation, check_conversation, trainable
from trainer.data.stats import DatasetStats
from trainer.data.tokenizer_pool import TokenizerPool

Span = tuple[int, int]  # [start, end) character offsets in the rendered text
OVERLONG = ("truncate", "drop")
ENCODE_CHUNK = 1024  # conversations per tokenizer call


@dataclass(frozen=True)
class MaskPolicy:
    last_turn_only: bool = False  # mask only the last trainable assistant turn
    train_thinking: bool = True  # False: thinking spans stay out of the mask
    think_tags: tuple[str, str] = ("<think>", "</think>")

    def __post_init__(self) -> None:
        start, end = self.think_tags
        if not start or not end or start == end:
            raise ValueError(f"think_tags must be two different non-empty strings, got {self.think_tags!r}")


@dataclass(frozen=True)
class EncodedSample:
    input_ids: list[int]
    loss_mask: list[bool]  # True on assistant content and its end-of-turn token
    truncated: bool = False  # cut to max_len
    boundary_tokens: int = 0  # tokens straddling a mask edge (left unmasked)
    thinking_tokens: int = 0  # assistant tokens kept out of the mask as thinking

    def __post_init__(self):
        assert len(self.input_ids) == len(self.loss_mask), "input_ids and loss_mask differ in length"


def read_chat_template(path: str | Path) -> str:
    """The Jinja chat template in file ``path`` (``data.chat_template``); ValueError naming the file (and line) when
    it is missing or does not parse."""
    import jinja2  # transformers renders chat templates with it

    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"config data.chat_template: {path} is not a file (a Jinja chat template)")
    text = file.read_text(encoding="utf-8")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"config data.chat_template: {file}:{e.lineno}: not a Jinja template ({e.message})") from None
    return text


def _render(tokenizer, messages: Conversation, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, conv: Conversation, last_turn_only: bool = False) -> tuple[str, list[Span]]:
    """The rendered text of ``conv`` and the character spans of its trainable assistant turns
    (all of them, or the last with ``last_turn_only``). Messages after the last trainable
    assistant turn carry no loss and are not rendered."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the target's tokenizer ({type(tokenizer).__name__}) has no chat template: set data.chat_template=FILE (Jinja)")
    check_conversation(conv)
    turns = [i for i, m in enumerate(conv) if trainable(m)]
    last = turns[-1]
    messages = conv[: last + 1]
    text = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i in [last] if last_turn_only else turns:
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        turn = text if i == last else _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not turn.startswith(prompt):
            raise ValueError(
                f"chat template problem: the generation prompt for messages[:{i}] is not a prefix of the "
                f"rendering with assistant turn {i}, so the assistant span cannot be located"
            )
        end = len(prompt) + len(turn[len(prompt) :].rstrip())
        if not text.startswith(turn[:end]):
            raise ValueError(
                f"chat template problem: assistant turn {i} renders differently once later turns follow "
                "(e.g. a template that strips earlier reasoning), so its span cannot be located; "
                "set data.train_only_last_turn=true to train on the last assistant turn only"
            )
        if end > len(prompt):
            spans.append((len(prompt), end))
    return text, spans


def _skip_space(text: str, pos: int, end: int) -> int:
    while pos < end and text[pos].isspace():
        pos += 1
    return pos


def thinking_spans(text: str, spans: Sequence[Span], tags: tuple[str, str]) -> list[Span]:
    """Character spans of thinking inside the assistant ``spans``: from an opening tag through
    its closing tag and the whitespace after it. A closing tag with no opening tag before it in
    the turn means the thinking began in the prompt (a template whose generation prompt opens
    it): the span starts at the turn start. An unclosed opening tag runs to the turn end."""
    start_tag, end_tag = tags
    out = []
    for a, b in spans:
        pos = a
        first_close, first_open = text.find(end_tag, a, b), text.find(start_tag, a, b)
        if first_close != -1 and (first_open == -1 or first_close < first_open):
            pos = _skip_space(text, first_close + len(end_tag), b)
            out.append((a, pos))
        while (opened := text.find(start_tag, pos, b)) != -1:
            closed = text.find(end_tag, opened + len(start_tag), b)
            pos = b if closed == -1 else _skip_space(text, closed + len(end_tag), b)
            out.append((opened, pos))
    return out


def subtract(spans: Sequence[Span], holes: Sequence[Span]) -> list[Span]:
    """``spans`` minus ``holes`` (both ascending, holes inside spans); empty pieces dropped."""
    out, k = [], 0
    for a, b in spans:
        start = a
        while k < len(holes) and holes[k][0] < b:
            h0, h1 = holes[k]
            if h0 > start:
                out.append((start, h0))
            start = max(start, h1)
            k += 1
        if start < b:
            out.append((start, b))
    return out


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> tuple[list[bool], int]:
    """True for tokens whose [start, end) lies inside a span; also counts tokens that cross a
    span edge (they stay False). Spans are ascending and disjoint."""
    if not spans or not len(offsets):
        return [False] * len(offsets), 0
    tok = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # [N, 2] character [start, end) per token
    span = np.asarray(spans, dtype=np.int64)  # [S, 2]
    start, end = tok[:, 0], tok[:, 1]
    k = np.maximum.accumulate(np.searchsorted(span[:, 1], start, side="right"))  # [N] first span ending after the
    # token's start (and after every earlier token's: the walk over ascending offsets never steps back)
    has = k < len(span)
    lo, hi = span[np.minimum(k, len(span) - 1)].T  # [N], [N] that span's edges (unused where not has)
    inside = has & (lo <= start) & (end <= hi) & (end > start)
    straddling = has & ~inside & (start < hi) & (end > lo)
    return inside.tolist(), int(straddling.sum())


def _sample(text: str, spans: list[Span], ids: Sequence[int], offsets: Sequence[tuple[int, int]], policy: MaskPolicy) -> EncodedSample:
    """The sample of a rendered conversation from its tokens and their character offsets."""
    thinking = [] if policy.train_thinking else thinking_spans(text, spans, policy.think_tags)
    mask, straddling = _mask_from_offsets(offsets, subtract(spans, thinking))
    thought = sum(_mask_from_offsets(offsets, thinking)[0]) if thinking else 0
    return EncodedSample(list(ids), mask, boundary_tokens=straddling, thinking_tokens=thought)


def encode_full(tokenizer, conv: Conversation, policy: MaskPolicy = MaskPolicy()) -> EncodedSample:
    """Tokens and loss mask of one whole conversation (no length policy). Needs a fast
    tokenizer (offset mapping)."""
    return next(encode_many(tokenizer, [conv], policy))


def _encode_chunk(tokenizer, chunk: list[Conversation], policy: MaskPolicy) -> list[EncodedSample]:
    """``encode_full`` of each conversation of ``chunk``, its texts in one tokenizer call."""
    rendered = [assistant_spans(tokenizer, conv, policy.last_turn_only) for conv in chunk]
    encoded = tokenizer([text for text, _ in rendered], return_offsets_mapping=True, add_special_tokens=False)
    return [
        _sample(text, spans, ids, offsets, policy)
        for (text, spans), ids, offsets in zip(rendered, encoded["input_ids"], encoded["offset_mapping"])
    ]


def _chunks(items: Sequence) -> list[list]:
    return [list(items[i : i + ENCODE_CHUNK]) for i in range(0, len(items), ENCODE_CHUNK)]


def encode_many(
    tokenizer, convs: Sequence[Conversation], policy: MaskPolicy = MaskPolicy(), pool: TokenizerPool | None = None
) -> Iterator[EncodedSample]:
    """``encode_full`` of each conversation, in order; ``ENCODE_CHUNK`` conversations a tokenizer call,
    the chunks spread over ``pool``'s workers when given."""
    pool = pool or TokenizerPool(tokenizer, 1)
    for samples in pool.map(_encode_chunk, ((chunk, policy) for chunk in _chunks(convs)), len(convs)):
        yield from samples


def _cut_chunk(tokenizer, texts: list[str], max_tokens: int) -> list[str | None]:
    """Each text cut after its first ``max_tokens`` tokens, or None where it is not longer."""
    offsets = tokenizer(texts, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    return [text[: spans[max_tokens - 1][1]] if len(spans) > max_tokens else None for text, spans in zip(texts, offsets)]


def cut_answers(
    tokenizer, convs: Sequence[Conversation], max_tokens: int, pool: TokenizerPool | None = None
) -> tuple[list[Conversation], int]:
    """Each assistant message's content cut after its first ``max_tokens`` tokens (the message
    tokenized alone, no special tokens: the template's end-of-turn token then follows the cut);
    the conversations and the number of messages cut. Other messages are kept as they are.
    ``pool``: the tokenizer calls spread over its workers."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = [list(conv) for conv in convs]
    where = [(i, j) for i, conv in enumerate(out) for j, m in enumerate(conv) if m["role"] == "assistant"]
    texts = [out[i][j]["content"] for i, j in where]
    pool = pool or TokenizerPool(tokenizer, 1)
    cuts = (c for chunk in pool.map(_cut_chunk, ((chunk, max_tokens) for chunk in _chunks(texts)), len(texts)) for c in chunk)
    cut = 0
    for (i, j), text in zip(where, cuts):
        if text is not None:
            out[i][j] = {**out[i][j], "content": text}
            cut += 1
    return out, cut


def fit_length(sample: EncodedSample, max_len: int, overlong: str) -> tuple[EncodedSample | None, str | None]:
    """The length policy: (sample, None), or (None, reason) with reason ``overlong`` (dropped)
    or ``no_masked_token`` (nothing left to learn from)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    if len(sample.input_ids) > max_len:
        if overlong == "drop":
            return None, "overlong"
        sample = dataclasses.replace(sample, input_ids=sample.input_ids[:max_len], loss_mask=sample.loss_mask[:max_len], truncated=True)
    if not any(sample.loss_mask):
        return None, "no_masked_token"
    return sample, None


def encode_conversation(
    tokenizer, conv: Conversation, max_len: int, *, overlong: str = "truncate", policy: MaskPolicy = MaskPolicy()
) -> EncodedSample | None:
    """Tokens and assistant loss mask of one conversation under the length policy; None when
    it is dropped (over ``max_len`` with ``overlong="drop"``, or no masked token left)."""
    return fit_length(encode_full(tokenizer, conv, policy), max_len, overlong)[0]


def encode_conversations(
    tokenizer,
    convs: Iterable[Conversation],
    max_len: int,
    stats: DatasetStats | None = None,
    *,
    overlong: str = "truncate",
    policy: MaskPolicy = MaskPolicy(),
    pool: TokenizerPool | None = None,
) -> tuple[list[EncodedSample], DatasetStats]:
    """``encode_conversation`` over ``convs``; returns the samples and ``stats`` (a copy, or a
    fresh one) with the encoding counters added. ``pool``: the encoding spread over its workers."""
    stats = dataclasses.replace(stats) if stats is not None else DatasetStats()
    samples = []
    for full in encode_many(tokenizer, list(convs), policy, pool):
        sample, dropped = fit_length(full, max_len, overlong)
        if dropped == "overlong":
            stats.overlong_dropped += 1
        elif dropped == "no_masked_token":
            stats.no_masked_token += 1
        else:
            samples.append(sample)
            stats.samples += 1
            stats.tokens += len(sample.input_ids)
            stats.masked_tokens += sum(sample.loss_mask)
            stats.truncated += sample.truncated
            stats.boundary_tokens += sample.boundary_tokens
            stats.thinking_tokens += sample.thinking_tokens
    return samples, stats
