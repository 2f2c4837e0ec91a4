"""Sequence packing: the batcher, and documents kept apart in the target and in the draft's TTT.

A packed row holds several documents back to back; every test here compares it with the
same documents alone (or padded one a row): the target's features, the draft's attention,
and the TTT loss and accuracy must not change, and must change if attention crossed.
"""

import random

import pytest
import torch

from models.attention import ttt_attention
from models.batch import TokenBatch, document_positions
from models.target import HFTargetEngine
from tests.fixtures.tiny import TINY_DRAFT
from tests.models.test_target import VOCAB, tiny_llama
from tests.trainer.test_ttt import _problem
from trainer.data import EncodedSample, PackedBatcher, first_fit_rows, next_fit_rows, pack_rows, pad_batch
from trainer.ttt import step_valid, target_labels, ttt_unroll


def samples(lengths, seed=0, vocab=VOCAB) -> list[EncodedSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        out.append(EncodedSample(ids, (torch.rand(n, generator=g) > 0.3).tolist()))
    return out


# --------------------------------------------------------------------------- the batcher


def test_pack_rows_layout():
    a, b, c = samples([3, 2, 4])
    batch = pack_rows([[a, b], [c]], pad_id=0)
    assert batch.input_ids.tolist() == [a.input_ids + b.input_ids, c.input_ids + [0]]
    assert batch.loss_mask.tolist() == [a.loss_mask + b.loss_mask, c.loss_mask + [False]]
    assert batch.doc_ids.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, -1]]
    assert batch.lengths.tolist() == [5, 4]
    assert batch.positions().tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert [d.tolist() for d in batch.documents()] == [a.input_ids, b.input_ids, c.input_ids]
    assert document_positions(torch.tensor([[0, 1, 2, 2, -1]])).tolist() == [[0, 0, 0, 1, 0]]


