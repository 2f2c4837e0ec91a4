"""The trainer: builds target engine, data, vocab map and the DeepSpeed draft; runs epochs."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from models.batch import FeatureBatch, TokenBatch
from models.draft import Eagle3Draft, draft_shape_for
from models.vocab_map import VocabMap, build_vocab_map, count_tokens
from serving.pipeline import export_verify_eval
from serving.prompts import PromptSpec, prompts_from_conversations, read_prompt_file, write_prompt_file
from trainer import checkpoint as ckpt
from trainer.config import Config
from trainer.data import EncodedSample, token_batches
from trainer.dist import Parallel, init_parallel, resolve_device
from trainer.flops import device_peak_tflops, flops_per_token, mfu
from trainer.report import metrics as M
from trainer.report.report import REPORT_DIR, REPORT_FILE, format_summary, write_report
from trainer.schedule import lr_factor
from trainer.sources import PreparedData, TargetBundle, load_target, prepare_data, target_recipe, train_batcher, with_eval_target
from trainer.stream.feature_stream import TargetSource, open_feature_stream
from trainer.ttt import TTTObjective, TTTOutput, simulated_accept_length, target_labels


@dataclass
class StepStats:
    """Summed counts of one or more TTT forwards; ratios are taken only when reporting."""

    loss_sum: torch.Tensor  # [K]
    correct: torch.Tensor  # [K]
    valid: torch.Tensor  # [K]

    @classmethod
    def of(cls, out: TTTOutput) -> "StepStats":
        return cls(out.loss_sum.detach().double(), out.correct.double(), out.valid.double())

    def add(self, other: "StepStats") -> "StepStats":
        return StepStats(self.loss_sum + other.loss_sum, self.correct + other.correct, self.valid + other.valid)

    def all_reduce(self, device: torch.device) -> "StepStats":
        packed = torch.stack([self.loss_sum, self.correct, self.valid]).to(device)  # NCCL reduces GPU tensors only
        torch.distributed.all_reduce(packed)
        return StepStats(*packed.cpu())

    def report(self, split: str) -> dict[str, float]:
        valid = self.valid.clamp(min=1)
        acc, loss = (self.correct / valid).tolist(), (self.loss_sum / valid).tolist()
        out = {f"{split}/loss": float(sum(loss) / len(loss))}
        for k in range(len(acc)):
            out[M.step_acc(k, split)] = acc[k]
            out[M.step_loss(k, split)] = loss[k]
        out[f"{split}/sim_accept_len"] = simulated_accept_length(acc)
        return out


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def _deepspeed_config(cfg: Config, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": cfg.deepspeed.grad_accum,
        "gradient_clipping": cfg.deepspeed.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": bf16},  # check_grad_overflow defaults on: a non-finite gradient skips the update
        "steps_per_print": 10**9,
    }


@dataclass
class Window:
    """What the trainer accumulates between two log rows."""

    stats: StepStats | None = None
    tokens: int = 0
    flops: float = 0.0  # model FLOPs of those tokens (trainer.flops)
    target_s: float = 0.0
    draft_s: float = 0.0
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, stats: StepStats, tokens: int, flops: float, target_s: float, draft_s: float) -> None:
        self.stats = stats if self.stats is None else self.stats.add(stats)
        self.tokens, self.flops = self.tokens + tokens, self.flops + flops
        self.target_s, self.draft_s = self.target_s + target_s, self.draft_s + draft_s


class Stop(Exception):
    """A stop signal (SIGINT, SIGTERM) ended the run: after the current step while training, at once otherwise."""


STARTUP, UNTRAINED_EVAL, TRAINING = "start-up", "untrained-draft eval", "training"
END_EVAL, SERVING_EVAL, REPORT = "end-of-run held-out eval", "end-of-run export, verify and serving eval", "summary and report"
PHASES = (STARTUP, UNTRAINED_EVAL, TRAINING, END_EVAL, SERVING_EVAL, REPORT)
PERIODIC_EVAL = "serving eval between training steps (trainer.export_every)"  # a stop cuts it and the training short
CHECKPOINTS = "checkpoints"  # the run dir's checkpoint folder
EVAL_PROMPTS_FILE = "eval_prompts.jsonl"  # the run dir's serving-eval prompts, a serving/prompts.py file


@dataclass
class StopSignals:
    """The run's phase and the stop signal received, shared by the signal handlers and the trainer.

    While training, a first signal stops the run after the current step (which saves a
    checkpoint); in every other phase, or on a second signal, ``Stop`` is raised at once."""

    phase: str = STARTUP
    received: str | None = None

    def enter(self, phase: str) -> None:
        """Begin ``phase``; Stop if a signal came while training deferred it."""
        self.phase = phase
        if self.received is not None:
            raise Stop()

    def handler(self, signum, frame) -> None:
        first, self.received = self.received is None, signal.Signals(signum).name
        if self.phase != TRAINING or not first:
            raise Stop()

    def exit_code(self) -> int:
        return 128 + signal.Signals[self.received].value  # what a shell reports for a process the signal ended

    def message(self, ckpt_root: Path, run_dir: Path) -> str:
        during = TRAINING if self.phase == PERIODIC_EVAL else self.phase
        skipped = [f"the rest of the {during}", *PHASES[PHASES.index(during) + 1 :]]
        if self.phase == PERIODIC_EVAL:
            skipped.insert(0, f"the rest of the {PERIODIC_EVAL}")
        head = f"stopped by {self.received} during the {self.phase}: skipped {'; '.join(skipped)}"
        kept = ckpt.latest(ckpt_root)
        if kept is None:
            return f"{head}.\nNo checkpoint yet: run the same command again to start over."
        step = ckpt.read_meta(kept)["position"]["step"]
        return (
            f"{head}.\nCheckpoint step {step} kept: {kept}\nResume (it redoes what was skipped) with the same overrides "
            f"plus: trainer.resume=auto hydra.run.dir={run_dir}"
        )


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, par: Parallel | None = None, signals: StopSignals | None = None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.signals = signals or StopSignals()
        self.par = par or init_parallel(resolve_device(cfg.trainer.device))
        torch.manual_seed(cfg.trainer.seed)
        self.dtype = _dtype(cfg.target.dtype, self.par.device)
        self.target: TargetBundle = load_target(cfg.target, cfg.engine.mode, self.par.device, self.dtype)
        info = self.target.head.info
        self.target_source = TargetSource(target_recipe(cfg, info.aux_layer_ids, self.dtype, self.par), engine=self.target.engine, info=info)
        self.data = prepare_data(cfg.data, self.target.head.tokenizer, cfg.trainer.seed, cfg.trainer.eval_prompts_file)
        self.loader = self.data.train_loader(train_batcher(cfg.data, self.target.pad_id), self.par.rank, self.par.world)
        self.eval_samples = self.data.eval_samples()
        self.prompts, self.prompt_origin = eval_prompt_set(cfg, self.data)
        if self.par.is_main:  # the serving eval's prompts: `python -m serving.eval ... --prompts RUN/eval_prompts.jsonl`
            write_prompt_file(self.prompts, self.run_dir / EVAL_PROMPTS_FILE)
        self.ckpt_root = self.run_dir / CHECKPOINTS
        resume_from = self._resume_path()
        built = self._vocab_map(self.loader.epoch_samples(0))  # an epoch of the mix: counts follow its weights
        self.vocab = VocabMap.load(resume_from / ckpt.VOCAB_FILE) if resume_from else built
        self.draft_to_target = self.vocab.draft_to_target.to(self.par.device)
        self.t2d = self.vocab.t2d.to(self.par.device)
        self.total_steps = self._total_steps()
        self.engine = self._deepspeed_engine()
        self.peak_tflops = device_peak_tflops(cfg.trainer.peak_tflops, self.par.device.type)  # None: no perf/mfu
        self.step, self.pos, self.nonfinite, self.resumed_from = 0, ckpt.Position(0, 0, 0), 0, resume_from
        self.out_of_time, self.train_s, self.tokens_local = False, 0.0, 0  # this process's training seconds and tokens (this rank)
        if resume_from:
            self._resume(resume_from, built)

    def _vocab_map(self, samples: list[EncodedSample]) -> VocabMap:
        pairs = ((torch.tensor(s.input_ids), torch.tensor(s.loss_mask)) for s in samples)
        counts = count_tokens(pairs, self.target.head.info.vocab_size)
        return build_vocab_map(counts, self.cfg.draft.vocab_size)

    def _deepspeed_engine(self):
        import deepspeed

        cfg, head = self.cfg, self.target.head
        draft = Eagle3Draft(draft_shape_for(head.config, len(head.info.aux_layer_ids), cfg.draft.vocab_size))
        draft.init_from_target(head.embed_weight.float().cpu(), head.lm_head_weight.float().cpu(), self.vocab.draft_to_target)
        objective = TTTObjective(draft, cfg.draft.ttt_steps, cfg.draft.step_decay, cfg.draft.norm_output)
        params = [p for p in objective.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.schedule.lr, betas=tuple(cfg.schedule.betas), weight_decay=cfg.schedule.weight_decay, fused=False, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg.schedule, s, self.total_steps))
        engine, *_ = deepspeed.initialize(
            model=objective, optimizer=opt, lr_scheduler=sched, config=_deepspeed_config(cfg, self.dtype == torch.bfloat16)
        )
        return engine

    # ------------------------------------------------------------------ resume and checkpoints

    def fingerprint(self, vocab: VocabMap) -> dict:
        """What a checkpoint was trained on; a resume compares it (trainer.resume_allow)."""
        info, cfg = self.target.head.info, self.cfg
        return {
            "target": {"architecture": info.architecture, "layers": info.num_layers, "hidden": info.hidden_size,
                       "vocab": info.vocab_size, "aux_layer_ids": list(info.aux_layer_ids)},
            "draft": self.engine.module.draft.shape.to_dict() | {"ttt_steps": cfg.draft.ttt_steps, "norm_output": cfg.draft.norm_output},
            "vocab_map": ckpt.vocab_digest(vocab),
            "data": asdict(cfg.data) | {"seed": cfg.trainer.seed},
            "schedule": asdict(cfg.schedule) | {"epochs": cfg.trainer.epochs, "max_steps": cfg.trainer.max_steps},
            "parallel": {"world": self.par.world, "zero_stage": cfg.deepspeed.zero_stage, "grad_accum": cfg.deepspeed.grad_accum},
        }  # fmt: skip

    def _resume_path(self) -> Path | None:
        resume = self.cfg.trainer.resume
        if resume is None:
            return None
        if resume == "auto":
            return ckpt.latest(self.ckpt_root)
        path = Path(resume)
        found = path if ckpt.is_complete(path) else ckpt.latest(path / "checkpoints")
        if found is None:
            raise ValueError(f"config trainer.resume: {path} is neither a checkpoint nor a run dir with checkpoints")
        return found

    def _resume(self, path: Path, built: VocabMap) -> None:
        allow = list(self.cfg.trainer.resume_allow) + (["vocab_map"] if "data" in self.cfg.trainer.resume_allow else [])
        saved = ckpt.read_meta(path)["fingerprint"]
        diffs = ckpt.differences(saved, self.fingerprint(built), allow)
        if diffs:
            raise ValueError(
                f"cannot resume from {path}, it differs from this run:\n  " + "\n  ".join(diffs)
                + "\n(trainer.resume_allow=[data] or [schedule] permits a deliberate change of data or schedule)"
            )
        self.pos, data_state = ckpt.load(self.engine, path)
        self.loader.load_state_dict(data_state, strict="data" not in allow)
        self.step = self.pos.step

    def save(self) -> Path:
        data_state = self.loader.state_for(self.pos.epoch, self.pos.micro)  # what was trained, not what was read ahead
        return ckpt.save(
            self.engine, self.ckpt_root, self.pos, data_state, self.fingerprint(self.vocab), self.vocab, asdict(self.cfg),
            self.cfg.trainer.keep_last, self.par.is_main,
        )  # fmt: skip

    # ------------------------------------------------------------------ steps

    def eval_batches(self) -> list[TokenBatch]:
        batches = token_batches(
            self.eval_samples, self.cfg.data.max_tokens, self.cfg.trainer.seed, 0, self.par.rank, self.par.world, self.target.pad_id
        )
        return batches[: self.cfg.trainer.eval_batches]

    def _total_steps(self) -> int:
        per_epoch = self.loader.batches_per_rank(0) // self.cfg.deepspeed.grad_accum
        if per_epoch == 0:
            raise ValueError(
                f"data: {self.data.mix.epoch_samples} training samples an epoch make no full optimizer step for "
                f"{self.par.world} rank(s) x grad_accum {self.cfg.deepspeed.grad_accum} at data.max_tokens {self.cfg.data.max_tokens}"
            )
        total = per_epoch * self.cfg.trainer.epochs
        return min(total, self.cfg.trainer.max_steps) if self.cfg.trainer.max_steps else total

    def _forward(self, fb: FeatureBatch) -> TTTOutput:
        labels = target_labels(fb.final, self.target.head.lm_head_weight, self.draft_to_target, self.t2d)
        t = fb.tokens
        return self.engine(t.input_ids, t.loss_mask, t.lengths, fb.aux, labels, self.draft_to_target, t.doc_ids)

    def _all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([1.0 if ok else 0.0], device=self.par.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _nonfinite(self, what: str) -> None:
        """Count a non-finite loss or gradient; stop unless trainer.on_nan=skip."""
        self.nonfinite += 1
        if self.cfg.trainer.on_nan == "stop":
            last = ckpt.latest(self.ckpt_root)
            raise RuntimeError(
                f"non-finite {what} at step {self.step + 1} (trainer.on_nan=stop); last good checkpoint: {last}"
            )

    def train_step(self, fb: FeatureBatch) -> TTTOutput | None:
        """Forward, backward, and (at an accumulation boundary) DeepSpeed's step; None if skipped."""
        out = self._forward(fb)
        if not self._all_agree(bool(torch.isfinite(out.loss))):
            self._nonfinite("loss")
            return None
        self.engine.backward(out.loss)
        self.engine.step()
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        batches = self.eval_batches()
        stats = None
        bar = tqdm(total=len(batches), desc="held-out eval", unit="batch", leave=False, disable=not self.par.is_main)
        with bar, open_feature_stream(self.cfg.engine, self.target_source, batches, self.par.device) as stream:
            for fb in stream:
                s = StepStats.of(self._forward(fb))
                bar.update(1)
                stats = s if stats is None else stats.add(s)
        self.engine.train()
        return stats.all_reduce(self.par.device).report("eval")

    def serve_eval(self) -> dict:
        """Export for SGLang and vLLM, verify both, and decode the held-out prompts speculatively
        with the SGLang export loaded back from disk against the whole target (rank 0; ZeRO-3
        gathers first; ``with_eval_target`` says when the target is loaded for it). Every rank gets the result."""
        import deepspeed

        draft, result, head = self.engine.module.draft, [None], self.target.head
        with deepspeed.zero.GatheredParameters(list(draft.parameters()), enabled=self.cfg.deepspeed.zero_stage == 3):
            if self.par.is_main:
                tqdm.write(
                    f"export for SGLang and vLLM to {self.run_dir / 'export'}, verify both, then decode "
                    f"{len(self.prompts)} held-out prompts speculatively (serving eval)", file=sys.stderr,
                )  # fmt: skip
                source = self.target.path

                def run(model) -> dict:
                    return export_verify_eval(
                        draft, self.vocab, head.info, model, head.tokenizer, self.prompts, self.run_dir / "export",
                        norm_output=self.cfg.draft.norm_output, k=self.cfg.trainer.spec_tokens,
                        max_new_tokens=self.cfg.trainer.eval_max_new_tokens, target_dir=source if source.is_dir() else None,
                    )  # fmt: skip

                result[0] = with_eval_target(self.target, self.cfg.trainer, self.par.device, self.dtype, run)
        torch.distributed.broadcast_object_list(result, src=0)
        return result[0]

    # ------------------------------------------------------------------ the loop

    def _flops(self, fb: FeatureBatch, tokens: int) -> float:
        """Model FLOPs of ``tokens`` trained tokens of ``fb``, the count launch/bench_throughput.py uses."""
        shape, seq = self.engine.module.draft.shape, fb.tokens.input_ids.shape[1]
        return tokens * flops_per_token(self.target.head.config, shape, seq, self.cfg.draft.ttt_steps)["total"]

    def _log_row(self, w: Window) -> dict[str, float]:
        packed = torch.tensor([float(w.tokens), w.flops], dtype=torch.float64, device=self.par.device)
        torch.distributed.all_reduce(packed)
        wall, n = time.perf_counter() - w.start, max(1, w.steps)
        row = w.stats.all_reduce(self.par.device).report("train") if w.stats is not None else {}
        row.update(self._progress())
        row.update({
            M.LR: self.engine.get_lr()[0], M.TOKENS_PER_S: packed[0].item() / wall, M.STEP_TIME: wall / n,
            M.TARGET_TIME: w.target_s / n, M.DRAFT_TIME: w.draft_s / n, M.NONFINITE: float(self.nonfinite),
            M.STALL_SHARE: w.target_s / max(1e-9, w.target_s + w.draft_s),
        })  # fmt: skip
        if self.peak_tflops is not None:
            row[M.MFU] = mfu(packed[1].item(), wall, self.par.world, self.peak_tflops)
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None and math.isfinite(grad_norm):
            row[M.GRAD_NORM] = float(grad_norm)
        if self.par.device.type == "cuda":
            row[M.GPU_MEM] = torch.cuda.max_memory_allocated(self.par.device) / 2**30
        return row

    def _progress(self) -> dict[str, float]:
        """Tokens trained on so far (all ranks) and this process's training seconds (every rank calls)."""
        packed = torch.tensor([float(self.tokens_local)], device=self.par.device)
        torch.distributed.all_reduce(packed)
        return {M.TOKENS_SEEN: packed.item(), M.TRAIN_TIME: self.train_s}

    def _sync(self) -> None:
        if self.par.device.type == "cuda":
            torch.cuda.synchronize()

    def _after_step(self, epoch: int, consumed: int, w: Window, sink, bar) -> Window:
        """Book-keeping at an optimizer-step boundary; returns the (possibly new) log window."""
        self.step, w.steps = self.step + 1, w.steps + 1
        self.pos = ckpt.Position(self.step, epoch, consumed)
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None and not math.isfinite(grad_norm):
            self._nonfinite("gradient")  # DeepSpeed has already skipped this update
        bar.update(1)
        if self.step % self.cfg.trainer.log_every == 0 or self.step == self.total_steps:
            row = self._log_row(w)
            if M.step_acc(0) in row:
                bar.set_postfix(loss=f"{row[M.LOSS]:.3f}", acc0=f"{row[M.step_acc(0)]:.3f}", tok_s=f"{row[M.TOKENS_PER_S]:.0f}")
            if sink is not None:
                sink.log(row | {"epoch": epoch}, step=self.step)
            w = Window()
        every = self.cfg.trainer
        stop = not self._all_agree(self.signals.received is None)
        if stop or (every.checkpoint_every and self.step % every.checkpoint_every == 0):
            self.save()  # before the serving eval: a stop signal during it keeps this step
        if stop:
            raise Stop()
        if every.export_every and self.step % every.export_every == 0:
            self._periodic_serve_eval(sink)
        if every.max_time_s is not None:
            self.out_of_time = not self._all_agree(self.train_s < every.max_time_s)
        return w

    def _periodic_serve_eval(self, sink) -> None:
        """Export -> verify -> serving eval between steps (minutes): a stop signal ends it, and the run, at once."""
        self.signals.phase = PERIODIC_EVAL
        served, progress = self.serve_eval(), self._progress()
        self.signals.phase = TRAINING
        if sink is not None:
            sink.log(_metrics_only(served) | progress, step=self.step)

    def _epoch(self, epoch: int, sink, bar) -> bool:
        """Train on the rest of ``epoch``; False when a cap (steps, time) ended the run inside it."""
        start = self.pos.micro if self.pos.epoch == epoch else 0
        batches = self.loader.epoch_batches(epoch)  # from the restored position when resuming into this epoch
        with open_feature_stream(self.cfg.engine, self.target_source, batches, self.par.device) as stream:
            return self._consume(stream, epoch, start, sink, bar)

    def _consume(self, stream, epoch: int, consumed: int, sink, bar) -> bool:
        accum, w, accumulated = self.cfg.deepspeed.grad_accum, Window(), 0
        while self.step < self.total_steps and not self.out_of_time:
            t0 = time.perf_counter()
            fb = next(stream, None)
            if fb is None:
                return True
            self._sync()
            t1 = time.perf_counter()
            out = self.train_step(fb)
            self._sync()
            consumed, self.train_s = consumed + 1, self.train_s + time.perf_counter() - t0
            if out is not None:
                tokens = int(fb.tokens.lengths.sum())
                self.tokens_local += tokens
                w.add(StepStats.of(out), tokens, self._flops(fb, tokens), t1 - t0, time.perf_counter() - t1)
                accumulated += 1
            if out is not None and accumulated % accum == 0:
                w = self._after_step(epoch, consumed, w, sink, bar)
        return False

    def _train(self, sink) -> None:
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not self.par.is_main, desc="train", unit="step")
        try:
            for epoch in range(self.pos.epoch, self.cfg.trainer.epochs):
                finished = self._epoch(epoch, sink, bar)
                if not finished:
                    break
                self.pos = ckpt.Position(self.step, epoch + 1, 0)
                self.save()
            else:
                return
            self.save()  # the step cap ended the run inside an epoch
        finally:
            bar.close()

    def fit(self) -> dict:
        """Evaluate the untrained draft, train, export, evaluate again; returns the summary."""
        start = time.perf_counter()
        sink = M.MetricsSink(self.cfg.wandb, self.run_dir, asdict(self.cfg), resume=self.resumed_from is not None) if self.par.is_main else None
        try:
            return self._fit(sink, start)
        except BaseException as e:
            if sink is not None:  # end the wandb run as failed or stopped rather than leave it open
                sink.run.finish(exit_code=self.signals.exit_code() if isinstance(e, Stop) else 1)
            raise

    def _fit(self, sink, start: float) -> dict:
        self.signals.enter(UNTRAINED_EVAL)
        untrained = None if self.resumed_from else self.evaluate()
        if sink is not None and untrained is not None:
            sink.log(untrained, step=0)
        try:
            self.signals.enter(TRAINING)
            self._train(sink)
            self.signals.enter(END_EVAL)
            trained = self.evaluate()
        finally:
            self.target_source.close()
        self.signals.enter(SERVING_EVAL)
        served, progress = self.serve_eval(), self._progress()
        trained |= _metrics_only(served)
        summary = {
            "steps": self.step,
            "stopped_by": self._stopped_by(),
            "wall_time_s": time.perf_counter() - start,
            "train_time_s": self.train_s,
            "tokens_seen": int(progress[M.TOKENS_SEEN]),
            "eval_prompts": self.prompt_origin,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "untrained_eval_sim_accept_len": untrained[M.EVAL_SIM_ACCEPT] if untrained else None,
            "eval_sim_accept_len": trained[M.EVAL_SIM_ACCEPT],
            "eval": trained,
            "nonfinite_skipped": self.nonfinite,
            "checkpoint": str(ckpt.latest(self.ckpt_root)),
            "export_dir": served["export_dirs"]["sglang"],
            "serve_eval": served["serve_eval"],
            "export_dirs": served["export_dirs"],
            "verify": served["verify"],
            "data": self.data.report(),
        }
        if sink is not None:
            sink.log(trained | progress, step=self.step)
            sink.finish(summary)
        return summary

    def _stopped_by(self) -> str:
        if self.out_of_time:
            return "trainer.max_time_s"
        capped = self.cfg.trainer.max_steps is not None and self.step >= self.cfg.trainer.max_steps
        return "trainer.max_steps" if capped else "trainer.epochs"


