"""Training-time test (TTT): target soft labels, the K-step unroll, loss and metrics.

Index conventions, for a row of valid length L (tokens x_0 .. x_{L-1}):
  step k, row t reads token x_{t+1+k} and (k = 0) the fused target features of position t
  or (k > 0) its own step-(k-1) output of row t; it sits at position t + k, and learns the
  target's next-token distribution at position p = t + 1 + k (which predicts x_{p+1}).
  The row counts when p + 1 < L, x_{p+1} is under the loss mask, and the target's argmax
  at p is in the draft vocab.

Packed rows (``doc_ids`` [B, T]): positions count from each document's start, attention stays
inside the document, and row t counts only when x_{p+1} is in t's document, so no label
crosses a document end (the rows whose shifted input is the next document's first token
are never counted, and no counted row attends to them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.batch import FeatureBatch, token_positions
from models.draft import Eagle3Draft
from trainer.soft_ce import soft_cross_entropy


@dataclass
class TargetLabels:
    probs: Tensor  # [B, T, V_d] float32  softmax of the target logits over the draft vocab
    in_draft: Tensor  # [B, T] bool         target argmax (full vocab) is a draft token
    argmax: Tensor  # [B, T] long          target argmax, target ids


@torch.no_grad()
def target_labels(final: Tensor, lm_head: Tensor, draft_ids: Tensor, t2d: Tensor, chunk: int = 16384) -> TargetLabels:
    """Target logits = ``final`` [B, T, H] @ ``lm_head`` [V, H]^T, never materialised whole.

    The full-vocab argmax is taken chunk by chunk; the soft labels use only the draft
    vocab rows ``draft_ids`` [V_d] (target ids, ascending). The logits stay in their own dtype:
    a float32 copy would order them alike, and the softmax reads them into float32 itself.
    """
    best_val = torch.full(final.shape[:-1], float("-inf"), device=final.device)
    best_idx = torch.zeros(final.shape[:-1], dtype=torch.long, device=final.device)
    for start in range(0, lm_head.shape[0], chunk):
        val, idx = (final @ lm_head[start : start + chunk].T).max(dim=-1)  # [B, T]
        better = val > best_val
        best_val = torch.where(better, val.float(), best_val)
        best_idx = torch.where(better, idx + start, best_idx)
    probs = torch.softmax(final @ lm_head[draft_ids].T, dim=-1, dtype=torch.float32)  # [B, T, V_d]
    return TargetLabels(probs=probs, in_draft=t2d[best_idx], argmax=best_idx)


def shift_left(x: Tensor, n: int) -> Tensor:
    """x[:, n:] padded with zeros at the end back to x's length (dim 1)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class TTTOutput:
    loss: Tensor  # scalar, sum_k decay^k * mean loss of step k
    loss_sum: Tensor  # [K] summed soft cross-entropy of each step (detached)
    correct: Tensor  # [K] draft argmax == target argmax, counted over valid rows
    valid: Tensor  # [K] rows counted at each step


def step_valid(loss_mask: Tensor, lengths: Tensor, in_draft: Tensor, k: int, doc_ids: Tensor | None = None) -> Tensor:
    """[B, T] bool: rows of step k that carry a loss (see the module docstring)."""
    b, t = loss_mask.shape
    p = torch.arange(t, device=loss_mask.device) + 1 + k  # [T] label position
    inside = (p + 1)[None, :] < lengths[:, None]  # [B, T]
    valid = inside & shift_left(loss_mask, 2 + k) & shift_left(in_draft, 1 + k)
    if doc_ids is not None:
        valid = valid & (shift_left(doc_ids, 2 + k) == doc_ids)  # x_{p+1} in row t's document
    return valid


