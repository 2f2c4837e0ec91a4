"""The fast TTT unroll against a plain reference that recomputes every step from scratch."""

import math

import pytest
import torch
import torch.nn.functional as F

from models.draft import Eagle3Draft
from tests.fixtures.tiny import TINY_DRAFT
from trainer.ttt import shift_left, simulated_accept_length, step_valid, target_labels, ttt_unroll


def _rope(x, positions, theta):
    """Rotate pairs (i, i + D/2) of x [B, H, T, D] by position * theta^(-2i/D)."""
    d = x.shape[-1]
    angle = positions[:, None, :, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)  # [B,1,T,D/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_logits(draft: Eagle3Draft, input_ids, aux, k_last: int, norm_output: bool):
    """Logits of step ``k_last``, recomputing steps 0..k_last with an explicit full mask."""
    s, layer = draft.shape, draft.midlayer
    b, t = input_ids.shape
    positions = torch.arange(t).expand(b, t)
    hidden = aux @ draft.fc.weight.T
    keys, values = [], []
    for j in range(k_last + 1):
        emb = draft.embed_tokens.weight[shift_left(input_ids, 1 + j)]
        x = torch.cat(
            [_rms(emb, layer.input_layernorm.weight, s.rms_norm_eps), _rms(hidden, layer.hidden_norm.weight, s.rms_norm_eps)], dim=-1
        )
        att = layer.self_attn
        q = (x @ att.q_proj.weight.T).view(b, t, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = (x @ att.k_proj.weight.T).view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        v = (x @ att.v_proj.weight.T).view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        q, k = _rope(q, positions + j, s.rope_theta), _rope(k, positions + j, s.rope_theta)
        keys.append(k.repeat_interleave(2, dim=1))
        values.append(v.repeat_interleave(2, dim=1))
        allowed = torch.zeros(t, (j + 1) * t, dtype=torch.bool)  # query row -> key (step i, row r)
        for i in range(j + 1):
            block = torch.ones(t, t).tril().bool() if i == 0 else torch.eye(t, dtype=torch.bool)
            allowed[:, i * t : (i + 1) * t] = block
        scores = q @ torch.cat(keys, 2).transpose(-1, -2) / math.sqrt(s.head_dim)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        attn_out = (probs @ torch.cat(values, 2)).transpose(1, 2).reshape(b, t, -1) @ att.o_proj.weight.T
        residual = hidden + attn_out
        mlp_in = _rms(residual, layer.post_attention_layernorm.weight, s.rms_norm_eps)
        mlp = layer.mlp
        out = residual + (F.silu(mlp_in @ mlp.gate_proj.weight.T) * (mlp_in @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        normed = _rms(out, draft.norm.weight, s.rms_norm_eps)
        hidden = normed if norm_output else out
    return normed @ draft.lm_head.weight.T


def _problem(seed=0, b=2, t=12):
    torch.manual_seed(seed)
    draft = Eagle3Draft(TINY_DRAFT)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    input_ids = torch.randint(0, TINY_DRAFT.vocab_size, (b, t))
    lengths = torch.tensor([t, t - 3])
    loss_mask = torch.rand(b, t) > 0.3
    aux = torch.randn(b, t, TINY_DRAFT.num_aux * TINY_DRAFT.target_hidden_size)
    draft_ids = torch.sort(torch.randperm(TINY_DRAFT.vocab_size)[: TINY_DRAFT.draft_vocab_size]).values
    t2d = torch.zeros(TINY_DRAFT.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    final = torch.randn(b, t, 16)
    labels = target_labels(final, torch.randn(TINY_DRAFT.vocab_size, 16), draft_ids, t2d, chunk=7)
    return draft, input_ids, loss_mask, lengths, aux, labels, draft_ids


@pytest.mark.parametrize("norm_output", [False, True])
def test_unroll_matches_reference(norm_output):
    steps = 4
    draft, input_ids, loss_mask, lengths, aux, labels, draft_ids = _problem()
    fast = ttt_unroll(draft, input_ids, loss_mask, lengths, aux, labels, draft_ids, steps, 0.8, norm_output)
    fast.loss.backward()
    fast_grad = draft.fc.weight.grad.clone()
    draft.zero_grad()
    ref_loss = 0.0
    for k in range(steps):
        logits = reference_logits(draft, input_ids, aux, k, norm_output)
        mask = step_valid(loss_mask, lengths, labels.in_draft, k)
        ce = -(shift_left(labels.probs, 1 + k) * logits.log_softmax(-1)).sum(-1)
        step_sum = (ce * mask).sum()
        torch.testing.assert_close(fast.loss_sum[k], step_sum.detach(), rtol=1e-5, atol=0)
        hits = (draft_ids[logits.argmax(-1)] == shift_left(labels.argmax, 1 + k)) & mask
        assert fast.correct[k] == hits.sum() and fast.valid[k] == mask.sum()
        ref_loss = ref_loss + 0.8**k * step_sum / mask.sum().clamp(min=1)
    ref_loss.backward()
    torch.testing.assert_close(fast.loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(fast_grad, draft.fc.weight.grad, rtol=1e-5, atol=1e-7)


def test_step_valid_follows_index_convention():
    # one row of length 6, every token masked, every argmax in the draft vocab
    loss_mask, in_draft = torch.ones(1, 6, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)
    lengths = torch.tensor([6])
    # step k row t learns position p = t+1+k, needs p+1 < 6  ->  t < 4 - k
    for k in range(4):
        assert step_valid(loss_mask, lengths, in_draft, k).tolist() == [[t < 4 - k for t in range(6)]]
    # the label token of row 0 at step 0 is x_2: unmasking it removes exactly that row
    loss_mask[0, 2] = False
    assert step_valid(loss_mask, lengths, in_draft, 0).tolist() == [[False, True, True, True, False, False]]
    # a target argmax outside the draft vocab at position p removes row p-1-k
    in_draft[0, 3] = False
    assert step_valid(torch.ones(1, 6, dtype=torch.bool), lengths, in_draft, 1).tolist()[0][:3] == [True, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_labels_chunked_equals_full(dtype):
    """The chunked argmax and the soft labels equal those of the whole logits taken in float32."""
    torch.manual_seed(1)
    final, lm_head = torch.randn(2, 5, 16, dtype=dtype), torch.randn(50, 16, dtype=dtype)
    draft_ids = torch.arange(0, 50, 3)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[draft_ids] = True
    labels = target_labels(final, lm_head, draft_ids, t2d, chunk=7)
    full = (final @ lm_head.T).float()
    assert torch.equal(labels.argmax, full.argmax(-1))
    assert torch.equal(labels.in_draft, t2d[full.argmax(-1)])
    assert labels.probs.dtype == torch.float32
    torch.testing.assert_close(labels.probs, full[..., draft_ids].softmax(-1))


def test_simulated_accept_length():
    assert simulated_accept_length([1.0, 1.0, 1.0]) == 3.0
    assert simulated_accept_length([0.5, 0.5]) == pytest.approx(0.5 + 0.25)
    assert simulated_accept_length([0.0, 1.0]) == 0.0


def per_position_attention(q, cache, groups):
    """The TTT attention one query position at a time: position i attends to the step-0 keys 0..i and to
    its own row's keys of steps 1..k, one softmax over them all. q [B, H, T, D]; cache[j] = (k, v) [B, H_kv, T, D]."""
    keys = [(k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)) for k, v in cache]  # each [B, H, T, D]
    rows = []
    for i in range(q.shape[2]):
        k_i = torch.cat([keys[0][0][:, :, : i + 1], *(k[:, :, i : i + 1] for k, _ in keys[1:])], dim=2)  # [B, H, i + k, D]
        v_i = torch.cat([keys[0][1][:, :, : i + 1], *(v[:, :, i : i + 1] for _, v in keys[1:])], dim=2)
        weights = torch.softmax((k_i @ q[:, :, i, :, None]).squeeze(-1) * q.shape[-1] ** -0.5, dim=-1)  # [B, H, i + k]
        rows.append((weights[..., None] * v_i).sum(2))  # [B, H, D]
    return torch.stack(rows, dim=2)


def per_position_soft_cross_entropy(logits, probs, shift):
    """-sum_v p[t + shift, v] log softmax(logits[t])_v at each position t, 0 where t + shift is past the row."""
    loss = logits.float().sum(-1) * 0  # [B, T], in the graph of logits even where no position has a label
    for t in range(logits.shape[1] - shift):
        loss[:, t] = -(probs[:, t + shift] * torch.log_softmax(logits[:, t].float(), dim=-1)).sum(-1)
    return loss


def test_current_kernels_match_the_per_position_forms():
    """models/attention.py (log-sum-exp merge) and trainer/soft_ce.py against a position-by-position reference."""
    from models.attention import ttt_attention
    from trainer.soft_ce import soft_cross_entropy

    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 8, requires_grad=True)
    cache = [(torch.randn(2, 2, 12, 8, requires_grad=True), torch.randn(2, 2, 12, 8, requires_grad=True)) for _ in range(3)]
    for n in (1, 3):
        current, reference = ttt_attention(q, cache[:n], 2), per_position_attention(q, cache[:n], 2)
        torch.testing.assert_close(current, reference)
        inputs = [q, *cache[0], *cache[n - 1]]
        for a, b in zip(torch.autograd.grad(current.square().sum(), inputs), torch.autograd.grad(reference.square().sum(), inputs)):
            torch.testing.assert_close(a, b)
    logits, probs = torch.randn(2, 12, 20, requires_grad=True), torch.softmax(torch.randn(2, 12, 20), -1)
    weight = torch.arange(12.0)
    current, reference = soft_cross_entropy(logits, probs, 3, chunk=5), per_position_soft_cross_entropy(logits, probs, 3)
    torch.testing.assert_close(current, reference)
    torch.testing.assert_close(
        torch.autograd.grad((current * weight).sum(), logits)[0], torch.autograd.grad((reference * weight).sum(), logits)[0]
    )


@pytest.mark.parametrize(
    "device, dtype, tol",
    [("cpu", torch.float32, 1e-6), pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.gpu)],
)
def test_compiled_pointwise_chains_equal_the_eager_ones(device, dtype, tol):
    """models.draft.compiled_pointwise (torch.compile of its rms_norm, silu_mul and apply_rope):
    outputs and gradients equal the eager functions'."""
    from models import draft
    from models.draft import compiled_pointwise

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    x, w = torch.randn(2, 6, 16, device=device, dtype=dtype), torch.randn(16, device=device, dtype=dtype)
    g, u = torch.randn(2, 6, 32, device=device, dtype=dtype), torch.randn(2, 6, 32, device=device, dtype=dtype)
    cos, sin = draft.rope_cos_sin(torch.arange(6, device=device)[None], 8, 10000.0, dtype)  # [1, 1, 6, 8]
    q = torch.randn(2, 3, 6, 8, device=device, dtype=dtype)
    cases = {"rms_norm": ((x, w), (1e-5,)), "silu_mul": ((g, u), ()), "apply_rope": ((q,), (cos, sin))}
    compiled = compiled_pointwise()
    for name, (grads_of, rest) in cases.items():
        outs = []
        for fn in (getattr(draft, name), compiled[name]):
            inputs = [t.detach().clone().requires_grad_() for t in grads_of]
            y = fn(*inputs, *rest)
            outs.append((y, *torch.autograd.grad((y.float() * torch.linspace(0, 1, y.numel(), device=device).view_as(y)).sum(), inputs)))
        for eager, fused in zip(*outs):
            torch.testing.assert_close(fused, eager, rtol=tol, atol=tol, msg=name)


def test_a_compiled_pointwise_draft_trains_as_the_eager_one():
    """Eagle3Draft(shape, Pointwise(compiled=True)): every module reaches the compiled functions, and
    the TTT loss and its gradients equal the eager draft's (fp32, CPU)."""
    from models.draft import Pointwise, compiled_pointwise

    draft, input_ids, loss_mask, lengths, aux, labels, draft_ids = _problem()
    fused = Eagle3Draft(TINY_DRAFT, Pointwise(compiled=True))
    fused.load_state_dict(draft.state_dict())
    users = [m for m in fused.modules() if hasattr(m, "pw")]
    assert len(users) == 7 and all(m.pw("rms_norm") is compiled_pointwise()["rms_norm"] for m in users)  # 4 norms, attn, mlp, draft
    outs = []
    for model in (draft, fused):
        out = ttt_unroll(model, input_ids, loss_mask, lengths, aux, labels, draft_ids, 3, 0.8, False)
        out.loss.backward()
        outs.append((out.loss.detach(), model.fc.weight.grad, model.midlayer.mlp.up_proj.weight.grad, model.norm.weight.grad))
    for eager, compiled in zip(*outs):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("b, t, shift, chunk", [(5, 7, 1, 4), (3, 6, 0, 100), (2, 4, 4, 3), (4, 3, 6, 2)])
def test_soft_cross_entropy_spans_rows_and_matches_the_explicit_form(b, t, shift, chunk):
    """Chunks run across rows: each row's last ``shift`` positions are 0 in value and gradient, the rest
    equal the explicit per-position form, and the kernel calls do not grow with the rows."""
    from trainer import soft_ce

    torch.manual_seed(1)
    logits, probs = torch.randn(b, t, 11, requires_grad=True), torch.softmax(torch.randn(b, t, 11), -1)
    weight = torch.rand(b, t) + 0.5  # non-zero on the invalid positions too
    current, baseline = soft_ce.soft_cross_entropy(logits, probs, shift, chunk), per_position_soft_cross_entropy(logits, probs, shift)
    torch.testing.assert_close(current, baseline)
    assert not current[:, max(t - shift, 0) :].any()
    torch.testing.assert_close(
        torch.autograd.grad((current * weight).sum(), logits)[0], torch.autograd.grad((baseline * weight).sum(), logits)[0]
    )
    assert len(list(soft_ce._spans(b, t, shift, chunk))) == -(-max(b * t - shift, 0) // chunk)


def test_soft_cross_entropy_gradient_is_zero_past_the_labels_in_uninitialised_memory():
    """The backward writes its [B * T, V] gradient into uninitialised memory (NaN here, as deterministic mode fills
    it): the positions whose label lies past the batch come back 0, not whatever the memory held."""
    from trainer import soft_ce

    torch.manual_seed(2)
    logits, probs = torch.randn(3, 5, 11, requires_grad=True), torch.softmax(torch.randn(3, 5, 11), -1)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grad = torch.autograd.grad(soft_ce.soft_cross_entropy(logits, probs, 2, chunk=4).sum(), logits)[0]
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.isfinite(grad).all()
    assert not grad.reshape(15, 11)[13:].any()  # the last 2 positions of the flattened batch


@pytest.mark.parametrize(
    "device, dtype, tol",
    [("cpu", torch.float32, 1e-5), pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.gpu)],
)
def test_compiled_soft_cross_entropy_kernels_equal_the_eager_ones(device, dtype, tol):
    """trainer.soft_ce's compiled row kernels (a GPU's): the cross-entropy, its logsumexp and sum(p), and the
    one-pass gradient from them equal the eager functions' and the explicit gradient of the loss."""
    from trainer import soft_ce

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(3)
    x = (3 * torch.randn(9, 37, device=device)).to(dtype).requires_grad_()
    p, g = torch.rand(9, 37, device=device), torch.rand(9, device=device)  # p unnormalised: sum(p) counts
    eager, compiled = soft_ce._kernels(False), soft_ce._kernels(True)
    rows = [fn(x.detach(), p) for fn, _ in (eager, compiled)]
    for a, b in zip(*rows):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    explicit = torch.autograd.grad((g * -(p * x.float().log_softmax(-1)).sum(-1)).sum(), x)[0]
    for (_, grad_fn), (_, lse, total) in zip((eager, compiled), rows):
        torch.testing.assert_close(grad_fn(x.detach(), p, lse, total, g).float(), explicit.float(), rtol=tol, atol=tol)