def eval_prompt_set(cfg: Config, data: PreparedData) -> tuple[list[PromptSpec], dict]:
    """The serving-eval prompts and where they come from (the run summary's ``eval_prompts``):
    ``trainer.eval_prompts_file``, or the first ``trainer.eval_prompts`` held-out conversations
    of the sources in mix order, with the held-out rule and how many each source gave."""
    n = cfg.trainer.eval_prompts
    if cfg.trainer.eval_prompts_file is not None:
        prompts = read_prompt_file(cfg.trainer.eval_prompts_file, limit=n)
        origin: dict = {"kind": "file", "path": cfg.trainer.eval_prompts_file}
    else:
        prompts, taken = [], {}
        for name in data.mix.names:
            if len(prompts) < n:
                got = prompts_from_conversations(data.eval_conversations[name], limit=n - len(prompts))
                prompts, taken[name] = prompts + got, len(got)
        origin = {"kind": "heldout", "split": data.heldout_rule, "sources": taken}
    return prompts, origin | {"prompts": len(prompts), "turns": sum(p.turns for p in prompts)}


def _metrics_only(served: dict) -> dict[str, float]:
    return {k: v for k, v in served.items() if k.startswith("eval/")}


def _shared_run_dir(run_dir: Path) -> Path:
    """Every rank writes under rank 0's run dir (Hydra's timestamped dir may differ by rank)."""
    box = [str(run_dir)]
    torch.distributed.broadcast_object_list(box, src=0)
    return Path(box[0])


