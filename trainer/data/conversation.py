"""One conversation, and the two record schemas that carry conversations in the wild.

A conversation is ``list[dict]``: each message has ``role`` (``system``, ``user`` or
``assistant``) and ``content`` (str); an assistant message may also carry
``reasoning_content`` (str, rendered by templates that know the key, e.g. Qwen3 / Kimi) and
``weight`` (0 or 1, OpenAI fine-tuning files: 0 keeps the turn out of the loss mask).

Record schemas:

- ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system" | ..., "value": str}],
  "system": str (optional)}``
- messages (UltraChat, OpenAI chat files, regenerated data): ``{"messages": [{"role": ...,
  "content": str | [{"type": "text", "text": str}, ...]}]}``

A parser raises ``UnknownRole`` for a role it cannot map (always an error: it means the wrong
format or a schema this reader does not know) and ``MalformedRecord`` for any other shape
problem (``data.on_error`` decides). Both are ``ValueError``s whose message starts with where
the record is (``file:line``).
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]
Conversation = list[Message]
ROLES = ("system", "user", "assistant")

# ShareGPT dumps name the speakers in several ways; these are the ones seen in the common dumps.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
# OpenAI's chat format; "developer" is its newer name for the system message.
MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


ON_ERROR = ("raise", "skip")  # what a reader does with a malformed record (data.on_error): raise it, or skip and count it


class MalformedRecord(ValueError):
    """A record that is not a conversation of the expected schema (``data.on_error`` decides)."""


class UnknownRole(ValueError):
    """A message role the schema does not know (always an error)."""


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise MalformedRecord(f"{where}: {message}")


def _text(content: object, where: str, i: int) -> str:
    """Message content as text: a str, or OpenAI content parts that are all text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise MalformedRecord(f"{where}: message {i} content must be a str or a list of text parts, got {content!r:.80}")


def parse_sharegpt(record: object, where: str) -> Conversation:
    """A ShareGPT record -> conversation (see the module doc)."""
    _require(isinstance(record, dict), where, f"a ShareGPT record must be an object, got {type(record).__name__}")
    turns = record.get("conversations")
    _require(isinstance(turns, list), where, "a ShareGPT record needs key 'conversations' holding a list")
    conv: Conversation = []
    system = record.get("system")
    if system is not None:
        _require(isinstance(system, str), where, "key 'system' must be a str")
        if system.strip():
            conv.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        _require(isinstance(turn, dict), where, f"turn {i} must be an object with 'from' and 'value'")
        speaker, value = turn.get("from"), turn.get("value")
        _require(isinstance(speaker, str) and isinstance(value, str), where, f"turn {i} needs 'from' and 'value' as str, got {turn!r:.80}")
        role = SHAREGPT_ROLES.get(speaker.lower())
        if role is None:
            raise UnknownRole(f"{where}: unknown role {speaker!r} in turn {i} ('from' must be one of {', '.join(SHAREGPT_ROLES)})")
        conv.append({"role": role, "content": value})
    return conv


def parse_messages(record: object, where: str) -> Conversation:
    """A messages record (UltraChat, OpenAI chat) -> conversation (see the module doc)."""
    _require(isinstance(record, dict), where, f"a messages record must be an object, got {type(record).__name__}")
    messages = record.get("messages")
    _require(isinstance(messages, list), where, "a messages record needs key 'messages' holding a list")
    conv: Conversation = []
    for i, message in enumerate(messages):
        _require(isinstance(message, dict), where, f"message {i} must be an object with 'role' and 'content'")
        name = message.get("role")
        _require(isinstance(name, str), where, f"message {i} needs 'role' as str, got {message!r:.80}")
        role = MESSAGE_ROLES.get(name)
        if role is None:
            raise UnknownRole(f"{where}: unknown role {name!r} in message {i} ('role' must be one of {', '.join(MESSAGE_ROLES)})")
        out: Message = {"role": role, "content": _text(message.get("content"), where, i)}
        if role == "assistant":
            reasoning = message.get("reasoning_content")
            _require(reasoning is None or isinstance(reasoning, str), where, f"message {i}: 'reasoning_content' must be a str")
            if reasoning is not None:
                out["reasoning_content"] = reasoning
            weight = message.get("weight")
            _require(
                weight in (None, 0, 1) and not isinstance(weight, bool), where, f"message {i}: 'weight' must be 0 or 1, got {weight!r}"
            )
            if weight is not None:
                out["weight"] = weight
        conv.append(out)
    return conv


def normalise(conv: Conversation, where: str) -> tuple[Conversation, int]:
    """The conversation with assistant turns before the first user turn dropped (a template
    cannot prompt for them) and the count dropped. A system message is allowed only first."""
    for i, message in enumerate(conv):
        _require(message["role"] != "system" or i == 0, where, f"message {i} is a system message; only the first message may be")
    start = 1 if conv and conv[0]["role"] == "system" else 0
    first_user = next((i for i in range(start, len(conv)) if conv[i]["role"] == "user"), len(conv))
    return conv[:start] + conv[first_user:], first_user - start


def trainable(message: Message) -> bool:
    """An assistant turn whose tokens go under the loss mask."""
    return message["role"] == "assistant" and message.get("weight", 1) == 1


def check_conversation(conv: Conversation) -> None:
    """Internal shape of a conversation handed to encoding (sources produce only these)."""
    for i, message in enumerate(conv):
        if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {message!r:.120}")
    if not any(trainable(m) for m in conv):
        raise ValueError("a conversation needs at least one assistant turn (with weight 1)")
