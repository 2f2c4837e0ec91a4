"""A Kimi-K2.5-shaped target dir without decoder weights, for SGLang's ``load_format=dummy``.

    python lab/kimi_reduced.py /tmp/kimi5 --with-head        # 5 layers, 16 experts: fits 2 x H200 beside the trainers
    python lab/kimi_reduced.py /tmp/kimi61 --layers 61 --experts 8 --int4 --with-head   # the real depth on one 80-GB GPU
    python lab/kimi_reduced.py /tmp/kimi-full --full         # the real 61 layers / 384 INT4 experts (the 8-GPU run)

The architecture is Moonshot's checkpoint's, ``KimiK25ForConditionalGeneration`` (a vision
wrapper; its MoonViT tower is built with dummy weights like the rest) with the language model
``DeepseekV3ForCausalLM`` in ``text_config`` (``--language-model``: that class's own config), with Kimi-K2.5's text-config
widths (hidden 7168; MLA: 64 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128;
vocab 163840; the first layer dense with intermediate 18432; MoE layers of 2048-wide experts,
1 shared, top-8 of ``n_routed_experts``, sigmoid scores with a correction bias, one group).
Reduced: fewer layers and routed experts, bf16 experts (``--int4``: Kimi's format). ``--full``: Kimi-K2.5's counts and
its INT4 expert format (compressed-tensors, group 32).

``config.json`` carries every field SGLang 0.5.14's ``deepseek_v2.py`` reads without a default
(``SGLANG_READS``; transformers' own ``DeepseekV3Config`` saves lack ``moe_layer_freq``).
The tokenizer is the embedded target's (SmolLM2-135M-Instruct, ``models.embedded``): its 49,152
ids are all below the vocab of 163,840, which is what the data path needs; Kimi's own tokenizer
is not shipped. ``provenance.json`` says all this in the dir itself.

``--with-head``: ``model.safetensors`` with the bf16 embedding and lm_head ([163840, 7168] each,
4.7 GB) under the checkpoint's names, valued as SGLang's dummy load values them: the trainer reads
the two by name (the draft's embedding, the labels' head); SGLang's dummy load never reads the file.
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
WRAPPER = "KimiK25ForConditionalGeneration"  # the class Moonshot's checkpoint names, a vision wrapper of ARCHITECTURE
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# config fields SGLang 0.5.14 reads as ``config.<field>`` in models/deepseek_v2.py with no default
# (tests/lab/test_kimi_reduced.py derives the list from the source when it is unpacked). The rope
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
# Kimi-K2.5's vision_config (MoonViT, 27 layers of 1152, and the patch-merger projector into 7168): the
# vision tower reads the plain names, the projector the ``vt_`` ones, so both are written.
KIMI_K25_VISION = {
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "vt_num_attention_heads": 16,
    "vt_num_hidden_layers": 27,
    "vt_hidden_size": 1152,
    "vt_intermediate_size": 4304,
    "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "mm_hidden_size": 1152,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "text_hidden_size": 7168,
}
REDUCED = {"num_hidden_layers": 5, "n_routed_experts": 16}
HEAD_NAMES = {  # the embedding's and lm_head's tensor names in each layout's checkpoint
    ARCHITECTURE: ("model.embed_tokens.weight", "lm_head.weight"),
    WRAPPER: ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"),
}


def kimi_config(
    layers: int, experts: int, *, int4: bool, tokens: dict[str, int], wrapper: bool = True, overrides: dict | None = None
) -> dict:
    """A config.json with Kimi-K2.5's widths, ``layers`` layers (the first dense) and ``experts``
    routed experts; ``int4``: Kimi's INT4 expert format. ``wrapper``: as Moonshot's checkpoint has it,
    ``KimiK25ForConditionalGeneration`` with the language model in ``text_config`` (model type
    ``kimi_k2``) beside ``vision_config``; else the language model's own ``DeepseekV3ForCausalLM``
    config. ``overrides`` replace text widths (tiny CPU tests)."""
    if layers < 2 or experts < KIMI_K25_TEXT["num_experts_per_tok"]:
        raise ValueError(f"--layers {layers} / --experts {experts}: need >= 2 layers (one dense, one MoE) and >= 8 experts (top-8)")
    text = {
        **KIMI_K25_TEXT,
        **tokens,
        "num_hidden_layers": layers,
        "n_routed_experts": experts,
        **(overrides or {}),
    }
    if int4:
        text["quantization_config"] = KIMI_K25_INT4
    if not wrapper:
        return {"architectures": [ARCHITECTURE], "model_type": "deepseek_v3", **text}
    vision = {**KIMI_K25_VISION, "text_hidden_size": text["hidden_size"]}
    text = {"architectures": [ARCHITECTURE], "model_type": "kimi_k2", **text}
    return {
        "architectures": [WRAPPER],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": vision,
        "pad_token_id": text["pad_token_id"],
        "torch_dtype": "bfloat16",
    }


def text_config(config: dict) -> dict:
    """The language model's fields of a config ``kimi_config`` wrote (either layout)."""
    return config.get("text_config", config)


