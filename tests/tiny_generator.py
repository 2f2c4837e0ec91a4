"""A 2-layer random Llama over SmolLM2's vocabulary, saved as a transformers dir: the
generator of the regeneration and synthesis tests (fast, output text is noise)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.embedded import embedded_target_dir
from models.target import load_tokenizer


def save_tiny_generator(path: Path, forced_eos: bool = False) -> Path:
    """Write the model + tokenizer to ``path``; ``forced_eos``: every generation ends at
    max_new_tokens with the eos token, so callers see finished turns."""
    tokenizer = load_tokenizer(embedded_target_dir())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    if forced_eos:
        model.generation_config.forced_eos_token_id = 2
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
