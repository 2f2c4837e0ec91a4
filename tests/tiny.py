"""Tiny, fast configs on the real embedded target, shared by the end-to-end tests, and a tiny draft shape."""

from pathlib import Path

from hydra import compose, initialize_config_dir

from models.draft import DraftShape
from trainer.config import Config, register_schema, to_config

ROOT = Path(__file__).resolve().parents[1]
TINY_DRAFT = DraftShape(  # a draft small enough for explicit references on the CPU
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    target_hidden_size=24,
    num_aux=3,
    vocab_size=50,
    draft_vocab_size=20,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
)
TINY = [
    "data.max_conversations=48",
    "data.max_eval_conversations=16",
    "data.max_tokens=512",
    "data.max_len=128",
    "draft.vocab_size=1024",
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "draft.ttt_steps=3",
    "trainer.eval_prompts=2",
    "trainer.eval_max_new_tokens=8",
]


def tiny_config(*overrides: str) -> Config:
    """The default config with TINY applied, then ``overrides``."""
    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=[*TINY, *overrides]))
