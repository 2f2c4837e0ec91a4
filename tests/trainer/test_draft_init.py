"""draft.init_from: an existing EAGLE-3 draft (an export, a SpecForge checkpoint) read strictly,
checked against the run, then trained on."""

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from models.draft import Eagle3Draft, draft_shape_for
from models.embedded import embedded_target_dir
from models.target_head import read_target_config
from models.vocab_map import build_vocab_map, count_tokens
from serving.export import export_draft, load_export
from serving.formats import ExportSpec
from tests.fixtures.tiny import TINY_DRAFT, tiny_config
from trainer.config import DraftConfig
from trainer.draft_init import initial_draft
from trainer.loop import Trainer

SHAPE = dataclasses.replace(TINY_DRAFT, target_hidden_size=TINY_DRAFT.hidden_size)  # the target's width: a shared embedding
LAYERS, IDS = 30, (1, 14, 26)  # the default ids of a 30-layer target


def _draft_and_vocab(shape, seed=0):
    torch.manual_seed(seed)
    draft = Eagle3Draft(shape)
    ids = torch.randint(0, shape.vocab_size, (400,))
    vocab = build_vocab_map(count_tokens([(ids, torch.ones_like(ids, dtype=torch.bool))], shape.vocab_size), shape.draft_vocab_size)
    return draft, vocab


def _head(shape):
    embed = torch.randn(shape.vocab_size, shape.hidden_size, generator=torch.Generator().manual_seed(1))
    return SimpleNamespace(info=SimpleNamespace(aux_layer_ids=IDS, num_layers=LAYERS), embed_weight=embed)


def _export(tmp_path, shape=SHAPE, norm_output=False):
    draft, vocab = _draft_and_vocab(shape)
    spec = ExportSpec.of(list(IDS), norm_output=norm_output, dtype=torch.float32, target_num_layers=LAYERS)
    return export_draft(tmp_path / "export", "sglang", draft, vocab, spec), draft, vocab


def _as_specforge(export_dir):
    """The export as SpecForge saves a draft: no eagle_config, target_hidden_size, head_dim or provenance; tied embeddings."""
    config = json.loads((export_dir / "config.json").read_text())
    for key in ("eagle_config", "target_hidden_size", "head_dim", "streamdraft"):
        del config[key]
    (export_dir / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    return export_dir


def test_a_specforge_checkpoint_loads_with_its_weights_and_vocab_map(tmp_path):
    path, draft, vocab = _export(tmp_path)
    head = _head(SHAPE)
    init = initial_draft(DraftConfig(init_from=str(_as_specforge(path))), head, SHAPE)
    assert init.shape == SHAPE and torch.equal(init.vocab.d2t, vocab.d2t) and torch.equal(init.vocab.t2d, vocab.t2d)
    for name, tensor in draft.trainable_state_dict().items():
        assert torch.equal(init.draft.state_dict()[name], tensor), name
    assert torch.equal(init.draft.embed_tokens.weight, head.embed_weight)  # the target's, as the engines share it


def test_a_draft_that_does_not_fit_the_run_names_every_difference_and_its_fix(tmp_path):
    path, _, _ = _export(tmp_path, norm_output=True)
    head = _head(SHAPE)
    head.info.aux_layer_ids = (2, 14, 26)
    run_shape = dataclasses.replace(SHAPE, draft_vocab_size=16, intermediate_size=64)
    with pytest.raises(ValueError) as err:
        initial_draft(DraftConfig(init_from=str(path)), head, run_shape)
    lines = str(err.value).splitlines()
    assert lines[0] == f"config draft.init_from: {path} does not fit this run:"
    assert lines[1:] == [
        "  it reads aux layers [1, 14, 26], this run captures [2, 14, 26]: set target.aux_layer_ids=[1, 14, 26]",
        "  it was trained with norm_output True: set draft.norm_output=true",
        f"  its draft_vocab_size is {SHAPE.draft_vocab_size}, this run's 16: set draft.draft_vocab_size={SHAPE.draft_vocab_size}",
        f"  its intermediate_size is {SHAPE.intermediate_size}, this run's 64: set draft.intermediate_size={SHAPE.intermediate_size}",
    ]
    with pytest.raises(ValueError, match="its hidden_size is 32, a draft of this target has 40: it was trained for another target"):
        initial_draft(DraftConfig(init_from=str(path), norm_output=True), head, dataclasses.replace(SHAPE, hidden_size=40))


def test_a_stray_tensor_is_refused_by_name(tmp_path):
    path, draft, vocab = _export(tmp_path)
    tensors = draft.trainable_state_dict() | {"d2t": vocab.d2t, "t2d": vocab.t2d, "extra.weight": torch.zeros(2)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"config draft.init_from: .*unexpected tensor\(s\) \['extra.weight'\]"):
        initial_draft(DraftConfig(init_from=str(path)), _head(SHAPE), SHAPE)


def test_the_run_trains_the_initial_drafts_weights_with_its_map(tmp_path):
    target = embedded_target_dir(Path(os.environ["STREAMDRAFT_CACHE"]))
    shape = draft_shape_for(read_target_config(target)[1], 3, 1024)
    draft, vocab = _draft_and_vocab(shape, seed=3)
    spec = ExportSpec.of([1, 14, 26], norm_output=False, dtype=torch.float32, target_num_layers=30)
    path = export_draft(tmp_path / "init", "sglang", draft, vocab, spec)
    trainer = Trainer(tiny_config(f"draft.init_from={path}"), tmp_path / "run")
    try:
        trained = trainer.ds_model.module.draft.state_dict()
        for name, tensor in load_export(path, embed_weight=trainer.target.head.embed_weight)[0].state_dict().items():
            assert torch.equal(trained[name], tensor), name
        assert torch.equal(trainer.built.vocab.d2t, vocab.d2t)
    finally:
        trainer.close()
