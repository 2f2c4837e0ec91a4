"""Metric names (one place, shared by the logger, the wandb dashboard and the offline report)
and the file rank 0 logs them to (``METRICS_FILE``, ``trainer.metrics_sink``). ``trainer.report.panels``
arranges these names into the panels both draw."""

from __future__ import annotations

from typing import Mapping

LOSS = "train/loss"
LR = "train/lr"
GRAD_NORM = "train/grad_norm"
SIM_ACCEPT = "train/sim_accept_len"
TOKENS_PER_S = "perf/tokens_per_s"
STEP_TIME = "perf/step_time_s"
TARGET_TIME = "perf/target_time_s"
DRAFT_TIME = "perf/draft_time_s"
EVAL_LOSS = "eval/loss"
EVAL_SIM_ACCEPT = "eval/sim_accept_len"
NONFINITE = "train/nonfinite_skipped"  # non-finite losses / gradients so far (trainer.on_nan)
TOKENS_SEEN = "train/tokens_seen"  # tokens (all ranks) the draft has trained on so far in this process
TRAIN_TIME = "perf/train_time_s"  # this process's training seconds so far: stream + draft steps, evaluations excluded
EPOCH = "epoch"

# real speculative decoding against the target with the exported draft loaded back from disk
# (serving.eval / serving.pipeline): the number a draft is judged by
EVAL_ACCEPT_LEN = "eval/accept_len"  # tau: tokens per target verify forward, bonus included (1 = none accepted)
EVAL_ACCEPT_LEN_SE = "eval/accept_len_se"  # its standard error over the eval turns (delta method, serving.eval.ratio_se)
EVAL_TF_ACC0 = "eval/tf_acc_0"  # the draft's first token on the eval answers with the true prefix everywhere (acc_0 there)
EVAL_SPEC_CYCLES = "eval/spec_cycles"  # verify forwards the measurement ran
EVAL_VERIFY_PROBLEMS = "eval/verify_problems"  # export verification problems, SGLang + vLLM (expect 0)

# performance beyond throughput and step times
MFU = "perf/mfu"  # model FLOPs utilisation of the draft trainer, 0..1
STALL_SHARE = "perf/stall_share"  # share of step time the trainer waited on the feature stream, 0..1 (mean of the ranks)
GPU_MEM = "perf/gpu_mem_gb"  # peak GPU memory allocated by the trainer rank, GiB

# data figures (DatasetStats fields, see data_metrics); logged once, kept in the run summary
DATA_CONVERSATIONS = "data/conversations"
DATA_SAMPLES = "data/samples"
DATA_TOKENS = "data/tokens"
DATA_MASKED_TOKENS = "data/masked_tokens"
DATA_TRUNCATED = "data/truncated"
DATA_ANSWERS_CUT = "data/answers_cut"  # assistant turns cut to data.answer_tokens
DATA_BOUNDARY_TOKENS = "data/boundary_tokens"
DATA_SKIPPED_MALFORMED = "data/skipped_malformed"
DATA_SKIPPED_NO_ASSISTANT = "data/skipped_no_assistant"
DATA_SKIPPED_DUPLICATES = "data/skipped_duplicates"
DATA_SKIPPED_NO_MASKED = "data/skipped_no_masked_token"
DATA_SKIPPED_OVERLONG = "data/skipped_overlong"  # samples longer than data.max_len, dropped
DATA_LEADING_TURNS_DROPPED = "data/leading_turns_dropped"  # assistant turns before the first user turn
DATA_THINKING_TOKENS = "data/thinking_tokens"  # assistant tokens kept out of the mask as thinking
DATA_SKIPPED = (
    DATA_SKIPPED_MALFORMED,
    DATA_SKIPPED_NO_ASSISTANT,
    DATA_SKIPPED_DUPLICATES,
    DATA_SKIPPED_NO_MASKED,
    DATA_SKIPPED_OVERLONG,
    DATA_LEADING_TURNS_DROPPED,
)
DATA_MIX_PREFIX = "data/mix/"
DATA_LABELS = {  # what each data figure counts, as the report's bars name it
    DATA_CONVERSATIONS: "conversations kept (train + held out)",
    DATA_SAMPLES: "training samples",
    DATA_TRUNCATED: "samples cut to data.max_len",
    DATA_ANSWERS_CUT: "answers cut to data.answer_tokens",
    DATA_TOKENS: "training tokens",
    DATA_MASKED_TOKENS: "tokens under the loss mask",
    DATA_THINKING_TOKENS: "thinking tokens left unmasked",
    DATA_BOUNDARY_TOKENS: "tokens straddling a mask edge",
    DATA_SKIPPED_MALFORMED: "malformed records skipped",
    DATA_SKIPPED_NO_ASSISTANT: "conversations without an assistant turn",
    DATA_SKIPPED_DUPLICATES: "repeated conversations skipped",
    DATA_SKIPPED_NO_MASKED: "samples without a masked token",
    DATA_SKIPPED_OVERLONG: "samples over data.max_len dropped",
    DATA_LEADING_TURNS_DROPPED: "leading assistant turns dropped",
}

