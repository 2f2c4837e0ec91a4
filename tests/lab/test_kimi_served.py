"""serving.served_check on the CPU: the widths an export was trained on, and the cause each mismatch names; the
untrained control of served tau."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from lab.kimi_reduced import dummy_head
from lab.kimi_served import WRONG_HIDDEN, caught, untrained_export, wrong_width_export
from models.draft import Eagle3Draft
from models.vocab_map import build_vocab_map, count_tokens
from serving.export import export_draft, load_export
from serving.formats import ExportSpec
from serving.served_check import trained_width, width_problem
from serving.verify import verify_export
from tests.fixtures.tiny import TINY_DRAFT, TINY_MLA_DRAFT

WRAPPER = "KimiK25ForConditionalGeneration"


@pytest.fixture
def export(tmp_path):
    save_file({"fc.weight": torch.zeros(8, 3 * 7168, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    config = {"target_hidden_size": 7168, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_trained_width_passes_and_the_field_failure_is_named(export):
    trained = trained_width(export)
    assert (trained.fc_in, trained.target_hidden, trained.aux_ids) == (21504, 7168, (1, 29, 57))
    assert width_problem(trained, WRAPPER, 21504, 7168) is None
    problem = width_problem(trained, WRAPPER, 7168, 7168)
    assert "last hidden state (7168" in problem and "aux capture is not switched on" in problem and WRAPPER in problem
    assert "no hidden states" in width_problem(trained, WRAPPER, None, 7168)


def test_a_draft_trained_at_another_width_is_named(export, tmp_path):
    wrong = trained_width(wrong_width_export(export, tmp_path / "wrong"))
    assert (wrong.fc_in, wrong.target_hidden) == (1728, 576)
    problem = width_problem(wrong, WRAPPER, 21504, 7168)
    assert "trained on a 576-wide target" in problem and "this target is 7168 wide" in problem


def test_a_dir_that_is_not_an_export_is_named(tmp_path):
    with pytest.raises(ValueError, match="config.json: missing"):
        trained_width(tmp_path)


@pytest.mark.parametrize(("shape", "scale"), [(TINY_DRAFT, 1.0), (TINY_MLA_DRAFT, 2.0**17)], ids=["llama", "mla-scaled-head"])
def test_the_untrained_control_is_the_draft_as_the_trainer_starts_it(tmp_path, shape, scale):
    shape = dataclasses.replace(shape, target_hidden_size=shape.hidden_size)  # the target's width, as on Kimi
    torch.manual_seed(0)
    draft = Eagle3Draft(shape)
    for p in draft.parameters():
        torch.nn.init.normal_(p, mean=0.5, std=0.1)  # "trained": far from any initial value
    ids = torch.randint(0, shape.vocab_size, (400,))
    vocab = build_vocab_map(count_tokens([(ids, torch.ones_like(ids, dtype=torch.bool))], shape.vocab_size), shape.draft_vocab_size)
    export = export_draft(tmp_path / "trained", "sglang", draft, vocab, ExportSpec.of([1, 3, 4], norm_output=False, target_num_layers=8))
    untrained = untrained_export(export, tmp_path / "untrained", lm_head_scale=scale)
    assert [p for p in verify_export(untrained, "sglang").problems if p.check != "target"] == []
    before, after = load_file(str(export / "model.safetensors")), load_file(str(untrained / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in after.items()} == {k: (v.shape, v.dtype) for k, v in before.items()}
    assert torch.equal(after["d2t"], before["d2t"]) and torch.equal(after["t2d"], before["t2d"])
    head = dummy_head(shape.vocab_size, shape.hidden_size, "cpu")
    assert torch.equal(after["lm_head.weight"], dummy_head(shape.vocab_size, shape.hidden_size, "cpu", scale)[vocab.draft_to_target])
    assert torch.equal(after["lm_head.weight"].float(), head[vocab.draft_to_target].float() * scale)  # a power of two: exact
    for name, t in after.items():
        if name in ("d2t", "t2d", "lm_head.weight"):
            continue
        if t.dim() == 1:
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            bound = 1 / math.sqrt(t.shape[1])
            assert t.abs().max() <= bound and t.std() > bound / 3, name  # nn.Linear's uniform draw
    reread, _, _ = load_export(untrained, embed_weight=head.float())
    assert torch.equal(reread.lm_head.weight, head[vocab.draft_to_target].float() * scale)


def test_a_control_counts_only_when_it_fails_for_its_cause(export, tmp_path):
    trained, wrong = trained_width(export), trained_width(wrong_width_export(export, tmp_path / "wrong"))
    capture_off = {"rc": 1, "message": [f"served check failed for E on T: {width_problem(trained, WRAPPER, 7168, 7168)}"]}
    wrong_width = {"rc": 1, "message": [f"served check failed for E on T: {width_problem(wrong, WRAPPER, 21504, 7168)}"]}
    assert caught(capture_off, "aux capture is not switched on")
    assert caught(wrong_width, f"trained on a {WRONG_HIDDEN}-wide target")
    crashed = {"rc": 1, "message": [], "tail": "ModuleNotFoundError: No module named 'cuda.tile'"}
    assert not caught(crashed, "aux capture is not switched on")
    assert not caught({**capture_off, "rc": 0}, "aux capture is not switched on")
