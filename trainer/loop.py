"""The training loop: fit() -> _train() -> _epoch() -> train_step() -> ttt.draft_step(), then at each
optimizer step the components of trainer.components in order. trainer.build makes what a run trains with."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from models.batch import FeatureBatch
from serving.prompts import write_prompt_file
from trainer import checkpoint as ckpt
from trainer import console
from trainer.build import build, eval_batches
from trainer.components import (
    EVAL_PROMPTS_FILE,
    Checkpointer,
    Counters,
    MetricsLog,
    NonFinite,
    StepEnd,
    StepStats,
    TimeCap,
    Validator,
    Window,
    metrics_only,
)
from trainer.config import Config
from trainer.dist import Parallel, init_parallel, resolve_device, shared_run_dir, synchronize
from trainer.model_card import add_speedup
from trainer.phases import END_EVAL, REPORT, SERVING_EVAL, SPEEDUP, START_EVAL, TRAINING, Stop, StopSignals
from trainer.preflight import check_inputs
from trainer.profiling import PROFILE_DIR, StepProfiler
from trainer.report import metrics as M
from trainer.report.report import REPORT_DIR, REPORT_FILE, format_summary, write_report
from trainer.speedup_phase import measure_speedup
from trainer.stream.feature_stream import EngineError, open_feature_stream
from trainer.ttt import TTTOutput, draft_step

CHECKPOINTS = "checkpoints"  # the run dir's checkpoint folder
log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, par: Parallel | None = None, signals: StopSignals | None = None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.signals = signals or StopSignals()
        self.par = par or init_parallel(resolve_device(cfg.trainer.device))
        self.ckpt_root = self.run_dir / CHECKPOINTS
        b = self.built = build(cfg, self.par, self.ckpt_root)
        self.target, self.target_source, self.data, self.loader, self.ds_model = b.target, b.target_source, b.data, b.loader, b.ds_model
        self.state = Counters()
        self.nonfinite = NonFinite(cfg.trainer.on_nan, self.ckpt_root, self.state, self.ds_model, self.par.device)
        self.metrics = MetricsLog(cfg, b, self.par, self.state)
        self.checkpointer = Checkpointer(cfg, b, self.par, self.ckpt_root, self.state, self.signals)
        self.validator = Validator(cfg, b, self.par, self.run_dir, self.signals, self.metrics)
        self.components = [
            self.state,
            self.nonfinite,
            self.metrics,
            self.checkpointer,
            self.validator,
            TimeCap(self.par.device, self.state, b.clock),
        ]
        if cfg.trainer.profile_steps:
            profiler = StepProfiler(cfg.trainer.profile_steps, self.state, self.par.device, self.run_dir / PROFILE_DIR, self.par.is_main)
            self.components.append(profiler)
        if b.resume_from:
            self.checkpointer.resume(b.resume_from)
        elif cfg.trainer.resume == "auto" and self.par.is_main:
            log.info(f"trainer.resume=auto: no checkpoint in {self.ckpt_root}, so the run starts from step 0")

    def close(self) -> None:
        """Remove DeepSpeed's gradient hooks: autograd holds them and they reference the DeepSpeed model, so
        without this the trainer (target, draft, optimizer) stays in memory until the process ends."""
        self.ds_model.destroy()

    def train_step(self, fb: FeatureBatch) -> TTTOutput | None:
        """Forward, backward, and (at an accumulation boundary) DeepSpeed's step; None if the loss was not finite."""
        return draft_step(self.ds_model, self.built.labeler, fb, keep=self.nonfinite.finite_loss)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.ds_model.eval()
        batches, stats = eval_batches(self.cfg, self.data, self.par, self.target.pad_id), None
        bar = tqdm(total=len(batches), desc="held-out eval", unit="batch", leave=False, disable=not self.par.is_main)
        with bar, open_feature_stream(self.cfg.engine, self.target_source, batches, self.par.device) as stream:
            for fb in stream:
                s = StepStats.of(self.ds_model(self.built.labeler.input_for(fb)))
                bar.update(1)
                stats = s if stats is None else stats.add(s)
        self.ds_model.train()
        return stats.all_reduce(self.par.device).report("eval")

    def _epoch(self, epoch: int, bar) -> bool:
        """Train on the rest of ``epoch`` (from the restored position when resuming into it); False when a cap ended the run."""
        state, accumulated, consumed = self.state, 0, self.state.pos.micro if self.state.pos.epoch == epoch else 0
        self.metrics.window = Window()
        with open_feature_stream(self.cfg.engine, self.target_source, self.loader.epoch_batches(epoch), self.par.device) as stream:
            while state.step < self.built.total_steps and not state.out_of_time:
                t0 = time.perf_counter()
                fb = next(stream, None)
                if fb is None:
                    return True
                synchronize(self.par.device)
                t1 = time.perf_counter()
                out = self.train_step(fb)
                synchronize(self.par.device)
                consumed, state.train_s = consumed + 1, state.train_s + time.perf_counter() - t0
                if out is None:
                    continue
                self.metrics.record(out, fb, t1 - t0, time.perf_counter() - t1)
                accumulated += 1
                if accumulated % self.cfg.deepspeed.grad_accum == 0:
                    at = StepEnd(epoch, consumed, bar)
                    for component in self.components:
                        component.after_step(at)
        return False

    def _train(self) -> None:
        bar = tqdm(total=self.built.total_steps, initial=self.state.step, disable=not self.par.is_main, desc="train", unit="step")
        try:
            for epoch in range(self.state.pos.epoch, self.cfg.trainer.epochs):
                if not self._epoch(epoch, bar):
                    self.checkpointer.save()  # a cap ended the run inside an epoch
                    break
                self.state.pos = ckpt.Position(self.state.step, epoch + 1, 0, self.state.train_s)
                self.checkpointer.save()
        except EngineError:
            self.checkpointer.keep_trained()
            raise
        finally:
            bar.close()
        if self.state.out_of_time and self.par.is_main:
            log.info(
                f"training stopped by trainer.max_time_s={self.cfg.trainer.max_time_s:g}: {self.built.clock.spent_s:.1f} s trained, "
                f"step {self.state.step} of {self.built.total_steps}"
            )

    def fit(self) -> dict:
        """Evaluate the draft the run starts from (untrained, draft.init_from's, or a resumed checkpoint's), train, export, evaluate
        again; returns the summary."""
        resumed = self.built.resume_from is not None
        if self.par.is_main:  # the serving eval's prompts: `python -m serving.eval ... --prompts RUN/eval_prompts.jsonl`
            write_prompt_file(self.built.prompts, self.run_dir / EVAL_PROMPTS_FILE)
        self.checkpointer.wandb_id = self.metrics.open(self.cfg, self.run_dir, self.checkpointer.wandb_id, resumed)
        try:
            return self._fit()
        except BaseException as e:  # end the wandb run as failed or stopped rather than leave it open
            self.metrics.finish(exit_code=self.signals.exit_code() if isinstance(e, Stop) else 1)
            raise

    def _fit(self) -> dict:
        # before the clock runs: the first batches build kernels and wake the engine, so a resumed run, like a fresh
        # one, leaves that warm-up out of trainer.max_time_s (an H200 resume without it spent 27 s of its clock there)
        self.signals.enter(START_EVAL)
        start = self.evaluate()
        if not self.built.resume_from:  # a resumed run's history already has steps past 0
            self.metrics.log(start, 0)
        try:
            self.signals.enter(TRAINING)
            self._train()
            self.signals.enter(END_EVAL)
            trained = self.evaluate()
        finally:
            self.target_source.close()
        self.signals.enter(SERVING_EVAL)
        served, progress = self.validator.serve_eval(), self.metrics.progress()
        trained |= metrics_only(served)
        summary = run_summary(self, self.signals.phase_seconds(), start, trained, served, progress)
        self.metrics.log(trained | progress, self.state.step)
        self.metrics.finish(summary)
        return summary


