"""From config to the run's data: read the sources (``read_sources``, before the target loads), split off the held-out side (``Holdout``),
check training prompts against held-out prompt files, cap, encode, and mix (``prepare_data``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import DataConfig, DataSourceConfig
from trainer.data import (
    Batcher,
    Conversation,
    DatasetStats,
    EncodedSample,
    MalformedRecord,
    MaskPolicy,
    Mix,
    MixLoader,
    PackedBatcher,
    PaddedBatcher,
    cut_answers,
    encode_conversations,
    first_prompt_key,
    read_chatterbot,
    read_source,
    split_by_prompts,
    split_holdout,
)
from trainer.data.corpora_select import LeakCheck, first_user_turn, read_heldout_files
from trainer.data.tokenizer_pool import TokenizerPool, default_workers


@dataclass
class PreparedData:
    """Encoded samples per source, the mix over them, and the counters to report."""

    train: dict[str, list[EncodedSample]]  # per source, in source order
    eval: dict[str, list[EncodedSample]]  # per source: its held-out split
    eval_conversations: dict[str, list[Conversation]]  # per source: the held-out conversations (serving eval prompts)
    stats: dict[str, DatasetStats]  # per source: reading + encoding counters of its training side
    mix: Mix
    heldout_rule: str  # how the held-out side was chosen, for reports (``Holdout.describe``)

    @property
    def total_stats(self) -> DatasetStats:
        return DatasetStats.total(self.stats.values())

    def report(self) -> dict:
        """The run summary's ``data`` entry: the summed counters, ``mix`` (source -> share of an
        epoch's samples, what ``trainer.report.metrics.data_metrics`` logs as data/mix/<source>) and
        ``sources`` (source -> its own counters)."""
        shares = {n: k / self.mix.epoch_samples for n, k in zip(self.mix.names, self.mix.quotas)}
        return self.total_stats.as_dict() | {"mix": shares, "sources": {n: s.as_dict() for n, s in self.stats.items()}}

    def eval_samples(self) -> list[EncodedSample]:
        """Every source's held-out samples, sources in mix order (not weighted)."""
        return [s for name in self.mix.names for s in self.eval[name]]

    def train_loader(self, batcher: Batcher, rank: int, world: int) -> MixLoader:
        return MixLoader(self.train, self.mix, batcher, rank, world)


def mask_policy(cfg: DataConfig) -> MaskPolicy:
    return MaskPolicy(last_turn_only=cfg.train_only_last_turn, train_thinking=cfg.train_thinking, think_tags=tuple(cfg.think_tags))


def train_batcher(cfg: DataConfig, pad_id: int) -> Batcher:
    """The training batcher: packed rows of ``data.max_len`` with ``data.packing``, else padded rows."""
    if cfg.packing:
        return PackedBatcher(max_tokens=cfg.max_tokens, row_tokens=cfg.max_len, pad_id=pad_id)
    return PaddedBatcher(max_tokens=cfg.max_tokens, pad_id=pad_id)


def _read(name: str, src: DataSourceConfig, on_error: str):
    """One source's conversations; a malformed record (``data.on_error=raise``) names its place and the fix."""
    try:
        return read_source(
            src.format, src.path, languages=tuple(src.languages), split=src.split, on_error=on_error, name=f"data.sources.{name}"
        )
    except MalformedRecord as e:
        raise MalformedRecord(f"{e}\n(data.on_error=skip skips malformed records and counts them)") from e


Sources = dict[str, tuple[list[Conversation], DatasetStats]]  # source -> its conversations and reading counters


def read_sources(cfg: DataConfig) -> Sources:
    """Every source the mix uses (all of ``data.sources`` when ``data.mix`` is unset), read and checked: a
    record that is not UTF-8, not JSON or not of its format names its file and line. Needs no tokenizer, so a
    run reads its data before the target loads; a source with no conversation left is an error here too."""
    if not cfg.sources:
        raise ValueError("config data.sources: no source; select a data group (data=chatterbot, data=sharegpt, ...)")
    sources = {}
    for name in list(cfg.mix) if cfg.mix is not None else list(cfg.sources):
        convs, stats = sources[name] = _read(name, cfg.sources[name], cfg.on_error)
        if not convs:
            raise no_samples_error(name, cfg.sources[name], stats, 0)
    return sources


