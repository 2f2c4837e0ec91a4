"""Conversations -> chat template -> tokens + assistant loss mask -> token-budget batches.

The pipeline has three seams, so new formats plug in without touching the rest:

1. a *source* produces conversations: ``list[dict(role, content)]`` with roles
   ``system`` (first message only), ``user`` and ``assistant`` (``chatterbot_conversations``
   is the one shipped source; ShareGPT / UltraChat / parquet readers return the same type);
2. ``encode_conversation`` renders one conversation with the tokenizer's own chat template
   and marks the loss mask: each assistant turn's content and its end-of-turn token, never
   headers, system or user text, nor template whitespace after the end-of-turn token;
3. ``token_batches`` shuffles the encoded samples for one epoch, groups them under a
   padded-token budget and hands each data-parallel rank its share.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
import yaml

from trainer.batch import TokenBatch

Conversation = list[dict[str, str]]
ROLES = ("system", "user", "assistant")


@dataclass
class DatasetStats:
    """Data figures for the trainer's report. Source counters, then encoding counters."""

    conversations: int = 0  # conversations the source kept
    malformed: int = 0  # skipped by the source: not a list of text turns
    no_assistant: int = 0  # skipped by the source: no assistant turn
    duplicates: int = 0  # skipped by the source: exact repeat of an earlier conversation
    samples: int = 0  # encoded samples (at least one masked token)
    tokens: int = 0  # tokens in the samples, after truncation
    masked_tokens: int = 0  # tokens under the loss mask
    truncated: int = 0  # samples cut to max_len (and kept)
    no_masked_token: int = 0  # conversations dropped: no masked token left after truncation
    boundary_tokens: int = 0  # tokens straddling an assistant span edge (left unmasked; expect 0)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- source: chatterbot


def _chatterbot_data_dir() -> Path:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the chatterbot corpus is not installed: pip install chatterbot-corpus==1.3.3")
    return Path(spec.submodule_search_locations[0]) / "data"


def chatterbot_languages() -> list[str]:
    """The languages the installed chatterbot corpus ships (folder names)."""
    return sorted(p.name for p in _chatterbot_data_dir().iterdir() if p.is_dir())


def _turns_to_conversation(turns: object) -> Conversation | None:
    """Alternate user / assistant, starting with user. None when the entry is not a list of
    non-blank text turns (chatterbot 1.3.3 has one such entry: a whole dialogue written as
    one string in english/trivia.yml)."""
    if not isinstance(turns, list) or not all(isinstance(t, str) and t.strip() for t in turns):
        return None
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def read_chatterbot(languages: str | Iterable[str] = ("english",)) -> tuple[list[Conversation], DatasetStats]:
    """The chatterbot dialogues of ``languages`` plus the source counters.

    YAML is read with ``yaml.BaseLoader``, so every turn is the text exactly as written in the
    file: an unquoted ``yes`` stays "yes" and ``007`` stays "007" (a typed loader would make
    them True / 7, and str() would not give the text back). Order: languages as given, files
    sorted, entries in file order; exact duplicate conversations are kept once (first seen).
    """
    languages = [languages] if isinstance(languages, str) else list(languages)
    available = chatterbot_languages()
    unknown = [lang for lang in languages if lang not in available]
    if not languages or unknown:
        raise ValueError(f"unknown chatterbot language(s) {unknown or languages}; available: {', '.join(available)}")
    stats, seen, convs = DatasetStats(), set(), []
    for lang in languages:
        for path in sorted((_chatterbot_data_dir() / lang).glob("*.yml")):
            for entry in yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)["conversations"]:
                conv = _turns_to_conversation(entry)
                key = None if conv is None else tuple(m["content"] for m in conv)
                if conv is None:
                    stats.malformed += 1
                elif len(conv) < 2:
                    stats.no_assistant += 1
                elif key in seen:
                    stats.duplicates += 1
                else:
                    seen.add(key)
                    convs.append(conv)
    stats.conversations = len(convs)
    return convs, stats