def test_first_fit_rows_reproduced_by_next_fit():
    """collate re-derives plan's rows by next-fit: inside a window this gives the first-fit rows."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(300)]
    rows = first_fit_rows(range(300), lengths, 128)
    assert sorted(i for row in rows for i in row) == list(range(300))
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    order = [i for row in rows for i in row]
    assert [[order[j] for j in row] for row in next_fit_rows([lengths[i] for i in order], 128)] == rows


def test_packed_plan_and_collate():
    rng = random.Random(1)
    data = samples([rng.randint(1, 64) for _ in range(500)])
    batcher = PackedBatcher(max_tokens=256, row_tokens=64, pad_id=0, sort_window=128)
    lengths = [len(s.input_ids) for s in data]
    groups = batcher.plan(lengths, random.Random(0))
    assert sorted(i for g in groups for i in g) == list(range(500))  # each sample once
    real = padded = 0
    for group in groups:
        batch = batcher.collate([data[i] for i in group])
        rows, width = batch.input_ids.shape
        assert rows <= 4 and width <= 64 and rows * width <= 256
        assert [d.tolist() for d in batch.documents()] == [data[i].input_ids for i in group]  # group order = row order
        real, padded = real + int(batch.lengths.sum()), padded + batch.input_ids.numel()
    assert real / padded > 0.9
    assert batcher.plan(lengths, random.Random(0)) == groups
    with pytest.raises(ValueError, match="does not fit a packed row of 64"):
        batcher.plan([65], random.Random(0))


def test_packing_beats_padding_on_english(tokenizer_and_english):
    """The figure docs/BENCHMARKS.md, "What did not help" (packing vs padding), quotes: share of real tokens, chatterbot
    English, default budget."""
    from trainer.data import PaddedBatcher, encode_conversations

    tokenizer, english = tokenizer_and_english
    data, _ = encode_conversations(tokenizer, english, max_len=512)
    lengths = [len(s.input_ids) for s in data]
    shares = {}
    for batcher in (PaddedBatcher(1024, 0), PackedBatcher(1024, 512, 0)):
        batches = [batcher.collate([data[i] for i in g]) for g in batcher.plan(lengths, random.Random(0))]
        shares[batcher.describe()] = sum(int(b.lengths.sum()) for b in batches) / sum(b.input_ids.numel() for b in batches)
    print("\nreal / padded tokens:", {k: round(v, 3) for k, v in shares.items()})
    padded, packed = shares.values()
    assert packed > 0.95 and packed > padded


@pytest.fixture(scope="module")
def tokenizer_and_english():
    from models.embedded import embedded_target_dir
    from models.target import load_tokenizer
    from trainer.data import read_chatterbot, split_holdout

    convs, _ = read_chatterbot("english")
    return load_tokenizer(embedded_target_dir()), split_holdout(convs, 0.1, 0)[0]


# --------------------------------------------------------------------------- the target


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_target_features_of_a_packed_row_are_each_document_alone(attn):
    model = tiny_llama()
    model.config._attn_implementation = attn
    engine = HFTargetEngine(model)
    docs = samples([9, 5, 14, 6], seed=2)
    packed = pack_rows([[docs[0], docs[1]], [docs[2]], [docs[3], docs[0]]], pad_id=0)  # doc 0 twice
    feats = engine.features(packed)
    spans = [(0, 0, 9), (0, 9, 14), (1, 0, 14), (2, 0, 6), (2, 6, 15)]  # (row, start, end)
    for (row, start, end), doc in zip(spans, [docs[0], docs[1], docs[2], docs[3], docs[0]]):
        alone = engine.features(pad_batch([doc], pad_id=0))
        torch.testing.assert_close(feats.aux[row, start:end], alone.aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats.final[row, start:end], alone.final[0], rtol=1e-5, atol=1e-5)
    # the same row without its document mask: the second document sees the first, and differs
    unmasked = engine.features(TokenBatch(packed.input_ids[:1], packed.loss_mask[:1], packed.lengths[:1]))
    assert not torch.allclose(unmasked.final[0, 9:14], feats.final[0, 9:14], atol=1e-3)


# --------------------------------------------------------------------------- the draft's TTT


def test_step_valid_stops_at_document_ends():
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, -1]])
    ones = torch.ones(1, 9, dtype=torch.bool)
    lengths = torch.tensor([8])
    # step k, row t counts when x_{t+2+k} is in t's document
    assert step_valid(ones, lengths, ones, 0, doc_ids)[0].nonzero().flatten().tolist() == [0, 1, 4, 5]
    assert step_valid(ones, lengths, ones, 1, doc_ids)[0].nonzero().flatten().tolist() == [0, 4]
    assert step_valid(ones, lengths, ones, 2, doc_ids)[0].nonzero().flatten().tolist() == []


def test_draft_attention_stays_inside_documents():
    torch.manual_seed(0)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 0, 0, 0, 1, 1, 1]])
    q = torch.randn(2, 4, 8, 8)
    cache = [(torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)) for _ in range(3)]
    out = ttt_attention(q, cache, 2, doc_ids)
    alone = ttt_attention(q[:1, :, 3:7], [(k[:1, :, 3:7], v[:1, :, 3:7]) for k, v in cache], 2)  # row 0, doc 1 alone
    torch.testing.assert_close(out[:1, :, 3:7], alone)
    perturbed = [(k.clone(), v.clone()) for k, v in cache]
    perturbed[0][0][:, :, :3] += 1.0  # step-0 keys and values of row 0's first document
    perturbed[0][1][:, :, :3] += 1.0
    moved = ttt_attention(q, perturbed, 2, doc_ids)
    torch.testing.assert_close(moved[0, :, 3:], out[0, :, 3:])  # the second document never sees them
    assert not torch.allclose(moved[0, :, :3], out[0, :, :3])
    assert not torch.allclose(ttt_attention(q, perturbed, 2)[0, :, 3:7], out[0, :, 3:7])  # without doc ids it would


@pytest.mark.gpu
def test_flex_document_mask_equals_the_explicit_one():
    """The GPU path (flex attention, document block mask) against the CPU path, forward and backward."""
    from models.attention import causal_with_lse, explicit_causal_with_lse

    torch.manual_seed(0)
    doc_ids = torch.tensor([[0] * 100 + [1] * 200 + [2] * 150 + [-1] * 62, [0] * 300 + [1] * 212], device="cuda")
    q, k, v = (torch.randn(2, h, 512, 64, device="cuda", requires_grad=True) for h in (8, 2, 2))
    flex, flex_lse = causal_with_lse(q, k, v, 0.125, doc_ids)
    ref, ref_lse = explicit_causal_with_lse(q, k, v, 0.125, doc_ids)
    torch.testing.assert_close(flex, ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(flex_lse, ref_lse, rtol=2e-3, atol=2e-3)
    for a, b in zip(torch.autograd.grad(flex.square().sum(), (q, k, v)), torch.autograd.grad(ref.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def _place(batch: TokenBatch, rows: list[list[int]], feats) -> tuple[torch.Tensor, torch.Tensor]:
    """aux, final [B, T, ...] of ``batch``, whose row r holds documents ``rows[r]`` back to back."""
    b, t = batch.input_ids.shape
    aux, final = torch.zeros(b, t, feats[0][0].shape[-1]), torch.zeros(b, t, feats[0][1].shape[-1])
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(feats[i][0])
            aux[r, start : start + n], final[r, start : start + n] = feats[i]
            start += n
    return aux, final


@pytest.mark.parametrize("norm_output", [False, True])
def test_ttt_loss_and_accuracy_packed_equal_padded(norm_output):
    draft, *_ = _problem()
    docs = samples([7, 11, 5, 9, 12], seed=3, vocab=TINY_DRAFT.vocab_size)
    g = torch.Generator().manual_seed(4)
    feats = [
        (torch.randn(len(d.input_ids), 3 * TINY_DRAFT.target_hidden_size, generator=g), torch.randn(len(d.input_ids), 16, generator=g))
        for d in docs
    ]
    padded, packed = pad_batch(docs, pad_id=0), pack_rows([docs[0:2], docs[2:4], docs[4:]], pad_id=0)
    draft_ids = torch.arange(0, TINY_DRAFT.vocab_size, 2)[: TINY_DRAFT.draft_vocab_size]
    t2d = torch.zeros(TINY_DRAFT.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    lm_head = torch.randn(TINY_DRAFT.vocab_size, 16, generator=g)
    results = []
    for batch, rows in ((padded, [[0], [1], [2], [3], [4]]), (packed, [[0, 1], [2, 3], [4]])):
        aux, final = _place(batch, rows, feats)
        labels = target_labels(final, lm_head, draft_ids, t2d)
        draft.zero_grad()
        out = ttt_unroll(draft, batch.input_ids, batch.loss_mask, batch.lengths, aux, labels, draft_ids, 4, 0.8, norm_output, batch.doc_ids)
        out.loss.backward()
        results.append((out, draft.fc.weight.grad.clone()))
    (a, grad_a), (b, grad_b) = results
    assert a.valid.tolist() == b.valid.tolist() and a.valid[-1] > 0
    assert a.correct.tolist() == b.correct.tolist()
    torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-4, atol=1e-6)