def _draft_checksum(trainer: Trainer) -> float:
    return float(sum(p.detach().double().abs().sum() for p in trainer.engine.module.draft.parameters()))


def _shard_overlap(trainer: Trainer) -> int:
    """Samples (by token content) that more than one rank trains on in epoch 0; 0 when disjoint."""
    loader = trainer.data.train_loader(train_batcher(trainer.cfg.data, trainer.target.pad_id), trainer.par.rank, trainer.par.world)
    mine = {hash(tuple(doc.tolist())) for b in loader.epoch_batches(0) for doc in b.documents()}
    every = [None] * trainer.par.world
    torch.distributed.all_gather_object(every, mine)
    return sum(len(a & b) for i, a in enumerate(every) for b in every[i + 1 :])


def _stop_on_signals(signals: StopSignals) -> dict:
    """SIGTERM / SIGINT stop the run (``StopSignals``); returns the old handlers."""
    return {s: signal.signal(s, signals.handler) for s in (signal.SIGTERM, signal.SIGINT)}


def run(cfg: Config, run_dir: Path) -> dict:
    """Train, export and evaluate one run; rank 0 writes ``summary.json`` and prints it.
    SIGINT / SIGTERM end it in any phase (``StopSignals``) with exit code 128 + the signal."""
    signals = StopSignals()
    previous = _stop_on_signals(signals)  # from the start: DeepSpeed's first init may build an op for a minute
    run_dir, is_main = run_dir / cfg.trainer.output_dir, os.environ.get("RANK", "0") == "0"
    try:
        par = init_parallel(resolve_device(cfg.trainer.device))
        run_dir, is_main = _shared_run_dir(run_dir), par.is_main
        run_dir.mkdir(parents=True, exist_ok=True)
        return _run(cfg, run_dir, par, signals)
    except Stop:
        if is_main:
            print(signals.message(run_dir / CHECKPOINTS, run_dir), file=sys.stderr, flush=True)
        raise SystemExit(signals.exit_code()) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(cfg: Config, run_dir: Path, par: Parallel, signals: StopSignals) -> dict:
    trainer = Trainer(cfg, run_dir, par, signals)
    summary = trainer.fit()
    signals.enter(REPORT)
    checksums = [None] * par.world
    torch.distributed.all_gather_object(checksums, _draft_checksum(trainer))
    summary["draft_checksums"] = checksums
    summary["shard_overlap"] = _shard_overlap(trainer)
    summary["summary_path"] = str(run_dir / "summary.json")
    summary["report"] = str(run_dir / REPORT_DIR / REPORT_FILE)
    if par.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        write_report(run_dir)
        print(format_summary(summary))
    return summary
