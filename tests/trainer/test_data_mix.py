"""Weighted mixes: epoch composition, proportions, determinism, rank sharding, resume position."""

import collections
import random

import pytest
import torch

from trainer.data import EncodedSample, Mix, MixLoader, PaddedBatcher

SIZES = {"sharegpt": 1000, "ultrachat": 300}
WEIGHTS = {"sharegpt": 0.3, "ultrachat": 0.7}


def _sources(sizes=SIZES, seed=0):
    """Sample i of source s carries the id (s, i) in its first two tokens; lengths vary."""
    rng = random.Random(seed)
    out = {}
    for s, (name, n) in enumerate(sizes.items()):
        lengths = [rng.choice([rng.randint(4, 40), rng.randint(40, 200)]) for _ in range(n)]
        out[name] = [EncodedSample([s + 1, i + 1] + [7] * (k - 2), [False, False] + [True] * (k - 2)) for i, k in enumerate(lengths)]
    return out


def _ids(batches):
    """(source index, sample index) of every row, in batch order."""
    return [(int(row[0]) - 1, int(row[1]) - 1) for b in batches for row in b.input_ids]


def test_quotas_are_exact_and_sum_to_the_epoch():
    mix = Mix(SIZES, WEIGHTS, seed=0, epoch_samples=4000)
    assert mix.quotas == (1200, 2800)
    for epoch in range(3):
        counts = collections.Counter(s for s, _ in mix.epoch(epoch))
        assert (counts[0], counts[1]) == (1200, 2800)
    assert Mix(SIZES, {"sharegpt": 1, "ultrachat": 1}, seed=0, epoch_samples=7).quotas == (4, 3)  # largest remainder
    assert Mix(SIZES, WEIGHTS, seed=0).epoch_samples == 1300  # default: the sources' total


def test_proportions_hold_over_every_stretch_of_the_epoch():
    refs = Mix(SIZES, WEIGHTS, seed=0, epoch_samples=4000).epoch(0)
    for start in range(0, 4000, 1000):
        share = sum(s == 1 for s, _ in refs[start : start + 1000]) / 1000
        assert abs(share - 0.7) < 0.05, (start, share)


def test_down_weighted_source_shows_new_samples_each_epoch():
    mix = Mix(SIZES, WEIGHTS, seed=0, epoch_samples=1000)  # sharegpt: 300 of its 1000 a epoch
    seen = [[i for s, i in mix.epoch(e) if s == 0] for e in range(4)]
    assert all(len(ids) == 300 for ids in seen)
    assert len(set(seen[0]) | set(seen[1]) | set(seen[2])) == 900  # no repeat before the pass ends
    assert set(range(1000)) - set(seen[0] + seen[1] + seen[2]) <= set(seen[3])  # epoch 3 ends pass 0, starts pass 1


def test_up_weighted_source_repeats_whole_passes():
    counts = collections.Counter(i for s, i in Mix(SIZES, WEIGHTS, seed=0, epoch_samples=4000).epoch(0) if s == 1)
    assert set(counts.values()) <= {9, 10} and len(counts) == 300  # 2800 draws over 300 samples


def test_no_weights_is_each_sample_once():
    mix = Mix(SIZES, None, seed=0)
    for epoch in range(2):
        refs = mix.epoch(epoch)
        assert sorted(refs) == [(s, i) for s, n in enumerate(SIZES.values()) for i in range(n)]


def test_seeded_and_deterministic():
    a, b = Mix(SIZES, WEIGHTS, seed=0), Mix(SIZES, WEIGHTS, seed=0)
    assert a.epoch(1) == b.epoch(1)
    assert a.epoch(0) != a.epoch(1) and a.epoch(0) != Mix(SIZES, WEIGHTS, seed=1).epoch(0)


@pytest.mark.parametrize(
    "weights, message",
    [
        ({}, "data.mix is empty"),
        ({"web": 1.0}, "unknown source"),
        ({"sharegpt": 0.0}, "positive"),
        ({"sharegpt": float("nan")}, "positive"),
        ({"sharegpt": True}, "positive"),
    ],
)
def test_bad_mixes(weights, message):
    with pytest.raises(ValueError, match=message):
        Mix(SIZES, weights, seed=0)


