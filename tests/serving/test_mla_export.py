"""The mla layout's export: the config and tensors SGLang's and vLLM's ``Eagle3DeepseekV2ForCausalLM`` load, every
tensor consumed and every parameter set (the loaders' replay), read back bit for bit and by draft.init_from; what
each engine would do with a broken one, named."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import models.aux_capture_table
from models.draft import Eagle3Draft
from models.vocab_map import build_vocab_map, count_tokens
from serving.export import export_both, load_export
from serving.formats import EXPORT_FORMATS, MLA_ARCHITECTURE, ExportSpec
from serving.verify import verify_export
from tests.fixtures.tiny import TINY_MLA_DRAFT
from trainer.config import DraftConfig
from trainer.draft_init import initial_draft

SHARED = dataclasses.replace(TINY_MLA_DRAFT, target_hidden_size=TINY_MLA_DRAFT.hidden_size)  # the target's width: no own embedding
LAYERS, IDS = 12, (1, 5, 8)


def _export(tmp_path, shape=TINY_MLA_DRAFT, norm_output=False):
    torch.manual_seed(0)
    draft = Eagle3Draft(shape)
    ids = torch.randint(0, shape.vocab_size, (400,))
    vocab = build_vocab_map(count_tokens([(ids, torch.ones_like(ids, dtype=torch.bool))], shape.vocab_size), shape.draft_vocab_size)
    spec = ExportSpec.of(list(IDS), norm_output=norm_output, dtype=torch.float32, target_num_layers=LAYERS)
    return export_both(tmp_path / "export", draft, vocab, spec), draft, vocab


def _problems(path, engine):
    return [(p.check, p.item) for p in verify_export(path, engine).problems if p.check != "target"]


@pytest.mark.parametrize("shape", [TINY_MLA_DRAFT, SHARED], ids=["own-embedding", "shared-embedding"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_each_engine_consumes_every_tensor_and_sets_every_parameter(tmp_path, engine, shape):
    paths, draft, _ = _export(tmp_path, shape)
    config = json.loads((paths[engine] / "config.json").read_text())
    assert config["architectures"] == [MLA_ARCHITECTURE] and config["model_type"] == "deepseek_v3" and config["fc_norm"] is True
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"], config["rope_interleave"]) == (24, 16, 4, True)
    tensors = {k: tuple(v.shape) for k, v in load_file(str(paths[engine] / "model.safetensors")).items()}
    replay = EXPORT_FORMATS[engine].replay(config, tensors, shape.vocab_size)
    assert set(replay.landed) == set(tensors) and not (replay.dropped or replay.refused or replay.shape_errors or replay.unset())
    fused = "fused_qkv_a_proj_with_mqa" if engine == "sglang" else "fused_qkv_a_proj"
    assert any(p.endswith(f"self_attn.{fused}.weight") and s == {0, 1} for p, s in replay.set_params.items())
    assert _problems(paths[engine], engine) == []


def test_the_engines_read_the_aux_ids_each_in_its_own_place_and_numbering(tmp_path):
    paths, _, _ = _export(tmp_path)
    sglang, vllm = (json.loads((paths[e] / "config.json").read_text()) for e in ("sglang", "vllm"))
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(IDS) and "eagle_aux_hidden_state_layer_ids" not in sglang
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in IDS] and "eagle_config" not in vllm
    assert vllm["num_aux_hidden_states"] == 3 and vllm["norm_before_residual"] is False and "speculators_config" not in vllm
    report = verify_export(paths["vllm"], "sglang")  # vLLM's ids handed to SGLang: named, nothing loaded
    assert [p.message for p in report.problems] == ["this is a vllm export, not a sglang one (its aux layer ids are in vllm's semantics)"]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_export_reads_back_bit_for_bit(tmp_path, engine):
    paths, draft, vocab = _export(tmp_path)
    loaded, loaded_vocab, _ = load_export(paths[engine])
    assert loaded.shape == TINY_MLA_DRAFT
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(loaded_vocab.d2t, vocab.d2t)


def test_sglang_holds_a_lone_a_projection_and_never_writes_it(tmp_path):
    """SGLang fuses q_a_proj and kv_a_proj_with_mqa when both came; one alone is dropped without a word."""
    paths, _, _ = _export(tmp_path)
    weights = paths["sglang"] / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"]
    save_file(tensors, str(weights))
    problems = _problems(paths["sglang"], "sglang")
    assert ("weights", "midlayer.self_attn.q_a_proj.weight") in problems
    assert ("weights", "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight") in problems


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(rope_interleave=False), "rope_interleave must be true"),
        (lambda c: c.pop("kv_lora_rank"), "lacks field(s) ['kv_lora_rank']"),
        (lambda c: c.update(fc_norm=False), "unexpected tensor(s) ['fc_norm.0.weight'"),
        (lambda c: c.update(qk_rope_head_dim=6), "q_b_proj.weight has shape"),
    ],
)
def test_a_tampered_mla_config_is_refused_by_name(tmp_path, edit, message):
    paths, _, _ = _export(tmp_path)
    config = json.loads((paths["sglang"] / "config.json").read_text())
    edit(config)
    (paths["sglang"] / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_export(paths["sglang"])
    assert message in str(err.value) and str(paths["sglang"]) in str(err.value)


def test_an_engine_without_the_mla_class_is_named(tmp_path, monkeypatch):
    """A vLLM whose registry lacks Eagle3DeepseekV2ForCausalLM (an older one): the draft class problem, by name."""
    paths, _, _ = _export(tmp_path)
    vllm = dict(models.aux_capture_table.TABLE["vllm"])
    vllm["drafts"] = [d for d in vllm["drafts"] if d != MLA_ARCHITECTURE]
    monkeypatch.setitem(models.aux_capture_table.TABLE, "vllm", vllm)
    problems = verify_export(paths["vllm"], "vllm").problems
    assert [p.message for p in problems if p.check == "draft"] == [
        "vllm 0.33.0 registers no draft class Eagle3DeepseekV2ForCausalLM: it cannot serve a mla-layout draft"
    ]


def test_init_from_reads_an_mla_draft_and_names_the_layout_a_run_must_set(tmp_path):
    paths, draft, _ = _export(tmp_path, SHARED)
    head = SimpleNamespace(info=SimpleNamespace(aux_layer_ids=IDS, num_layers=LAYERS), embed_weight=draft.embed_tokens.weight)
    cfg = DraftConfig(init_from=str(paths["sglang"]), layout="mla", fc_norm=True)
    init = initial_draft(cfg, head, SHARED)
    assert init.shape == SHARED and torch.equal(init.draft.midlayer.self_attn.kv_b_proj.weight, draft.midlayer.self_attn.kv_b_proj.weight)
    llama = dataclasses.replace(SHARED, mla=None, num_key_value_heads=2, head_dim=8, fc_norm=False)
    with pytest.raises(ValueError) as err:
        initial_draft(DraftConfig(init_from=str(paths["sglang"])), head, llama)
    lines = str(err.value).splitlines()[1:]
    assert lines == [
        "  its layout is mla, this run's llama: set draft.layout=mla",
        "  its fc_norm is True, this run's False: set draft.fc_norm=true",
    ]
