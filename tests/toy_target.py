"""A pure-torch stand-in for a target, for the engine-process lifecycle tests.

Kept apart from test_stream.py so that an engine process unpickling ``ToyTarget`` imports
only torch and this file (no pytest, no transformers): it starts in a couple of seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.batch import FeatureBatch, TokenBatch

VOCAB = 128


def make_batches(n: int, seed: int = 0, vocab: int = VOCAB) -> list[TokenBatch]:
    """``n`` right-padded batches of varying shape (B x T = 48 <= 64)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b, t = (2, 24) if i % 2 == 0 else (3, 16)
        ids = torch.randint(1, vocab, (b, t), generator=g)  # [B, T]
        lengths = torch.tensor([t] + [t - 3 - r for r in range(b - 1)])  # [B]
        valid = torch.arange(t)[None, :] < lengths[:, None]
        ids[~valid] = 0
        out.append(TokenBatch(ids, valid & (torch.rand(b, t, generator=g) > 0.3), lengths))
    return out


@dataclass(frozen=True)
class ToyInfo:
    hidden_size: int
    aux_layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class ToyTarget:
    """Features that are a function of the token ids; raises on ``fail_on_token``."""

    hidden: int = 8
    fail_on_token: int | None = None

    def build(self, device: torch.device) -> "ToyEngine":
        return ToyEngine(self, torch.device(device))


class ToyEngine:
    def __init__(self, spec: ToyTarget, device: torch.device):
        self.spec, self.device, self.dtype = spec, device, torch.float32
        self.info = ToyInfo(hidden_size=spec.hidden, aux_layer_ids=(0, 1, 2))

    def features(self, tokens: TokenBatch) -> FeatureBatch:
        tokens = tokens.to(self.device)
        if self.spec.fail_on_token is not None and bool((tokens.input_ids == self.spec.fail_on_token).any()):
            raise ValueError(f"poisoned batch: token {self.spec.fail_on_token}")
        x = tokens.input_ids.float()[..., None]  # [B, T, 1]
        h = self.spec.hidden
        aux = x * torch.arange(1, 3 * h + 1, device=self.device)  # [B, T, 3H]
        return FeatureBatch(tokens, aux, x + torch.arange(h, device=self.device))  # final [B, T, H]