def test_empty_source_or_no_sources():
    with pytest.raises(ValueError, match="no training samples"):
        Mix({"a": 0, "b": 5}, {"a": 1, "b": 1}, seed=0)
    with pytest.raises(ValueError, match="no sources"):
        Mix({}, None, seed=0)


# --------------------------------------------------------------------------- loader


def _loader(rank=0, world=1, seed=0, sources=None, max_tokens=1024, epoch_samples=4000):
    sources = sources or _sources()
    mix = Mix({n: len(v) for n, v in sources.items()}, WEIGHTS, seed=seed, epoch_samples=epoch_samples)
    return MixLoader(sources, mix, PaddedBatcher(max_tokens=max_tokens, pad_id=0), rank, world)


def test_loader_epoch_is_the_mix_epoch_batched():
    loader = _loader()
    batches = list(loader.epoch_batches(0))
    assert len(batches) == loader.batches_per_rank(0)
    assert sorted(_ids(batches)) == sorted(loader.mix.epoch(0))
    assert all(b.input_ids.numel() <= 1024 or b.input_ids.shape[0] == 1 for b in batches)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["offset"] == 0
    assert [len(s.input_ids) for s in loader.epoch_samples(0)] == [len(loader._sample(r).input_ids) for r in loader.mix.epoch(0)]


def test_ranks_are_disjoint_in_lockstep_and_cover_the_epoch():
    whole = list(_loader().epoch_batches(0))
    shards = [list(_loader(rank=r, world=2).epoch_batches(0)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(whole) // 2
    # the same batches, dealt round-robin: rank r gets batches r, r + 2, ...
    assert [_ids([b]) for b in shards[0]] == [_ids([b]) for b in whole[0 : 2 * len(shards[0]) : 2]]
    assert [_ids([b]) for b in shards[1]] == [_ids([b]) for b in whole[1 : 2 * len(shards[1]) : 2]]


def test_too_few_batches_for_the_ranks():
    sources = _sources({"sharegpt": 3, "ultrachat": 3})
    with pytest.raises(ValueError, match="batch.*for 2 ranks"):
        next(_loader(rank=0, world=2, sources=sources, max_tokens=100_000, epoch_samples=6).epoch_batches(0))


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask) for x, y in zip(a, b))


@pytest.mark.parametrize("stop_at", [0, 1, 17])
def test_resume_continues_at_the_same_sample(stop_at):
    reference = _loader()
    ref = [list(reference.epoch_batches(e)) for e in range(2)]
    first = _loader()
    it = first.epoch_batches(0)
    taken = [next(it) for _ in range(stop_at)]
    state = first.state_dict()
    assert state["offset"] == stop_at and state["epoch"] == 0
    assert first.state_for(0, stop_at) == state  # what a read-ahead consumer saves for the same position

    resumed = _loader()  # a new process: same data, same config
    resumed.load_state_dict(state)
    rest = list(resumed.epoch_batches(resumed.epoch))
    assert _same(taken + rest, ref[0])
    assert _same(list(resumed.epoch_batches(1)), ref[1])


def test_resume_at_an_epoch_boundary_and_onto_another_world_size():
    loader = _loader(rank=0, world=2)
    list(loader.epoch_batches(0))
    state = loader.state_dict()
    assert (state["epoch"], state["offset"], state["world"]) == (1, 0, 2)
    it = loader.epoch_batches(1)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    assert state["offset"] == 10  # groups over all ranks
    single = _loader()
    single.load_state_dict(state)  # one rank takes over what two ranks left
    rest = list(single.epoch_batches(single.epoch))
    full = list(_loader().epoch_batches(1))
    assert _same(rest, full[10:])


def test_resume_onto_different_data_is_refused():
    state = _loader().state_dict()
    for other in (_loader(seed=1), _loader(max_tokens=2048), _loader(sources=_sources(seed=3))):
        with pytest.raises(ValueError, match="fingerprint"):
            other.load_state_dict(state)
    lenient = _loader(seed=1)
    lenient.load_state_dict(dict(state, epoch=2, offset=4), strict=False)
    assert (lenient.epoch, lenient.offset) == (2, 4)
    with pytest.raises(ValueError, match="version"):
        lenient.load_state_dict(dict(state, version=0))
    with pytest.raises(ValueError, match="epoch and offset"):
        lenient.load_state_dict(dict(state, offset=-1))
