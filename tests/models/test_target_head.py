"""TargetHead: the target's config, tokenizer, embedding and lm_head read by tensor name from a
checkpoint (never a decoder layer), and a colocated trainer that holds no target model."""

from __future__ import annotations

import gc
import json
import shutil
import types
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from models.draft import draft_shape_for
from models.embedded import embedded_target_dir
from models.target import HFTargetEngine
from models.target_head import INDEX_FILE, TargetHead, checkpoint_bytes, read_target_config
from tests.fixtures.tiny import tiny_config

VOCAB, HIDDEN = 96, 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def with_tokenizer(path: Path) -> Path:
    """Give a model dir the embedded target's tokenizer (the head reads one; its size is irrelevant here)."""
    for name in TOKENIZER_FILES:
        shutil.copy(embedded_target_dir() / name, path / name)
    return path


def saved_llama(path: Path, tied: bool = False, shard: str | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    with_tokenizer(path)
    return model


def test_reads_exactly_the_models_embedding_and_lm_head(tmp_path):
    model = saved_llama(tmp_path / "m")
    head = TargetHead.from_path(tmp_path / "m", aux_layer_ids=[1, 3, 4])
    assert torch.equal(head.embed_weight, model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head_weight, model.lm_head.weight)
    assert not torch.equal(head.embed_weight, head.lm_head_weight)  # untied: two different matrices
    engine = HFTargetEngine.from_path(tmp_path / "m", aux_layer_ids=[1, 3, 4])
    assert head.info == engine.info and head.info.vocab_size == VOCAB and head.info.aux_layer_ids == (1, 3, 4)
    assert draft_shape_for(head.config, 3, 64) == draft_shape_for(engine.model.config, 3, 64)
    assert head.tokenizer.eos_token_id is not None


def test_tied_embeddings_share_one_matrix(tmp_path):
    model = saved_llama(tmp_path / "m", tied=True)
    head = TargetHead.from_path(tmp_path / "m")
    assert head.lm_head_weight is head.embed_weight and torch.equal(head.lm_head_weight, model.lm_head.weight)


def test_a_sharded_checkpoint_is_read_without_its_decoder_shards(tmp_path):
    """Only the shards that hold the two matrices are opened: the others may as well be gone."""
    model = saved_llama(tmp_path / "m", shard="60KB")
    files = json.loads((tmp_path / "m" / INDEX_FILE).read_text())["weight_map"]
    needed = {files["model.embed_tokens.weight"], files["lm_head.weight"]}
    others = set(files.values()) - needed
    assert len(others) >= 3, "the shard size must spread the decoder layers over several files"
    for name in others:
        (tmp_path / "m" / name).unlink()
    head = TargetHead.from_path(tmp_path / "m")
    assert torch.equal(head.embed_weight, model.model.embed_tokens.weight) and torch.equal(head.lm_head_weight, model.lm_head.weight)
    assert checkpoint_bytes(tmp_path / "m") == sum((tmp_path / "m" / n).stat().st_size for n in needed)


def kimi_like(path: Path, embed: torch.Tensor, lm_head: torch.Tensor) -> Path:
    """A Kimi-K2.5-shaped dir: the sizes in text_config (model_type kimi_k2), weights under language_model."""
    path.mkdir()
    text = {
        "model_type": "kimi_k2",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "tie_word_embeddings": False,
    }
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    (path / "config.json").write_text(json.dumps(config))
    save_file({"language_model.model.embed_tokens.weight": embed, "vision_tower.patch.weight": torch.ones(4, 4)}, path / "a.safetensors")
    save_file({"language_model.lm_head.weight": lm_head, "language_model.model.layers.0.mlp.weight": torch.ones(4)}, path / "b.safetensors")
    weight_map = {
        "language_model.model.embed_tokens.weight": "a.safetensors",
        "vision_tower.patch.weight": "a.safetensors",
        "language_model.lm_head.weight": "b.safetensors",
        "language_model.model.layers.0.mlp.weight": "b.safetensors",
    }
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return with_tokenizer(path)


def test_a_text_config_nested_checkpoint_with_a_language_model_prefix(tmp_path):
    embed, lm_head = torch.randn(VOCAB, HIDDEN).bfloat16(), torch.randn(VOCAB, HIDDEN).bfloat16()
    head = TargetHead.from_path(kimi_like(tmp_path / "kimi", embed, lm_head), dtype=torch.bfloat16)
    assert torch.equal(head.embed_weight, embed) and torch.equal(head.lm_head_weight, lm_head)
    info = head.info
    assert (info.architecture, info.model_type, info.num_layers, info.hidden_size, info.vocab_size) == (
        "KimiK25ForConditionalGeneration",
        "deepseek_v3",
        8,
        HIDDEN,
        VOCAB,
    )
    assert info.aux_layer_ids == (1, 3, 4)  # the default ids of 8 layers
    assert type(read_target_config(tmp_path / "kimi")[1]).__name__ == "DeepseekV3Config"


def test_missing_tensors_name_the_file_and_the_tensor(tmp_path):
    path = kimi_like(tmp_path / "kimi", torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"]["language_model.lm_head.weight"] = "a.safetensors"  # the index points at the wrong file
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"a\.safetensors: has no tensor 'language_model\.lm_head\.weight'"):
        TargetHead.from_path(path)
    del index["weight_map"]["language_model.lm_head.weight"]  # no lm_head at all, and the config does not tie it
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=rf"{INDEX_FILE}: no lm_head tensor \(looked for lm_head\.weight, language_model\.lm_head\.weight\)"
    ):
        TargetHead.from_path(path)
    (path / "b.safetensors").unlink()
    (path / INDEX_FILE).unlink()
    with pytest.raises(ValueError, match=f"neither {INDEX_FILE} nor model.safetensors"):
        TargetHead.from_path(path)
    with pytest.raises(ValueError, match=r"\.gguf file has no tensors to read by name"):
        TargetHead.from_path(tmp_path / "x.gguf")