def ttt_unroll(
    draft: Eagle3Draft,
    input_ids: Tensor,  # [B, T]
    loss_mask: Tensor,  # [B, T] bool
    lengths: Tensor,  # [B]
    aux: Tensor,  # [B, T, num_aux * H_t]
    labels: TargetLabels,
    draft_to_target: Tensor,  # [V_d] target id of each draft id
    steps: int,
    decay: float,
    norm_output: bool,
    doc_ids: Tensor | None = None,  # [B, T] packed rows: document of each token, -1 on padding
) -> TTTOutput:
    positions = token_positions(input_ids, doc_ids)  # [B, T]
    hidden = draft.project(aux)
    cache: list = []
    loss = hidden.new_zeros((), dtype=torch.float32)
    loss_sum, correct, valid = [], [], []
    for k in range(steps):
        out, logits = draft.step(shift_left(input_ids, 1 + k), hidden, positions + k, cache, doc_ids)
        mask = step_valid(loss_mask, lengths, labels.in_draft, k, doc_ids)  # [B, T]
        ce = soft_cross_entropy(logits, labels.probs, 1 + k)  # [B, T]
        n = mask.sum()
        step_loss = (ce * mask).sum()
        loss = loss + decay**k * step_loss / n.clamp(min=1)
        hit = draft_to_target[logits.argmax(-1)] == shift_left(labels.argmax, 1 + k)
        loss_sum.append(step_loss.detach())
        correct.append((hit & mask).sum())
        valid.append(n)
        hidden = draft.norm(out) if norm_output else out
    return TTTOutput(loss=loss, loss_sum=torch.stack(loss_sum), correct=torch.stack(correct), valid=torch.stack(valid))


@dataclass
class TTTInput:
    """One batch for the objective: the target's features and its labels over the draft vocab."""

    features: FeatureBatch
    labels: TargetLabels
    draft_to_target: Tensor  # [V_d] target id of each draft id


@dataclass
class TargetLabeler:
    """What the labels of a feature batch are computed from: the frozen target head and the vocab map."""

    lm_head: Tensor  # [V, H] the target's lm_head weight
    draft_to_target: Tensor  # [V_d] target id of each draft id
    t2d: Tensor  # [V] bool, target id is a draft token

    def input_for(self, fb: FeatureBatch) -> TTTInput:
        return TTTInput(fb, target_labels(fb.final, self.lm_head, self.draft_to_target, self.t2d), self.draft_to_target)


class TTTObjective(nn.Module):
    """The module DeepSpeed wraps: the draft plus its TTT settings; forward = ``ttt_unroll``."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, norm_output: bool):
        super().__init__()
        self.draft = draft
        self.steps, self.decay, self.norm_output = steps, decay, norm_output

    def forward(self, batch: TTTInput) -> TTTOutput:
        t, fb = batch.features.tokens, batch.features
        return ttt_unroll(
            self.draft,
            t.input_ids,
            t.loss_mask,
            t.lengths,
            fb.aux,
            batch.labels,
            batch.draft_to_target,
            self.steps,
            self.decay,
            self.norm_output,
            t.doc_ids,
        )


def draft_step(model, labeler: TargetLabeler, fb: FeatureBatch, optimizer=None, keep=None) -> TTTOutput | None:
    """One training step of the draft on ``fb``: labels, the TTT forward, backward and the update.

    ``model`` is a DeepSpeed engine wrapping a ``TTTObjective`` (``optimizer`` None: the engine's
    backward and step, which accumulate and clip) or the objective itself with its ``optimizer``.
    ``keep(out)`` False skips backward and update (a non-finite loss) and returns None."""
    with torch.profiler.record_function("labels"):
        batch = labeler.input_for(fb)
    with torch.profiler.record_function("ttt_forward"):
        out = model(batch)
    if keep is not None and not keep(out):
        return None
    if optimizer is None:
        with torch.profiler.record_function("backward"):
            model.backward(out.loss)
        with torch.profiler.record_function("optimizer"):
            model.step()
        return out
    with torch.profiler.record_function("backward"):
        out.loss.backward()
    with torch.profiler.record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def simulated_accept_length(acc: list[float]) -> float:
    """sum_k prod_{j<=k} acc_j: expected accepted draft tokens of a greedy chain."""
    total, run = 0.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total
