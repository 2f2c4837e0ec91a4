"""The SGLang export: round trip, config fields, exact tensor names, strict loading."""

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.draft import DraftShape, Eagle3Draft
from models.vocab_map import build_vocab_map
from serving.export import export_draft, load_export
from serving.formats import EXPORT_FORMATS, ExportSpec, format_of, read_export_config

# hidden 64 != target hidden 48: SGLang keeps the draft's own embedding, so it is exported.
CARRIED = DraftShape(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    target_hidden_size=48,
    num_aux=3,
    vocab_size=300,
    draft_vocab_size=100,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=512,
)
# hidden == target hidden: SGLang shares the target embedding, so it is not exported.
SHARED = DraftShape(**{**CARRIED.to_dict(), "target_hidden_size": 64})
AUX_IDS = [1, 7, 12]

# Every tensor SGLang's LlamaForCausalLMEagle3 consumes, by the names it expects.
LAYER_KEYS = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def _draft(shape: DraftShape, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(shape)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return draft


def _vocab(shape: DraftShape, seed: int = 0):
    counts = torch.randint(0, 20, (shape.vocab_size,), generator=torch.Generator().manual_seed(seed))
    return build_vocab_map(counts, shape.draft_vocab_size)


def _run(draft: Eagle3Draft, steps: int = 3, seed: int = 1) -> list[torch.Tensor]:
    """project + `steps` chained draft steps (pre-norm feedback) on random inputs."""
    g = torch.Generator().manual_seed(seed)
    s = draft.shape
    b, t = 2, 7
    aux = torch.randn(b, t, s.num_aux * s.target_hidden_size, generator=g)
    ids = torch.randint(0, s.vocab_size, (b, t + steps), generator=g)
    positions = torch.arange(t).expand(b, t)
    param = next(draft.parameters())
    hidden = draft.project(aux.to(param.dtype))
    cache, logits = [], []
    with torch.no_grad():
        for k in range(steps):
            out, lg = draft.step(ids[:, 1 + k : 1 + k + t], hidden, positions + k, cache)
            logits.append(lg.float())
            hidden = out
    return logits


def _export(tmp_path, shape=CARRIED, name="export", **kw):
    draft, vocab = _draft(shape), _vocab(shape)
    args = {"aux_layer_ids": AUX_IDS, "norm_output": False, "dtype": torch.float32, "target_architecture": "LlamaForCausalLM"}
    out = export_draft(tmp_path / name, "sglang", draft, vocab, ExportSpec.of(**{**args, **kw}))
    return out, draft, vocab


def test_fp32_round_trip_gives_identical_logits(tmp_path):
    out, draft, vocab = _export(tmp_path)
    back, back_vocab, config = load_export(out)
    assert torch.equal(back_vocab.d2t, vocab.d2t) and torch.equal(back_vocab.t2d, vocab.t2d)
    for a, b in zip(_run(draft), _run(back)):
        assert torch.equal(a, b)
    assert "norm_output" not in config and "SpecForge" in config["streamdraft"]["norm_output_key"]
    assert read_export_config(out).norm_output is False


def test_shared_embedding_round_trip(tmp_path):
    out, draft, _ = _export(tmp_path, shape=SHARED)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == LAYER_KEYS  # never the embedding
    with pytest.raises(ValueError, match="pass embed_weight"):
        load_export(out)
    with pytest.raises(ValueError, match=r"embed_weight has shape \(300, 48\)"):
        load_export(out, torch.zeros(300, 48))
    back, _, _ = load_export(out, draft.embed_tokens.weight)
    assert torch.equal(back.embed_tokens.weight, draft.embed_tokens.weight)
    assert not back.embed_tokens.weight.requires_grad
    for a, b in zip(_run(draft), _run(back)):
        assert torch.equal(a, b)


def test_carried_embedding_refuses_an_embed_weight(tmp_path):
    out, draft, _ = _export(tmp_path)
    with pytest.raises(ValueError, match="carries its own embedding"):
        load_export(out, torch.zeros(300, 48))


def test_bf16_export_gives_close_logits(tmp_path):
    out, draft, _ = _export(tmp_path, dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    back, _, config = load_export(out)
    assert config["torch_dtype"] == "bfloat16"
    for a, b in zip(_run(draft), _run(back)):
        scale = a.abs().max()
        assert (a - b).abs().max() < 0.03 * scale
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_safetensors_key_set_is_exact(tmp_path):
    out, _, _ = _export(tmp_path)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == LAYER_KEYS | {"embed_tokens.weight"}
    assert not any(k.startswith("layers.") for k in keys)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def _sglang_param_name(name: str) -> str | None:
    """SGLang LlamaForCausalLMEagle3.load_weights' renaming (None: consumed as d2t / t2d)."""
    for legacy, new in {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0"}.items():
        name = name.replace(legacy, new)
    if "d2t" in name or "t2d" in name:
        return None
    for param, shard in [
        (".qkv_proj", ".q_proj"),
        (".qkv_proj", ".k_proj"),
        (".qkv_proj", ".v_proj"),
        (".gate_up_proj", ".gate_proj"),
        (".gate_up_proj", ".up_proj"),
    ]:
        if shard in name:
            name = name.replace(shard, param)
            break
    return name if name == "lm_head.weight" else f"model.{name}"


def test_every_tensor_lands_on_an_sglang_parameter(tmp_path):
    out, _, _ = _export(tmp_path)
    sglang_params = {
        "model.embed_tokens.weight",
        "model.fc.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.hidden_norm.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        landed = {_sglang_param_name(k) for k in f.keys()} - {None}
    assert landed == sglang_params


def test_config_fields(tmp_path):
    out, _, vocab = _export(tmp_path, norm_output=True, target_num_layers=16)
    config = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "vocab_size": 300,
        "draft_vocab_size": 100,
        "target_hidden_size": 48,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
        "norm_output": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 7, 12], "use_aux_hidden_state": True},
    }
    for key, value in expected.items():
        assert config[key] == value, key
    assert config["streamdraft"]["target_architecture"] == "LlamaForCausalLM"
    assert config["streamdraft"]["target_num_layers"] == 16
    assert "output of decoder layer k" in config["streamdraft"]["aux_layer_id_semantics"]
    assert not {"fc_norm", "use_aux_norm", "bias", "num_aux_hidden_states"} & config.keys()
    _, _, back = load_export(out)
    assert back["norm_output"] is True


def test_config_reads_as_sglang_sees_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    out, _, _ = _export(tmp_path)
    c = transformers.LlamaConfig.from_pretrained(out)
    assert c.tie_word_embeddings is False
    assert (c.draft_vocab_size, c.vocab_size, c.target_hidden_size, c.hidden_size) == (100, 300, 48, 64)
    assert c.head_dim == 16 and c.num_hidden_layers == 1 and c.hidden_act == "silu"
    assert c.eagle_config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert not hasattr(c, "norm_output")  # SGLang: getattr(config, "norm_output", False)
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}
    assert rope["rope_theta"] == 500000.0


