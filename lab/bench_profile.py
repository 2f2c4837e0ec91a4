"""``bench_throughput.py --profile``: where the draft step spends its time, against the baseline.

1. torch.profiler over a few draft steps (labels, TTT forward, backward, AdamW) on random
   features of the benchmark's shapes: the top ops by device time (CPU time on a CPU).
2. The step timed with the current kernels (flex-attention step 0 + log-sum-exp merge;
   fused soft cross-entropy), with the earlier ones of ``lab/draft_variants.py`` (one or
   both swapped in), and with the current ones plus compiled pointwise chains
   (``compiled_pointwise``): median ms a step, peak memory, and loss / gradient against the
   baseline on the same weights and inputs (they must agree to bf16 rounding).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch

import models.draft as draft_module
import trainer.ttt as ttt_module
from lab.draft_variants import plain_soft_cross_entropy, ttt_attention_scores
from models.batch import FeatureBatch, TokenBatch
from models.draft import compiled_pointwise
from trainer.ttt import draft_step

_BASELINE_ATTENTION = {"ttt_attention": ttt_attention_scores}  # in models.draft
_BASELINE_CE = {"soft_cross_entropy": plain_soft_cross_entropy}  # in trainer.ttt

# name: () -> (swaps in models.draft, swaps in trainer.ttt); the first is the reference
VARIANTS = {
    "baseline": lambda: (_BASELINE_ATTENTION, _BASELINE_CE),
    "flex_attention": lambda: ({}, _BASELINE_CE),
    "fused_soft_ce": lambda: (_BASELINE_ATTENTION, {}),
    "current": lambda: ({}, {}),
    "compiled_pointwise": lambda: (compiled_pointwise(), {}),
}


@contextlib.contextmanager
def kernels(draft_swaps: dict, ttt_swaps: dict):
    """Swap functions of ``models.draft`` and ``trainer.ttt`` by name (both look them up at call time)."""
    targets = ((draft_module, draft_swaps), (ttt_module, ttt_swaps))
    saved = [(module, name, getattr(module, name)) for module, swaps in targets for name in swaps]
    for module, swaps in targets:
        for name, fn in swaps.items():
            setattr(module, name, fn)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def random_features(st) -> FeatureBatch:
    torch.manual_seed(4)
    b, t = st.args.rows, st.args.seq
    tokens = st.batches[0].to(st.device)
    h = st.target_cfg["hidden_size"]
    aux = torch.randn(b, t, 3 * h, device=st.device).to(st.dtype)  # [B, T, 3H]
    final = torch.randn(b, t, h, device=st.device).to(st.dtype)  # [B, T, H]
    return FeatureBatch(TokenBatch(tokens.input_ids, tokens.loss_mask, tokens.lengths), aux, final)


def _sync(st) -> None:
    if st.device.type == "cuda":
        torch.cuda.synchronize(st.device)


def top_ops(st, objective, opt, fb, steps: int = 3, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if st.device.type == "cuda" else [])
    draft_step(objective, st.labeler, fb, opt)
    _sync(st)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            draft_step(objective, st.labeler, fb, opt)
        _sync(st)
    key = "self_device_time_total" if st.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def first_step_grads(st, objective, fb) -> tuple[float, dict[str, torch.Tensor]]:
    out = objective(st.labeler.input_for(fb))
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in objective.draft.named_parameters() if p.grad is not None}
    objective.draft.zero_grad(set_to_none=True)
    return float(out.loss.detach()), grads


def time_variant(st, objective, opt, fb, name: str, reference: tuple[float, dict] | None, steps: int) -> dict:
    with kernels(*VARIANTS[name]()):
        loss, grads = first_step_grads(st, objective, fb)
        row = {"variant": name, "loss": loss}
        if reference is not None:
            ref_loss, ref_grads = reference
            row["loss_diff"] = abs(loss - ref_loss)
            row["max_rel_grad_diff"] = max(
                float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp(min=1e-30)) for n in ref_grads
            )
        for _ in range(2):  # warm-up (and compile)
            draft_step(objective, st.labeler, fb, opt)
        _sync(st)
        if st.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(st.device)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            draft_step(objective, st.labeler, fb, opt)
            _sync(st)
            times.append(time.perf_counter() - t0)
    tokens = fb.aux.shape[0] * fb.aux.shape[1]
    row["step_ms"] = 1000 * statistics.median(times)
    row["draft_tokens_per_s"] = tokens / statistics.median(times)
    row["draft_tflops"] = row["draft_tokens_per_s"] * (st.flops["draft_train"] + st.flops["labels"]) / 1e12
    row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(st.device) if st.device.type == "cuda" else None
    return row, (loss, grads)


def profile(st, make_objective) -> dict:
    """``make_objective(st)``: the benchmark's fresh draft objective and its AdamW."""
    fb = random_features(st)
    objective, opt = make_objective(st)
    initial = copy.deepcopy(objective.draft.state_dict())
    ops = top_ops(st, objective, opt, fb)
    print(ops)
    rows, reference = [], None
    for name in VARIANTS:
        objective.draft.load_state_dict(initial)
        opt.state.clear()
        try:
            row, grads = time_variant(st, objective, opt, fb, name, reference, steps=max(3, st.args.steps // 2))
        except RuntimeError as err:  # a variant that fails to compile or run is reported, and the others still run
            if name in ("baseline", "current"):
                raise
            rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:2000]})
            print(f"{name:<20} FAILED: {rows[-1]['error'][:300]}", flush=True)
            objective.draft.zero_grad(set_to_none=True)
            if st.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        reference = reference or grads
        rows.append(row)
        print(
            f"{name:<20} {row['step_ms']:>9.1f} ms/step {row['draft_tokens_per_s']:>9.0f} tok/s {row['draft_tflops']:>7.1f} TFLOP/s"
            f"  loss diff {row.get('loss_diff', 0):.2e}  grad rel diff {row.get('max_rel_grad_diff', 0):.2e}",
            flush=True,
        )
    return {"top_ops": ops, "variants": rows}
