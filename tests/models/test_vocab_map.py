"""The draft vocab map: build from counts, every invariant (d2t offsets increasing and in range, t2d agrees), save/load."""

import pytest
import torch
from safetensors.torch import save_file

from models.vocab_map import VocabMap, build_vocab_map, count_tokens


def _map(target_ids: list[int], v_t: int) -> VocabMap:
    """A map over the given ascending target ids, with a t2d that agrees with it."""
    ids = torch.tensor(target_ids, dtype=torch.long)
    t2d = torch.zeros(v_t, dtype=torch.bool)
    t2d[ids] = True
    return VocabMap(ids - torch.arange(len(ids)), t2d)


def test_build_takes_most_frequent_ascending():
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 3, 0, 2, 8])
    m = build_vocab_map(counts, 4)
    assert m.draft_to_target.tolist() == [1, 3, 5, 9]  # counts 5, 9, 7, 8
    assert m.d2t.tolist() == [1, 2, 3, 6]
    assert m.t2d.nonzero().flatten().tolist() == [1, 3, 5, 9]
    assert m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool
    assert (m.draft_vocab_size, m.target_vocab_size) == (4, 10)


def test_build_breaks_ties_by_lower_id():
    counts = torch.tensor([1, 4, 2, 4, 4, 2, 0])
    assert build_vocab_map(counts, 2).draft_to_target.tolist() == [1, 3]
    assert build_vocab_map(counts, 4).draft_to_target.tolist() == [1, 2, 3, 4]


def test_build_fills_up_with_unseen_tokens_by_lower_id():
    counts = torch.tensor([0, 0, 3, 0, 1, 0, 0, 0])  # 2 distinct tokens seen
    m = build_vocab_map(counts, 5)
    assert m.draft_to_target.tolist() == [0, 1, 2, 3, 4]  # 2 and 4, then unseen 0, 1, 3
    assert build_vocab_map(counts, 1).draft_to_target.tolist() == [2]


def test_build_caps_at_target_vocab():
    counts = torch.tensor([3, 1, 2])
    m = build_vocab_map(counts, 32000)
    assert m.draft_vocab_size == 3
    assert m.d2t.tolist() == [0, 0, 0] and bool(m.t2d.all())


def test_build_large_random_passes_invariants_and_counts_check():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (5000,), generator=g)
    m = build_vocab_map(counts, 700)
    m.validate("again", counts=counts)
    ids = m.draft_to_target
    assert counts[ids].min() >= counts[~m.t2d].max()


def test_build_rejects_bad_inputs():
    with pytest.raises(ValueError, match="integer"):
        build_vocab_map(torch.rand(10), 3)
    with pytest.raises(ValueError, match="non-negative"):
        build_vocab_map(torch.tensor([1, -1, 2]), 2)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(torch.tensor([1, 2]), 0)


def test_identity_prefix_map_is_legitimate():
    # Byte-level BPE: ids 0..19 are punctuation and digits, hot in any corpus, so a correct
    # map can start with 20+ zero offsets. t2d (from the counts) agrees: accepted.
    counts = torch.zeros(1000, dtype=torch.long)
    counts[:25] = 100
    counts[[40, 77, 300, 999]] = 50
    m = build_vocab_map(counts, 29)
    assert m.d2t[:25].tolist() == [0] * 25
    assert m.draft_to_target[25:].tolist() == [40, 77, 300, 999]
    VocabMap(m.d2t.clone(), m.t2d.clone()).validate("identity prefix map")


def test_zeroed_prefix_is_refused():
    # The field failure: correct t2d from the counts, d2t's first 20 offsets zeroed.
    real = _map(list(range(100, 150)), 1000)
    corrupt = VocabMap(real.d2t.clone(), real.t2d.clone())
    corrupt.d2t[:20] = 0
    with pytest.raises(ValueError, match=r"field map: corrupt vocab map: the first 20 d2t entries are all zero"):
        corrupt.validate("field map")
    small = _map([3, 5, 8], 10)
    small.d2t[:] = 0  # V_d < 20: the whole d2t is the prefix
    with pytest.raises(ValueError, match="first 3 d2t entries are all zero"):
        small.validate("small map")


def test_self_consistent_zeroed_map_is_refused_given_counts():
    # A t2d derived from the corrupt d2t passes the structural checks; the counts refuse it.
    counts = torch.zeros(1000, dtype=torch.long)
    counts[100:150] = 10
    corrupt = _map(list(range(20)) + list(range(120, 150)), 1000)
    corrupt.validate("structurally fine")
    with pytest.raises(ValueError, match="not the most frequent tokens"):
        corrupt.validate("cached map", counts=counts)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: setattr(m, "d2t", m.d2t.int()), "d2t must be a 1-D int64 tensor"),
        (lambda m: setattr(m, "d2t", m.d2t[None]), "d2t must be a 1-D int64 tensor"),
        (lambda m: setattr(m, "t2d", m.t2d.long()), "t2d must be a 1-D bool tensor"),
        (lambda m: m.d2t.__setitem__(2, m.d2t[1] - 1), "strictly increasing; draft id 2"),
        (lambda m: m.d2t.__setitem__(4, 10**6), r"\[0, 1000\); draft id 4"),
        (lambda m: m.d2t.__setitem__(0, -1), r"\[0, 1000\); draft id 0"),
        (lambda m: m.t2d.__setitem__(999, True), "t2d.sum\\(\\) must equal the draft vocab size 30, got 31"),
        (lambda m: m.t2d.__setitem__(130, False), "t2d.sum\\(\\) must equal the draft vocab size 30, got 29"),
        (lambda m: (m.t2d.__setitem__(130, False), m.t2d.__setitem__(999, True)), "t2d disagrees with d2t: draft id 10"),
        (lambda m: setattr(m, "t2d", torch.ones(10, dtype=torch.bool)), "larger than the target vocab"),
        (lambda m: setattr(m, "d2t", m.d2t[:0]), "d2t is empty"),
    ],
)
def test_each_corruption_is_refused(mutate, message):
    m = _map(list(range(120, 150)), 1000)
    m.validate("ok")
    mutate(m)
    with pytest.raises(ValueError, match=f"^/some/map.safetensors: .*{message}"):
        m.validate("/some/map.safetensors")


