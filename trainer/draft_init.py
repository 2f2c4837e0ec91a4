"""``draft.init_from``: an existing EAGLE-3 draft to go on training (a StreamDraft or SGLang export, a
SpecForge checkpoint, a vLLM speculators export), read strictly and checked against this run.

The run trains the checkpoint's weights with the checkpoint's vocab map; its aux layer ids, feedback
state (``norm_output``) and every size that shapes a tensor must be this run's, or the error names
each difference and the setting that removes it. Sizes that shape no tensor (RoPE theta, RMSNorm eps,
max positions) are the checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.draft import DraftShape, Eagle3Draft
from models.target_head import TargetHead
from models.vocab_map import VocabMap
from serving.export import load_draft
from trainer.config import DraftConfig

SETTABLE = {  # shape field -> its key
    "layout": "draft.layout",
    "fc_norm": "draft.fc_norm",
    "draft_vocab_size": "draft.draft_vocab_size",
    "intermediate_size": "draft.intermediate_size",
}
TARGET_SIZES = ("hidden_size", "num_attention_heads", "target_hidden_size", "num_aux", "vocab_size")
ATTENTION_SIZES = ("num_key_value_heads", "head_dim", "mla")  # compared when the layouts agree


@dataclass
class InitialDraft:
    draft: Eagle3Draft  # the checkpoint's weights, the target's embedding
    vocab: VocabMap  # the checkpoint's map

    @property
    def shape(self) -> DraftShape:
        return self.draft.shape


def initial_draft(cfg: DraftConfig, head: TargetHead, shape: DraftShape) -> InitialDraft | None:
    """The draft ``draft.init_from`` names, checked against the target ``head`` and the ``shape`` this
    run's config builds; None without ``draft.init_from``."""
    if cfg.init_from is None:
        return None
    path, info = Path(cfg.init_from).expanduser(), head.info
    try:
        draft, vocab, parsed = load_draft(path, head.embed_weight.float().cpu(), info.num_layers)
    except ValueError as e:
        raise ValueError(f"config draft.init_from: {e}") from None
    problems = []
    if list(parsed.aux_layer_ids) != list(info.aux_layer_ids):
        problems.append(
            f"it reads aux layers {parsed.aux_layer_ids}, this run captures {list(info.aux_layer_ids)}: "
            f"set target.aux_layer_ids={parsed.aux_layer_ids}"
        )
    if parsed.norm_output != cfg.norm_output:
        problems.append(f"it was trained with norm_output {parsed.norm_output}: set draft.norm_output={str(parsed.norm_output).lower()}")
    for field, key in SETTABLE.items():
        theirs, ours = getattr(parsed.shape, field), getattr(shape, field)
        if theirs != ours:
            said = str(theirs).lower() if isinstance(theirs, bool) else theirs  # as the command line writes it
            problems.append(f"its {field} is {theirs}, this run's {ours}: set {key}={said}")
    same_layout = parsed.shape.layout == shape.layout
    for field in TARGET_SIZES + (ATTENTION_SIZES if same_layout else ()):
        theirs, ours = getattr(parsed.shape, field), getattr(shape, field)
        if theirs != ours:
            problems.append(f"its {field} is {theirs}, a draft of this target has {ours}: it was trained for another target")
    if problems:
        raise ValueError(f"config draft.init_from: {path} does not fit this run:\n  " + "\n  ".join(problems))
    return InitialDraft(draft, vocab)