def no_samples_error(name: str, src: DataSourceConfig, stats: DatasetStats, train_conversations: int) -> ValueError:
    """Why a source gave no training sample, in words: what it read, and what was skipped or dropped."""
    where = f"data.sources.{name}" + (f" ({src.path})" if src.path is not None else "")
    if stats.conversations == 0 and stats.malformed == 0 and stats.no_assistant == 0 and stats.duplicates == 0:
        return ValueError(f"{where}: holds no conversation: nothing to train on")
    dropped = {
        "malformed records skipped": stats.malformed,
        "conversations without an assistant turn": stats.no_assistant,
        "exact duplicates": stats.duplicates,
        "samples over data.max_len dropped (data.overlong=drop)": stats.overlong_dropped,
        "samples with no token under the loss mask": stats.no_masked_token,
    }
    why = ", ".join(f"{n} {what}" for what, n in dropped.items() if n)
    return ValueError(
        f"{where}: no training sample left of {stats.conversations} conversations read "
        f"({train_conversations} on the training side after the held-out split{'; ' + why if why else ''})"
    )


@dataclass(frozen=True)
class Holdout:
    """The held-out rule of a config: the first prompts of ``data.holdout_categories`` (held out
    of every source), or else a seeded hash of the first prompt at each source's fraction."""

    cfg: DataConfig
    seed: int
    keys: frozenset[str] | None  # first-prompt keys of the held-out categories; None: hash split

    @classmethod
    def of(cls, cfg: DataConfig, seed: int) -> "Holdout":
        if cfg.holdout_categories is None:
            return cls(cfg, seed, None)
        held, _ = read_chatterbot(chatterbot_languages_of(cfg), cfg.holdout_categories)
        return cls(cfg, seed, frozenset(first_prompt_key(c) for c in held))

    def split(self, name: str, convs: list[Conversation]) -> tuple[list[Conversation], list[Conversation]]:
        if self.keys is not None:
            return split_by_prompts(convs, self.keys)
        src = self.cfg.sources[name]
        return split_holdout(convs, src.holdout_fraction if src.holdout_fraction is not None else self.cfg.holdout_fraction, self.seed)

    def describe(self) -> str:
        if self.keys is not None:
            return (
                f"chatterbot categories {', '.join(self.cfg.holdout_categories)} ({', '.join(chatterbot_languages_of(self.cfg))}; "
                f"{len(self.keys)} first prompts, held out of every source, never trained on)"
            )
        fractions = {n: s.holdout_fraction for n, s in self.cfg.sources.items() if s.holdout_fraction is not None}
        return f"first-prompt hash, fraction {self.cfg.holdout_fraction}{f' {fractions}' if fractions else ''}, seed {self.seed}"


def chatterbot_languages_of(cfg: DataConfig) -> list[str]:
    """The languages of the config's chatterbot sources (english when it has none)."""
    langs = [lang for s in cfg.sources.values() if s.format == "chatterbot" for lang in s.languages]
    return list(dict.fromkeys(langs)) or ["english"]


def leak_check(cfg: DataConfig, eval_prompts_file: str | None) -> LeakCheck | None:
    """The held-out prompts of ``data.heldout_prompt_files`` and ``eval_prompts_file`` (None when neither is set)."""
    files = [*cfg.heldout_prompt_files, *([eval_prompts_file] if eval_prompts_file is not None else [])]
    return LeakCheck(read_heldout_files(files)) if files else None


