"""Per-GPU memory of a co-located run: an SGLang target (DeepSeek-V3 / Kimi-K2.5 shape) at
tensor parallelism ``tp`` beside an EAGLE-3 draft trainer on every GPU (docs/SGLANG.md, docs/KIMI.md).

    python -m models.memory_plan --config DIR --tp 8 --tokens 8192
    python -m models.memory_plan --config DIR --tp 2 --tokens 8192 --max-total-tokens 24576 --json plan.json

Every figure is derived from ``config.json`` (``text_config`` when the model is a wrapper),
SGLang 0.5.14's sizing rules and the draft ``trainer`` builds (``draft_shape_for``). Items
marked ``est`` are estimates; the rest are exact byte counts of tensors that exist.

GB is 10^9 bytes (as docs/SGLANG.md); an H200 holds 143,771 MiB = 150.8 GB = 140.4 GiB.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BF16 = 2
GB = 1e9
GIB = 2**30
H200_BYTES = 143_771 * 2**20  # nvidia-smi's total on an H200
CONTEXT_BYTES = 1.5e9  # est: a CUDA context with NCCL buffers, per process (docs/SGLANG.md)
EXTRA_CONTEXT = 4  # SGLang 0.5.14 req_to_token row headroom without speculative decoding (mem_cache/common.py:260)
# est.: what PyTorch's caching allocator holds beyond a DeepSpeed trainer's peak allocation beside its SGLang engine,
# as a share of the activations, in the plan of a process's peak; sized by the Kimi-K2.5-shaped co-located runs
# (docs/BENCHMARKS.md, "Kimi-K2.5 shape"), whose reserve beyond the peak varied between identical runs
ALLOCATOR_RESERVE = 0.25
# The 8B-shaped measurement the draft activations are scaled from: docs/BENCHMARKS.md, "Training
# throughput and MFU", its peak GPU memory row (colocated) (Llama-3.1-8B target, draft vocab 32000,
# 4 x 2048 tokens, TTT 7): trainer peak 25.2 GiB, with torch AdamW (bf16 states, no master copy)
# on one GPU.
MEASURED_8B = {
    "peak_bytes": 25.2 * GIB,
    "tokens": 8192,
    "hidden": 4096,
    "intermediate": 14336,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "vocab": 128256,
    "draft_vocab_size": 32000,
}


SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "first_k_dense_replace",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class TargetShape:
    """The sizes of a DeepSeek-V3-architecture language model that memory depends on."""

    hidden: int
    layers: int
    dense_layers: int  # first_k_dense_replace
    intermediate: int  # dense MLP
    moe_intermediate: int
    experts: int  # routed
    shared_experts: int
    topk: int
    heads: int
    q_lora: int
    kv_lora: int
    rope: int
    nope: int
    v_head: int
    vocab: int
    context: int  # max_position_embeddings: SGLang's context length
    expert_bits: int  # 16: bf16 experts; 4: INT4 (compressed-tensors pack-quantized)
    group_size: int  # weights a bf16 scale covers when quantized
    vision_params: int = 0  # a vision wrapper's tower and projector (Kimi-K2.5's MoonViT), bf16

    @classmethod
    def from_config(cls, config: dict) -> "TargetShape":
        """From a config.json dict; a wrapper's sizes are in ``text_config`` (Kimi-K2.5)."""
        text = config.get("text_config", config)
        missing = [k for k in SHAPE_KEYS if k not in text]
        if missing:
            raise ValueError(f"config.json: no {', '.join(missing)}; a DeepSeek-V3-architecture config is needed")
        bits, group = expert_format(text.get("quantization_config") or config.get("quantization_config"))
        return cls(
            hidden=text["hidden_size"],
            layers=text["num_hidden_layers"],
            dense_layers=text["first_k_dense_replace"],
            intermediate=text["intermediate_size"],
            moe_intermediate=text["moe_intermediate_size"],
            experts=text["n_routed_experts"],
            shared_experts=text["n_shared_experts"],
            topk=text["num_experts_per_tok"],
            heads=text["num_attention_heads"],
            q_lora=text["q_lora_rank"],
            kv_lora=text["kv_lora_rank"],
            rope=text["qk_rope_head_dim"],
            nope=text["qk_nope_head_dim"],
            v_head=text["v_head_dim"],
            vocab=text["vocab_size"],
            context=text["max_position_embeddings"],
            expert_bits=bits,
            group_size=group,
            vision_params=vision_params(config.get("vision_config"), text["hidden_size"]),
        )

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


