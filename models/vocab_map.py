"""The draft vocabulary: which target tokens the draft's ``lm_head`` can emit.

The draft predicts over ``V_d`` tokens, the most frequent target tokens under the loss
mask. Two tensors describe the map, in the layout SGLang and SpecForge use:

* ``d2t`` [V_d] int64: ``d2t[i] = target_id(i) - i`` (offsets, not ids). SGLang reads it as
  ``hot_token_id = d2t + arange(V_d)`` and validates nothing.
* ``t2d`` [V_t] bool: ``t2d[j]`` is True iff target token ``j`` is a draft token. SGLang
  ignores it; the trainer uses it to tell whether the target's argmax is reachable.

Draft ids are the hot target ids in ascending order, so ``d2t + arange`` is strictly
increasing and ``d2t`` itself is non-decreasing.

The zero-prefix rule (the field failure: a map whose first 20 ``d2t`` entries were zero
instead of offsets, so the draft learned to predict target tokens 0..19). A zero prefix is
not corrupt by itself: in byte-level BPE vocabularies (Llama-3, Qwen, GPT-2, tiktoken) ids
0..19 are ``! " # $ % & ' ( ) * + , - . / 0 1 2 3 4``, which are hot in any chat corpus, so a
correct map for those targets has ``d2t[:20] == 0``. Refusing every zero prefix would refuse
correct maps. What makes a zero prefix corrupt is that the prefix target ids are *not* the
hot tokens, and the witness for that is ``t2d``, which ``build_vocab_map`` derives from the
counts independently of ``d2t``. So a map is valid only if ``d2t + arange`` equals the sorted
positions of ``t2d`` exactly (the invariants below together say that); a zeroed ``d2t``
prefix against a ``t2d`` built from real counts is refused with a message naming the zero
prefix. A map whose ``t2d`` was itself derived from a corrupt ``d2t`` is self-consistent and
cannot be told apart from a correct one without the counts: pass ``counts`` to ``validate``
(the trainer has them, from ``count_tokens``) and the map must also be a top-``V_d`` set of
those counts, which refuses it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

ZERO_PREFIX = 20  # length of the d2t prefix the zero-prefix diagnosis looks at
KEYS = ("d2t", "t2d")


@dataclass
class VocabMap:
    d2t: Tensor  # [V_d] int64, target_id(i) - i
    t2d: Tensor  # [V_t] bool, target token is a draft token

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.shape[0]

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.shape[0]

    @property
    def draft_to_target(self) -> Tensor:
        """[V_d] int64: the target id of each draft id (ascending)."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def to(self, device) -> "VocabMap":
        return VocabMap(self.d2t.to(device), self.t2d.to(device))

    def validate(self, where: str = "built map", counts: Tensor | None = None) -> "VocabMap":
        """Check every invariant (listed below); ValueError naming ``where`` otherwise.

        Invariants: ``d2t`` int64 1-D non-empty; ``t2d`` bool 1-D; ``V_d <= V_t``;
        ``d2t + arange`` within ``[0, V_t)`` and strictly increasing; ``t2d.sum() == V_d``;
        ``t2d[d2t + arange]`` all True. Together these say ``d2t + arange`` is exactly the
        sorted positions of ``t2d``. With ``counts`` [V_t], the draft tokens must also be a
        most-frequent set: no non-draft token is counted more often than a draft token.
        Returns ``self`` so calls chain.
        """
        d2t, t2d = self.d2t, self.t2d
        if not isinstance(d2t, Tensor) or d2t.dtype != torch.int64 or d2t.dim() != 1:
            raise ValueError(f"{where}: d2t must be a 1-D int64 tensor, got {_describe(d2t)}")
        if not isinstance(t2d, Tensor) or t2d.dtype != torch.bool or t2d.dim() != 1:
            raise ValueError(f"{where}: t2d must be a 1-D bool tensor, got {_describe(t2d)}")
        v_d, v_t = d2t.shape[0], t2d.shape[0]
        if v_d == 0:
            raise ValueError(f"{where}: d2t is empty (draft vocab of 0 tokens)")
        if v_d > v_t:
            raise ValueError(f"{where}: draft vocab ({v_d}) is larger than the target vocab ({v_t})")
        d2t, t2d = d2t.cpu(), t2d.cpu()
        ids = d2t + torch.arange(v_d)
        bad = ((ids < 0) | (ids >= v_t)).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"{where}: d2t + arange must be target ids in [0, {v_t}); draft id {i} maps to "
                f"{int(ids[i])} ({len(bad)} draft ids out of range)"
            )
        k = min(ZERO_PREFIX, v_d)
        if bool((d2t[:k] == 0).all()) and not bool(t2d[:k].all()):
            missing = (~t2d[:k]).nonzero().flatten()[:5].tolist()
            raise ValueError(
                f"{where}: corrupt vocab map: the first {k} d2t entries are all zero (draft ids "
                f"0..{k - 1} -> target ids 0..{k - 1}) but t2d does not mark target ids {missing}: "
                "the d2t offsets were zeroed; rebuild the map from token counts"
            )
        bad = (ids[1:] <= ids[:-1]).nonzero()
        if len(bad):
            i = int(bad[0]) + 1
            raise ValueError(
                f"{where}: d2t + arange must be strictly increasing; draft id {i} maps to target id "
                f"{int(ids[i])}, not above draft id {i - 1}'s {int(ids[i - 1])}"
            )
        marked = int(t2d.sum())
        if marked != v_d:
            raise ValueError(f"{where}: t2d.sum() must equal the draft vocab size {v_d}, got {marked}")
        bad = (~t2d[ids]).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"{where}: t2d disagrees with d2t: draft id {i} maps to target id {int(ids[i])}, "
                f"which t2d does not mark ({len(bad)} such draft ids)"
            )
        if counts is not None:
            _check_top_k(where, counts, t2d)
        return self

    def save(self, path: str | os.PathLike) -> Path:
        """Validate, then write ``d2t`` and ``t2d`` as safetensors (atomically)."""
        path = Path(path)
        self.validate(str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            save_file(
                {"d2t": self.d2t.detach().cpu().contiguous(), "t2d": self.t2d.detach().cpu().contiguous()},
                str(tmp),
                metadata={"format": "pt", "content": "streamdraft vocab map"},
            )
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "VocabMap":
        """Read a map written by ``save``; ValueError naming the file and key on any problem."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: vocab map file does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                missing = [k for k in KEYS if k not in keys]
                if missing:
                    raise ValueError(f"{path}: vocab map file lacks tensor(s) {missing} (it holds {sorted(keys)})")
                extra = sorted(keys - set(KEYS))
                if extra:
                    raise ValueError(f"{path}: vocab map file holds unexpected tensor(s) {extra}")
                tensors = {k: f.get_tensor(k) for k in KEYS}
        except SafetensorError as e:
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
        return cls(tensors["d2t"], tensors["t2d"]).validate(str(path))


def build_vocab_map(counts: Tensor, draft_vocab_size: int) -> VocabMap:
    """The ``min(draft_vocab_size, V_t)`` most frequent target tokens, ascending by target id.

    Ties are broken by the lower target id; tokens never counted are used only to fill the
    draft vocab up (lowest ids first) when fewer distinct tokens were seen.
    """
    if not isinstance(counts, Tensor) or counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"token counts must be a 1-D integer tensor [target vocab], got {_describe(counts)}")
    if counts.numel() == 0:
        raise ValueError("token counts are empty (target vocab of 0 tokens)")
    if bool((counts < 0).any()):
        raise ValueError("token counts must be non-negative")
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    counts = counts.cpu().long()
    v_t = counts.shape[0]
    n = min(draft_vocab_size, v_t)
    order = torch.sort(-counts, stable=True).indices  # descending count, ascending id on ties
    ids = order[:n].sort().values
    t2d = torch.zeros(v_t, dtype=torch.bool)
    t2d[ids] = True
    return VocabMap(d2t=ids - torch.arange(n), t2d=t2d).validate("built map", counts=counts)


def count_tokens(batches: Iterable, vocab_size: int) -> Tensor:
    """[vocab_size] int64 counts of the loss-masked tokens: the tokens the draft learns to predict.

    ``batches`` yields ``(input_ids, loss_mask)`` pairs (any matching shapes) or objects with
    ``input_ids`` and ``loss_mask`` (a ``TokenBatch``). Padding must be outside the mask.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for n, item in enumerate(batches):
        ids, mask = item if isinstance(item, (tuple, list)) else (item.input_ids, item.loss_mask)
        if ids.shape != mask.shape:
            raise ValueError(f"batch {n}: input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} differ in shape")
        picked = ids[mask.bool()].reshape(-1).cpu().long()
        if picked.numel() == 0:
            continue
        lo, hi = int(picked.min()), int(picked.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"batch {n}: token id {lo if lo < 0 else hi} is outside the target vocab [0, {vocab_size})")
        counts += torch.bincount(picked, minlength=vocab_size)
    return counts


def _check_top_k(where: str, counts: Tensor, t2d: Tensor) -> None:
    if not isinstance(counts, Tensor) or counts.shape != t2d.shape:
        raise ValueError(f"{where}: counts must be a tensor of shape {tuple(t2d.shape)}, got {_describe(counts)}")
    if bool(t2d.all()):
        return
    counts = counts.cpu().long()
    least_draft = int(counts[t2d].min())
    top_other = int(counts[~t2d].max())
    if top_other > least_draft:
        token = int(torch.where(~t2d, counts, -1).argmax())
        raise ValueError(
            f"{where}: the map is not the most frequent tokens of these counts: target token {token} "
            f"(count {top_other}) is not a draft token, but a draft token has count {least_draft}"
        )


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
