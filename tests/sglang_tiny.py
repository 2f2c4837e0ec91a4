"""The tiny SGLang GPU test targets and the layer check, shared by tests/test_sglang.py (CPU) and
tests/test_sglang_gpu.py; imports torch and transformers only (the GPU machine has no Hydra)."""

import torch
from transformers import DeepseekV3Config


def tiny_deepseek_v3_config() -> DeepseekV3Config:
    """DeepSeek-V3 (Kimi-K2.5's language model) at tiny widths: MLA with the real latent sizes, a dense
    first layer, then MoE layers with a shared expert; the routing fields a real config.json carries
    (DeepSeek-V3 and Kimi-K2.5 alike), which transformers' DeepseekV3Config lacks and SGLang reads."""
    return DeepseekV3Config(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        first_k_dense_replace=1,
        moe_intermediate_size=256,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=512,
        q_lora_rank=384,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        max_position_embeddings=1024,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


MARGIN = 0.25  # an aux block's error to its own layer, at most this share of its error to any other layer


def layer_errors(block: torch.Tensor, outputs: list[torch.Tensor]) -> list[float]:
    """Relative distance of a feature block [N, H] to the output of every decoder layer ([N, H] each)."""
    return [((block - out).norm() / out.norm()).item() for out in outputs]


def is_layer(errors: list[float], k: int) -> bool:
    """Layer k is the closest, by MARGIN over every other layer."""
    return errors[k] < MARGIN * min(e for j, e in enumerate(errors) if j != k)