def _tamper(out, edit):
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(
    "edit, names",
    [
        (
            lambda t: t.update({k.replace("midlayer.", "layers.0."): t.pop(k) for k in list(t) if k.startswith("midlayer.")}),
            ["missing", "midlayer.self_attn.q_proj.weight", "unexpected", "layers.0.self_attn.q_proj.weight"],
        ),
        (lambda t: t.pop("fc.weight"), ["missing tensor(s) ['fc.weight']"]),
        (lambda t: t.update({"extra.weight": torch.zeros(3)}), ["unexpected tensor(s) ['extra.weight']"]),
        (lambda t: t.update({"fc.weight": torch.zeros(64, 48)}), ["fc.weight has shape (64, 48), expected (64, 144)"]),
        (lambda t: t.pop("d2t"), ["missing tensor(s) ['d2t']"]),
        (lambda t: t.update({"d2t": t["d2t"].int()}), ["d2t has dtype I32, expected I64"]),
        (lambda t: t.update({"norm.weight": torch.zeros(64, dtype=torch.int32)}), ["norm.weight has dtype I32"]),
    ],
)
def test_tampered_weights_are_refused_by_name(tmp_path, edit, names):
    out, _, _ = _export(tmp_path)
    path = _tamper(out, edit)
    with pytest.raises(ValueError) as err:
        load_export(out)
    message = str(err.value)
    assert message.startswith(str(path))
    for name in names:
        assert name in message


