"""Evaluation prompts: jsonl files with ``prompt``, ``messages`` or MT-bench-style ``turns``.

Each line is one JSON object with exactly one of:

* ``"prompt": "text"``: a single user turn;
* ``"messages": [{"role": ..., "content": ...}, ...]``: a chat context ending with a user
  turn (``system`` first if any, then ``user`` / ``assistant``);
* ``"turns": ["first question", "follow-up", ...]``: MT-bench style; each turn is asked
  after the model's own answer to the previous one.

A ``messages`` record may add ``"follow_ups": ["later user turn", ...]``, asked like the later
``turns`` (a held-out conversation with a system message and several user turns).

All are rendered with the target tokenizer's chat template and a generation prompt.
A reply ends at one of ``models.generation.stop_ids_of``: the generation config's eos ids and the tokenizer's
(the one stop rule of the serving eval and of regenerate / synthesize).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serving.jsonl import json_lines

Message = dict[str, str]
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PromptSpec:
    context: tuple[Message, ...]  # messages before the first answer; ends with a user turn
    follow_ups: tuple[str, ...] = ()  # later user turns, each after the generated answer

    @property
    def turns(self) -> int:
        return 1 + len(self.follow_ups)


def _message(m: object, where: str) -> Message:
    if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
        raise ValueError(f"{where}: each message must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")
    return {"role": m["role"], "content": m["content"]}


def parse_prompt(obj: object, where: str) -> PromptSpec:
    """One jsonl record -> PromptSpec; ValueError naming ``where`` when malformed."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kinds = [k for k in ("prompt", "messages", "turns") if k in obj]
    if len(kinds) != 1:
        raise ValueError(f"{where}: needs exactly one of 'prompt', 'messages', 'turns' (found {kinds or 'none'})")
    value = obj[kinds[0]]
    if kinds[0] == "prompt":
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        return PromptSpec(({"role": "user", "content": value},))
    if kinds[0] == "turns":
        if not isinstance(value, list) or not value or not all(isinstance(t, str) and t.strip() for t in value):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return PromptSpec(({"role": "user", "content": value[0]},), tuple(value[1:]))
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    messages = tuple(_message(m, where) for m in value)
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: 'messages' must end with a user turn (the model answers it)")
    follow_ups = obj.get("follow_ups", [])
    if not isinstance(follow_ups, list) or not all(isinstance(t, str) and t.strip() for t in follow_ups):
        raise ValueError(f"{where}: 'follow_ups' must be a list of non-empty strings")
    return PromptSpec(messages, tuple(follow_ups))


def read_prompt_file(path: str | Path, limit: int | None = None) -> list[PromptSpec]:
    """Every record of a jsonl prompt file (blank lines skipped), at most ``limit``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: prompt file does not exist")
    specs = []
    for record in json_lines(path):
        if record.error is not None:
            raise ValueError(f"{record.where}: {record.error}")
        specs.append(parse_prompt(record.value, record.where))
        if limit is not None and len(specs) >= limit:
            break
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return specs


def prompt_record(spec: PromptSpec) -> dict:
    """The jsonl record ``parse_prompt`` reads back as ``spec``."""
    if len(spec.context) == 1 and spec.context[0]["role"] == "user":
        first = spec.context[0]["content"]
        return {"turns": [first, *spec.follow_ups]} if spec.follow_ups else {"prompt": first}
    return {"messages": list(spec.context)} | ({"follow_ups": list(spec.follow_ups)} if spec.follow_ups else {})


def write_prompt_file(specs: list[PromptSpec], path: str | Path) -> Path:
    """``specs`` as a prompt file (one record a line) that ``read_prompt_file`` reads back equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(prompt_record(s), ensure_ascii=False) + "\n" for s in specs), encoding="utf-8")
    return path


def prompts_from_conversations(conversations) -> list[PromptSpec]:
    """Held-out conversations (lists of role/content messages) -> prompts asking their user
    turns in order; the conversations' own assistant answers are dropped (the model answers)."""
    specs = []
    for conv in conversations:
        users = [m["content"] for m in conv if m.get("role") == "user"]
        system = [dict(m) for m in conv[:1] if m.get("role") == "system"]
        if users:
            specs.append(PromptSpec((*system, {"role": "user", "content": users[0]}), tuple(users[1:])))
    return specs


def distinct(specs: list[PromptSpec]) -> list[PromptSpec]:
    """``specs`` with each prompt (context and follow-ups) once, in first-seen order."""
    seen: set[str] = set()
    keys = [json.dumps(prompt_record(s), sort_keys=True, ensure_ascii=False) for s in specs]
    return [s for s, key in zip(specs, keys) if not (key in seen or seen.add(key))]


def ask(spec: PromptSpec, answer: Callable[[list[Message]], str]) -> int:
    """Ask every turn of ``spec``: ``answer(messages)`` replies to the conversation so far (which
    ends with a user turn) and later turns see that reply. Returns the number of turns."""
    messages = list(spec.context)
    for follow_up in (None, *spec.follow_ups):
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
        messages.append({"role": "assistant", "content": answer(list(messages))})
    return spec.turns


def render(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of ``messages`` under the chat template, ending in the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