_DATA_FIELDS = {  # DatasetStats field -> metric name; other numeric fields become data/<field>
    "conversations": DATA_CONVERSATIONS,
    "samples": DATA_SAMPLES,
    "tokens": DATA_TOKENS,
    "masked_tokens": DATA_MASKED_TOKENS,
    "truncated": DATA_TRUNCATED,
    "answers_cut": DATA_ANSWERS_CUT,
    "boundary_tokens": DATA_BOUNDARY_TOKENS,
    "malformed": DATA_SKIPPED_MALFORMED,
    "no_assistant": DATA_SKIPPED_NO_ASSISTANT,
    "duplicates": DATA_SKIPPED_DUPLICATES,
    "no_masked_token": DATA_SKIPPED_NO_MASKED,
    "overlong_dropped": DATA_SKIPPED_OVERLONG,
    "leading_turns_dropped": DATA_LEADING_TURNS_DROPPED,
    "thinking_tokens": DATA_THINKING_TOKENS,
}


def step_loss(k: int, split: str = "train") -> str:
    return f"{split}/loss_{k}"


def stall_share_rank(rank: int) -> str:
    """One rank's stall share; logged beside ``STALL_SHARE`` when more than one rank trains."""
    return f"{STALL_SHARE}_rank{rank}"


def step_acc(k: int, split: str = "train") -> str:
    return f"{split}/acc_{k}"


def accept_rate(k: int) -> str:
    """Share of verify forwards in which draft position k (0-based) was accepted (real decoding)."""
    return f"eval/accept_rate_{k}"


def cond_accept_rate(k: int) -> str:
    """Share of verify forwards reaching draft position k in which it was accepted (real decoding)."""
    return f"eval/cond_accept_rate_{k}"


def mix_share(source: str) -> str:
    """Share of the training samples that came from data source ``source`` (0..1)."""
    return f"{DATA_MIX_PREFIX}{source}"


def data_metrics(stats: Mapping[str, object]) -> dict[str, float]:
    """The data figures of a run (``DatasetStats.as_dict()``, i.e. ``summary["data"]``) under
    their metric names. A ``mix`` mapping of source -> share becomes ``data/mix/<source>``;
    other numeric fields become ``data/<field>``; per-source counters (``sources``) and text
    fields are left out."""
    out: dict[str, float] = {}
    for field, value in stats.items():
        if field == "mix":
            if not isinstance(value, Mapping):
                raise ValueError(f"data stats: mix must map source -> share, got {value!r}")
            out.update({mix_share(str(src)): float(share) for src, share in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[_DATA_FIELDS.get(field, f"data/{field}")] = value  # counts stay ints
    return out


METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step: {"step": n, name: value, ...}