def vision_params(vision: dict | None, text_hidden: int) -> int:
    """Parameters of Kimi-K2.5's vision tower (MoonViT: patch embedding, learned 2-D position
    embedding, pre-norm transformer layers with biases) and its patch-merger projector into the text
    width, from ``vision_config``; 0 without one. SGLang builds both even for text-only requests."""
    if not vision:
        return 0
    h, i, layers = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["vt_num_hidden_layers"]
    patch = 3 * vision["patch_size"] ** 2 * h + h
    position = vision["init_pos_emb_height"] * vision["init_pos_emb_width"] * h
    layer = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h  # qkv + out with biases, the MLP, two layer norms
    merged = h * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    projector = 2 * h + merged * merged + merged + merged * text_hidden + text_hidden
    return patch + position + layers * layer + 2 * h + projector


def expert_format(quant: dict | None) -> tuple[int, int]:
    """(bits, group size) of the routed experts: bf16 without a quantization_config; a
    compressed-tensors integer group scheme gives its num_bits and group_size."""
    if not quant:
        return 16, 0
    if quant.get("quant_method") != "compressed-tensors":
        raise ValueError(f"quantization_config {quant.get('quant_method')!r}: only compressed-tensors INT group schemes are sized here")
    weights = [g["weights"] for g in quant["config_groups"].values()]
    if len({(w["num_bits"], w["group_size"]) for w in weights}) != 1:
        raise ValueError(f"quantization_config: config groups of different formats {weights}")
    return weights[0]["num_bits"], weights[0]["group_size"]


# --------------------------------------------------------------------------- parameters and weights


def attention_params(s: TargetShape) -> dict[str, int]:
    """MLA of one layer, by SGLang's TP treatment: the down-projections (q_a and kv_a with the
    rope key, fused as fused_qkv_a_proj_with_mqa) are replicated; q_b, kv_b and o are split."""
    qk = s.nope + s.rope
    return {
        "replicated": s.hidden * (s.q_lora + s.kv_lora + s.rope) + s.q_lora + s.kv_lora,  # + the two latent norms
        "split": s.q_lora * s.heads * qk + s.kv_lora * s.heads * (s.nope + s.v_head) + s.heads * s.v_head * s.hidden,
    }


def param_counts(s: TargetShape) -> dict[str, int]:
    attn = attention_params(s)
    return {
        "routed_experts": s.moe_layers * s.experts * 3 * s.hidden * s.moe_intermediate,
        "attention": s.layers * (attn["replicated"] + attn["split"]),
        "embedding_lm_head": 2 * s.vocab * s.hidden,
        "dense_mlp": s.dense_layers * 3 * s.hidden * s.intermediate,
        "shared_experts": s.moe_layers * s.shared_experts * 3 * s.hidden * s.moe_intermediate,
        "routers": s.moe_layers * (s.experts * s.hidden + s.experts),  # gate weight + e_score_correction_bias
        "norms": s.layers * 2 * s.hidden + s.hidden,
        "vision_tower": s.vision_params,
    }


def expert_bytes(s: TargetShape) -> tuple[float, float]:
    """(weight bytes, scale bytes) of the routed experts."""
    n = param_counts(s)["routed_experts"]
    if s.expert_bits == 16:
        return n * BF16, 0.0
    return n * s.expert_bits / 8, n / s.group_size * BF16


def weight_bytes(s: TargetShape, tp: int) -> dict[str, float]:
    """Whole-model and per-GPU weight bytes at TP ``tp`` (the replicated parts on every GPU)."""
    p = param_counts(s)
    experts, scales = expert_bytes(s)
    rest = sum(v for k, v in p.items() if k != "routed_experts") * BF16
    replicated = (s.layers * attention_params(s)["replicated"] + p["routers"] + p["norms"] + p["vision_tower"]) * BF16
    return {
        "routed_experts": experts,
        "expert_scales": scales,
        "rest_bf16": rest,
        "total": experts + scales + rest,
        "per_gpu": (experts + scales + rest - replicated) / tp + replicated,
        "replicated_per_gpu": replicated,
    }


