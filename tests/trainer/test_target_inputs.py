"""A target's bad inputs named before any weight loads: aux ids beyond the depth its config (or its text_config)
gives, and a quantization format SGLang does not build."""

import json

import pytest

from models.backends.sglang.preflight import SOURCE_ENV, SGLangSource, find_sglang_source, quantization_problem
from trainer.preflight import check_sglang_format, check_target_path


def wrapper_dir(root, layers=61, quant_method="compressed-tensors"):
    """A Kimi-K2.5-style config: the language model's sizes and its expert format in text_config."""
    text = {"num_hidden_layers": layers, "hidden_size": 7168, "quantization_config": {"quant_method": quant_method}}
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}))
    return root


def test_aux_ids_beyond_the_depth_of_the_text_config_are_refused_by_key_and_file(tmp_path):
    target = wrapper_dir(tmp_path / "kimi")
    check_target_path(str(target), [1, 29, 57])  # the real ids
    with pytest.raises(ValueError) as err:
        check_target_path(str(target), [1, 29, 60])
    message = str(err.value)
    assert message.startswith("config target.aux_layer_ids: aux layer ids [1, 29, 60] out of range for a 61-layer target")
    assert message.endswith(f"({target / 'config.json'})")


@pytest.fixture(scope="module")
def sglang_source():
    found = find_sglang_source()
    if found is None:
        pytest.skip(f"no SGLang source: set {SOURCE_ENV} to an unpacked sglang wheel's sglang/")
    return found


def test_an_expert_format_sglang_does_not_build_is_named_before_the_target_loads(tmp_path, sglang_source, monkeypatch):
    source = SGLangSource.read(sglang_source)
    assert quantization_problem(wrapper_dir(tmp_path / "int4"), source) is None  # Kimi's INT4 experts: compressed-tensors
    bad = wrapper_dir(tmp_path / "bad", quant_method="int3_experts")
    monkeypatch.setenv(SOURCE_ENV, str(sglang_source))
    with pytest.raises(ValueError) as err:
        check_sglang_format(str(bad))
    assert str(err.value).startswith(
        f"config target.path: {bad / 'config.json'}: quantization_config.quant_method 'int3_experts' is not a format SGLang"
    )
    assert "compressed-tensors" in str(err.value)
