"""The draft-step kernels StreamDraft used before flex attention and the fused soft
cross-entropy, kept as the baseline that ``bench_throughput.py --profile`` times the
current kernels (``models/attention.py``, ``trainer/soft_ce.py``) against:

1. ``ttt_attention_scores``: explicit ``[B, H, T, T + k]`` scores (step-0 causal block plus
   the same-row keys of steps 1..k), one fp32 softmax.
2. ``plain_soft_cross_entropy``: ``-(shift_left(p) * log_softmax(x.float())).sum(-1)``,
   which keeps an fp32 log-softmax and a shifted fp32 label copy per TTT step.

The compiled pointwise chains the bench also times are ``models.draft.compiled_pointwise``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.attention import document_causal_mask
from trainer.ttt import shift_left


def ttt_attention_scores(q: Tensor, cache: list[tuple[Tensor, Tensor]], groups: int, doc_ids: Tensor | None = None) -> Tensor:
    """Drop-in for ``models.attention.ttt_attention``: q [B, H, T, D]; cache[j] = (k, v) [B, H_kv, T, D]."""
    scale = q.shape[-1] ** -0.5
    k0, v0 = (x.repeat_interleave(groups, dim=1) for x in cache[0])  # [B, H, T, D]
    t = q.shape[2]
    allowed = document_causal_mask(t, q.device, doc_ids)[:, None]  # [1 or B, 1, T, T]
    scores0 = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~allowed, torch.finfo(q.dtype).min)  # [B, H, T, T]
    later = [(k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)) for k, v in cache[1:]]
    diag = [(q * k).sum(-1, keepdim=True) * scale for k, _ in later]  # each [B, H, T, 1]
    probs = torch.softmax(torch.cat([scores0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :t] @ v0  # [B, H, T, D]
    for j, (_, v) in enumerate(later):
        out = out + probs[..., t + j : t + j + 1] * v
    return out


def plain_soft_cross_entropy(logits: Tensor, probs: Tensor, shift: int, chunk: int = 0) -> Tensor:
    """Drop-in for ``trainer.soft_ce.soft_cross_entropy``."""
    return -(shift_left(probs, shift) * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
