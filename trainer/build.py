"""What a run is built from its config: the target, the data, the vocab map and the DeepSpeed draft."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from models.batch import TokenBatch
from models.draft import DraftShape, Eagle3Draft, Pointwise, draft_shape_for
from models.target import TargetInfo
from models.vocab_map import VocabMap, build_vocab_map, count_tokens
from serving.prompts import PromptSpec, distinct, prompts_from_conversations, read_prompt_file
from trainer import checkpoint as ckpt
from trainer.config import Config
from trainer.data import EncodedSample, MixLoader, read_chat_template, token_batches
from trainer.data_setup import PreparedData, prepare_data, read_sources, train_batcher
from trainer.dist import Parallel
from trainer.draft_init import InitialDraft, initial_draft
from trainer.engine_memory import check_engine_memory
from trainer.flops import device_peak_tflops
from trainer.preflight import resume_path
from trainer.schedule import RunClock, ScheduleStart, draft_optimizer, run_lr_factor
from trainer.stream.feature_stream import TargetSource
from trainer.target_setup import TargetBundle, load_target, target_factory
from trainer.ttt import TargetLabeler, TTTObjective


@dataclass
class RunIdentity:
    """What a checkpoint's fingerprint is computed from: the target, the draft's shape, the sizes of the run."""

    cfg: Config
    info: TargetInfo
    shape: DraftShape
    embed_digest: str  # the target's embedding, which the draft keeps frozen
    dtype: torch.dtype
    world: int

    def fingerprint(self, vocab: VocabMap) -> dict:
        """What a checkpoint was trained on, every size that shapes a saved or rebuilt tensor included;
        a resume compares it key by key (trainer.resume_allow)."""
        info, cfg, shape = self.info, self.cfg, self.shape.to_dict()
        derived = ("vocab_size", "target_hidden_size", "num_aux")  # the target's: in target.*
        return {
            "target": {
                "architecture": info.architecture,
                "layers": info.num_layers,
                "hidden": info.hidden_size,
                "vocab": info.vocab_size,
                "aux_layer_ids": list(info.aux_layer_ids),
                "dtype": str(self.dtype),
                "embedding": self.embed_digest,
            },
            "draft": {k: v for k, v in shape.items() if k not in derived}
            | {"ttt_steps": cfg.draft.ttt_steps, "norm_output": cfg.draft.norm_output},
            "vocab_map": ckpt.vocab_digest(vocab),
            "data": asdict(cfg.data) | {"seed": cfg.trainer.seed},
            "schedule": asdict(cfg.schedule) | {"epochs": cfg.trainer.epochs, "max_steps": cfg.trainer.max_steps},
            "parallel": {"world": self.world, "zero_stage": cfg.deepspeed.zero_stage, "grad_accum": cfg.deepspeed.grad_accum},
        }


@dataclass
class Built:
    """Everything ``Trainer`` trains with, built by ``build``."""

    dtype: torch.dtype  # the target's features
    target: TargetBundle
    identity: RunIdentity
    target_source: TargetSource  # the feature engine (inprocess, colocated or SGLang)
    data: PreparedData
    loader: MixLoader  # this rank's training batches
    prompts: list[PromptSpec]  # the serving-eval prompts
    prompt_origin: dict  # where they come from (the summary's ``eval_prompts``)
    resume_from: Path | None  # the checkpoint the run continues from
    vocab: VocabMap  # the map trained with: built from this run's data, or the resumed checkpoint's
    labeler: TargetLabeler
    total_steps: int
    schedule_start: ScheduleStart  # where the LR schedule starts: step 0, or a trained draft's continuation
    clock: RunClock  # the training seconds the LR schedule reads (trainer.components.TimeCap keeps them)
    ds_model: object  # deepspeed.DeepSpeedEngine wrapping a TTTObjective (the draft and its loss)
    peak_tflops: float | None  # None: no perf/mfu


def build(cfg: Config, par: Parallel, ckpt_root: Path) -> Built:
    """Build a run in a fixed order (the seed is set first: the draft's initialisation draws from it)."""
    torch.manual_seed(cfg.trainer.seed)
    dtype = _dtype(cfg.target.dtype, par.device)
    sources = read_sources(cfg.data)  # before the target loads: a bad record is an error in seconds
    target = load_target(cfg.target, cfg.engine.mode, par.device, dtype)
    head, ids = target.head, tuple(target.head.info.aux_layer_ids)
    if cfg.data.chat_template is not None:  # the data and the serving eval render with it
        head.tokenizer.chat_template = read_chat_template(cfg.data.chat_template)
    d = cfg.draft
    configured = draft_shape_for(head.config, len(ids), d.draft_vocab_size, d.intermediate_size, d.layout, d.fc_norm)
    check_engine_memory(cfg, head.config, len(ids), par.device)  # before DeepSpeed and the engine take the GPU
    init = initial_draft(cfg.draft, head, configured)  # draft.init_from, checked against this target and config
    shape = init.shape if init else configured
    identity = RunIdentity(cfg, head.info, shape, ckpt.tensor_digest(head.embed_weight), dtype, par.world)
    source = TargetSource(target_factory(cfg, ids, dtype, par), engine=target.engine, info=head.info)
    data = prepare_data(cfg.data, head.tokenizer, cfg.trainer.seed, cfg.trainer.eval_prompts_file, sources)
    loader = data.train_loader(train_batcher(cfg.data, target.pad_id), par.rank, par.world)
    prompts, prompt_origin = eval_prompt_set(cfg, data)
    resume_from = resume_path(cfg.trainer.resume, ckpt_root)
    # the map trained with: draft.init_from's, else from an epoch of the mix (counts follow its weights)
    built = init.vocab if init else vocab_map(loader.epoch_samples(0), head.info.vocab_size, cfg.draft.draft_vocab_size)
    if resume_from:
        check_resume(cfg, resume_from, identity.fingerprint(built))  # before anything is built to the checkpoint's shapes
    vocab = VocabMap.load(resume_from / ckpt.VOCAB_FILE) if resume_from else built
    labeler = TargetLabeler(head.lm_head_weight, vocab.draft_to_target.to(par.device), vocab.t2d.to(par.device))
    total, clock = total_steps(cfg, data, loader, par), RunClock(cfg.trainer.max_time_s)
    start = schedule_start(cfg, resume_from)
    return Built(
        dtype=dtype,
        target=target,
        identity=identity,
        target_source=source,
        data=data,
        loader=loader,
        prompts=prompts,
        prompt_origin=prompt_origin,
        resume_from=resume_from,
        vocab=vocab,
        labeler=labeler,
        total_steps=total,
        schedule_start=start,
        clock=clock,
        ds_model=deepspeed_model(cfg, target, shape, vocab, total, start, clock, dtype, par.device, init),
        peak_tflops=device_peak_tflops(cfg.trainer.peak_tflops, par.device.type),
    )


def schedule_start(cfg: Config, resume_from: Path | None) -> ScheduleStart:
    """Where the run's LR schedule starts. A fresh run: step 0, continued under ``draft.init_from``. A resume that
    changes ``schedule.name`` (grokking from a cosine checkpoint): a new schedule for a trained draft from the
    checkpoint's step. Any other resume: the checkpoint's own start."""
    if resume_from is None:
        return ScheduleStart(0, continued=cfg.draft.init_from is not None)
    meta = ckpt.read_meta(resume_from)
    pos = ckpt.Position(**meta["position"])
    if meta["fingerprint"]["schedule"]["name"] != cfg.schedule.name:
        return ScheduleStart(pos.step, continued=True)
    return ScheduleStart(pos.schedule_from_step, pos.continued)


def eval_batches(cfg: Config, data: PreparedData, par: Parallel, pad_id: int) -> list[TokenBatch]:
    """This rank's held-out batches (the first ``trainer.eval_batches``)."""
    batches = token_batches(data.eval_samples(), cfg.data.max_tokens, cfg.trainer.seed, 0, par.rank, par.world, pad_id)
    return batches[: cfg.trainer.eval_batches]


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def vocab_map(samples: list[EncodedSample], target_vocab: int, draft_vocab_size: int) -> VocabMap:
    """The draft vocabulary of ``samples``' loss-masked tokens, counted in one pass over all of them."""
    total = sum(len(s.input_ids) for s in samples)
    ids = np.fromiter(itertools.chain.from_iterable(s.input_ids for s in samples), np.int64, total)  # [N]
    mask = np.fromiter(itertools.chain.from_iterable(s.loss_mask for s in samples), np.bool_, total)  # [N]
    return build_vocab_map(count_tokens([(torch.from_numpy(ids), torch.from_numpy(mask))], target_vocab), draft_vocab_size)


def total_steps(cfg: Config, data: PreparedData, loader: MixLoader, par: Parallel) -> int:
    per_epoch = loader.batches_per_rank(0) // cfg.deepspeed.grad_accum
    if per_epoch == 0:
        raise ValueError(
            f"data: {data.mix.epoch_samples} training samples an epoch make no full optimizer step for "
            f"{par.world} rank(s) x grad_accum {cfg.deepspeed.grad_accum} at data.max_tokens {cfg.data.max_tokens}"
        )
    total = per_epoch * cfg.trainer.epochs
    return min(total, cfg.trainer.max_steps) if cfg.trainer.max_steps else total


def deepspeed_config(cfg: Config, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": cfg.deepspeed.grad_accum,
        "gradient_clipping": cfg.deepspeed.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": bf16},  # check_grad_overflow defaults on: a non-finite gradient skips the update
        "steps_per_print": 10**9,
        # DeepSpeed's throughput timer synchronizes the device as each forward starts; the trainer times its own steps
        "timers": {"throughput": {"enabled": False}},
    }


def pointwise_for(cfg: Config, device: torch.device) -> Pointwise:
    """draft.compile_pointwise, or (null) ``Pointwise.default_for`` the device."""
    compiled = cfg.draft.compile_pointwise
    return Pointwise.default_for(device) if compiled is None else Pointwise(compiled=compiled)


def deepspeed_model(
    cfg: Config,
    target: TargetBundle,
    shape: DraftShape,
    vocab: VocabMap,
    total: int,
    start: ScheduleStart,
    clock: RunClock,
    dtype: torch.dtype,
    device: torch.device,
    init: InitialDraft | None = None,
):
    """The draft, initialised from ``init`` (draft.init_from) or else from the target's embedding and
    lm_head, in its TTT objective under DeepSpeed."""
    import deepspeed

    head = target.head
    draft = Eagle3Draft(shape, pointwise_for(cfg, device))
    if init:
        draft.load_state_dict(init.draft.state_dict())
    else:
        draft.init_from_target(head.embed_weight.float().cpu(), head.lm_head_weight.float().cpu(), vocab.draft_to_target)
    objective = TTTObjective(draft, cfg.draft.ttt_steps, cfg.draft.step_decay, cfg.draft.norm_output)
    params = [p for p in objective.parameters() if p.requires_grad]
    s = cfg.schedule
    opt = draft_optimizer(params, s, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: run_lr_factor(s, start, step, total, clock.schedule_frac))
    config = deepspeed_config(cfg, dtype == torch.bfloat16)
    ds_model, *_ = deepspeed.initialize(model=objective, optimizer=opt, lr_scheduler=sched, config=config)
    return ds_model


def check_resume(cfg: Config, path: Path, now: dict) -> None:
    """Refuse to resume from ``path`` when its fingerprint differs from this run's ``now`` (except trainer.resume_allow)."""
    allow = list(cfg.trainer.resume_allow) + (["vocab_map"] if "data" in cfg.trainer.resume_allow else [])
    diffs = ckpt.differences(ckpt.read_meta(path)["fingerprint"], now, allow)
    if diffs:
        raise ValueError(
            f"cannot resume from {path}, it differs from this run:\n  "
            + "\n  ".join(diffs)
            + f"\n(resume with the checkpoint's values; trainer.resume_allow={' or '.join(f'[{k}]' for k in ckpt.CHANGEABLE)} "
            f"permits a deliberate change of {' or '.join(ckpt.CHANGEABLE)})"
        )


def eval_prompt_set(cfg: Config, data: PreparedData) -> tuple[list[PromptSpec], dict]:
    """The serving-eval prompts and where they come from (the run summary's ``eval_prompts``):
    ``trainer.eval_prompts_file``, or the first ``trainer.eval_prompts`` distinct prompts of the
    held-out conversations of the sources in mix order (conversations that open alike ask one
    prompt), with the held-out rule and how many each source gave."""
    n = cfg.trainer.eval_prompts
    if cfg.trainer.eval_prompts_file is not None:
        prompts = read_prompt_file(cfg.trainer.eval_prompts_file, limit=n)
        origin: dict = {"kind": "file", "path": cfg.trainer.eval_prompts_file}
    else:
        prompts, taken = [], {}
        for name in data.mix.names:
            if len(prompts) < n:
                got = distinct(prompts + prompts_from_conversations(data.eval_conversations[name]))[len(prompts) : n]
                prompts, taken[name] = prompts + got, len(got)
        origin = {"kind": "heldout", "split": data.heldout_rule, "sources": taken}
    return prompts, origin | {"prompts": len(prompts), "turns": sum(p.turns for p in prompts)}
