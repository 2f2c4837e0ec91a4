"""AuxLayerIds: validated once, translated for each consumer (transformers, SGLang, vLLM)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.aux_ids import AuxLayerIds


def test_default_ids_are_sglangs_default_capture():
    assert AuxLayerIds.default(30).ids == (1, 14, 26)
    assert AuxLayerIds.default(61).ids == (1, 29, 57)
    assert AuxLayerIds.default(61).num_layers == 61
    with pytest.raises(ValueError, match="at least 7 layers, got 6"):
        AuxLayerIds.default(6)


def test_resolve_takes_the_default_only_for_none():
    assert AuxLayerIds.resolve(None, 30) == AuxLayerIds.default(30)
    assert AuxLayerIds.resolve([0, 28], 30).ids == (0, 28)
    with pytest.raises(ValueError, match="out of range"):
        AuxLayerIds.resolve([1, 29], 30)


@pytest.mark.parametrize(
    "ids, num_layers, num_aux, match",
    [
        ("1,2", None, None, "must be a list of ints"),
        (7, None, None, "must be a list of ints"),
        ([1.0, 2], None, None, "must be a list of ints"),
        ([True, 2], None, None, "must be a list of ints"),
        ([], None, None, "empty"),
        ([-1, 3], 30, None, "out of range: .* must be non-negative"),
        ([14, 1], 30, None, "strictly increasing"),
        ([1, 1, 2], 30, None, "strictly increasing"),
        ([1, 29], 30, None, r"out of range for a 30-layer target: .* must be <= 28"),
        ([1, 30], 30, None, "out of range for a 30-layer target"),
        ([1, 7], None, 3, r"2 aux layer ids \[1, 7\] for a draft whose fc reads 3 aux states"),
    ],
)
def test_each_invalid_input_is_named(ids, num_layers, num_aux, match):
    with pytest.raises(ValueError, match=match):
        AuxLayerIds.of(ids, num_layers, num_aux)


def test_valid_ids_at_the_edges():
    assert AuxLayerIds.of([0, 28], 30).ids == (0, 28)  # the last capturable output is layer N - 2
    assert AuxLayerIds.of((5, 900)).ids == (5, 900)  # no layer count: no upper bound
    assert AuxLayerIds.of([1, 7, 12], num_aux=3).check_count(3).ids == (1, 7, 12)


def test_translations():
    ids = AuxLayerIds.of([1, 14, 26], 30)
    assert ids.sglang_argument == [1, 14, 26]  # SGLang reads explicit ids as outputs of layer k
    assert ids.sglang_layer_inputs == [2, 15, 27]  # and captures the input of layer k + 1
    assert ids.hidden_states_index == [2, 15, 27]  # transformers' output_hidden_states[k + 1]
    assert ids.vllm == [2, 15, 27]  # vLLM: inputs of layer k


def test_sglangs_deepseek_rule_adds_one_only_when_the_first_id_is_1():
    assert AuxLayerIds.of([1, 29, 57]).sglang_deepseek_layer_inputs == [2, 30, 58]
    assert AuxLayerIds.of([2, 30, 57]).sglang_deepseek_layer_inputs == [2, 30, 57]  # one layer early
    assert AuxLayerIds.of([0, 30, 57]).sglang_deepseek_layer_inputs == [0, 30, 57]


def test_from_vllm_inverts_vllm():
    ids = AuxLayerIds.of([0, 14, 28], 30)
    assert AuxLayerIds.from_vllm(ids.vllm, 30, 3) == ids
    with pytest.raises(ValueError, match="non-negative"):
        AuxLayerIds.from_vllm([0, 14, 28])  # vLLM's 0 is the embeddings: no decoder layer's output
    with pytest.raises(ValueError, match="list of ints"):
        AuxLayerIds.from_vllm("0")


def test_hidden_states_index_picks_the_outputs_of_layers_k():
    """The index is the tensor a forward hook on decoder layer k sees as its output."""
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )
    model = LlamaForCausalLM(config).eval()
    ids, outputs = AuxLayerIds.default(8), {}
    for k in ids.ids:
        model.model.layers[k].register_forward_hook(
            lambda m, a, out, k=k: outputs.__setitem__(k, out[0] if isinstance(out, tuple) else out)
        )
    with torch.no_grad():
        hidden = model(input_ids=torch.arange(5)[None], output_hidden_states=True).hidden_states
    for k, i in zip(ids.ids, ids.hidden_states_index):
        assert torch.equal(hidden[i], outputs[k])
