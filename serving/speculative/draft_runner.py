"""The EAGLE-3 draft as an engine runs it: an incremental KV cache, chain steps, SGLang's wiring.

``models/draft.py`` computes the training-time-test unroll over whole sequences; a serving
engine instead keeps one KV cache of draft rows in position order and appends to it:

* *extend* rows (after each target forward): row t reads the embedding of token x_{t+1}
  and the target's features of position t, fused by ``fc``, and sits at position t;
* *chain* rows (drafting): row t + j reads the embedding of draft token j and the draft's
  own output at the previous row, fed back pre-norm unless ``norm_output``.

A query attends to every cached row at or before its position, which equals the TTT mask
of ``models/draft.ttt_attention`` (tests/serving/test_eval.py checks the two agree). Chain rows are
dropped (``crop``) once the target has verified them; the accepted tokens come back as
extend rows with the target's features, as in SGLang's draft-extend.

Feature wiring follows SGLang's ``LlamaModel.forward``: ``fc`` is applied only when the
incoming width differs from the embedding width. Fed the target's final hidden state
(a target class without aux capture), a draft as wide as its target skips ``fc``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.draft import Eagle3Draft


class DraftRunner:
    def __init__(self, draft: Eagle3Draft, draft_to_target: Tensor, norm_output: bool):
        self.draft = draft.eval()
        self.draft_to_target = draft_to_target  # [V_d] target id of each draft id
        self.norm_output = norm_output
        self.keys: Tensor | None = None  # [1, H_kv, L, D]
        self.values: Tensor | None = None
        self.fc_skipped = False  # set once features arrived as wide as the embedding

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reset(self) -> None:
        self.keys = self.values = None

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def fuse(self, features: Tensor) -> Tensor:
        """Target features [T, F] -> draft hidden [T, H], with SGLang's fc-skip rule."""
        param = next(self.draft.parameters())
        features = features.to(param.dtype)
        if features.shape[-1] != self.draft.shape.hidden_size:
            return self.draft.project(features)
        self.fc_skipped = True
        return features

    @torch.no_grad()
    def extend(self, tokens: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """Extend rows: tokens [T] (x_{t+1}), target features [T, F] -> (feedback [T, H], next target ids [T])."""
        return self.step(tokens, self.fuse(features))

    @torch.no_grad()
    def step(self, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Rows at the next positions: tokens [T], hidden [T, H] -> (feedback [T, H], next target ids [T])."""
        d, m = self.draft, self.draft.midlayer
        embeds = d.embed_tokens(tokens).to(hidden.dtype)  # [T, H]
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        residual = hidden + self._attend(x)
        out = residual + m.mlp(m.post_attention_layernorm(residual))  # [T, H], pre-norm
        normed = d.norm(out)
        draft_ids = d.lm_head(normed).argmax(-1)  # [T]
        return (normed if self.norm_output else out), self.draft_to_target[draft_ids]

    def _attend(self, x: Tensor) -> Tensor:
        """Causal attention of rows x [T, 2H] over the cache plus themselves; appends their k/v."""
        a, s = self.draft.midlayer.self_attn, self.draft.shape
        t, start = x.shape[0], self.length
        positions = torch.arange(start, start + t, device=x.device)[None]  # [1, T]
        q, k, v = a.qkv(x[None], positions)  # [1, H_q, T, D], [1, H_kv, T, D], [1, H_kv, T, Dv]
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        groups = s.num_attention_heads // s.num_key_value_heads
        keys, values = (c.repeat_interleave(groups, dim=1) for c in (self.keys, self.values))  # [1, H_q, L, D]
        scores = (q @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [1, H_q, T, L]
        visible = torch.arange(self.length, device=x.device)[None] <= positions[0][:, None]  # [T, L]
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (probs @ values)[0].transpose(0, 1).reshape(t, -1)  # [T, H_q * Dv]
        return a.o_proj(out)
