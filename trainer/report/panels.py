"""The panels people look at, in one place: the wandb workspace (``trainer.dashboard``) and
the offline PNG report (``trainer.report``) both draw exactly these sections and panels.

Metric names come from ``trainer.report.metrics``; a panel only arranges them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from trainer.report import metrics as M

X_LABEL = "optimizer step"


@dataclass(frozen=True)
class PanelSpec:
    title: str
    metrics: tuple[str, ...]
    y_label: str
    kind: Literal["line", "bar"] = "line"  # line: history over steps; bar: one final value per metric


@dataclass(frozen=True)
class SectionSpec:
    key: str  # file-name friendly: training, evaluation, performance, data
    title: str
    panels: tuple[PanelSpec, ...]

    def metrics(self) -> tuple[str, ...]:
        return tuple(m for p in self.panels for m in p.metrics)


def label(metric: str) -> str:
    """Legend label of a metric: its name after the section prefix (``train/acc_3`` -> ``acc_3``)."""
    return metric.split("/", 1)[-1]


def sections(ttt_steps: int, spec_tokens: int, mix_sources: Sequence[str]) -> tuple[SectionSpec, ...]:
    """Training, evaluation, performance and data sections for a draft unrolled ``ttt_steps``
    positions in training, evaluated drafting ``spec_tokens`` tokens per verify forward, and
    trained on the named data sources."""
    if ttt_steps < 1 or spec_tokens < 1:
        raise ValueError(f"panels: ttt_steps and spec_tokens must be >= 1, got {ttt_steps} and {spec_tokens}")
    ks, spec = range(ttt_steps), range(spec_tokens)
    training = SectionSpec(
        "training",
        "Training",
        (
            PanelSpec("Loss per TTT position", (M.LOSS, *(M.step_loss(k) for k in ks)), "soft cross-entropy"),
            PanelSpec("Accuracy per TTT position", tuple(M.step_acc(k) for k in ks), "top-1 accuracy"),
            PanelSpec("Simulated acceptance length", (M.SIM_ACCEPT,), "accepted draft tokens / round"),
            PanelSpec("Learning rate", (M.LR,), "learning rate"),
            PanelSpec("Gradient norm", (M.GRAD_NORM,), "global L2 norm"),
            PanelSpec("Non-finite steps skipped", (M.NONFINITE,), "count"),
        ),
    )
    evaluation = SectionSpec(
        "evaluation",
        "Evaluation",
        (
            PanelSpec("Acceptance length τ (real spec. decoding)", (M.EVAL_ACCEPT_LEN,), "tokens / verify forward"),
            PanelSpec("Acceptance rate per draft position", tuple(M.accept_rate(k) for k in spec), "share of verify forwards"),
            PanelSpec("Conditional acceptance per position", tuple(M.cond_accept_rate(k) for k in spec), "share when reached"),
            PanelSpec("Held-out simulated acceptance length", (M.EVAL_SIM_ACCEPT,), "accepted draft tokens / round"),
            PanelSpec("Held-out accuracy per TTT position", tuple(M.step_acc(k, "eval") for k in ks), "top-1 accuracy"),
            PanelSpec("Export verification problems", (M.EVAL_VERIFY_PROBLEMS,), "problems (expect 0)"),
        ),
    )
    performance = SectionSpec(
        "performance",
        "Performance",
        (
            PanelSpec("Throughput", (M.TOKENS_PER_S,), "tokens / s"),
            PanelSpec("Model FLOPs utilisation", (M.MFU,), "MFU"),
            PanelSpec("Stall share (waiting on the target)", (M.STALL_SHARE,), "share of step time"),
            PanelSpec("Time per optimizer step", (M.STEP_TIME, M.TARGET_TIME, M.DRAFT_TIME), "seconds"),
            PanelSpec("GPU memory", (M.GPU_MEM,), "GiB"),
        ),
    )
    data = SectionSpec(
        "data",
        "Data",
        (
            PanelSpec(
                "Conversations and samples",
                (M.DATA_CONVERSATIONS, M.DATA_SAMPLES, M.DATA_TRUNCATED, M.DATA_ANSWERS_CUT),
                "count",
                kind="bar",
            ),
            PanelSpec(
                "Tokens", (M.DATA_TOKENS, M.DATA_MASKED_TOKENS, M.DATA_THINKING_TOKENS, M.DATA_BOUNDARY_TOKENS), "tokens", kind="bar"
            ),
            PanelSpec("Skipped and dropped", M.DATA_SKIPPED, "count", kind="bar"),
            PanelSpec("Mix shares", tuple(M.mix_share(s) for s in mix_sources), "share of samples", kind="bar"),
        ),
    )
    return training, evaluation, performance, data
