"""Conversations -> chat template -> tokens + assistant loss mask -> a weighted mix -> micro-batches.

One module a job (docs/DATA.md tells the whole story):

- ``conversation``: the conversation type and the ShareGPT / messages record schemas
- ``files``: records out of .json / .jsonl / .parquet files and ``datasets`` directories
- ``sources``: the named source formats, with the rules and counters they share
- ``split``: the held-out split by prompt
- ``chat``: chat template rendering, the assistant loss mask, the length policy
- ``mix``: weighted mixes of sources and what an epoch of one is
- ``batching``: batchers (plan groups, collate a TokenBatch) and rank sharding
- ``loader``: this rank's batches of a mix, epoch after epoch, with a resumable position
- ``stats``: the counters a run reports
"""

from trainer.data.batching import (
    Batcher,
    Group,
    PackedBatcher,
    PaddedBatcher,
    first_fit_rows,
    group_by_budget,
    next_fit_rows,
    pack_rows,
    pad_batch,
    shard,
    token_batches,
)
from trainer.data.chat import (
    OVERLONG,
    EncodedSample,
    MaskPolicy,
    assistant_spans,
    cut_answers,
    encode_conversation,
    encode_conversations,
    encode_full,
    fit_length,
    read_chat_template,
    thinking_spans,
)
from trainer.data.conversation import ON_ERROR, ROLES, Conversation, MalformedRecord, UnknownRole, parse_messages, parse_sharegpt
from trainer.data.loader import MixLoader
from trainer.data.mix import Mix
from trainer.data.sources import (
    DATA_FORMATS,
    chatterbot_categories,
    chatterbot_conversations,
    chatterbot_languages,
    chatterbot_turns,
    read_chatterbot,
    read_source,
)
from trainer.data.split import first_prompt_key, prompt_key, split_by_prompts, split_holdout
from trainer.data.stats import DatasetStats

__all__ = [
    "Batcher",
    "Group",
    "PackedBatcher",
    "PaddedBatcher",
    "first_fit_rows",
    "group_by_budget",
    "next_fit_rows",
    "pack_rows",
    "pad_batch",
    "shard",
    "token_batches",
    "OVERLONG",
    "EncodedSample",
    "MaskPolicy",
    "assistant_spans",
    "cut_answers",
    "encode_conversation",
    "encode_conversations",
    "encode_full",
    "fit_length",
    "thinking_spans",
    "ROLES",
    "Conversation",
    "MalformedRecord",
    "UnknownRole",
    "parse_messages",
    "parse_sharegpt",
    "MixLoader",
    "Mix",
    "DATA_FORMATS",
    "ON_ERROR",
    "chatterbot_categories",
    "chatterbot_conversations",
    "chatterbot_languages",
    "chatterbot_turns",
    "read_chat_template",
    "read_chatterbot",
    "read_source",
    "first_prompt_key",
    "prompt_key",
    "split_by_prompts",
    "split_holdout",
    "DatasetStats",
]
