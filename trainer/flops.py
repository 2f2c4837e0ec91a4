"""FLOPs of one online training token and model FLOPs utilisation (MFU): the one count behind
the trainer's ``perf/mfu`` and ``lab/bench_throughput.py``."""

from __future__ import annotations

from models.draft import DraftShape

H200_BF16_PEAK_TFLOPS = 790.0  # bf16 dense matmul ceiling, measured on the H200 (docs/BENCHMARKS.md, its opening paragraph)


def flops_per_token(target_config, s: DraftShape, seq: int, ttt: int) -> dict[str, float]:
    """FLOPs per token of one training token: target forward + target labels + draft training.

    ``target_config`` is the target's transformers config (a dense Llama-style decoder);
    ``seq`` the row length the attention terms assume; ``ttt`` the draft's TTT steps.

    A matmul of an [n, a] input by an [a, b] weight costs 2ab a token forward; its backward
    costs 2ab for the weight gradient plus 2ab for the input gradient when the input needs
    one. Attention of a causal query over c keys costs 4 * (heads * head_dim) * c (QK^T and
    PV); a query at position t sees t + 1 keys, (seq + 1) / 2 on average.
    - target forward (the decoder body; its lm_head is never run):
      layers * [2 * (H*q + 2*H*kv + q*H) + 2 * 3*H*I + 4 * q * (seq+1)/2]
    - labels (no grad): full-vocab argmax 2*H*V + draft-vocab softmax 2*H*V_d
    - draft: fc (aux needs no grad: forward + weight gradient) 2 * 2*(A*H_t)*H_d, then per TTT
      step k, forward x 3 (forward + both gradients): the attention's projections (``draft_attention``),
      MLP 2*3*H_d*I_d, lm_head 2*H_d*V_d, attention over (seq+1)/2 + k keys
    """
    c = target_config
    h, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads  # transformers' rule for Llama configs
    q_t, kv_t = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    ctx = (seq + 1) / 2
    target = layers * (2 * (h * q_t + 2 * h * kv_t + q_t * h) + 2 * 3 * h * inter + 4 * q_t * ctx)
    labels = 2 * h * c.vocab_size + 2 * h * s.draft_vocab_size
    projections, per_key = draft_attention(s)
    hd = s.hidden_size
    fc = 2 * 2 * (s.num_aux * s.target_hidden_size) * hd
    steps = sum(
        3 * (projections + 2 * 3 * hd * s.intermediate_size + 2 * hd * s.draft_vocab_size + per_key * (ctx + k)) for k in range(ttt)
    )
    draft = fc + steps
    return {"target_forward": target, "labels": labels, "draft_train": draft, "total": target + labels + draft}


def draft_attention(s: DraftShape) -> tuple[float, float]:
    """FLOPs a token of the draft's attention: (its projections, its scores and values per key seen).
    llama: q/k/v from the 2H input and o, 4 * heads * head_dim a key. mla: the query's two-stage
    projection, the latent and RoPE key part, their expansion to per-head keys and values, o;
    2 * heads * (nope + rope) for the scores and 2 * heads * v for the values, a key."""
    h, n = s.hidden_size, s.num_attention_heads
    if s.mla is None:
        q, kv = n * s.head_dim, s.num_key_value_heads * s.head_dim
        return 2 * (2 * h) * (q + 2 * kv) + 2 * q * h, 4 * q
    m = s.mla
    projections = (
        2 * (2 * h) * m.q_lora_rank
        + 2 * m.q_lora_rank * n * m.qk_head_dim
        + 2 * (2 * h) * (m.kv_lora_rank + m.qk_rope_head_dim)
        + 2 * m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        + 2 * n * m.v_head_dim * h
    )
    return projections, 2 * n * m.qk_head_dim + 2 * n * m.v_head_dim


def mfu(flops: float, seconds: float, devices: int, peak_tflops: float) -> float:
    """Share (0..1) of ``devices`` x ``peak_tflops`` that ``flops`` done in ``seconds`` used."""
    return flops / (seconds * devices * peak_tflops * 1e12)


def device_peak_tflops(configured: float | None, device_type: str) -> float | None:
    """``trainer.peak_tflops`` when set, else the H200's bf16 peak on CUDA; None (no MFU) on a CPU."""
    if configured is not None:
        return configured
    return H200_BF16_PEAK_TFLOPS if device_type == "cuda" else None
