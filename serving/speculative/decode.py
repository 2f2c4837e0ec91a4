"""Greedy chain speculative decoding: draft k tokens, verify them in one target forward.

One cycle, with the committed sequence x_0 .. x_n (x_n produced by the target, not yet fed
to it; the target's KV cache holds x_0 .. x_{n-1}, the draft's rows 0 .. n-1):

1. draft: the last extend row already predicted d_1; k - 1 chain steps give d_2 .. d_k;
2. verify: one target forward over [x_n, d_1 .. d_k] gives its greedy token g_i after each;
3. accept: the longest prefix with d_i == g_{i-1} (a tokens), then the target's own g_a;
4. roll back: crop the target cache to x_0 .. x_n, d_1 .. d_a and the draft cache to its
   n extend rows; the a + 1 new tokens become extend rows with the verify features.

The output is, token for token, the target's greedy decoding. Acceptance length
τ = mean over cycles of (a + 1): tokens per target verify forward, SGLang's
``spec_accept_length`` (the first token, from the prefill forward, is not a cycle).

``teacher_forced_hits`` scores the draft's first token on a finished answer with the true
prefix at every position (what training's acc_0 measures), to set beside the served
accept rate at position 1, which counts only the positions where a cycle starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from serving.speculative.draft_runner import DraftRunner
from serving.speculative.target_runner import TargetRunner


@dataclass
class Generation:
    tokens: list[int]  # generated tokens, the stop token included when one was produced
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per cycle (a), 0..k


def _accepted(drafted: list[int], greedy: Tensor) -> int:
    """Length of the prefix of ``drafted`` equal to the target's greedy tokens."""
    a = 0
    while a < len(drafted) and drafted[a] == int(greedy[a]):
        a += 1
    return a


def _draft_chain(draft: DraftRunner, feedback: Tensor, first: Tensor, k: int) -> list[int]:
    """d_1 (already predicted by the last extend row) and k - 1 chain steps -> [d_1 .. d_k]."""
    tokens, hidden = [int(first)], feedback[-1:]  # [1, H]
    for _ in range(k - 1):
        hidden, nxt = draft.step(torch.tensor(tokens[-1:], device=feedback.device), hidden)
        tokens.append(int(nxt[-1]))
    return tokens


def _finish(tokens: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """Append ``new`` up to the budget or a stop token; True when generation is over."""
    for t in new:
        tokens.append(t)
        if t in stop_ids or len(tokens) >= max_new_tokens:
            return True
    return False


@torch.no_grad()
def speculative_generate(
    target: TargetRunner, draft: DraftRunner, prompt: Tensor, k: int, max_new_tokens: int, stop_ids: set[int]
) -> Generation:
    """Greedy speculative decoding of ``prompt`` [P] with a chain of ``k`` draft tokens."""
    if k < 1:
        raise ValueError(f"k (draft tokens per cycle) must be >= 1, got {k}")
    target.reset()
    draft.reset()
    greedy, features = target.forward(prompt)  # [P], [P, F]
    gen = Generation(tokens=[int(greedy[-1])])
    if gen.tokens[0] in stop_ids or max_new_tokens <= 1:
        return gen
    ext_tokens = torch.cat([prompt[1:], greedy[-1:]])  # x_1 .. x_P
    while True:
        n = target.length
        feedback, predicted = draft.extend(ext_tokens, features)  # rows n - len .. n - 1
        drafted = _draft_chain(draft, feedback, predicted[-1], k)
        verify = torch.tensor([gen.tokens[-1], *drafted], device=prompt.device)  # [k + 1]
        greedy, features = target.forward(verify)
        a = _accepted(drafted, greedy)
        gen.accepted.append(a)
        new = drafted[:a] + [int(greedy[a])]
        target.crop(n + 1 + a)
        draft.crop(n)
        if _finish(gen.tokens, new, max_new_tokens, stop_ids):
            return gen
        ext_tokens, features = torch.tensor(new, device=prompt.device), features[: a + 1]


@torch.no_grad()
def teacher_forced_hits(target: TargetRunner, draft: DraftRunner, prompt: Tensor, answer: list[int]) -> Tensor:
    """[A - 1] bool: for each of the answer's tokens after its first (the first comes from the
    prefill, never from the draft), whether the draft's first token, fed the target's features
    of the true prefix, equals the target's greedy token there (element j: answer token j + 2,
    counting from 1). ``prompt`` [P]; ``answer``: the target's greedy tokens that followed it."""
    if len(answer) < 2:
        return torch.zeros(0, dtype=torch.bool)
    seq = torch.cat([prompt, torch.tensor(answer[:-1], device=prompt.device)])  # x_0 .. x_{L-1}, L = P + A - 1
    target.reset()
    draft.reset()
    greedy, features = target.forward(seq)  # greedy[i]: the target's x_{i+1}
    _, predicted = draft.extend(torch.cat([seq[1:], greedy[-1:]]), features)  # predicted[i]: the draft's x_{i+2}
    p = prompt.shape[0]
    return (predicted[p - 1 : -1] == greedy[p:]).cpu()  # [A - 1]: x_{P+1} .. x_{P+A-1}