def run_summary(trainer: Trainer, phase_s: dict[str, float], start: dict, trained: dict, served: dict, progress: dict) -> dict:
    """A finished run's ``summary.json``: what ``trainer`` trained, where it stopped, its evaluations and exports
    (``phase_s``: the phases so far; ``run`` adds those after)."""
    state, b, serve_eval = trainer.state, trainer.built, trainer.cfg.trainer.serve_eval
    return {
        "steps": state.step,
        "ranks": trainer.par.world,
        "stopped_by": state.stopped_by(trainer.cfg.trainer.max_steps),
        "wall_time_s": sum(phase_s.values()),
        "train_time_s": state.train_s,
        "tokens_seen": int(progress[M.TOKENS_SEEN]),
        "eval_prompts": b.prompt_origin if serve_eval else None,  # none decoded with trainer.serve_eval=false
        "resumed_from": str(b.resume_from) if b.resume_from else None,
        "init_from": trainer.cfg.draft.init_from,  # the trained draft the run started from (draft.init_from)
        "schedule_start": asdict(b.schedule_start),
        "start_eval_sim_accept_len": start[M.EVAL_SIM_ACCEPT],
        "eval_sim_accept_len": trained[M.EVAL_SIM_ACCEPT],
        "eval": trained,
        "nonfinite_skipped": state.nonfinite,
        "checkpoint": str(ckpt.latest(trainer.ckpt_root)),
        "export_dir": served["export_dirs"]["sglang"],
        "serve_eval": served["serve_eval"],
        "export_dirs": served["export_dirs"],
        "verify": served["verify"],
        "data": trainer.data.report(),
    }


