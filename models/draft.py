"""The EAGLE-3 draft model in plain PyTorch.

One decoder layer whose attention reads ``[input_layernorm(embeds), hidden_norm(hidden)]``
(2 x hidden wide). Parameter names are the names of SGLang's ``LlamaForCausalLMEagle3``
checkpoint (``fc``, ``midlayer.*``, ``norm``, ``lm_head``), so export is a rename-free
``state_dict``. The token embedding is the target's, frozen, and never exported.

The pointwise pieces (``rms_norm``, ``silu_mul``, ``apply_rope``) are module functions that the
modules reach through a ``Pointwise``: looked up here at call time (a benchmark swaps them,
``launch/draft_variants.py``), or their ``torch.compile``d versions (``Pointwise(compiled=True)``).

Attention takes a list of per-step key/value caches: step 0 holds the causal keys of the
whole sequence; each later TTT step k adds one key per position (the draft token at
position t + k). A query at row t of step k sees step-0 keys s <= t and the step-j key of
row t for 1 <= j <= k: EAGLE-3's training-time-test mask, equal to chain drafting at
serving time.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import KVCache, ttt_attention


@dataclass(frozen=True)
class DraftShape:
    """Every size the draft needs; ``draft_shape_for`` derives it from the target config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    num_aux: int
    vocab_size: int  # target vocab (embedding rows)
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    def to_dict(self) -> dict:
        return asdict(self)


def draft_shape_for(target_config, num_aux: int, draft_vocab_size: int, intermediate_size: int | None = None) -> DraftShape:
    """A draft as wide as the target, with the target's attention sizes and its MLP width (or
    ``intermediate_size``); its vocabulary of ``draft_vocab_size`` target tokens is at most the target's."""
    if draft_vocab_size > target_config.vocab_size:
        raise ValueError(
            f"config draft.vocab_size: {draft_vocab_size} is above the target's vocabulary of {target_config.vocab_size} "
            f"tokens; set draft.vocab_size={target_config.vocab_size} or less"
        )
    heads = target_config.num_attention_heads
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
    return DraftShape(
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size if intermediate_size is None else intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim,
        target_hidden_size=target_config.hidden_size,
        num_aux=num_aux,
        vocab_size=target_config.vocab_size,
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=rope_theta_of(target_config),
        max_position_embeddings=target_config.max_position_embeddings,
    )


def rope_theta_of(config) -> float:
    """RoPE base of a transformers config (v5 ``rope_parameters`` or v4 ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None)
    if params and "rope_theta" in params:
        return float(params["rope_theta"])
    if hasattr(config, "rope_theta"):
        return float(config.rope_theta)
    raise ValueError(f"target config {type(config).__name__} names no RoPE base (rope_theta)")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H] normalised in fp32, cast back to its dtype, times ``weight`` [H]."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """The SwiGLU activation: silu(gate) * up, both [..., I]."""
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, pw: Pointwise):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.pw = eps, pw

    def forward(self, x: Tensor) -> Tensor:
        return self.pw("rms_norm")(x, self.weight, self.eps)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for integer ``positions`` [B, T] -> two [B, 1, T, head_dim] tensors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


POINTWISE = ("rms_norm", "silu_mul", "apply_rope")


@functools.cache
def compiled_pointwise() -> dict[str, Callable]:
    """``torch.compile``d versions of this module's pointwise functions, by name (one set a process):
    each chain fused into kernels, forward and backward, with the same arithmetic."""
    return {name: torch.compile(globals()[name]) for name in POINTWISE}


@dataclass(frozen=True)
class Pointwise:
    """Where a draft's modules find their pointwise functions: this module's, looked up at call time,
    or, ``compiled``, ``compiled_pointwise()``'s."""

    compiled: bool = False

    @classmethod
    def default_for(cls, device: torch.device) -> Pointwise:
        """Compiled on CUDA (measured faster there: docs/BENCHMARKS.md, "Training throughput and MFU"), eager elsewhere."""
        return cls(compiled=device.type == "cuda")

    def __call__(self, name: str) -> Callable:
        return compiled_pointwise()[name] if self.compiled else globals()[name]


class Attention(nn.Module):
    def __init__(self, s: DraftShape, pw: Pointwise):
        super().__init__()
        self.s, self.pw = s, pw
        q_out, kv_out = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        self.q_proj = nn.Linear(2 * s.hidden_size, q_out, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, kv_out, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, s.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache, doc_ids: Tensor | None) -> Tensor:
        """x [B, T, 2H] at ``positions`` [B, T], documents ``doc_ids`` [B, T] or None; appends k/v to ``cache``."""
        s, (b, t, _) = self.s, x.shape
        q = self.q_proj(x).view(b, t, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, s.head_dim, s.rope_theta, q.dtype)
        rope = self.pw("apply_rope")
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        cache.append((k, v))
        out = ttt_attention(q, cache, s.num_attention_heads // s.num_key_value_heads, doc_ids)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: DraftShape, pw: Pointwise):
        super().__init__()
        self.pw = pw
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.pw("silu_mul")(self.gate_proj(x), self.up_proj(x)))


class MidLayer(nn.Module):
    """The draft's single decoder layer; returns the pre-norm residual sum [B, T, H]."""

    def __init__(self, s: DraftShape, pw: Pointwise):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, pw)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps, pw)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, pw)
        self.self_attn = Attention(s, pw)
        self.mlp = MLP(s, pw)

    def forward(self, embeds: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache, doc_ids: Tensor | None) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        residual = hidden + self.self_attn(x, positions, cache, doc_ids)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Draft(nn.Module):
    def __init__(self, s: DraftShape, pw: Pointwise = Pointwise()):
        super().__init__()
        self.shape, self.pw = s, pw
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(s.num_aux * s.target_hidden_size, s.hidden_size, bias=False)
        self.midlayer = MidLayer(s, pw)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, pw)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)

    def init_from_target(self, embed_weight: Tensor, lm_head_weight: Tensor, draft_to_target: Tensor) -> None:
        """Share the target embedding; initialise lm_head from the target's draft-vocab rows."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
            self.lm_head.weight.copy_(lm_head_weight[draft_to_target])

    def project(self, aux: Tensor) -> Tensor:
        """Fuse the target's aux features [B, T, num_aux * H_t] -> [B, T, H]."""
        return self.fc(aux)

    def step(
        self, input_ids: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache, doc_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """One draft forward. Returns (pre-norm hidden [B, T, H], draft logits [B, T, V_d]).

        ``doc_ids`` [B, T] (packed rows): attention stays inside each document; None: one a row.
        The pre-norm hidden is what SGLang feeds back at the next draft step unless the
        exported config sets ``norm_output``.
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        out = self.midlayer(embeds, hidden, positions, cache, doc_ids)
        return out, self.lm_head(self.norm(out))

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The exported tensors: everything but the shared target embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