def test_corrupt_vocab_map_in_export_is_refused(tmp_path):
    out, _, _ = _export(tmp_path)

    def zero_prefix(t):
        t["d2t"][:20] = 0

    path = _tamper(out, zero_prefix)
    assert torch.count_nonzero(load_file(str(path))["d2t"][:20]) == 0
    with pytest.raises(ValueError, match=f"{path}: corrupt vocab map"):
        load_export(out)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings must be false"),
        (lambda c: c.pop("draft_vocab_size"), "lacks field(s) ['draft_vocab_size']"),
        (lambda c: c.update(norm_output="no"), "norm_output must be true or false"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures must be"),
        (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers must be 1"),
        (lambda c: c.update(use_aux_norm=True), "missing tensor(s) ['fc_norm.0.weight'"),  # the config says fc_norm, the tensors lack it
        (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 7]), "fc.weight has shape"),
    ],
)
def test_tampered_config_is_refused(tmp_path, edit, message):
    out, _, _ = _export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_export(out)
    assert message in str(err.value)
    assert str(out) in str(err.value)


def test_overwrite_replaces_an_earlier_export(tmp_path):
    out, _, _ = _export(tmp_path)
    (out / "stale.txt").write_text("left over")
    draft2, vocab2 = _draft(CARRIED, seed=5), _vocab(CARRIED, seed=5)
    export_draft(out, "sglang", draft2, vocab2, ExportSpec.of(AUX_IDS, norm_output=True, dtype=torch.float32))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temp or old dir left
    back, back_vocab, config = load_export(out)
    assert config["norm_output"] is True and torch.equal(back_vocab.d2t, vocab2.d2t)
    assert torch.equal(back.fc.weight, draft2.fc.weight)


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a StreamDraft export"):
        export_draft(foreign, "sglang", _draft(CARRIED), _vocab(CARRIED), ExportSpec.of(AUX_IDS, norm_output=False))
    assert (foreign / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    export_draft(empty, "sglang", _draft(CARRIED), _vocab(CARRIED), ExportSpec.of(AUX_IDS, norm_output=False))
    assert (empty / "config.json").is_file()


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"aux_layer_ids": [1, 7]}, "2 aux layer ids"),
        ({"aux_layer_ids": [7, 1, 12]}, "strictly increasing"),
        ({"aux_layer_ids": [1, 1, 12]}, "strictly increasing"),
        ({"aux_layer_ids": [-1, 7, 12]}, "non-negative"),
        ({"aux_layer_ids": [1, 7, 15], "target_num_layers": 16}, "must be <= 14"),
        ({"norm_output": None}, "norm_output must be a bool"),
        ({"dtype": torch.int8}, "floating torch dtype"),
    ],
)
def test_export_refuses_bad_arguments(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        _export(tmp_path, **kw)
    assert not (tmp_path / "export").exists()


def test_export_refuses_a_draft_whose_fc_sglang_would_skip(tmp_path):
    shape = DraftShape(
        **{**CARRIED.to_dict(), "target_hidden_size": 16, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
    )
    with pytest.raises(ValueError, match="skip fc silently"):
        _export(tmp_path, shape=shape)


def test_export_refuses_a_vocab_map_of_other_sizes(tmp_path):
    draft = _draft(CARRIED)
    vocab = build_vocab_map(torch.arange(300), 50)
    with pytest.raises(ValueError, match="does not fit the draft"):
        export_draft(tmp_path / "x", "sglang", draft, vocab, ExportSpec.of(AUX_IDS, norm_output=False))


def test_export_is_readable_by_other_users(tmp_path):
    """A server running as another user reads the export: the umask's modes, weights included."""
    old = os.umask(0o022)
    try:
        out, _, _ = _export(tmp_path)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644}
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


@pytest.mark.parametrize("engine", list(EXPORT_FORMATS))
def test_every_format_parses_the_config_it_writes(engine):
    fmt = EXPORT_FORMATS[engine]
    spec = ExportSpec.of(AUX_IDS, norm_output=False, target_num_layers=16, num_speculative_tokens=3)
    config = fmt.write_config(CARRIED, spec)
    parsed = format_of(config).parse(config, "config.json")
    assert format_of(config) is fmt and parsed.engine == engine and parsed.shape == CARRIED
    assert parsed.aux_layer_ids == AUX_IDS and parsed.engine_aux_layer_ids == fmt.engine_aux_ids(spec.aux_layer_ids)
    assert (parsed.num_speculative_tokens, parsed.target_num_layers) == (3, 16)


def test_export_refuses_an_unknown_engine_and_a_bad_speculative_count(tmp_path):
    with pytest.raises(ValueError, match="unknown export engine 'tgi': known engines are sglang, vllm"):
        export_draft(tmp_path / "x", "tgi", _draft(CARRIED), _vocab(CARRIED), ExportSpec.of(AUX_IDS, norm_output=False))
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive int, got 0"):
        ExportSpec.of(AUX_IDS, norm_output=False, num_speculative_tokens=0)