def test_count_tokens_counts_loss_masked_tokens():
    ids = torch.tensor([[1, 2, 3, 0], [2, 2, 5, 4]])
    mask = torch.tensor([[False, True, True, False], [True, True, False, True]])
    counts = count_tokens([(ids, mask), (ids[:1], mask[:1])], 6)
    assert counts.tolist() == [0, 0, 4, 2, 1, 0]
    assert counts.dtype == torch.long

    class Batch:  # a TokenBatch-like object
        input_ids, loss_mask = ids, mask

    assert count_tokens([Batch()], 6).tolist() == [0, 0, 3, 1, 1, 0]
    with pytest.raises(ValueError, match="outside the target vocab"):
        count_tokens([(ids, mask)], 4)  # masked id 4; the unmasked 5 is not looked at
    with pytest.raises(ValueError, match="differ in shape"):
        count_tokens([(ids, mask[:1])], 6)


def test_save_load_round_trip(tmp_path):
    m = build_vocab_map(torch.randint(0, 9, (500,), generator=torch.Generator().manual_seed(1)), 64)
    path = m.save(tmp_path / "sub" / "vocab.safetensors")
    back = VocabMap.load(path)
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back.t2d, m.t2d)
    assert back.d2t.dtype == torch.int64 and back.t2d.dtype == torch.bool
    assert [p.name for p in path.parent.iterdir()] == ["vocab.safetensors"]  # no temp file left


def test_save_refuses_corrupt_map_naming_the_file(tmp_path):
    m = _map(list(range(100, 150)), 1000)
    m.d2t[:20] = 0
    path = tmp_path / "bad.safetensors"
    with pytest.raises(ValueError, match=f"{path}: corrupt vocab map"):
        m.save(path)
    assert not path.exists()


def test_load_names_file_and_key(tmp_path):
    good = _map(list(range(100, 150)), 1000)
    missing = tmp_path / "missing.safetensors"
    save_file({"d2t": good.d2t}, str(missing))
    with pytest.raises(ValueError, match=rf"{missing}: .*\['t2d'\]"):
        VocabMap.load(missing)

    extra = tmp_path / "extra.safetensors"
    save_file({"d2t": good.d2t, "t2d": good.t2d, "counts": torch.zeros(3)}, str(extra))
    with pytest.raises(ValueError, match=rf"{extra}: .*unexpected .*\['counts'\]"):
        VocabMap.load(extra)

    corrupt = tmp_path / "corrupt.safetensors"
    d2t = good.d2t.clone()
    d2t[:20] = 0
    save_file({"d2t": d2t, "t2d": good.t2d}, str(corrupt))
    with pytest.raises(ValueError, match=f"{corrupt}: corrupt vocab map: the first 20 d2t"):
        VocabMap.load(corrupt)

    wrong_dtype = tmp_path / "int32.safetensors"
    save_file({"d2t": good.d2t.int(), "t2d": good.t2d}, str(wrong_dtype))
    with pytest.raises(ValueError, match=f"{wrong_dtype}: d2t must be a 1-D int64"):
        VocabMap.load(wrong_dtype)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=f"{garbage}: not a readable safetensors"):
        VocabMap.load(garbage)
    with pytest.raises(ValueError, match="does not exist"):
        VocabMap.load(tmp_path / "nope.safetensors")


def test_the_trainers_map_counts_every_samples_masked_tokens_once():
    from trainer.build import vocab_map
    from trainer.data import EncodedSample

    g = torch.Generator().manual_seed(4)
    samples = []
    for n in (5, 1, 17, 9):
        ids = torch.randint(0, 40, (n,), generator=g).tolist()
        samples.append(EncodedSample(ids, (torch.rand(n, generator=g) < 0.6).tolist()))
    per_sample = count_tokens(((torch.tensor(s.input_ids), torch.tensor(s.loss_mask)) for s in samples), 40)
    built = vocab_map(samples, 40, 12)
    expected = build_vocab_map(per_sample, 12)
    assert torch.equal(built.d2t, expected.d2t) and torch.equal(built.t2d, expected.t2d)
    with pytest.raises(ValueError, match="token id 40 is outside the target vocab"):
        vocab_map([EncodedSample([3, 40], [True, True])], 40, 12)
