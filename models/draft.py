"""The EAGLE-3 draft model in plain PyTorch.

One decoder layer whose attention reads ``[input_layernorm(embeds), hidden_norm(hidden)]``
(2 x hidden wide), in one of two layouts: ``llama`` (grouped-query attention, SGLang's
``LlamaForCausalLMEagle3``) or ``mla`` (DeepSeek-V2 multi-latent attention, SGLang's
``Eagle3DeepseekV2ForCausalLM``, the layout Kimi-K2.x drafts use: the draft's KV cache has
the target's MLA shape). Parameter names are the checkpoint names both engines load (``fc``,
``fc_norm.*``, ``midlayer.*``, ``norm``, ``lm_head``), so export is a rename-free
``state_dict``. The token embedding is the target's, frozen, and never exported.

The pointwise pieces (``rms_norm``, ``silu_mul``, ``apply_rope``) are module functions that the
modules reach through a ``Pointwise``: looked up here at call time (a benchmark swaps them,
``lab/draft_variants.py``), or their ``torch.compile``d versions (``Pointwise(compiled=True)``).

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

LAYOUTS = ("llama", "mla")


@dataclass(frozen=True)
class MLAShape:
    """The multi-latent attention sizes of an ``mla`` draft (DeepSeek-V2's names)."""

    q_lora_rank: int  # the query's low-rank width (SGLang's draft class needs one)
    kv_lora_rank: int  # the cached latent's width
    qk_nope_head_dim: int  # the part of a query/key head without RoPE
    qk_rope_head_dim: int  # the part with RoPE (one key part shared by every head)
    v_head_dim: int

    @classmethod
    def of_target(cls, config) -> MLAShape:
        """The target's own MLA sizes (a DeepSeek-V3 / Kimi-K2 config), or sizes derived from its head
        width for a target without MLA: nope = v = head_dim, rope = head_dim / 2, latent 4 x head_dim,
        query rank 3 x latent (DeepSeek-V3's 128 / 64 / 512 / 1536)."""
        if getattr(config, "kv_lora_rank", None):
            if not getattr(config, "q_lora_rank", None):
                raise ValueError("config draft.layout: mla: the target's MLA has no q_lora_rank, which SGLang's MLA draft needs")
            names = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            return cls(*(int(getattr(config, n)) for n in names))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head_dim % 4:
            raise ValueError(f"config draft.layout: mla: the target's head_dim {head_dim} is not a multiple of 4 (RoPE: half, in pairs)")
        return cls(3 * 4 * head_dim, 4 * head_dim, head_dim, head_dim // 2, head_dim)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    mla: MLAShape | None = None  # None: the llama layout
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm over each aux state before fc

    @property
    def layout(self) -> str:
        return "llama" if self.mla is None else "mla"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DraftShape:
        mla = d.get("mla")
        return cls(**{**d, "mla": MLAShape(**mla) if mla else None})


def draft_shape_for(
    target_config,
    num_aux: int,
    draft_vocab_size: int,
    intermediate_size: int | None = None,
    layout: str = "llama",
    fc_norm: bool = False,
) -> DraftShape:
    """A draft as wide as the target, with the target's attention sizes (``layout`` mla: its MLA sizes,
    ``MLAShape.of_target``) and its MLP width (or ``intermediate_size``); its vocabulary of
    ``draft_vocab_size`` target tokens is at most the target's."""
    if layout not in LAYOUTS:
        raise ValueError(f"config draft.layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    if draft_vocab_size > target_config.vocab_size:
        raise ValueError(
            f"config draft.draft_vocab_size: {draft_vocab_size} is above the target's vocabulary of {target_config.vocab_size} "
            f"tokens; set draft.draft_vocab_size={target_config.vocab_size} or less"
        )
    heads = target_config.num_attention_heads
    mla = MLAShape.of_target(target_config) if layout == "mla" else None
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
    return DraftShape(
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size if intermediate_size is None else intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=heads if mla else target_config.num_key_value_heads,  # MLA: every head its own key
        head_dim=mla.qk_head_dim if mla else head_dim,
        target_hidden_size=target_config.hidden_size,
        num_aux=num_aux,
        vocab_size=target_config.vocab_size,
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=rope_theta_of(target_config),
        max_position_embeddings=target_config.max_position_embeddings,
        mla=mla,
        fc_norm=fc_norm,
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
    """RoPE on halves (Llama, GPT-NeoX style): channel i pairs with channel i + D/2."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def interleaved_cos_sin(positions: Tensor, dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables of interleaved RoPE for ``positions`` [B, T] -> two [B, 1, T, dim] tensors
    (frequency i at channels 2i and 2i + 1)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device).float() / dim))
    emb = (positions.float()[..., None] * inv_freq).repeat_interleave(2, dim=-1)[:, None]  # [B, 1, T, dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on adjacent pairs (DeepSeek's MLA, GPT-J style): channel 2i pairs with 2i + 1."""
    rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return x * cos + rotated * sin


POINTWISE = ("rms_norm", "silu_mul", "apply_rope", "apply_rope_interleaved")


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

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H] at ``positions`` [B, T] -> q [B, H_q, T, D], k and v [B, H_kv, T, D], RoPE applied."""
        s, (b, t, _) = self.s, x.shape
        q = self.q_proj(x).view(b, t, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, s.head_dim, s.rope_theta, q.dtype)
        rope = self.pw("apply_rope")
        return rope(q, cos, sin), rope(k, cos, sin), v

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache, doc_ids: Tensor | None) -> Tensor:
        return attend(self, x, positions, cache, doc_ids)


def attend(attn: Attention | MLAAttention, x: Tensor, positions: Tensor, cache: KVCache, doc_ids: Tensor | None) -> Tensor:
    """One TTT step of either layout's attention: x [B, T, 2H] at ``positions`` [B, T], documents ``doc_ids``
    [B, T] or None; appends the step's k/v to ``cache``; returns [B, T, H]."""
    s, (b, t, _) = attn.s, x.shape
    q, k, v = attn.qkv(x, positions)
    cache.append((k, v))
    out = ttt_attention(q, cache, s.num_attention_heads // s.num_key_value_heads, doc_ids)  # [B, H_q, T, Dv]
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLAAttention(nn.Module):
    """DeepSeek-V2 multi-latent attention over the 2H-wide input, trained in its expanded form (SGLang serves
    the same weights absorbed into the latent): queries through a rank-``q_lora_rank`` bottleneck, keys and
    values from a ``kv_lora_rank`` latent, and a RoPE key part shared by every head."""

    def __init__(self, s: DraftShape, pw: Pointwise):
        super().__init__()
        m, n = s.mla, s.num_attention_heads
        self.s, self.m, self.pw = s, m, pw
        self.q_a_proj = nn.Linear(2 * s.hidden_size, m.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(m.q_lora_rank, s.rms_norm_eps, pw)
        self.q_b_proj = nn.Linear(m.q_lora_rank, n * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * s.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, s.rms_norm_eps, pw)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, n * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * m.v_head_dim, s.hidden_size, bias=False)

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H] at ``positions`` [B, T] -> q and k [B, n, T, nope + rope] (RoPE on the last rope
        channels), v [B, n, T, v]."""
        m, n, (b, t, _) = self.m, self.s.num_attention_heads, x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, n, m.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)  # [B, n, T, nope], [B, n, T, rope]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)  # [B, T, r], [B, T, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, n, m.qk_nope_head_dim + m.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)  # [B, n, T, nope], [B, n, T, v]
        cos, sin = interleaved_cos_sin(positions, m.qk_rope_head_dim, self.s.rope_theta, q.dtype)
        rope = self.pw("apply_rope_interleaved")
        q_pe, k_pe = rope(q_pe, cos, sin), rope(k_pe[:, None], cos, sin)  # k_pe [B, 1, T, rope]: one for every head
        k = torch.cat([k_nope, k_pe.expand(b, n, t, m.qk_rope_head_dim)], dim=-1)
        return torch.cat([q_nope, q_pe], dim=-1), k, v

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache, doc_ids: Tensor | None) -> Tensor:
        return attend(self, x, positions, cache, doc_ids)


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
        self.self_attn = Attention(s, pw) if s.mla is None else MLAAttention(s, pw)
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
        if s.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(s.target_hidden_size, s.rms_norm_eps, pw) for _ in range(s.num_aux))
        self.midlayer = MidLayer(s, pw)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, pw)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)

    def init_from_target(self, embed_weight: Tensor, lm_head_weight: Tensor, draft_to_target: Tensor) -> None:
        """Share the target embedding; initialise lm_head from the target's draft-vocab rows."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
            self.lm_head.weight.copy_(lm_head_weight[draft_to_target])

    def project(self, aux: Tensor) -> Tensor:
        """Fuse the target's aux features [B, T, num_aux * H_t] -> [B, T, H] (``fc_norm``: each aux state
        [B, T, H_t] normed first)."""
        if self.shape.fc_norm:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(self.shape.num_aux, dim=-1))], dim=-1)
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
