"""Soft cross-entropy against shifted target probabilities, without fp32 [B, T, V] copies.

``ce[b, t] = -sum_v probs[b, t + shift, v] * log_softmax(logits[b, t])_v``, computed as
``sum(p) * logsumexp(x) - p . x`` in chunks of the flattened [B * T] positions (across rows, so a
batch of many short rows costs as few calls as one of long rows) with the backward written out
(``g * (exp(x - logsumexp(x)) * sum(p) - p)``, one pass over the logits and labels: the forward keeps each
position's logsumexp and sum(p)); on a GPU each is one compiled kernel. Only the logits (their own dtype)
and two floats a position are kept for the backward, and the labels are read unshifted, in place.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor


def _ce_rows(x: Tensor, p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [n, V] logits, p [n, V] fp32 -> ce, logsumexp(x), sum(p): each [n] fp32."""
    xf = x.float()
    lse, total = torch.logsumexp(xf, -1), p.sum(-1)
    return total * lse - (p * xf).sum(-1), lse, total


def _ce_grad_rows(x: Tensor, p: Tensor, lse: Tensor, total: Tensor, g: Tensor) -> Tensor:
    """d ce / d x for rows x [n, V], p [n, V], their forward's lse and total [n], upstream g [n] -> [n, V] in x's dtype."""
    softmax = torch.exp(x.float() - lse[:, None])  # [n, V]
    return (g.float()[:, None] * (softmax * total[:, None] - p)).to(x.dtype)


@lru_cache(maxsize=2)
def _kernels(cuda: bool):
    if cuda:
        return torch.compile(_ce_rows, dynamic=True), torch.compile(_ce_grad_rows, dynamic=True)
    return _ce_rows, _ce_grad_rows


def _spans(b: int, t: int, shift: int, chunk: int):
    """Spans [start, stop) of the flattened positions b * T + t whose label position, + shift, lies in the
    batch: chunks of at most ``chunk`` positions that run across rows (a row's last ``shift`` positions
    read the next row's first labels; ``_valid`` zeroes them)."""
    end = b * t - shift
    for start in range(0, max(end, 0), chunk):
        yield start, min(start + chunk, end)


def _valid(b: int, t: int, shift: int, device) -> Tensor:
    """[B, T] bool: position t has its label at t + shift in the same row."""
    return (torch.arange(t, device=device) < t - shift).expand(b, t)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, probs: Tensor, shift: int, chunk: int) -> Tensor:
        rows_fn, _ = _kernels(logits.device.type == "cuda")
        b, t, v = logits.shape
        x, p = logits.reshape(b * t, v), probs.reshape(b * t, v)  # views of the contiguous [B, T, V]
        ce, lse, total = torch.zeros(3, b * t, dtype=torch.float32, device=logits.device)  # each [B * T]
        for start, stop in _spans(b, t, shift, chunk):
            ce[start:stop], lse[start:stop], total[start:stop] = rows_fn(x[start:stop], p[start + shift : stop + shift])
        ctx.save_for_backward(logits, probs, lse, total)
        ctx.shift, ctx.chunk = shift, chunk
        return ce.view(b, t) * _valid(b, t, shift, logits.device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        _, grad_fn = _kernels(grad.device.type == "cuda")
        logits, probs, lse, total = ctx.saved_tensors
        b, t, v = logits.shape
        x, p = logits.reshape(b * t, v), probs.reshape(b * t, v)
        g = (grad * _valid(b, t, ctx.shift, grad.device)).reshape(b * t)  # [B * T], 0 where ce is 0 by definition
        out = torch.empty_like(x)  # [B * T, V]: the spans write [0, B * T - shift), the positions past have no label
        out[max(b * t - ctx.shift, 0) :] = 0
        for start, stop in _spans(b, t, ctx.shift, ctx.chunk):
            span = slice(start, stop)
            out[span] = grad_fn(x[span], p[start + ctx.shift : stop + ctx.shift], lse[span], total[span], g[span])
        return out.view(b, t, v), None, None, None


def soft_cross_entropy(logits: Tensor, probs: Tensor, shift: int, chunk: int = 4096) -> Tensor:
    """logits [B, T, V_d], probs [B, T, V_d] fp32 -> ce [B, T] fp32 (0 where t >= T - shift)."""
    return _SoftCrossEntropy.apply(logits, probs, shift, chunk)
