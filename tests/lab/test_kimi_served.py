"""serving.served_check on the CPU: the widths an export was trained on, and the cause each mismatch names."""

import json

import pytest
import torch
from safetensors.torch import save_file

from lab.kimi_served import wrong_width_export
from serving.served_check import trained_width, width_problem

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