def kv_bytes_per_token(s: TargetShape) -> int:
    """SGLang's MLA cell: the latent and the rope key of every layer, bf16, on every TP rank
    (pool_configurator.py: (kv_lora_rank + qk_rope_head_dim) x layers x 2)."""
    return (s.kv_lora + s.rope) * s.layers * BF16


def handoff_bytes_per_token(s: TargetShape, num_aux: int) -> int:
    """What the ring carries a token: the aux layers' outputs and the final hidden state, bf16."""
    return (num_aux + 1) * s.hidden * BF16


def req_to_token_bytes(s: TargetShape, pool_tokens: int) -> int:
    """SGLang's request -> token table, int32 [max_num_reqs + 1, context + 4], outside the
    mem_fraction_static budget (model_runner_kv_cache_mixin.py:_resolve_max_num_reqs)."""
    reqs = min(max(min(int(pool_tokens / s.context * 512), 4096), 2048), pool_tokens // 2)
    return (reqs + 1) * (s.context + EXTRA_CONTEXT) * 4


# --------------------------------------------------------------------------- the draft


@dataclass(frozen=True)
class DraftCounts:
    trainable: int
    frozen: int  # the embedding
    hidden: int
    intermediate: int
    q_width: int
    kv_width: int
    draft_vocab_size: int


def transformers_config(config: dict):
    """The transformers config the trainer builds the draft from (a wrapper's ``text_config``)."""
    from transformers import AutoConfig

    text = dict(config.get("text_config", config))
    kind = text.pop("model_type", "deepseek_v3")
    kind = "deepseek_v3" if kind == "kimi_k2" else kind  # Kimi's text config is DeepSeek-V3's
    return AutoConfig.for_model(kind, **{k: v for k, v in text.items() if k != "quantization_config"})


def draft_counts(config, num_aux: int, draft_vocab_size: int, intermediate_size: int | None = None, layout: str = "llama") -> DraftCounts:
    """The draft the trainer builds for ``config`` (a transformers config; ``intermediate_size``: the
    draft's MLP width, default the target's; ``layout``: llama or mla), counted on the meta device."""
    from models.draft import Eagle3Draft, draft_shape_for

    shape = draft_shape_for(config, num_aux, draft_vocab_size, intermediate_size, layout)
    with torch.device("meta"):
        draft = Eagle3Draft(shape)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    return DraftCounts(
        trainable,
        frozen,
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_attention_heads * shape.head_dim,
        shape.num_key_value_heads * shape.head_dim,
        shape.draft_vocab_size,
    )


def ttt_width(h: int, i: int, q: int, kv: int, v: int) -> int:
    """Values a TTT step keeps a token for backward (est.), for hidden ``h``, intermediate ``i``,
    q / kv widths and draft vocab ``v``: the 2H attention input, q/k/v, attention output, o
    output, gate/up/act, down output, and the draft-vocab logits in fp32 (two bf16 widths)."""
    return 2 * h + q + 2 * kv + q + h + 3 * i + h + 2 * v


def draft_activation_bytes(d: DraftCounts, tokens: int) -> float:
    """est.: the 8B-shaped measurement's activations (its peak less its exact states), scaled by
    tokens and by ``ttt_width``."""
    m = MEASURED_8B
    trainable_8b = (
        3 * m["hidden"] * m["hidden"]
        + 2 * m["hidden"] * (m["heads"] + 2 * m["kv_heads"]) * m["head_dim"]
        + m["heads"] * m["head_dim"] * m["hidden"]
        + 3 * m["hidden"] * m["intermediate"]
        + m["hidden"] * m["draft_vocab_size"]
    )
    states_8b = trainable_8b * (2 + 2 + 4) + 2 * m["vocab"] * m["hidden"] * BF16 + 3 * m["tokens"] * 4 * m["hidden"] * BF16
    width_8b = ttt_width(m["hidden"], m["intermediate"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["draft_vocab_size"])
    width = ttt_width(d.hidden, d.intermediate, d.q_width, d.kv_width, d.draft_vocab_size)
    return (m["peak_bytes"] - states_8b) * tokens / m["tokens"] * width / width_8b


def draft_trainer_bytes(d: DraftCounts, tokens: int) -> float:
    """est.: a draft trainer's peak on one GPU for batches of ``tokens``: bf16 weights, fp32 master and Adam
    states and bf16 gradients of the trainable part (16 bytes a parameter), the bf16 embedding, the activations."""
    return d.trainable * 16 + d.frozen * BF16 + draft_activation_bytes(d, tokens)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Item:
    process: str  # engine | trainer
    name: str
    bytes: float
    estimate: bool = False


@dataclass
class Plan:
    shape: TargetShape
    tp: int
    tokens: int
    ranks: int
    items: list[Item]
    facts: dict

    def total(self, process: str | None = None) -> float:
        return sum(i.bytes for i in self.items if process is None or i.process == process)

    def as_dict(self) -> dict:
        return {
            "shape": asdict(self.shape),
            "tp": self.tp,
            "tokens": self.tokens,
            "ranks": self.ranks,
            "facts": self.facts,
            "items": [asdict(i) for i in self.items],
            "engine_bytes": self.total("engine"),
            "trainer_bytes": self.total("trainer"),
            "per_gpu_bytes": self.total(),
        }


def plan(
    config: dict,
    tp: int,
    tokens: int,
    *,
    ranks: int | None = None,
    slots: int = 3,
    num_aux: int = 3,
    draft_vocab_size: int = 32000,
    max_total_tokens: int | None = None,
    hf_target_in_trainer: bool = False,
    draft_layout: str = "llama",
) -> Plan:
    """Per-GPU bytes with ``tokens`` a trainer rank's batch (``data.max_tokens``), ``ranks``
    trainer ranks over which ZeRO shards the optimizer (default ``tp``), a ring of ``slots``,
    and SGLang's KV pool of ``max_total_tokens`` (default: one prefill, ``tp x tokens``).
    ``hf_target_in_trainer``: the trainer also holds the whole target in bf16 (load_target
    through transformers). ``draft_layout``: the draft's decoder layer, llama or mla (draft.layout)."""
    s = TargetShape.from_config(config)
    ranks = ranks or tp
    group = tp * tokens  # one prefill: every TP rank's batch
    pool = max_total_tokens or group
    if pool < group:
        raise ValueError(f"max_total_tokens {pool} < one prefill of {tp} x {tokens} = {group} tokens")
    w, kv, hand = weight_bytes(s, tp), kv_bytes_per_token(s), handoff_bytes_per_token(s, num_aux)
    d = draft_counts(transformers_config(config), num_aux, draft_vocab_size, layout=draft_layout)
    embed = s.vocab * s.hidden * BF16
    moe_buffers = group * s.topk * (s.moe_intermediate // tp + s.hidden) * BF16 + 2 * group * s.hidden * BF16
    attention = group * (s.heads // tp) * (2 * (s.nope + s.rope) + 2 * s.v_head) * BF16  # MHA prefill: q, k, v, output
    items = [
        Item("engine", "weights", w["per_gpu"]),
        Item("engine", f"KV pool ({pool} tokens)", pool * kv),
        Item("engine", "req_to_token table", req_to_token_bytes(s, pool)),
        Item("engine", f"captured aux + final of the prefill ({group} tokens)", group * hand),
        Item("engine", "FULL-mode concatenation of the aux states", group * num_aux * s.hidden * BF16),
        Item("engine", "this rank's rows for the ring copy", tokens * hand),
        Item("engine", "prefill: hidden + residual", 2 * group * s.hidden * BF16),
        Item("engine", "prefill: fused-MoE buffers, or attention if larger", max(moe_buffers, attention), estimate=True),
        Item("engine", "CUDA context + NCCL", CONTEXT_BYTES, estimate=True),
        Item("trainer", "draft trainable bf16 weights + grads", d.trainable * 4),
        Item("trainer", f"fp32 master + Adam m, v (ZeRO over {ranks} ranks)", d.trainable * 12 / ranks),
        Item("trainer", "draft's frozen embedding, bf16", embed),
        Item("trainer", "target lm_head for the labels, bf16", embed),
        Item("trainer", f"feature ring ({slots} slots x {tokens} tokens)", slots * tokens * hand),
        Item("trainer", "draft activations", draft_activation_bytes(d, tokens), estimate=True),
        Item(
            "trainer", "caching allocator's reserve beyond the peak", ALLOCATOR_RESERVE * draft_activation_bytes(d, tokens), estimate=True
        ),
        Item("trainer", "CUDA context + NCCL", CONTEXT_BYTES, estimate=True),
    ]
    if hf_target_in_trainer:
        target = sum(param_counts(s).values()) * BF16 - embed  # its lm_head is counted above
        items.append(Item("trainer", "the whole target through transformers, bf16 (load_target)", target))
    facts = {
        "params": param_counts(s),
        "params_total": sum(param_counts(s).values()),
        "weights": w,
        "kv_bytes_per_token": kv,
        "handoff_bytes_per_token": hand,
        "aux_width": num_aux * s.hidden,
        "draft_trainable": d.trainable,
        "draft_frozen": d.frozen,
        "prefill_tokens": group,
        "kv_pool_tokens": pool,
        "static_bytes": w["per_gpu"] + pool * kv,
        "num_aux": num_aux,
        "draft_vocab_size": draft_vocab_size,
        "slots": slots,
    }
    return Plan(s, tp, tokens, ranks, items, facts)


def format_plan(p: Plan, gpu_bytes: float = H200_BYTES) -> str:
    f, s = p.facts, p.shape
    lines = [
        f"target: {s.layers} layers ({s.dense_layers} dense), hidden {s.hidden}, {s.experts} routed experts top-{s.topk} "
        f"({'bf16' if s.expert_bits == 16 else f'INT{s.expert_bits} / {s.group_size}'}), vocab {s.vocab}: "
        f"{f['params_total'] / 1e9:.2f} B parameters, weights {f['weights']['total'] / GB:.1f} GB",
        f"TP {p.tp}, {p.ranks} trainer ranks, {p.tokens} tokens a batch: a prefill of {f['prefill_tokens']} tokens; "
        f"KV {f['kv_bytes_per_token']} B/token ({f['kv_bytes_per_token'] / 1024:.1f} KiB), hand-off {f['handoff_bytes_per_token']} "
        f"B/token ({f['handoff_bytes_per_token'] / 1024:.0f} KiB), aux width {f['aux_width']}; "
        f"draft {f['draft_trainable'] / 1e9:.3f} B trainable",
        f"{'process':<8} {'item':<62} {'GB':>7}",
    ]
    for i in p.items:
        lines.append(f"{i.process:<8} {i.name + (' (est.)' if i.estimate else ''):<62} {i.bytes / GB:>7.2f}")
    for name in ("engine", "trainer"):
        lines.append(f"{name:<8} {'total':<62} {p.total(name) / GB:>7.2f}")
    lines.append(f"{'GPU':<8} {'total (of ' + f'{gpu_bytes / GB:.1f} GB = {gpu_bytes / GIB:.1f} GiB)':<62} {p.total() / GB:>7.2f}")
    lines.append(
        f"SGLang static (weights + KV pool) {f['static_bytes'] / GB:.2f} GB: "
        "mem_fraction_static must exceed it / the GPU memory free at engine start"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Plan:
    p = argparse.ArgumentParser(prog="python -m models.memory_plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="model dir with config.json (DeepSeek-V3 architecture, or a wrapper with text_config)")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True, help="a trainer rank's batch tokens (data.max_tokens)")
    p.add_argument("--ranks", type=int, default=None, help="trainer ranks ZeRO shards over (default: --tp)")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--num-aux", type=int, default=3)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--draft-layout", choices=("llama", "mla"), default="llama", help="the draft's decoder layer (draft.layout)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="SGLang KV pool (default: one prefill)")
    p.add_argument(
        "--hf-target-in-trainer", action="store_true", help="the trainer also loads the whole target (load_target through transformers)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the plan here")
    a = p.parse_args(argv)
    config = json.loads((Path(a.config) / "config.json").read_text())
    result = plan(
        config,
        a.tp,
        a.tokens,
        ranks=a.ranks,
        slots=a.slots,
        num_aux=a.num_aux,
        draft_vocab_size=a.draft_vocab_size,
        draft_layout=a.draft_layout,
        max_total_tokens=a.max_total_tokens,
        hf_target_in_trainer=a.hf_target_in_trainer,
    )
    print(format_plan(result))
    if a.json is not None:
        a.json.write_text(json.dumps(result.as_dict(), indent=1))
    return result


if __name__ == "__main__":
    main()
