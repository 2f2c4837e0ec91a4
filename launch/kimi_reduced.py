"""A Kimi-K2.5-shaped target dir without decoder weights, for SGLang's ``load_format=dummy``.

    python launch/kimi_reduced.py /tmp/kimi5 --with-head        # 5 layers, 16 experts: fits 2 x H200 beside the trainers
    python launch/kimi_reduced.py /tmp/kimi-full --full         # the real 61 layers / 384 INT4 experts (the 8-GPU run)

The architecture is ``DeepseekV3ForCausalLM``: the language model Kimi-K2.5
(``KimiK25ForConditionalGeneration``, a vision wrapper) runs, with Kimi-K2.5's text-config
widths (hidden 7168; MLA: 64 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128;
vocab 163840; the first layer dense with intermediate 18432; MoE layers of 2048-wide experts,
1 shared, top-8 of ``n_routed_experts``, sigmoid scores with a correction bias, one group).
Reduced: fewer layers and routed experts, bf16 experts. ``--full``: Kimi-K2.5's counts and
its INT4 expert format (compressed-tensors, group 32).

``config.json`` carries every field SGLang 0.5.14's ``deepseek_v2.py`` reads without a default
(``SGLANG_READS``; transformers' own ``DeepseekV3Config`` saves lack ``moe_layer_freq``).
The tokenizer is the embedded target's (SmolLM2-135M-Instruct, ``models.embedded``): its 49,152
ids are all below the vocab of 163,840, which is what the data path needs; Kimi's own tokenizer
is not shipped. ``provenance.json`` says all this in the dir itself.

``--with-head``: ``model.safetensors`` with a seeded random bf16 ``model.embed_tokens.weight``
and ``lm_head.weight`` ([163840, 7168] each, 4.7 GB): the trainer reads the two by name (the
draft's embedding, the labels' head); SGLang's dummy load never reads the file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

import torch  # noqa: E402

from models import hub  # noqa: E402
from models.embedded import embedded_target_dir  # noqa: E402

ARCHITECTURE = "DeepseekV3ForCausalLM"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# config fields SGLang 0.5.14 reads as ``config.<field>`` in models/deepseek_v2.py with no default
# (tests/launch/test_kimi_reduced.py derives the list from the source when it is unpacked). The rope
# fields are read as rope_parameters (transformers v5 builds it from rope_theta + rope_scaling);
# quantization_config only behind an fp8 shared-expert check.
SGLANG_READS = (
    "architectures",
    "first_k_dense_replace",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "kv_lora_rank",
    "max_position_embeddings",
    "moe_intermediate_size",
    "moe_layer_freq",
    "n_group",
    "n_routed_experts",
    "n_shared_experts",
    "norm_topk_prob",
    "num_attention_heads",
    "num_experts_per_tok",
    "num_hidden_layers",
    "pad_token_id",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "rms_norm_eps",
    "rope_parameters",
    "routed_scaling_factor",
    "scoring_func",
    "tie_word_embeddings",
    "topk_group",
    "topk_method",
    "v_head_dim",
    "vocab_size",
)
SGLANG_GUARDED = ("quantization_config", "rope_theta", "rope_scaling")  # read only on a branch our config does not take

# Kimi-K2.5's text_config (DeepSeek-V3 architecture), as Moonshot's config.json gives it.
KIMI_K25_TEXT = {
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "seq_aux": True,
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}
# The routed experts' INT4 format in compressed-tensors' terms (W4A16, symmetric, a bf16 scale per
# 32 weights); everything but the routed experts stays bf16. Check it against the checkpoint's own
# quantization_config before the 8-GPU run.
KIMI_K25_INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:model[.]layers[.]0[.]mlp[.].*", "re:.*mlp[.]gate$"],
}
REDUCED = {"num_hidden_layers": 5, "n_routed_experts": 16}


def kimi_config(layers: int, experts: int, *, int4: bool, tokens: dict[str, int], overrides: dict | None = None) -> dict:
    """A DeepseekV3ForCausalLM config.json with Kimi-K2.5's widths, ``layers`` layers (the first
    dense) and ``experts`` routed experts; ``int4``: Kimi's INT4 expert format. ``overrides``
    replace widths (tiny CPU tests)."""
    if layers < 2 or experts < KIMI_K25_TEXT["num_experts_per_tok"]:
        raise ValueError(f"--layers {layers} / --experts {experts}: need >= 2 layers (one dense, one MoE) and >= 8 experts (top-8)")
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        **KIMI_K25_TEXT,
        **tokens,
        "num_hidden_layers": layers,
        "n_routed_experts": experts,
        **(overrides or {}),
    }
    if int4:
        config["quantization_config"] = KIMI_K25_INT4
    return config


def token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """bos / eos / pad ids of the tokenizer the dir ships (the embedded target's config says them)."""
    source = json.loads((tokenizer_dir / "config.json").read_text())
    return {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def write_head(out: Path, vocab: int, hidden: int, device: str, seed: int = 0) -> Path:
    """``model.safetensors`` with seeded random bf16 embedding and lm_head, [vocab, hidden] each."""
    from safetensors.torch import save_file

    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {
        name: (torch.randn(vocab, hidden, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()
        for name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def write_target(
    out: Path, *, full: bool, layers: int, experts: int, with_head: bool, head_device: str = "cpu", overrides: dict | None = None
) -> dict:
    """Write config.json, the tokenizer, provenance.json and (``with_head``) model.safetensors into ``out``."""
    if full:
        layers, experts = KIMI_K25_TEXT["num_hidden_layers"], KIMI_K25_TEXT["n_routed_experts"]
    tok = embedded_target_dir()
    config = kimi_config(layers, experts, int4=full, tokens=token_ids(tok), overrides=overrides)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copyfile(tok / name, out / name)
    (out / "model.safetensors").unlink(missing_ok=True)
    if with_head:
        write_head(out, config["vocab_size"], config["hidden_size"], head_device)
    provenance = {
        "architecture": f"{ARCHITECTURE}: the language model Kimi-K2.5 (KimiK25ForConditionalGeneration) wraps",
        "widths": "Kimi-K2.5's text_config (launch/kimi_reduced.py: KIMI_K25_TEXT)",
        "shape": "full: Kimi-K2.5's 61 layers and 384 routed experts, INT4"
        if full
        else f"reduced: {layers} layers (the first dense), {experts} routed experts, bf16",
        "weights": "none for the decoder: run SGLang with load_format=dummy (random weights of these shapes)"
        + ("; model.safetensors: seeded random bf16 embed_tokens and lm_head for the trainer" if with_head else ""),
        "tokenizer": f"SmolLM2-135M-Instruct's, copied from the embedded target {tok} (models/embedded.py); "
        f"its ids are < {config['vocab_size']}; Kimi's own tokenizer is not shipped",
        "written_by": "launch/kimi_reduced.py",
    }
    (out / "provenance.json").write_text(json.dumps(provenance, indent=1))
    return config


def main(argv: list[str] | None = None) -> dict:
    hub.offline()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the target dir to write")
    p.add_argument("--full", action="store_true", help="Kimi-K2.5's real 61 layers / 384 INT4 experts (the 8-GPU run)")
    p.add_argument("--layers", type=int, default=REDUCED["num_hidden_layers"])
    p.add_argument("--experts", type=int, default=REDUCED["n_routed_experts"])
    p.add_argument("--with-head", action="store_true", help="also write random embed_tokens + lm_head (4.7 GB) for the trainer")
    p.add_argument("--head-device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the random head is drawn")
    a = p.parse_args(argv)
    config = write_target(a.out, full=a.full, layers=a.layers, experts=a.experts, with_head=a.with_head, head_device=a.head_device)
    print(
        f"wrote {a.out}: {ARCHITECTURE}, {config['num_hidden_layers']} layers, {config['n_routed_experts']} routed experts"
        f"{', INT4' if 'quantization_config' in config else ', bf16'}{', with embed + lm_head' if a.with_head else ''}"
    )
    return config


if __name__ == "__main__":
    main()
