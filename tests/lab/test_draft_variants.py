"""lab/draft_variants.py, the baseline kernels bench_profile.py times the current ones against: equal to them."""

from __future__ import annotations

import torch

from lab.draft_variants import plain_soft_cross_entropy, ttt_attention_scores
from models.attention import ttt_attention
from trainer.soft_ce import soft_cross_entropy


def test_the_baseline_kernels_match_the_current_ones():
    """models/attention.py (log-sum-exp merge) and trainer/soft_ce.py against the explicit forms."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 8, requires_grad=True)
    cache = [(torch.randn(2, 2, 12, 8, requires_grad=True), torch.randn(2, 2, 12, 8, requires_grad=True)) for _ in range(3)]
    for n in (1, 3):
        current, baseline = ttt_attention(q, cache[:n], 2), ttt_attention_scores(q, cache[:n], 2)
        torch.testing.assert_close(current, baseline)
        inputs = [q, *cache[0], *cache[n - 1]]
        for a, b in zip(torch.autograd.grad(current.square().sum(), inputs), torch.autograd.grad(baseline.square().sum(), inputs)):
            torch.testing.assert_close(a, b)
    logits, probs = torch.randn(2, 12, 20, requires_grad=True), torch.softmax(torch.randn(2, 12, 20), -1)
    weight = torch.arange(12.0)
    current, baseline = soft_cross_entropy(logits, probs, 3, chunk=5), plain_soft_cross_entropy(logits, probs, 3)
    torch.testing.assert_close(current, baseline)
    torch.testing.assert_close(
        torch.autograd.grad((current * weight).sum(), logits)[0], torch.autograd.grad((baseline * weight).sum(), logits)[0]
    )
