"""serving.verify over real exports for the embedded target: good exports pass for both engines,
both name the same physical layers, and each field failure is reported by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from models.draft import Eagle3Draft, draft_shape_for
from models.embedded import embedded_target_dir
from models.target import HFTargetEngine
from models.vocab_map import build_vocab_map
from serving.export import export_both
from serving.formats import EXPORT_FORMATS, ExportSpec, read_export_config
from serving.verify import format_report, target_facts, verify_export, verify_exports
from serving.verify import main as verify_main

AUX = [1, 14, 26]


@pytest.fixture(scope="module")
def target_dir():
    return embedded_target_dir()


def _export_draft(target_dir, out_dir, intermediate_size=None) -> dict:
    """An untrained-but-initialised draft for the embedded target (1,024-token vocab), exported for both engines."""
    config = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(0)
    shape = draft_shape_for(config, num_aux=3, draft_vocab_size=1024, intermediate_size=intermediate_size)
    counts = torch.randint(0, 1000, (shape.vocab_size,), generator=torch.Generator().manual_seed(0))
    draft, vocab = Eagle3Draft(shape), build_vocab_map(counts, 1024)
    spec = ExportSpec.of(
        AUX,
        norm_output=False,
        dtype=torch.bfloat16,
        target_architecture="LlamaForCausalLM",
        target_num_layers=30,
        target_path=str(target_dir),
    )
    return export_both(out_dir, draft, vocab, spec)


@pytest.fixture(scope="module")
def exports(target_dir, tmp_path_factory):
    return _export_draft(target_dir, tmp_path_factory.mktemp("exports"))


def _copy(exports, engine, tmp_path):
    return shutil.copytree(exports[engine], tmp_path / engine)


def _edit_weights(out, edit):
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))


def _edit_config(out, edit):
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))


def _messages(report) -> str:
    return "\n".join(f"{p.check} {p.item}: {p.message}" for p in report.problems)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_good_exports_verify_for_their_engine(exports, target_dir, engine, capsys):
    report = verify_export(exports[engine], engine, target_dir)
    assert report.ok, _messages(report)
    assert report.consumed == 15 and report.params_set == (10 if engine == "sglang" else 11)  # vLLM: + draft_id_to_target_id
    assert verify_main([str(exports[engine]), "--engine", engine, "--target", str(target_dir)]) == 0
    assert capsys.readouterr().out.startswith("OK")


def test_a_draft_with_a_wider_mlp_than_the_target_exports_and_verifies_for_both_engines(target_dir, tmp_path):
    config = AutoConfig.from_pretrained(target_dir)
    assert draft_shape_for(config, 3, 1024, intermediate_size=3072).intermediate_size == 3072
    assert draft_shape_for(config, 3, 1024).intermediate_size == config.intermediate_size == 1536
    out = _export_draft(target_dir, tmp_path, intermediate_size=3072)
    for engine in ("sglang", "vllm"):
        assert read_export_config(out[engine]).shape.intermediate_size == 3072
        report = verify_export(out[engine], engine, target_dir)
        assert report.ok, _messages(report)
    _edit_config(out["sglang"], lambda c: c.update(intermediate_size=config.intermediate_size))  # config and weights disagree
    assert not verify_export(out["sglang"], "sglang", target_dir).ok


def test_both_exports_name_the_same_physical_layers(exports, target_dir):
    sglang, vllm = read_export_config(exports["sglang"]), read_export_config(exports["vllm"])
    assert sglang.engine_aux_layer_ids == AUX  # SGLang: output of layer k, written unchanged
    assert vllm.engine_aux_layer_ids == [k + 1 for k in AUX]  # vLLM: input of layer k
    assert sglang.aux_layer_ids == vllm.aux_layer_ids == AUX
    # Replay each engine's capture on the real target: SGLang appends the residual stream at
    # the input of layer id + 1, vLLM at the input of layer id; in transformers the input of
    # layer j is output_hidden_states[j]. Both must be the tensors training captured.
    engine = HFTargetEngine.from_path(target_dir)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 30, 2, 198, 1, 4093, 198]])
    with torch.no_grad():
        hidden = engine.model(input_ids=ids, output_hidden_states=True).hidden_states
    from models.batch import TokenBatch

    trained = engine.features(TokenBatch(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([ids.shape[1]]))).aux
    at_sglang = torch.cat([hidden[k + 1] for k in sglang.engine_aux_layer_ids], dim=-1)
    at_vllm = torch.cat([hidden[k] for k in vllm.engine_aux_layer_ids], dim=-1)
    assert torch.equal(at_sglang, trained) and torch.equal(at_vllm, trained)


def _module_prefix(t):  # a DDP / DeepSpeed wrapper's state_dict names
    for k in [k for k in t if k.startswith("midlayer.")]:
        t["module." + k] = t.pop(k)


FAILURES = [
    ("wrapper-prefixed keys", _module_prefix, ["module.midlayer.self_attn.q_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"]),
    ("missing key", lambda t: t.pop("norm.weight"), ["model.norm.weight", "set by no tensor"]),
    (
        "wrong fc width",
        lambda t: t.update({"fc.weight": torch.zeros(576, 1152, dtype=torch.bfloat16)}),
        ["fc.weight", "(576, 1152)", "num_aux * target_hidden_size: 1728 in config.json, 1152 in the tensors"],
    ),
    ("corrupted d2t", lambda t: t["d2t"].__setitem__(slice(0, 20), 0), ["corrupt vocab map", "first 20 d2t entries are all zero"]),
]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("name, edit, expected", FAILURES, ids=[f[0] for f in FAILURES])
def test_field_failures_fail_verify_by_name(exports, target_dir, tmp_path, engine, name, edit, expected, capsys):
    out = _copy(exports, engine, tmp_path)
    _edit_weights(out, edit)
    report = verify_export(out, engine, target_dir)
    assert not report.ok
    for text in expected:
        assert text in _messages(report), _messages(report)
    assert verify_main([str(out), "--engine", engine, "--target", str(target_dir)]) == 1
    printed = capsys.readouterr().out
    assert printed.startswith("FAIL") and expected[0] in printed


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_config_width_unlike_the_tensors_is_one_problem_and_against_the_target_another(exports, target_dir, tmp_path, engine):
    out = _copy(exports, engine, tmp_path)
    _edit_config(out, lambda c: (c["transformer_layer_config"] if engine == "vllm" else c).update(hidden_size=512))
    widths = "widths hidden_size: 512 in config.json, 576 in the tensors (norm.weight (576,)): they must agree"
    assert _messages(verify_export(out, engine)) == widths  # not each tensor's shape: they all follow from it
    against = "target hidden_size: 512 in config.json, the target's is 576: the draft embeds with the target's embedding"
    assert _messages(verify_export(out, engine, target_dir)).splitlines() == [widths, f"{against} (the export has none of its own)"]


def test_dropped_tensors_are_called_silent_for_sglang_and_refused_for_vllm(exports, target_dir, tmp_path):
    for engine, verb in (("sglang", "skips it silently"), ("vllm", "refuses it")):
        out = _copy(exports, engine, tmp_path)
        _edit_weights(out, _module_prefix)
        assert verb in _messages(verify_export(out, engine, target_dir))


def test_layers_0_names_load_in_both_engines(exports, target_dir, tmp_path):
    """SGLang and vLLM both map ``layers.0.*`` onto their module: the engines accept it."""
    for engine in ("sglang", "vllm"):
        out = _copy(exports, engine, tmp_path)
        _edit_weights(
            out, lambda t: t.update({k.replace("midlayer.", "layers.0."): t.pop(k) for k in list(t) if k.startswith("midlayer.")})
        )
        report = verify_export(out, engine, target_dir)
        assert report.ok, _messages(report)


def test_an_export_for_the_other_engine_is_refused(exports, target_dir):
    report = verify_export(exports["vllm"], "sglang", target_dir)
    assert [p.check for p in report.problems] == ["format"] and "this is a vllm export" in report.problems[0].message


def test_aux_ids_out_of_range_for_the_target(exports, target_dir, tmp_path):
    out = _copy(exports, "sglang", tmp_path)
    _edit_config(out, lambda c: (c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 14, 29]), c.pop("streamdraft")))
    messages = _messages(verify_export(out, "sglang", target_dir))
    assert "[1, 14, 29] out of range for a 30-layer target" in messages and "ids must lie in [0, 28]" in messages


def test_vllm_speculators_defaults_are_caught(exports, target_dir, tmp_path):
    out = _copy(exports, "vllm", tmp_path)
    _edit_config(out, lambda c: c.pop("norm_before_residual"))  # speculators' default is true
    assert "norm_before_residual must be false" in _messages(verify_export(out, "vllm", target_dir))
    out = _copy(exports, "vllm", tmp_path / "2")
    _edit_weights(out, lambda t: t.pop("d2t"))
    messages = _messages(verify_export(out, "vllm", target_dir))
    assert "draft_id_to_target_id" in messages and "identity" in messages


@pytest.mark.parametrize(
    "engine, arch, expected",
    [
        ("sglang", "TorchNativeLlamaForCausalLM", ["does not implement set_eagle3_layers_to_capture", "accept ~1.0"]),
        ("sglang", "NotAModelForCausalLM", ["has no model class", "TransformersForCausalLM"]),
        ("vllm", "Gemma2ForCausalLM", ["does not implement SupportsEagle3"]),
    ],
)
def test_a_target_without_aux_capture_is_flagged(exports, target_dir, tmp_path, engine, arch, expected):
    target = tmp_path / "target"
    target.mkdir()
    config = json.loads((target_dir / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
    report = verify_export(exports[engine], engine, target)
    assert [p.check for p in report.problems] == ["target"], _messages(report)
    for text in expected:
        assert text in report.problems[0].message


def test_report_table_names_every_problem(exports, target_dir, tmp_path):
    out = _copy(exports, "sglang", tmp_path)
    _edit_weights(out, lambda t: (t.pop("norm.weight"), t["d2t"].__setitem__(slice(0, 20), 0)))
    text = format_report(verify_export(out, "sglang", target_dir))
    assert text.splitlines()[0].endswith("2 problem(s)")
    assert "weights" in text and "vocab" in text and "model.norm.weight" in text


def test_verify_without_engine_loops_over_every_format(exports, target_dir, tmp_path, capsys):
    root = exports["sglang"].parent
    assert sorted(p.name for p in root.iterdir()) == sorted(EXPORT_FORMATS)
    assert verify_main([str(root), "--target", str(target_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["OK"] * len(EXPORT_FORMATS)
    assert [line.split(":")[0].split()[-1] for line in lines] == list(EXPORT_FORMATS)
    broken = tmp_path / "root"
    for engine in EXPORT_FORMATS:
        shutil.copytree(exports[engine], broken / engine)
    _edit_weights(broken / "vllm", lambda t: t.pop("norm.weight"))
    assert verify_main([str(broken), "--target", str(target_dir)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("OK") and "FAIL" in out and "model.norm.weight" in out


def test_an_unknown_engine_is_a_clear_error(exports, capsys):
    with pytest.raises(ValueError, match="unknown export engine 'tgi': known engines are sglang, vllm"):
        verify_export(exports["sglang"], "tgi")
    with pytest.raises(SystemExit):
        verify_main([str(exports["sglang"]), "--engine", "tgi"])
    assert "invalid choice: 'tgi'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"no export dir given for engine\(s\) \['vllm'\]"):
        verify_exports({"sglang": exports["sglang"]})


def test_a_multimodal_target_is_read_from_its_text_config(exports, target_dir, tmp_path):
    config = json.loads((target_dir / "config.json").read_text())
    text = {k: v for k, v in config.items() if k != "architectures"}
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    (wrapped / "config.json").write_text(json.dumps({"architectures": config["architectures"], "text_config": text}))
    facts = target_facts(wrapped, None)
    assert (facts.architecture, facts.num_layers, facts.hidden_size, facts.vocab_size) == (
        config["architectures"][0],
        config["num_hidden_layers"],
        config["hidden_size"],
        config["vocab_size"],
    )
    assert verify_export(exports["sglang"], "sglang", wrapped).ok