def chatterbot_conversations(languages: str | Iterable[str] = ("english",)) -> list[Conversation]:
    """The chatterbot dialogues of ``languages`` (see ``read_chatterbot``)."""
    return read_chatterbot(languages)[0]


# --------------------------------------------------------------------------- held-out split


def _first_user_text(conv: Conversation) -> str:
    for message in conv:
        if message["role"] == "user":
            return message["content"]
    raise ValueError("a conversation without a user turn cannot be split by prompt")


def _unit_hash(text: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}\0{text}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_holdout(convs: Sequence[Conversation], fraction: float, seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """(train, heldout): a conversation is held out when a seeded hash of its first user turn
    (whitespace-collapsed, case-folded) falls below ``fraction``. Each prompt decides alone, so
    a prompt never lands on both sides, and the split of old conversations is unchanged when
    the corpus grows. Order within each side follows ``convs``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout fraction must be in (0, 1), got {fraction!r}")
    train, heldout = [], []
    for conv in convs:
        key = " ".join(_first_user_text(conv).split()).casefold()
        (heldout if _unit_hash(key, seed) < fraction else train).append(conv)
    return train, heldout


# --------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class EncodedSample:
    input_ids: list[int]
    loss_mask: list[bool]  # True on assistant content and its end-of-turn token
    truncated: bool = False  # cut to max_len
    boundary_tokens: int = 0  # tokens straddling an assistant span edge (left unmasked)

    def __post_init__(self):
        assert len(self.input_ids) == len(self.loss_mask), "input_ids and loss_mask differ in length"


def _render(tokenizer, messages: Conversation, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _check_conversation(conv: Conversation) -> None:
    for i, message in enumerate(conv):
        if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {message!r}")
    if not any(m["role"] == "assistant" for m in conv):
        raise ValueError("a conversation needs at least one assistant turn")


def assistant_spans(tokenizer, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text of ``conv`` and the character spans of its assistant turns.

    For assistant turn i, the text for messages[:i] with the generation prompt must be a
    prefix of the text for messages[:i+1], and that text a prefix of the whole conversation;
    the difference is the turn (content + end-of-turn token + template whitespace, which is
    trimmed). Messages after the last assistant turn carry no loss and are not rendered.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; set tokenizer.chat_template")
    _check_conversation(conv)
    last = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
    messages = conv[: last + 1]
    text = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        turn = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not turn.startswith(prompt):
            raise ValueError(
                f"chat template problem: the generation prompt for messages[:{i}] is not a prefix of the "
                f"rendering with assistant turn {i}, so the assistant span cannot be located"
            )
        end = len(prompt) + len(turn[len(prompt) :].rstrip())
        if not text.startswith(turn[:end]):
            raise ValueError(
                f"chat template problem: assistant turn {i} renders differently once later turns follow "
                "(e.g. a template that strips earlier reasoning), so its span cannot be located"
            )
        if end > len(prompt):
            spans.append((len(prompt), end))
    return text, spans


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> tuple[list[bool], int]:
    """True for tokens whose [start, end) lies inside a span; also counts tokens that cross a
    span edge (they stay False). Offsets and spans are both ascending."""
    mask, straddling, k = [], 0, 0
    for start, end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        inside = k < len(spans) and spans[k][0] <= start and end <= spans[k][1] and end > start
        straddling += k < len(spans) and not inside and start < spans[k][1] and end > spans[k][0]
        mask.append(inside)
    return mask, straddling


def encode_conversation(tokenizer, conv: Conversation, max_len: int) -> EncodedSample | None:
    """Tokens and assistant loss mask of one conversation, cut to the first ``max_len`` tokens;
    None when no masked token remains. Needs a fast tokenizer (offset mapping)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    text, spans = assistant_spans(tokenizer, conv)
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    mask, straddling = _mask_from_offsets(encoded["offset_mapping"], spans)
    ids = list(encoded["input_ids"])
    if not any(mask[:max_len]):
        return None
    return EncodedSample(ids[:max_len], mask[:max_len], truncated=len(ids) > max_len, boundary_tokens=straddling)


def encode_conversations(
    tokenizer, convs: Iterable[Conversation], max_len: int, stats: DatasetStats | None = None
) -> tuple[list[EncodedSample], DatasetStats]:
    """``encode_conversation`` over ``convs``; returns the samples and ``stats`` (a copy, or a
    fresh one) with the encoding counters added."""
    stats = dataclasses.replace(stats) if stats is not None else DatasetStats()
    samples = []
    for conv in convs:
        sample = encode_conversation(tokenizer, conv, max_len)
        if sample is None:
            stats.no_masked_token += 1
            continue
        samples.append(sample)
        stats.samples += 1
        stats.tokens += len(sample.input_ids)
        stats.masked_tokens += sum(sample.loss_mask)
        stats.truncated += sample.truncated
        stats.boundary_tokens += sample.boundary_tokens
    return samples, stats


# --------------------------------------------------------------------------- batching


def _epoch_groups(lengths: Sequence[int], max_tokens: int, seed: int, epoch: int, sort_window: int) -> list[list[int]]:
    """Sample indices of every batch of one epoch, in batch order (see ``token_batches``)."""
    rng = random.Random(f"streamdraft-data:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    windows = [order[w : w + sort_window] for w in range(0, len(order), sort_window)]
    # alternate the sort direction so that lengths run smoothly across window edges
    order = [i for k, win in enumerate(windows) for i in sorted(win, key=lengths.__getitem__, reverse=k % 2 == 1)]
    groups = [[order[j] for j in g] for g in _group_by_budget([lengths[i] for i in order], max_tokens)]
    rng.shuffle(groups)
    return groups


def _group_by_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups whose padded size len(group) * max(length) <= max_tokens; a single
    item longer than the budget forms its own group."""
    groups, current, longest = [], [], 0
    for i, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def pad_batch(samples: Sequence[EncodedSample], pad_id: int) -> TokenBatch:
    """Right-pad ``samples`` into one TokenBatch (padding: ``pad_id``, mask False)."""
    width = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, s in enumerate(samples):
        input_ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.long)
        loss_mask[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.bool)
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    return TokenBatch(input_ids=input_ids, loss_mask=loss_mask, lengths=lengths)


def token_batches(
    samples: Sequence[EncodedSample],
    max_tokens: int,
    seed: int,
    epoch: int,
    rank: int,
    world: int,
    pad_id: int,
    sort_window: int = 256,
) -> list[TokenBatch]:
    """This rank's batches for one epoch.

    An epoch is one pass over ``samples``: they are shuffled by (seed, epoch); each window of
    ``sort_window`` consecutive samples is sorted by length (ascending and descending in turn),
    so that a batch holds similar lengths and little padding; the result is cut into
    consecutive batches of padded size B * T_max <= max_tokens (a sample longer than the
    budget alone), and the batch order is shuffled. ``sort_window=1`` batches in plain shuffled
    order (measured on chatterbot English with SmolLM2, 4096-token budget: 39% of the padded
    tokens are real with 1, 80% with 256, 93% with 1024). Every rank builds the same
    batch list and takes batches rank, rank + world, ...; all ranks get len(batches) // world
    batches, so the last len(batches) % world batches (at most world - 1) are skipped this
    epoch. Another epoch reshuffles, so the skipped samples change from epoch to epoch. With
    world = 1 every sample appears exactly once.
    """
    if max_tokens < 1 or sort_window < 1:
        raise ValueError(f"max_tokens and sort_window must be >= 1, got {max_tokens}, {sort_window}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need world >= 1 and 0 <= rank < world, got rank={rank}, world={world}")
    if not samples:
        raise ValueError("no samples to batch")
    groups = _epoch_groups([len(s.input_ids) for s in samples], max_tokens, seed, epoch, sort_window)
    per_rank = len(groups) // world
    if per_rank == 0:
        raise ValueError(f"{len(groups)} batch(es) for {world} ranks: lower max_tokens or add data")
    mine = groups[rank : per_rank * world : world]
    return [pad_batch([samples[i] for i in group], pad_id) for group in mine]
