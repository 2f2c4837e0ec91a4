"""Attention of the TTT unroll: a causal block over step 0 plus one same-row key per later step.

Step 0 is one causal attention that also returns its log-sum-exp (``flex_attention``,
compiled, on a GPU: never builds the [B, H, T, T] scores; explicit scores on a CPU, where
flex has no backward). The step-j keys (one per row) are merged in by log-sum-exp:

    out = sum_i softmax([lse0, d_1 .. d_k])_i * [out0, v_1 .. v_k]_i

which equals a softmax over ``[scores0, d_1 .. d_k]`` (tests/trainer/test_ttt.py checks it against
an explicit full mask). Measured on an H200, 8B draft shapes: docs/BENCHMARKS.md, "Training throughput and MFU".

Packed rows (``doc_ids`` [B, T], several documents a row) make step 0 causal *within each
document*; the same-row keys of later steps never cross a document.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

KVCache = list[tuple[Tensor, Tensor]]  # per TTT step: (k, v), each [B, H_kv, T, D]


@lru_cache(maxsize=16)
def _causal_block_mask(t: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, B=None, H=None, Q_LEN=t, KV_LEN=t, device=device)


@lru_cache(maxsize=1)
def _document_block_mask(doc_ids: Tensor):
    """The block mask of ``document_causal_mask`` for doc_ids [B, T]; cached for the one batch
    whose TTT steps ask in turn (keyed by the tensor object, which the cache keeps alive)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(b, h, q, kv):
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    b, t = doc_ids.shape
    return create_block_mask(same_document, B=b, H=None, Q_LEN=t, KV_LEN=t, device=doc_ids.device)


def document_causal_mask(t: int, device, doc_ids: Tensor | None = None) -> Tensor:
    """[1, T, T] bool, query q sees key kv <= q; with doc_ids [B, T]: [B, T, T], and only in its document."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None]
    if doc_ids is None:
        return causal
    return causal & (doc_ids[:, :, None] == doc_ids[:, None, :])


@lru_cache(maxsize=1)
def _compiled_flex():
    """flex_attention compiled (its eager form is a slow reference); new lengths make T dynamic."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def explicit_causal_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, doc_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Causal attention through explicit [B, H, T, T] scores: (out [B, H, T, Dv], lse [B, H, T] fp32)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, H, T, D]
    allowed = document_causal_mask(q.shape[2], q.device, doc_ids)[:, None]  # [1 or B, 1, T, T]
    scores = ((q @ k.transpose(-1, -2)).float() * scale).masked_fill(~allowed, float("-inf"))  # [B, H, T, T]
    return torch.softmax(scores, -1).to(q.dtype) @ v, torch.logsumexp(scores, -1)


def causal_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, doc_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [B, H, T, D] over k, v [B, H_kv, T, D] (doc_ids [B, T]: within documents): flex_attention
    on a GPU, explicit scores on a CPU."""
    if q.device.type != "cuda":
        return explicit_causal_with_lse(q, k, v, scale, doc_ids)
    from torch.nn.attention.flex_attention import AuxRequest

    mask = _causal_block_mask(q.shape[2], str(q.device)) if doc_ids is None else _document_block_mask(doc_ids)
    out, aux = _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
    return out, aux.lse


def ttt_attention(q: Tensor, cache: KVCache, groups: int, doc_ids: Tensor | None = None) -> Tensor:
    """q [B, H, T, D] against step-0 keys (causal, within documents of doc_ids [B, T]) + the
    same-row keys of steps 1..k; values [B, H_kv, T, Dv] may be narrower than the keys (MLA).
    Returns [B, H, T, Dv]."""
    b, h, t, d = q.shape
    dv = cache[0][1].shape[-1]
    scale = d**-0.5
    out0, lse0 = causal_with_lse(q, *cache[0], scale, doc_ids)  # [B, H, T, Dv], [B, H, T]
    if len(cache) == 1:
        return out0
    qg = q.view(b, h // groups, groups, t, d)  # query heads grouped by their kv head
    diag = [((qg * k[:, :, None]).sum(-1) * scale).reshape(b, h, t) for k, _ in cache[1:]]  # each [B, H, T]
    weights = torch.softmax(torch.stack([lse0, *(x.float() for x in diag)], dim=-1), dim=-1).to(q.dtype)  # [B, H, T, 1+k]
    out = out0 * weights[..., 0:1]
    for j, (_, v) in enumerate(cache[1:], start=1):
        out = out + weights[..., j : j + 1] * v[:, :, None].expand(b, h // groups, groups, t, dv).reshape(b, h, t, dv)
    return out