def token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """bos / eos / pad ids of the tokenizer the dir ships (the embedded target's config says them)."""
    source = json.loads((tokenizer_dir / "config.json").read_text())
    return {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def dummy_head(vocab: int, hidden: int, device: str, scale: float = 1.0) -> torch.Tensor:
    """[vocab, hidden] bf16 on the CPU, as SGLang's dummy load values a tensor of that shape drawn on ``device``
    (``initialize_dummy_weights``: uniform in +-1e-3, a generator seeded 1234 per tensor), times ``scale`` (a power
    of two keeps every value's direction exact)."""
    g = torch.Generator(device=device).manual_seed(1234)
    head = torch.empty(vocab, hidden, dtype=torch.bfloat16, device=device).uniform_(-1e-3, 1e-3, generator=g)
    return (head if scale == 1.0 else (head.float() * scale).bfloat16()).cpu()


def write_head(out: Path, architecture: str, vocab: int, hidden: int, device: str, lm_head_scale: float = 1.0) -> Path:
    """``model.safetensors`` with bf16 embedding and lm_head, [vocab, hidden] each, under the names
    ``architecture``'s checkpoint gives them, valued by ``dummy_head``: drawn on a CUDA device, the
    trainer's head is the head of the target SGLang serves with ``load_format=dummy``. ``lm_head_scale``
    multiplies the lm_head: the same greedy tokens as the served target's, but target probabilities a draft
    can learn (SGLang's dummy values give a flat next-token distribution: soft labels at ln V_d)."""
    from safetensors.torch import save_file

    embed_name, head_name = HEAD_NAMES[architecture]
    tensors = {embed_name: dummy_head(vocab, hidden, device), head_name: dummy_head(vocab, hidden, device, lm_head_scale)}
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def write_target(
    out: Path,
    *,
    full: bool,
    layers: int,
    experts: int,
    with_head: bool,
    int4: bool = False,
    wrapper: bool = True,
    head_device: str = "cpu",
    lm_head_scale: float = 1.0,
    tokenizer: Path | None = None,
    overrides: dict | None = None,
) -> dict:
    """Write config.json, the tokenizer, provenance.json and (``with_head``) model.safetensors into
    ``out``. ``full``: Kimi-K2.5's layer and expert counts, INT4. ``tokenizer``: a dir with the
    tokenizer files and a config.json of its bos / eos / pad ids (default: the embedded target's)."""
    if full:
        layers, experts, int4 = KIMI_K25_TEXT["num_hidden_layers"], KIMI_K25_TEXT["n_routed_experts"], True
    tok = tokenizer if tokenizer is not None else embedded_target_dir()
    config = kimi_config(layers, experts, int4=int4, tokens=token_ids(tok), wrapper=wrapper, overrides=overrides)
    text, architecture = text_config(config), config["architectures"][0]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copyfile(tok / name, out / name)
    (out / "model.safetensors").unlink(missing_ok=True)
    if with_head:
        write_head(out, architecture, text["vocab_size"], text["hidden_size"], head_device, lm_head_scale)
    experts_format = "INT4 (compressed-tensors W4A16, group 32)" if int4 else "bf16"
    provenance = {
        "architecture": f"{WRAPPER}, the vision wrapper Moonshot's checkpoint names, its language model {ARCHITECTURE} in text_config"
        if wrapper
        else f"{ARCHITECTURE}: the language model Kimi-K2.5 ({WRAPPER}) wraps",
        "widths": "Kimi-K2.5's text_config (lab/kimi_reduced.py: KIMI_K25_TEXT)",
        "shape": "full: Kimi-K2.5's 61 layers and 384 routed experts, INT4"
        if full
        else f"reduced: {layers} layers (the first dense), {experts} routed experts, {experts_format}",
        "weights": "none for the decoder: run SGLang with load_format=dummy (random weights of these shapes)"
        + ("; model.safetensors: seeded random bf16 embed_tokens and lm_head for the trainer" if with_head else ""),
        "lm_head_scale": lm_head_scale,
        "tokenizer": f"SmolLM2-135M-Instruct's, copied from the embedded target {tok} (models/embedded.py); "
        f"its ids are < {text['vocab_size']}; Kimi's own tokenizer is not shipped",
        "written_by": "lab/kimi_reduced.py",
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
    p.add_argument("--int4", action="store_true", help="the routed experts in Kimi-K2.5's INT4 format (--full implies it)")
    p.add_argument("--language-model", action="store_true", help=f"write {ARCHITECTURE}'s own config instead of the {WRAPPER} wrapper")
    p.add_argument("--tokenizer", type=Path, default=None, help="a dir with the tokenizer to copy (default: the embedded target's)")
    p.add_argument("--with-head", action="store_true", help="also write random embed_tokens + lm_head (4.7 GB) for the trainer")
    p.add_argument("--head-device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the random head is drawn")
    p.add_argument(
        "--lm-head-scale", type=float, default=1.0, help="the trainer's lm_head: SGLang's dummy one times this (e.g. 131072 = 2^17)"
    )
    a = p.parse_args(argv)
    config = write_target(
        a.out,
        full=a.full,
        layers=a.layers,
        experts=a.experts,
        with_head=a.with_head,
        int4=a.int4,
        wrapper=not a.language_model,
        head_device=a.head_device,
        lm_head_scale=a.lm_head_scale,
        tokenizer=a.tokenizer,
    )
    text = text_config(config)
    print(
        f"wrote {a.out}: {config['architectures'][0]}, {text['num_hidden_layers']} layers, {text['n_routed_experts']} routed experts"
        f"{', INT4' if 'quantization_config' in text else ', bf16'}{', with embed + lm_head' if a.with_head else ''}"
    )
    return config


if __name__ == "__main__":
    main()