# --------------------------------------------------------------------------- the trainer process


def reachable(root) -> list:
    """Every object reachable from ``root`` through containers, instance attributes and tensors
    (not through modules, classes or functions, which reach the whole interpreter)."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType)
    seen, stack, out = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        out.append(obj)
        stack.extend(gc.get_referents(obj))
    return out


def draft_weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.ds_model.module.draft.state_dict().items()}


@pytest.mark.slow
def test_the_colocated_trainer_holds_no_target_model_and_trains_as_inprocess(tmp_path):
    """The same run in both modes: the colocated trainer process reaches no transformers model,
    and its evaluations, speculative decoding and draft weights equal the inprocess run's."""
    from trainer.loop import Trainer

    runs = {}
    for mode in ("inprocess", "colocated"):
        trainer = Trainer(tiny_config("trainer.max_steps=2", f"engine.mode={mode}"), tmp_path / mode)
        models = {type(o).__name__ for o in reachable(trainer) if isinstance(o, PreTrainedModel)}
        summary = trainer.fit()
        runs[mode] = (models, summary, draft_weights(trainer))
    (inproc_models, inproc, inproc_weights), (coloc_models, coloc, coloc_weights) = runs["inprocess"], runs["colocated"]
    assert "LlamaForCausalLM" in inproc_models and coloc_models == set()  # the walk finds a held model when there is one
    assert inproc["serve_eval"] == "the in-process target" and coloc["serve_eval"].startswith("the target loaded for the eval")
    assert "eval/accept_len" in coloc["eval"] and coloc["eval"] == inproc["eval"]
    assert coloc["start_eval_sim_accept_len"] == inproc["start_eval_sim_accept_len"]
    assert inproc_weights.keys() == coloc_weights.keys() and all(torch.equal(inproc_weights[k], coloc_weights[k]) for k in inproc_weights)


def test_the_eval_target_is_loaded_for_the_eval_only_and_freed(tmp_path, capsys):
    from trainer.config import TrainConfig
    from trainer.target_setup import load_target, with_eval_target

    saved_llama(tmp_path / "m")
    target = load_target(
        tiny_config(f"target.path={tmp_path / 'm'}", "engine.mode=colocated").target, "colocated", torch.device("cpu"), torch.float32
    )
    assert target.engine is None
    held = []

    def run(model) -> dict:
        held.append(weakref.ref(model) if model is not None else None)
        return {"decoded": model is not None}

    out = with_eval_target(target, TrainConfig(), torch.device("cpu"), torch.float32, run)
    assert out["decoded"] and "then freed" in out["serve_eval"] and "loading the whole target" in capsys.readouterr().out
    gc.collect()
    assert held[-1]() is None  # nothing keeps the eval's target alive
    out = with_eval_target(target, TrainConfig(serve_eval_max_gb=1e-6), torch.device("cpu"), torch.float32, run)
    assert not out["decoded"] and "over trainer.serve_eval_max_gb=1e-06" in out["serve_eval"] and held[-1] is None
    out = with_eval_target(target, TrainConfig(serve_eval=False), torch.device("cpu"), torch.float32, run)
    assert not out["decoded"] and out["serve_eval"].startswith("off")
    with pytest.raises(ValueError, match="config trainer.serve_eval_max_gb: must be positive"):
        TrainConfig(serve_eval_max_gb=0)


def test_the_engine_process_must_build_the_target_the_head_describes(tmp_path):
    from models.backends.hf.target import PathTarget
    from trainer.stream.feature_stream import TargetSource

    saved_llama(tmp_path / "m")
    head = TargetHead.from_path(tmp_path / "m", aux_layer_ids=[0, 2, 4])  # the engine builds the default ids (1, 3, 4)
    settings = types.SimpleNamespace(mode="colocated", slots=2, slot_tokens=64, start_timeout_s=120.0, wait_timeout_s=120.0)
    with TargetSource(PathTarget(str(tmp_path / "m")), info=head.info) as source:
        with pytest.raises(
            ValueError, match=r"built a different target than the trainer's: aux_layer_ids: trainer \(0, 2, 4\), engine \(1, 3, 4\)"
        ):
            source.colocated(settings, "cpu")