def check_split_sizes(cfg: DataConfig, holdout: "Holdout", train: dict[str, list], held: dict[str, list]) -> None:
    """Before any service starts: every source has a held-out side (hash split; with held-out
    categories, at least one source has), else a ValueError saying which setting to change."""
    sizes = ", ".join(f"{n}: {len(train[n])} train / {len(held[n])} held out" for n in train)
    if holdout.keys is not None:
        if not any(held.values()):
            raise ValueError(
                f"config data.holdout_categories: no source has a conversation of those categories ({sizes}); name other categories"
            )
        return
    for name in train:
        if not held[name]:
            src = cfg.sources[name]
            fraction = src.holdout_fraction if src.holdout_fraction is not None else cfg.holdout_fraction
            capped = " or data.max_eval_conversations (it is 0)" if cfg.max_eval_conversations == 0 else ""
            raise ValueError(
                f"data.sources.{name}: the held-out split is empty ({sizes}; holdout_fraction {fraction}): the run evaluates on it. "
                f"Raise data.sources.{name}.holdout_fraction (or data.holdout_fraction){capped}, or add conversations"
            )


def prepare_data(
    cfg: DataConfig, tokenizer, seed: int, eval_prompts_file: str | None = None, sources: Sources | None = None
) -> PreparedData:
    """Split, cap and encode the sources the mix uses (``sources``: as ``read_sources`` read them; None:
    read here); held-out conversations never reach training. A training
    conversation whose first prompt repeats a prompt of ``data.heldout_prompt_files`` or
    ``eval_prompts_file`` (exactly or as a near-duplicate) is an error, and so is an empty
    training or held-out side (``check_split_sizes``)."""
    sources = read_sources(cfg) if sources is None else sources
    holdout = Holdout.of(cfg, seed)
    with TokenizerPool(tokenizer, cfg.encode_workers or default_workers()) as pool:
        train, held, held_convs_by_source, stats = _encode_sources(cfg, sources, tokenizer, holdout, eval_prompts_file, pool)
    check_split_sizes(cfg, holdout, train, held)
    weights = dict(cfg.mix) if cfg.mix is not None else None
    mix = Mix({n: len(train[n]) for n in sources}, weights, seed, cfg.epoch_samples)
    return PreparedData(
        train=train, eval=held, eval_conversations=held_convs_by_source, stats=stats, mix=mix, heldout_rule=holdout.describe()
    )


def _encode_sources(
    cfg: DataConfig, sources: Sources, tokenizer, holdout: Holdout, eval_prompts_file: str | None, pool: TokenizerPool
) -> tuple[dict, dict, dict, dict]:
    """Each source split, leak-checked, cut and encoded: (train, held, held conversations, stats) by source."""
    policy, leaks = mask_policy(cfg), leak_check(cfg, eval_prompts_file)
    train, held, held_convs_by_source, stats = {}, {}, {}, {}
    for name, (convs, read_stats) in sources.items():
        src = cfg.sources[name]
        train_convs, held_convs = holdout.split(name, convs)
        if leaks is not None:
            firsts = ((str(i), first_user_turn(c)) for i, c in enumerate(train_convs))
            leaks.check(firsts, f"data.sources.{name}: training conversation", pool)
        train_convs, held_convs = train_convs[: cfg.max_conversations], held_convs[: cfg.max_eval_conversations]
        if cfg.answer_tokens is not None:
            train_convs, read_stats.answers_cut = cut_answers(tokenizer, train_convs, cfg.answer_tokens, pool)
            held_convs, _ = cut_answers(tokenizer, held_convs, cfg.answer_tokens, pool)
        train[name], stats[name] = encode_conversations(
            tokenizer, train_convs, cfg.max_len, read_stats, overlong=cfg.overlong, policy=policy, pool=pool
        )
        held[name], _ = encode_conversations(tokenizer, held_convs, cfg.max_len, overlong=cfg.overlong, policy=policy, pool=pool)
        held_convs_by_source[name] = held_convs
        if not train[name]:
            raise no_samples_error(name, src, stats[name], len(train_convs))
    return train, held, held_convs_by_source, stats
