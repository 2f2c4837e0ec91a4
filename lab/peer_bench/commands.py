"""The command lines of both sides: SpecForge's own capture, training and export, and StreamDraft's recipe
training, built from the bench's arguments (no process starts here)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: launch/recipe.py and the product packages

# SpecForge's checked-in recipe for its smallest Llama-architecture EAGLE-3 target (examples/configs/
# qwen2.5-0.5b-eagle3-online.yaml): the settings a user of its launcher starts from at this size
PEER_TRAINING = {
    "strategy": "eagle3",
    "batch_size": 1,
    "learning_rate": 1e-4,
    "max_grad_norm": 0.5,
    "ttt_length": 7,
    "attention_backend": "flex_attention",
    "log_interval": 10,
    "dist_timeout": 20,
    "seed": 0,
    "num_epochs": 10,
}
PEER_MAX_LENGTH = 512  # that recipe's data.max_length
PEER_CHAT_TEMPLATE = "qwen"  # SpecForge's <|im_start|> template: SmolLM2's turn markers, for the loss mask of the rendered text
# SpecForge's target-derived EAGLE-3 draft (training/model_loading.py _generate_draft_config): these target fields, then
# one llama layer, untied, a 32,000-token draft vocabulary
TARGET_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "max_position_embeddings",
    "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias", "attention_dropout", "head_dim", "rope_theta",
    "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window", "use_sliding_window", "max_window_layers",
)  # fmt: skip


@dataclass(frozen=True)
class PeerPaths:
    """Where the peer's files go under ``--out``."""

    root: Path

    @property
    def data(self) -> Path:
        return self.root / "train_preformatted.jsonl"

    @property
    def hidden(self) -> Path:
        return self.root / "hidden_states"

    @property
    def draft_config(self) -> Path:
        return self.root / "draft_config.json"

    def run_dir(self, name: str) -> Path:
        return self.root / name

    def config(self, name: str) -> Path:
        return self.root / name / "run.yaml"

    def export(self, name: str) -> Path:
        return self.root / name / "export_sglang"


def draft_config(target: Path) -> dict:
    """The EAGLE-3 draft config SpecForge derives from the target's ``config.json``."""
    path = target / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--target {target}: cannot read {path} ({e})") from None
    payload = {k: config[k] for k in TARGET_FIELDS if config.get(k) is not None}
    if "rope_theta" not in payload and "rope_theta" in config.get("rope_parameters", {}):
        payload["rope_theta"] = config["rope_parameters"]["rope_theta"]  # transformers 5 keeps it in rope_parameters
    missing = [k for k in ("vocab_size", "hidden_size") if k not in payload]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}")
    payload |= {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1}
    payload |= {"tie_word_embeddings": False, "use_cache": True, "draft_vocab_size": 32000}
    payload.setdefault("pad_token_id", 0)
    return payload


def capture_argv(scripts: Path, target: Path, paths: PeerPaths, mem_fraction: float) -> list[str]:
    """SpecForge's offline feature capture (its ``scripts/prepare_hidden_states.py``) of the rendered answers."""
    return [
        sys.executable, str(scripts / "prepare_hidden_states.py"),
        "--strategy", "eagle3",
        "--target-model-path", str(target),
        "--draft-model-config", str(paths.draft_config),
        "--data-path", str(paths.data),
        "--output-path", str(paths.hidden),
        "--chat-template", PEER_CHAT_TEMPLATE,
        "--is-preformatted",
        "--max-length", str(PEER_MAX_LENGTH),
        "--sglang-mem-fraction-static", str(mem_fraction),
    ]  # fmt: skip


def run_config(target: Path, paths: PeerPaths, name: str, max_steps: int) -> dict:
    """A local offline ``specforge train`` run config: SpecForge's recipe settings, ``max_steps`` optimizer steps (its
    cosine schedule's horizon too)."""
    return {
        "model": {
            "target_model_path": str(target),
            "draft_model_config": str(paths.draft_config),
            "target_backend": "sglang",
            "embedding_key": "model.embed_tokens.weight",
            "torch_dtype": "bfloat16",
        },
        "data": {
            "hidden_states_path": str(paths.hidden),
            "max_length": PEER_MAX_LENGTH,
            "chat_template": PEER_CHAT_TEMPLATE,
            "cache_dir": str(paths.root / "cache"),
        },  # fmt: skip
        "training": PEER_TRAINING | {"max_steps": max_steps},
        "run_id": name,
        "output_dir": str(paths.run_dir(name)),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }


def train_argv(specforge: list[str], config: Path) -> list[str]:
    return [*specforge, "train", "--config", str(config)]


def export_argv(specforge: list[str], paths: PeerPaths, name: str) -> list[str]:
    """SpecForge's own SGLang export of the run's latest checkpoint."""
    checkpoint = paths.run_dir(name) / f"{name}-latest"
    return [*specforge, "export", "--to", "sglang", "--checkpoint", str(checkpoint), "--draft-config", str(paths.draft_config),
            "--output-dir", str(paths.export(name))]  # fmt: skip


def streamdraft_argv(recipe_out: Path, corpora: Path, target: Path | None, seconds: float) -> list[str]:
    """StreamDraft's recipe training (``launch/recipe.py --phases training``) for ``seconds`` on the answers placed in
    ``recipe_out`` (answered.jsonl, sampled.jsonl); its own speedup phase off: the bench measures both exports alike."""
    argv = [sys.executable, str(ROOT / "launch" / "recipe.py"), "--corpora", str(corpora), "--out", str(recipe_out), "--phases", "training"]
    argv += ["--train-s", f"{seconds:g}"]
    argv += [] if target is None else ["--target", str(target)]
    return argv + ["--trainer-args", "trainer.speedup.enabled=false"]


def speedup_argv(export: Path, prompts: list[Path], target: Path, settings: list[str], concurrency: list[int], mem: float,
                 results: Path, plain_from: Path | None) -> list[str]:  # fmt: skip
    argv = [sys.executable, "-m", "serving.speedup", str(export), "--prompts", *map(str, prompts), "--target", str(target)]
    argv += ["--settings", *settings, "--concurrency", *map(str, concurrency), "--mem-fraction-static", str(mem), "--json", str(results)]
    return argv + ([] if plain_from is None else ["--plain-from", str(plain_from)])
