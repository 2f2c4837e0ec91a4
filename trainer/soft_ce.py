"""Soft cross-entropy against shifted target probabilities, without fp32 [B, T, V] copies.

``ce[b, t] = -sum_v probs[b, t + shift, v] * log_softmax(logits[b, t])_v``, computed as
``sum(p) * logsumexp(x) - p . x`` in row chunks with the backward written out
(``g * (softmax(x) * sum(p) - p)``); on a GPU each is one compiled kernel. Only the logits
(their own dtype) are kept for the backward and the labels are read unshifted, in place.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor


def _ce_rows(x: Tensor, p: Tensor) -> Tensor:
    """x [n, V] logits, p [n, V] fp32 -> [n]."""
    xf = x.float()
    return p.sum(-1) * torch.logsumexp(xf, -1) - (p * xf).sum(-1)


def _ce_grad_rows(x: Tensor, p: Tensor, g: Tensor) -> Tensor:
    """d ce / d x for rows x [n, V], p [n, V], upstream g [n] -> [n, V] in x's dtype."""
    xf = x.float()
    return (g.float()[:, None] * (torch.softmax(xf, -1) * p.sum(-1, keepdim=True) - p)).to(x.dtype)


@lru_cache(maxsize=2)
def _kernels(cuda: bool):
    if cuda:
        return torch.compile(_ce_rows, dynamic=True), torch.compile(_ce_grad_rows, dynamic=True)
    return _ce_rows, _ce_grad_rows


def _chunks(rows: int, length: int, chunk: int):
    for row in range(rows):
        for start in range(0, max(length, 0), chunk):
            yield row, start, min(start + chunk, length)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, probs: Tensor, shift: int, chunk: int) -> Tensor:
        rows_fn, _ = _kernels(logits.device.type == "cuda")
        b, t, _ = logits.shape
        ce = torch.zeros(b, t, dtype=torch.float32, device=logits.device)
        for row, start, stop in _chunks(b, t - shift, chunk):
            ce[row, start:stop] = rows_fn(logits[row, start:stop], probs[row, start + shift : stop + shift])
        ctx.save_for_backward(logits, probs)
        ctx.shift, ctx.chunk = shift, chunk
        return ce

    @staticmethod
    def backward(ctx, grad: Tensor):
        _, grad_fn = _kernels(grad.device.type == "cuda")
        logits, probs = ctx.saved_tensors
        b, t, _ = logits.shape
        out = torch.zeros_like(logits)
        for row, start, stop in _chunks(b, t - ctx.shift, ctx.chunk):
            out[row, start:stop] = grad_fn(logits[row, start:stop], probs[row, start + ctx.shift : stop + ctx.shift], grad[row, start:stop])
        return out, None, None, None


def soft_cross_entropy(logits: Tensor, probs: Tensor, shift: int, chunk: int = 4096) -> Tensor:
    """logits [B, T, V_d], probs [B, T, V_d] fp32 -> ce [B, T] fp32 (0 where t >= T - shift)."""
    return _SoftCrossEntropy.apply(logits, probs, shift, chunk)
