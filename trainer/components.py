"""The trainer's policies, one component each: the loop calls ``after_step`` on every one, in this
order, at each optimizer-step boundary; one that acts only at some steps says when in ``should_...``.

  Counters    where the run is (step, data position, training seconds and tokens)
  NonFinite   counts non-finite losses and gradients; stops the run unless trainer.on_nan=skip
  MetricsLog  the log window and its row (losses, accuracies, throughput, MFU) every trainer.log_every
  Checkpointer  saves every trainer.checkpoint_every, at each trainer.checkpoint_at_s (kept) and on a stop signal
              (``trainer.phases.StopSignals``); resumes
  Validator   export -> verify -> serving eval, every trainer.export_every and at the end
  TimeCap     ends the run after trainer.max_time_s of training (over every resume); the LR schedule reads its clock
and last, with trainer.profile_steps, trainer.profiling.StepProfiler (torch.profiler over those steps).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from models.batch import FeatureBatch
from serving.pipeline import export_verify_eval
from trainer import checkpoint as ckpt
from trainer import console
from trainer.build import Built
from trainer.config import Config
from trainer.dist import Parallel, all_agree, all_reduce_scalar
from trainer.flops import flops_per_token, mfu
from trainer.metrics_sink import MetricsSink
from trainer.model_card import write_cards
from trainer.phases import PERIODIC_EVAL, TRAINING, Stop, StopSignals
from trainer.report import metrics as M
from trainer.schedule import RunClock
from trainer.target_setup import with_eval_target
from trainer.ttt import TTTOutput, simulated_accept_length

log = logging.getLogger(__name__)

EVAL_PROMPTS_FILE = "eval_prompts.jsonl"  # the run dir's serving-eval prompts, a serving/prompts.py file


@dataclass
class StepEnd:
    """What the components see at an optimizer-step boundary."""

    epoch: int
    consumed: int  # micro-batches of ``epoch`` trained (or skipped) so far
    bar: tqdm


@dataclass
class Counters:
    """Where the run is: the loop writes step, position and training seconds; the components the rest."""

    step: int = 0
    pos: ckpt.Position = field(default_factory=lambda: ckpt.Position(0, 0, 0))
    train_s: float = 0.0  # this process's training seconds
    tokens_local: int = 0  # tokens trained on by this rank
    nonfinite: int = 0
    out_of_time: bool = False

    def after_step(self, at: StepEnd) -> None:
        self.step += 1
        self.pos = ckpt.Position(self.step, at.epoch, at.consumed, self.train_s)

    def stopped_by(self, max_steps: int | None) -> str:
        """The cap that ended the run (the summary's ``stopped_by``)."""
        if self.out_of_time:
            return "trainer.max_time_s"
        return "trainer.max_steps" if max_steps is not None and self.step >= max_steps else "trainer.epochs"


class NonFinite:
    """A non-finite loss (every rank skips the batch) or gradient (DeepSpeed skipped the update)."""

    def __init__(self, on_nan: str, ckpt_root: Path, state: Counters, ds_model, device: torch.device):
        self.on_nan, self.ckpt_root, self.state, self.ds_model, self.device = on_nan, ckpt_root, state, ds_model, device

    def finite_loss(self, out: TTTOutput) -> bool:
        """True when the loss is finite on every rank; else count it (every rank skips the batch)."""
        if all_agree(bool(torch.isfinite(out.loss)), self.device):
            return True
        self.count("loss")
        return False

    def count(self, what: str) -> None:
        """Count one; stop unless trainer.on_nan=skip."""
        self.state.nonfinite += 1
        if self.on_nan == "stop":
            last = ckpt.latest(self.ckpt_root)
            raise RuntimeError(f"non-finite {what} at step {self.state.step + 1} (trainer.on_nan=stop); last good checkpoint: {last}")

    def after_step(self, at: StepEnd) -> None:
        grad_norm = self.ds_model.get_global_grad_norm()
        if grad_norm is not None and not math.isfinite(grad_norm):
            self.count("gradient")  # DeepSpeed has already skipped this update


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


class MetricsLog:
    """Accumulates trained batches in a ``Window`` and logs its row every trainer.log_every steps (and the last);
    rank 0 writes every row to its ``sink`` (wandb and metrics.jsonl)."""

    def __init__(self, cfg: Config, built: Built, par: Parallel, state: Counters):
        self.every, self.ttt_steps, self.total = cfg.trainer.log_every, cfg.draft.ttt_steps, built.total_steps
        self.ds_model, self.config, self.par, self.state = built.ds_model, built.target.head.config, par, state
        self.peak_tflops = built.peak_tflops
        self.window, self.sink = Window(), None

    def open(self, cfg: Config, run_dir: Path, wandb_id: str | None, resumed: bool) -> str | None:
        """Start rank 0's sink (a resumed run continues wandb run ``wandb_id`` and its log); returns
        the wandb run id: the sink's on rank 0, ``wandb_id`` elsewhere."""
        if not self.par.is_main:
            return wandb_id
        self.sink = MetricsSink(cfg.wandb, run_dir, asdict(cfg), wandb_id, self.state.step if resumed else None)
        return self.sink.run.id

    def finish(self, summary: dict | None = None, exit_code: int = 0) -> None:
        """End rank 0's wandb run: with the run's ``summary``, or (None) failed or stopped with ``exit_code``."""
        if self.sink is not None and summary is not None:
            self.sink.finish(summary)
        elif self.sink is not None:
            self.sink.run.finish(exit_code=exit_code)

    def log(self, row: dict[str, float], step: int) -> None:
        if self.sink is not None:
            self.sink.log(row, step=step)

    def record(self, out: TTTOutput, fb: FeatureBatch, target_s: float, draft_s: float) -> None:
        """Add one trained batch: its counts, tokens, model FLOPs (the count lab/bench_throughput.py uses), times."""
        tokens = int(fb.tokens.lengths.sum())
        self.state.tokens_local += tokens
        shape, seq = self.ds_model.module.draft.shape, fb.tokens.input_ids.shape[1]
        flops = tokens * flops_per_token(self.config, shape, seq, self.ttt_steps)["total"]
        self.window.add(StepStats.of(out), tokens, flops, target_s, draft_s)

    def should_log(self) -> bool:
        return self.state.step % self.every == 0 or self.state.step == self.total

    def after_step(self, at: StepEnd) -> None:
        self.window.steps += 1
        at.bar.update(1)
        if not self.should_log():
            return
        row = self.row(self.window)
        if M.step_acc(0) in row:
            at.bar.set_postfix(loss=f"{row[M.LOSS]:.3f}", acc0=f"{row[M.step_acc(0)]:.3f}", tok_s=f"{row[M.TOKENS_PER_S]:.0f}")
        self.log(row | {"epoch": at.epoch}, self.state.step)
        self.window = Window()

    def row(self, w: Window) -> dict[str, float]:
        packed = torch.tensor([float(w.tokens), w.flops], dtype=torch.float64, device=self.par.device)
        torch.distributed.all_reduce(packed)
        wall, n = time.perf_counter() - w.start, max(1, w.steps)
        row = w.stats.all_reduce(self.par.device).report("train") if w.stats is not None else {}
        row.update(self.progress())
        row.update(
            {
                M.LR: self.ds_model.get_lr()[0],
                M.TOKENS_PER_S: packed[0].item() / wall,
                M.STEP_TIME: wall / n,
                M.TARGET_TIME: w.target_s / n,
                M.DRAFT_TIME: w.draft_s / n,
                M.NONFINITE: float(self.state.nonfinite),
            }
        )
        row.update(self.stall_shares(w))
        if self.peak_tflops is not None:
            row[M.MFU] = mfu(packed[1].item(), wall, self.par.world, self.peak_tflops)
        grad_norm = self.ds_model.get_global_grad_norm()
        if grad_norm is not None and math.isfinite(grad_norm):
            row[M.GRAD_NORM] = float(grad_norm)
        if self.par.device.type == "cuda":
            row[M.GPU_MEM] = torch.cuda.max_memory_allocated(self.par.device) / 2**30
        return row

    def stall_shares(self, w: Window) -> dict[str, float]:
        """The share of step time each rank waited on its feature stream, and their mean (every rank calls)."""
        times = torch.zeros(self.par.world, 2, dtype=torch.float64, device=self.par.device)  # [world, (target_s, draft_s)]
        times[self.par.rank] = torch.tensor([w.target_s, w.draft_s], dtype=torch.float64)
        torch.distributed.all_reduce(times)
        shares = (times[:, 0] / (times.sum(dim=1)).clamp(min=1e-9)).tolist()
        row = {M.STALL_SHARE: sum(shares) / len(shares)}
        if len(shares) > 1:
            row.update({M.stall_share_rank(r): s for r, s in enumerate(shares)})
        return row

    def progress(self) -> dict[str, float]:
        """Tokens trained on so far (all ranks) and this process's training seconds (every rank calls)."""
        packed = torch.tensor([float(self.state.tokens_local)], device=self.par.device)
        torch.distributed.all_reduce(packed)
        return {M.TOKENS_SEEN: packed.item(), M.TRAIN_TIME: self.state.train_s}


class Checkpointer:
    """Saves every trainer.checkpoint_every steps, at each trainer.checkpoint_at_s mark of the run's clock (a
    checkpoint never pruned), when a stop signal came (then stops the run) and after an engine failure
    (``keep_trained``); resumes."""

    def __init__(self, cfg: Config, built: Built, par: Parallel, ckpt_root: Path, state: Counters, signals: StopSignals):
        self.cfg, self.built, self.par, self.root, self.state, self.signals = cfg, built, par, ckpt_root, state, signals
        self.saved_step = 0  # the step of the last checkpoint saved or resumed from
        self.marks = sorted(cfg.trainer.checkpoint_at_s)  # the trainer.checkpoint_at_s marks not reached yet
        # a resume continues the checkpoint's wandb run; a checkpoint of another run dir starts a new one (a branch)
        resumed = built.resume_from
        own = resumed is not None and resumed.resolve().parent == ckpt_root.resolve()
        self.wandb_id: str | None = ckpt.read_meta(resumed)["wandb_id"] if own else None

    def resume(self, path: Path) -> None:
        """Continue from the checkpoint at ``path`` (``build`` has checked it): weights, optimizer, position, data order."""
        self.state.pos, data_state = ckpt.load(self.built.ds_model, path)
        self.built.loader.load_state_dict(data_state, strict="data" not in self.cfg.trainer.resume_allow)
        self.state.step, self.state.train_s = self.state.pos.step, self.state.pos.train_s
        moved = self.built.schedule_start.step != self.state.pos.schedule_from_step  # a new schedule starts here
        self.built.clock.spent_s, self.built.clock.start_s = self.state.pos.train_s, None if moved else self.state.pos.schedule_start_s
        self.saved_step = self.state.step
        self.marks = [t for t in self.marks if t > self.built.clock.spent_s]

    def save(self, kept: bool = False) -> Path:
        b = self.built
        start = b.schedule_start
        pos = replace(self.state.pos, schedule_start_s=b.clock.start_s, schedule_from_step=start.step, continued=start.continued)
        self.saved_step = pos.step
        data_state = b.loader.state_for(pos.epoch, pos.micro)  # what was trained, not what was read ahead
        return ckpt.save(
            b.ds_model,
            self.root,
            pos,
            data_state,
            b.identity.fingerprint(b.vocab),
            b.vocab,
            asdict(self.cfg),
            self.cfg.trainer.keep_last,
            self.par.is_main,
            self.wandb_id,
            kept,
        )

    def keep_trained(self) -> None:
        """After the engine failed (between two steps: the draft and the position agree), save the steps trained
        since the last checkpoint. With one rank only: a save is collective, and the other ranks are not here."""
        if self.par.world == 1 and self.state.step > self.saved_step:
            self.save()

    def should_save(self) -> bool:
        every = self.cfg.trainer.checkpoint_every
        return bool(every) and self.state.step % every == 0

    def mark_reached(self) -> bool:
        """The run's clock (every rank's, the slowest) has passed a trainer.checkpoint_at_s mark since the last one."""
        reached = bool(self.marks) and self.built.clock.spent_s >= self.marks[0]
        self.marks = [t for t in self.marks if t > self.built.clock.spent_s]
        return reached

    def after_step(self, at: StepEnd) -> None:
        stop = not all_agree(self.signals.received is None, self.par.device)
        kept = self.mark_reached()
        if stop or kept or self.should_save():
            path = self.save(kept)  # before the serving eval: a stop signal during it keeps this step
            if kept and self.par.is_main:
                log.info(f"checkpoint kept at {self.built.clock.spent_s:.1f} s of training (trainer.checkpoint_at_s): {path}")
        if stop:
            raise Stop()


class Validator:
    """Export for SGLang and vLLM, verify both and run the serving eval: every trainer.export_every steps and at the end."""

    def __init__(self, cfg: Config, built: Built, par: Parallel, run_dir: Path, signals: StopSignals, metrics: MetricsLog):
        self.cfg, self.built, self.par, self.run_dir, self.signals, self.metrics = cfg, built, par, run_dir, signals, metrics

    def should_validate(self) -> bool:
        every = self.cfg.trainer.export_every
        return bool(every) and self.metrics.state.step % every == 0

    def after_step(self, at: StepEnd) -> None:
        """Between steps (minutes): a stop signal ends it, and the run, at once."""
        if not self.should_validate():
            return
        self.signals.switch(PERIODIC_EVAL)
        served, progress = self.serve_eval(), self.metrics.progress()
        self.signals.switch(TRAINING)
        self.metrics.log(metrics_only(served) | progress, self.metrics.state.step)

    def serve_eval(self) -> dict:
        """Export for SGLang and vLLM, verify both, and decode the held-out prompts speculatively
        with the SGLang export loaded back from disk against the whole target (rank 0; ZeRO-3
        gathers first; ``with_eval_target`` says when the target is loaded for it). Every rank gets the result."""
        import deepspeed

        b, cfg, result = self.built, self.cfg, [None]
        draft, head = b.ds_model.module.draft, b.target.head
        with deepspeed.zero.GatheredParameters(list(draft.parameters()), enabled=cfg.deepspeed.zero_stage == 3):
            if self.par.is_main:
                then = (
                    f"then decode {len(b.prompts)} held-out prompts speculatively (serving eval)"
                    if cfg.trainer.serve_eval
                    else "no serving eval (trainer.serve_eval=false)"
                )
                console.show(f"export for SGLang and vLLM to {self.run_dir / 'export'}, verify both, {then}")
                source = b.target.path

                def run(model) -> dict:
                    return export_verify_eval(
                        draft,
                        b.vocab,
                        head.info,
                        model,
                        head.tokenizer,
                        b.prompts,
                        self.run_dir / "export",
                        norm_output=cfg.draft.norm_output,
                        k=cfg.trainer.spec_tokens,
                        max_new_tokens=cfg.trainer.eval_max_new_tokens,
                        target_dir=source if source.is_dir() else None,
                    )

                result[0] = with_eval_target(b.target, cfg.trainer, self.par.device, b.dtype, run)
                write_cards(result[0], cfg, b, self.metrics.state.step, self.run_dir / EVAL_PROMPTS_FILE)
        torch.distributed.broadcast_object_list(result, src=0)
        return result[0]


class TimeCap:
    """Ends the run once it has trained trainer.max_time_s seconds, counted over every resume (every rank
    agrees, on the slowest rank's count), and keeps the LR schedule's clock."""

    def __init__(self, device: torch.device, state: Counters, clock: RunClock):
        self.device, self.state, self.clock = device, state, clock

    def after_step(self, at: StepEnd) -> None:
        if self.clock.max_time_s is not None:
            self.clock.spent_s = all_reduce_scalar(self.state.train_s, self.device, torch.distributed.ReduceOp.MAX)
            if self.clock.start_s is None:  # the run's first step ended: the schedule's time axis starts here
                self.clock.start_s = self.clock.spent_s
            self.state.out_of_time = self.clock.time_frac >= 1.0


def metrics_only(served: dict) -> dict[str, float]:
    return {k: v for k, v in served.items() if k.startswith("eval/")}