def run(cfg: Config, run_dir: Path, on_start: Callable[[], None] = lambda: None, signals: StopSignals | None = None) -> dict:
    """Train, export and evaluate one run; rank 0 writes ``summary.json`` and prints it. Nothing is
    written before the trainer is built (inputs, target, data, resume checks); then ``on_start`` runs.
    ``signals``: its start-up phase begins when they were made (the command line's: at process start).
    SIGINT / SIGTERM end it in any phase (``StopSignals``) with exit code 128 + the signal; an engine that
    failed, died or hung ends it with exit code 1, the rank it served saying why and how to resume."""
    signals = signals or StopSignals()
    signals.install()  # from the start: DeepSpeed's first init may build an op for a minute
    run_dir, is_main = run_dir / cfg.trainer.output_dir, os.environ.get("RANK", "0") == "0"
    if cfg.trainer.threads is not None:  # an engine process takes this process's count
        torch.set_num_threads(cfg.trainer.threads)
    try:
        check_inputs(cfg, run_dir / CHECKPOINTS)  # before DeepSpeed and the target start: a wrong path is an error in a second
        par = init_parallel(resolve_device(cfg.trainer.device))
        run_dir, is_main = shared_run_dir(run_dir), par.is_main
        trainer = Trainer(cfg, run_dir, par, signals)
        run_dir.mkdir(parents=True, exist_ok=True)
        on_start()
        summary = trainer.fit()
        signals.enter(SPEEDUP)
        trainer.close()
        if par.is_main:
            summary |= measure_speedup(cfg, Path(summary["export_dir"]), trainer.built.target.path, run_dir)
            add_speedup(Path(summary["export_dir"]), summary.get("speedup", {}))
        signals.enter(REPORT)
        phase_s = signals.phase_seconds()  # wall time: the phases', from the start-up's beginning to the summary
        summary |= {"wall_time_s": sum(phase_s.values()), "phase_s": phase_s, "engine_start_s": trainer.target_source.start_s}
        summary |= {"summary_path": str(run_dir / "summary.json"), "report": str(run_dir / REPORT_DIR / REPORT_FILE)}
        if par.is_main:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            write_report(run_dir)
            log.info(format_summary(summary))  # the console and the run dir's log (hydra.job_logging)
        return summary
    except Stop:
        if is_main:
            console.show(signals.message(run_dir / CHECKPOINTS, run_dir))
        raise SystemExit(signals.exit_code()) from None
    except EngineError as e:
        console.show(f"{e}\n{signals.message(run_dir / CHECKPOINTS, run_dir, by='the engine failure')}")
        raise SystemExit(1) from e
    finally:
        signals.restore()
