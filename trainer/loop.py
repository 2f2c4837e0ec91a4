"""The trainer: builds target engine, data, vocab map and the DeepSpeed draft; runs epochs."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from models.draft import Eagle3Draft, draft_shape_for
from models.vocab_map import VocabMap, build_vocab_map, count_tokens
from serving.export import export_sglang
from trainer import metrics as M
from trainer.batch import FeatureBatch, TokenBatch
from trainer.config import Config
from trainer.data import EncodedSample, token_batches
from trainer.dist import Parallel, init_parallel, resolve_device
from trainer.schedule import lr_factor
from trainer.sources import TargetBundle, load_target, prepare_samples
from trainer.stream import feature_stream
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

    def all_reduce(self) -> "StepStats":
        packed = torch.stack([self.loss_sum, self.correct, self.valid]).cpu()
        torch.distributed.all_reduce(packed)
        return StepStats(*packed)

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
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, par: Parallel | None = None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.par = par or init_parallel(resolve_device(cfg.trainer.device))
        torch.manual_seed(cfg.trainer.seed)
        self.dtype = _dtype(cfg.target.dtype, self.par.device)
        self.target: TargetBundle = load_target(cfg.target, self.par.device, self.dtype)
        self.train_samples, self.eval_samples, self.data_stats = prepare_samples(cfg.data, self.target.tokenizer, cfg.trainer.seed)
        self.vocab = self._vocab_map(self.train_samples)
        self.draft_to_target = self.vocab.draft_to_target.to(self.par.device)
        self.t2d = self.vocab.t2d.to(self.par.device)
        self.engine = self._deepspeed_engine()
        self.step = 0

    def _vocab_map(self, samples: list[EncodedSample]) -> VocabMap:
        pairs = ((torch.tensor(s.input_ids), torch.tensor(s.loss_mask)) for s in samples)
        counts = count_tokens(pairs, self.target.engine.info.vocab_size)
        return build_vocab_map(counts, self.cfg.draft.vocab_size)

    def _deepspeed_engine(self):
        import deepspeed

        cfg, info = self.cfg, self.target.engine.info
        draft = Eagle3Draft(draft_shape_for(self.target.engine.model.config, len(info.aux_layer_ids), cfg.draft.vocab_size))
        draft.init_from_target(self.target.engine.embed_weight.float().cpu(), self.target.engine.lm_head_weight.float().cpu(), self.vocab.draft_to_target)
        objective = TTTObjective(draft, cfg.draft.ttt_steps, cfg.draft.step_decay, cfg.draft.norm_output)
        params = [p for p in objective.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.schedule.lr, betas=tuple(cfg.schedule.betas), weight_decay=cfg.schedule.weight_decay, fused=False, foreach=False)
        self.total_steps = self._total_steps()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg.schedule, s, self.total_steps))
        engine, *_ = deepspeed.initialize(
            model=objective, optimizer=opt, lr_scheduler=sched, config=_deepspeed_config(cfg, self.dtype == torch.bfloat16)
        )
        return engine

    def batches(self, samples: list[EncodedSample], epoch: int) -> list[TokenBatch]:
        return token_batches(
            samples, self.cfg.data.max_tokens, self.cfg.trainer.seed, epoch, self.par.rank, self.par.world, self.target.pad_id
        )

    def _total_steps(self) -> int:
        per_epoch = len(self.batches(self.train_samples, 0)) // self.cfg.deepspeed.grad_accum
        if per_epoch == 0:
            raise ValueError(
                f"data: {len(self.train_samples)} training samples make no full optimizer step for "
                f"{self.par.world} rank(s) x grad_accum {self.cfg.deepspeed.grad_accum} at data.max_tokens {self.cfg.data.max_tokens}"
            )
        total = per_epoch * self.cfg.trainer.epochs
        return min(total, self.cfg.trainer.max_steps) if self.cfg.trainer.max_steps else total

    def _forward(self, fb: FeatureBatch) -> TTTOutput:
        labels = target_labels(fb.final, self.target.engine.lm_head_weight, self.draft_to_target, self.t2d)
        t = fb.tokens
        return self.engine(t.input_ids, t.loss_mask, t.lengths, fb.aux, labels, self.draft_to_target)

    def train_step(self, fb: FeatureBatch) -> TTTOutput:
        out = self._forward(fb)
        self.engine.backward(out.loss)
        self.engine.step()
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        batches = self.batches(self.eval_samples, 0)[: self.cfg.trainer.eval_batches]
        stats = None
        for fb in feature_stream(self.target.engine, batches, self.par.device):
            s = StepStats.of(self._forward(fb))
            stats = s if stats is None else stats.add(s)
        self.engine.train()
        return stats.all_reduce().report("eval")

    def export(self) -> Path:
        """The SGLang export of the current draft (rank 0 writes; ZeRO-3 gathers first)."""
        import deepspeed

        out_dir = self.run_dir / "export"
        draft = self.engine.module.draft
        with deepspeed.zero.GatheredParameters(list(draft.parameters()), enabled=self.cfg.deepspeed.zero_stage == 3):
            if self.par.is_main:
                export_sglang(
                    out_dir, draft, self.vocab, list(self.target.engine.info.aux_layer_ids), self.cfg.draft.norm_output,
                    dtype=torch.bfloat16, target_architecture=self.target.engine.info.architecture,
                    target_num_layers=self.target.engine.info.num_layers,
                )
        torch.distributed.barrier()
        return out_dir

    def _log_window(self, stats: StepStats, tokens: int, times: dict[str, float], wall: float) -> dict[str, float]:
        packed = torch.tensor([float(tokens)])
        torch.distributed.all_reduce(packed)
        row = stats.all_reduce().report("train")
        row.update({
            M.LR: self.engine.get_lr()[0],
            M.TOKENS_PER_S: packed.item() / wall,
            M.STEP_TIME: wall / self.cfg.trainer.log_every,
            M.TARGET_TIME: times["target"] / self.cfg.trainer.log_every,
            M.DRAFT_TIME: times["draft"] / self.cfg.trainer.log_every,
        })
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            row[M.GRAD_NORM] = float(grad_norm)
        return row

    def _sync(self) -> None:
        if self.par.device.type == "cuda":
            torch.cuda.synchronize()

    def _epoch(self, epoch: int, sink, bar) -> None:
        accum, every = self.cfg.deepspeed.grad_accum, self.cfg.trainer.log_every
        stream = feature_stream(self.target.engine, self.batches(self.train_samples, epoch), self.par.device)
        stats, tokens, times, t_window = None, 0, {"target": 0.0, "draft": 0.0}, time.perf_counter()
        micro = 0
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            fb = next(stream, None)
            if fb is None:
                return
            self._sync()
            t1 = time.perf_counter()
            s = StepStats.of(self.train_step(fb))
            self._sync()
            times["target"] += t1 - t0
            times["draft"] += time.perf_counter() - t1
            stats, tokens, micro = (s if stats is None else stats.add(s)), tokens + int(fb.tokens.lengths.sum()), micro + 1
            if micro % accum:
                continue
            self.step += 1
            bar.update(1)
            if self.step % every == 0 or self.step == self.total_steps:
                row = self._log_window(stats, tokens, times, time.perf_counter() - t_window)
                bar.set_postfix(loss=f"{row[M.LOSS]:.3f}", acc0=f"{row[M.step_acc(0)]:.3f}", tok_s=f"{row[M.TOKENS_PER_S]:.0f}")
                if sink is not None:
                    sink.log(row | {"epoch": epoch}, step=self.step)
                stats, tokens, times, t_window = None, 0, {"target": 0.0, "draft": 0.0}, time.perf_counter()
            if self.cfg.trainer.export_every and self.step % self.cfg.trainer.export_every == 0:
                self.export()

    def fit(self) -> dict:
        """Evaluate the untrained draft, train, export, evaluate again; returns the summary."""
        start = time.perf_counter()
        sink = M.MetricsSink(self.cfg.wandb, self.run_dir, asdict(self.cfg)) if self.par.is_main else None
        untrained = self.evaluate()
        if sink is not None:
            sink.log(untrained, step=0)
        bar = tqdm(total=self.total_steps, disable=not self.par.is_main, desc="train", unit="step")
        for epoch in range(self.cfg.trainer.epochs):
            self._epoch(epoch, sink, bar)
        bar.close()
        export_dir = self.export()
        trained = self.evaluate()
        summary = {
            "steps": self.step,
            "wall_time_s": time.perf_counter() - start,
            "untrained_eval_sim_accept_len": untrained[M.EVAL_SIM_ACCEPT],
            "eval_sim_accept_len": trained[M.EVAL_SIM_ACCEPT],
            "eval": trained,
            "export_dir": str(export_dir),
            "data": asdict(self.data_stats),
        }
        if sink is not None:
            sink.log(trained, step=self.step)
            sink.finish(summary)
        return summary


def _shared_run_dir(run_dir: Path) -> Path:
    """Every rank writes under rank 0's run dir (Hydra's timestamped dir may differ by rank)."""
    box = [str(run_dir)]
    torch.distributed.broadcast_object_list(box, src=0)
    return Path(box[0])


def _draft_checksum(trainer: Trainer) -> float:
    return float(sum(p.detach().double().abs().sum() for p in trainer.engine.module.draft.parameters()))


def _shard_overlap(trainer: Trainer) -> int:
    """Samples (by token content) that more than one rank trains on in epoch 0; 0 when disjoint."""
    mine = {hash(tuple(row[:n].tolist())) for b in trainer.batches(trainer.train_samples, 0) for row, n in zip(b.input_ids, b.lengths)}
    every = [None] * trainer.par.world
    torch.distributed.all_gather_object(every, mine)
    return sum(len(a & b) for i, a in enumerate(every) for b in every[i + 1 :])


def print_summary(summary: dict) -> None:
    rows = [
        ("optimizer steps", summary["steps"]),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
        ("held-out sim. accept length, untrained", f"{summary['untrained_eval_sim_accept_len']:.3f}"),
        ("held-out sim. accept length, trained", f"{summary['eval_sim_accept_len']:.3f}"),
        ("held-out acc_0", f"{summary['eval']['eval/acc_0']:.3f}"),
        ("export (SGLang)", summary["export_dir"]),
        ("summary", summary["summary_path"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def run(cfg: Config, run_dir: Path) -> dict:
    """Train, export and evaluate one run; rank 0 writes ``summary.json`` and prints it."""
    par = init_parallel(resolve_device(cfg.trainer.device))
    run_dir = _shared_run_dir(run_dir / cfg.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, run_dir, par)
    summary = trainer.fit()
    checksums = [None] * par.world
    torch.distributed.all_gather_object(checksums, _draft_checksum(trainer))
    summary["draft_checksums"] = checksums
    summary["shard_overlap"] = _shard_overlap(trainer)
    summary["summary_path"] = str(run_dir / "summary.json")
    if par.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary(summary)
    return summary
