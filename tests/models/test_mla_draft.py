"""The mla layout (``Eagle3DeepseekV2ForCausalLM``): its TTT unroll against SGLang's absorbed MLA written out
by hand, its sizes from a DeepSeek / Kimi config, its FLOP count (the serving runner's chain: tests/serving/test_eval.py)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, LlamaConfig

from models.draft import DraftShape, Eagle3Draft, MLAShape, draft_shape_for
from tests.fixtures.tiny import TINY_MLA_DRAFT
from trainer.flops import draft_attention
from trainer.ttt import shift_left

MLA = TINY_MLA_DRAFT


def _rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_pairs(x, positions, theta):
    """Rotate channel pairs (2i, 2i + 1) of x [..., T, D] as complex numbers by position * theta^(-2i/D)."""
    d = x.shape[-1]
    angle = positions[..., None].double() * theta ** (-torch.arange(0, d, 2).double() / d)  # [.., T, D/2]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2).to(x.dtype)


def absorbed_logits(draft: Eagle3Draft, input_ids, aux, k_last: int, norm_output: bool):
    """Logits of TTT step ``k_last``, every step recomputed with attention as SGLang serves MLA: the query's
    no-RoPE part absorbed into the latent through w_kc (kv_b_proj split as SGLang's post_load_weights),
    scores over the normed latent and the shared RoPE key, the latent output back through w_vc."""
    s, m, layer = draft.shape, draft.shape.mla, draft.midlayer
    a, n, b, t = layer.self_attn, draft.shape.num_attention_heads, *input_ids.shape
    w = a.kv_b_proj.weight.unflatten(0, (n, m.qk_nope_head_dim + m.v_head_dim))  # [n, nope + v, r]
    w_kc, w_vc = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]  # [n, nope, r], [n, v, r]
    chunks = aux.chunk(s.num_aux, -1)
    hidden = torch.cat([_rms(c, norm.weight, s.rms_norm_eps) for c, norm in zip(chunks, draft.fc_norm)], -1) @ draft.fc.weight.T
    latents, rope_keys = [], []
    positions = torch.arange(t).expand(b, t)
    for j in range(k_last + 1):
        emb = draft.embed_tokens.weight[shift_left(input_ids, 1 + j)]
        x = torch.cat([_rms(emb, layer.input_layernorm.weight, s.rms_norm_eps), _rms(hidden, layer.hidden_norm.weight, s.rms_norm_eps)], -1)
        q = _rms(x @ a.q_a_proj.weight.T, a.q_a_layernorm.weight, s.rms_norm_eps) @ a.q_b_proj.weight.T
        q = q.view(b, t, n, m.qk_head_dim).transpose(1, 2)  # [B, n, T, nope + rope]
        kv_a = x @ a.kv_a_proj_with_mqa.weight.T  # [B, T, r + rope]
        latents.append(_rms(kv_a[..., : m.kv_lora_rank], a.kv_a_layernorm.weight, s.rms_norm_eps))  # [B, T, r]
        rope_keys.append(_rope_pairs(kv_a[..., m.kv_lora_rank :], positions + j, s.rope_theta))  # [B, T, rope]
        q_latent = torch.einsum("bntd,ndr->bntr", q[..., : m.qk_nope_head_dim], w_kc)  # [B, n, T, r]
        q_pe = _rope_pairs(q[..., m.qk_nope_head_dim :], positions[:, None] + j, s.rope_theta)
        allowed = torch.cat([torch.ones(t, t).tril().bool() if i == 0 else torch.eye(t, dtype=torch.bool) for i in range(j + 1)], 1)
        c, r = torch.cat(latents, 1), torch.cat(rope_keys, 1)  # [B, (j+1) T, r], [B, (j+1) T, rope]
        scores = (torch.einsum("bntr,bsr->bnts", q_latent, c) + torch.einsum("bntd,bsd->bnts", q_pe, r)) * m.qk_head_dim**-0.5
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out = torch.einsum("nvr,bnts,bsr->btnv", w_vc, probs, c).reshape(b, t, -1) @ a.o_proj.weight.T
        residual = hidden + out
        mlp_in = _rms(residual, layer.post_attention_layernorm.weight, s.rms_norm_eps)
        mlp = layer.mlp
        result = residual + (F.silu(mlp_in @ mlp.gate_proj.weight.T) * (mlp_in @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        normed = _rms(result, draft.norm.weight, s.rms_norm_eps)
        hidden = normed if norm_output else result
    return normed @ draft.lm_head.weight.T


def _draft(seed=0):
    torch.manual_seed(seed)
    draft = Eagle3Draft(MLA).double()
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return draft


@pytest.mark.parametrize("norm_output", [False, True])
def test_the_unroll_equals_the_absorbed_attention_sglang_serves(norm_output):
    draft, b, t = _draft(), 2, 10
    input_ids = torch.randint(0, MLA.vocab_size, (b, t))
    aux = torch.randn(b, t, MLA.num_aux * MLA.target_hidden_size, dtype=torch.float64)
    positions, cache = torch.arange(t).expand(b, t), []
    hidden = draft.project(aux)
    for k in range(4):
        out, logits = draft.step(shift_left(input_ids, 1 + k), hidden, positions + k, cache)
        torch.testing.assert_close(
            logits, absorbed_logits(draft, input_ids, aux, k, norm_output), rtol=1e-4, atol=1e-6
        )  # rms_norm runs in fp32
        hidden = draft.norm(out) if norm_output else out


def test_sizes_come_from_the_targets_mla_or_its_head_width():
    kimi = DeepseekV3Config(hidden_size=7168, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840, intermediate_size=18432)  # fmt: skip
    s = draft_shape_for(kimi, 3, 32000, layout="mla", fc_norm=True)
    assert s.mla == MLAShape(1536, 512, 128, 64, 128) and (s.num_key_value_heads, s.head_dim, s.layout, s.fc_norm) == (64, 192, "mla", True)
    llama = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, vocab_size=1000, intermediate_size=1536)
    assert draft_shape_for(llama, 3, 100, layout="mla").mla == MLAShape(768, 256, 64, 32, 64)  # head_dim 64
    assert draft_shape_for(llama, 3, 100).mla is None and DraftShape.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="config draft.layout: 'gqa' is not one of llama, mla"):
        draft_shape_for(llama, 3, 100, layout="gqa")
    kimi.q_lora_rank = None
    with pytest.raises(ValueError, match="q_lora_rank"):
        draft_shape_for(kimi, 3, 100, layout="mla")


@pytest.mark.parametrize("shape", [MLA, DraftShape(**{**MLA.to_dict(), "mla": None, "num_key_value_heads": 2, "head_dim": 8})])
def test_the_attention_flops_are_twice_its_weights_a_token(shape):
    """Every attention weight multiplies once a token: the projection FLOPs are 2 x their count."""
    attn = Eagle3Draft(shape).midlayer.self_attn
    weights = sum(m.weight.numel() for m in attn.modules() if isinstance(m, torch.nn.Linear))
    assert draft_attention(shape)[0] == 2 * weights
