"""The feature stream: ring slots, the co-located engine process, and its failure paths.

A real (tiny, saved) transformers target serves the equivalence, release, backpressure and
no-disk tests from one engine process; the lifecycle tests use ``ToyTarget``
(``tests.fixtures.toy_target``), a pure-torch stand-in whose engine process starts without importing
transformers or pytest.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from models.backends.hf.target import PathTarget
from models.batch import FeatureBatch, TokenBatch
from tests.fixtures.tiny import TINY_DRAFT
from tests.fixtures.toy_target import VOCAB, ToyTarget, make_batches
from trainer.data import EncodedSample, PackedBatcher
from trainer.stream.engine_process import TARGET_BUILT, EngineError, EngineStats, PackedTokens, Submit, _EngineLoop
from trainer.stream.feature_ring import RingSpec, allocate_ring
from trainer.stream.feature_stream import ColocatedStream, InProcessStream, TargetSource, open_feature_stream

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here and (inherited at spawn) in every engine process: two processes
    of tiny ops on a shared 2-core machine only contend with more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def toy_features(tokens: TokenBatch) -> FeatureBatch:
    return ToyTarget().build(torch.device("cpu")).features(tokens)


@dataclass
class Settings:
    """The engine config fields a stream reads (``trainer.config.EngineConfig`` has them too)."""

    mode: str
    slots: int = 2
    slot_tokens: int | None = 64
    start_timeout_s: float = 120.0
    wait_timeout_s: float = 120.0


COLOCATED = Settings("colocated")
INPROCESS = Settings("inprocess")


def clone(fb: FeatureBatch) -> FeatureBatch:
    t = fb.tokens
    doc_ids = t.doc_ids.clone() if t.doc_ids is not None else None
    tokens = TokenBatch(t.input_ids.clone(), t.loss_mask.clone(), t.lengths.clone(), doc_ids)
    return FeatureBatch(tokens, fb.aux.clone(), fb.final.clone())


def assert_same(a: FeatureBatch, b: FeatureBatch) -> None:
    for x, y in (
        (a.aux, b.aux),
        (a.final, b.final),
        (a.tokens.input_ids, b.tokens.input_ids),
        (a.tokens.loss_mask, b.tokens.loss_mask),
        (a.tokens.lengths, b.tokens.lengths),
    ):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert (a.tokens.doc_ids is None) == (b.tokens.doc_ids is None)
    assert a.tokens.doc_ids is None or torch.equal(a.tokens.doc_ids, b.tokens.doc_ids)


def packed_batches(n: int) -> list[TokenBatch]:
    """``n`` packed batches: 2 rows of at most 32 tokens, several documents a row."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 16, (8 * n,), generator=g).tolist()
    docs = [EncodedSample(torch.randint(1, VOCAB, (m,), generator=g).tolist(), [True] * m) for m in lengths]
    batcher = PackedBatcher(max_tokens=64, row_tokens=32, pad_id=0)
    return [batcher.collate([docs[i] for i in group]) for group in batcher.plan(lengths, random.Random(0))[:n]]


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def io_counters(pids: list[int]) -> tuple[int, int]:
    """Summed (write_bytes, wchar) of ``pids``: bytes sent to storage, bytes passed to write() (pipes too)."""
    disk = chars = 0
    for pid in pids:
        values = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        disk, chars = disk + int(values["write_bytes"]), chars + int(values["wchar"])
    return disk, chars


# --------------------------------------------------------------------------- the ring


def test_ring_spec_refuses_bad_sizes():
    with pytest.raises(ValueError, match="at least 2 slots"):
        RingSpec(slots=1, tokens=8, aux_width=6, hidden=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="floating point"):
        RingSpec(slots=2, tokens=8, aux_width=6, hidden=2, dtype=torch.long)
    with pytest.raises(ValueError, match="cuda or cpu"):
        allocate_ring(RingSpec(slots=2, tokens=8, aux_width=6, hidden=2, dtype=torch.float32), torch.device("meta"))


def test_slot_round_trip_in_shared_memory():
    spec = RingSpec(slots=2, tokens=64, aux_width=24, hidden=8, dtype=torch.float32)
    ring = allocate_ring(spec, torch.device("cpu"))
    assert all(t.is_shared() for s in ring for t in (s.aux, s.final, s.input_ids, s.loss_mask, s.lengths))
    for tokens in make_batches(2):
        fb = toy_features(tokens)
        b, t = ring[1].write(fb)
        assert_same(ring[1].view(b, t, False), fb)
        assert ring[1].view(b, t, False).aux.data_ptr() == ring[1].aux.data_ptr()  # a view, not a copy
    too_big = make_batches(1)[0]
    too_big = TokenBatch(too_big.input_ids.repeat(3, 1), too_big.loss_mask.repeat(3, 1), too_big.lengths.repeat(3))
    with pytest.raises(ValueError, match="does not fit a feature ring slot of 64 tokens: raise engine.slot_tokens"):
        ring[0].write(toy_features(too_big))
    with pytest.raises(ValueError, match="do not match the ring"):
        allocate_ring(RingSpec(2, 64, 12, 8, torch.float32), torch.device("cpu"))[0].write(toy_features(make_batches(1)[0]))


# --------------------------------------------------------------------------- a real tiny target, one engine process


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("target") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_source(target_dir):
    """A TargetSource whose engine process (2 slots of 64 tokens) serves every test of the module."""
    source = TargetSource(PathTarget(str(target_dir)))
    yield source
    process = source.process
    source.close()
    assert process is None or wait_gone(process.pid, 5.0), "closing the source must stop its engine process"


@pytest.fixture(scope="module")
def reference(hf_source) -> list[FeatureBatch]:
    """In-process features of ``make_batches(6)``."""
    with open_feature_stream(INPROCESS, hf_source, make_batches(6), "cpu") as stream:
        assert isinstance(stream, InProcessStream)
        return [clone(fb) for fb in stream]


def test_colocated_equals_inprocess_bitwise(hf_source, reference):
    with open_feature_stream(COLOCATED, hf_source, make_batches(6), "cpu") as stream:
        assert isinstance(stream, ColocatedStream)
        got = [clone(fb) for fb in stream]
    assert len(got) == len(reference) == 6
    for a, b in zip(got, reference):
        assert_same(a, b)
    process = hf_source.process
    assert process.pid != os.getpid() and process.alive
    assert stream.stats.batches == 6 and stream.stats.tokens == sum(b.input_ids.numel() for b in make_batches(6))
    assert process.info.aux_layer_ids == (1, 3, 4) and process.spec.aux_width == 3 * 64


def test_packed_batches_colocated_equal_inprocess(hf_source):
    """The ring carries a packed batch's doc ids; a padded batch after it reads none."""
    batches = packed_batches(4)
    assert all(int(b.doc_ids.max()) > 0 for b in batches)
    with open_feature_stream(INPROCESS, hf_source, batches, "cpu") as stream:
        reference = [clone(fb) for fb in stream]
    with open_feature_stream(COLOCATED, hf_source, [*batches, make_batches(1)[0]], "cpu") as stream:
        got = [clone(fb) for fb in stream]
    for a, b in zip(got, reference):
        assert_same(a, b)
    assert len(got) == 5 and got[-1].tokens.doc_ids is None


def test_losses_equal_over_steps(hf_source):
    """inprocess and colocated give identical TTT losses for the same seed over N optimizer steps."""
    from models.draft import Eagle3Draft
    from trainer.ttt import TargetLabeler, TTTObjective

    lm_head = hf_source.inprocess("cpu").lm_head_weight
    draft_ids = torch.arange(0, VOCAB, 2)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    shape = replace(TINY_DRAFT, target_hidden_size=64, vocab_size=VOCAB, draft_vocab_size=len(draft_ids))

    def losses(mode: Settings) -> list[float]:
        torch.manual_seed(7)
        objective = TTTObjective(Eagle3Draft(shape), 2, 0.8, False)
        opt = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        out = []
        with open_feature_stream(mode, hf_source, make_batches(3, seed=3), "cpu") as stream:
            for fb in stream:
                loss = objective(TargetLabeler(lm_head, draft_ids, t2d).input_for(fb)).loss
                loss.backward()  # reads the slot's aux again (fc's weight gradient): the slot is still held
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
        return out

    inprocess, colocated = losses(INPROCESS), losses(COLOCATED)
    assert len(inprocess) == 3 and inprocess == colocated
    assert inprocess[-1] < inprocess[0]  # the draft learns something: the features are not garbage


def test_slot_is_reused_only_after_release(hf_source, reference):
    """Backpressure: with 2 slots and the trainer holding one, the engine fills the other and
    waits; the held batch stays intact however long the trainer keeps it."""
    process = hf_source.colocated(COLOCATED, "cpu")
    with open_feature_stream(COLOCATED, hf_source, make_batches(6), "cpu") as stream:
        start = process.stats()
        first = next(stream)
        deadline = time.monotonic() + 30
        while process.stats().full_waits == start.full_waits and time.monotonic() < deadline:
            time.sleep(0.02)  # until the engine has work but no free slot
        stats = process.stats()
        assert stats.full_waits > start.full_waits, "the engine never waited for a free slot"
        assert stats.batches - start.batches == 2  # one held by the trainer, one ready: no more
        time.sleep(0.3)
        assert process.stats().batches - start.batches == 2
        assert_same(first, reference[0])  # not overwritten while held
        rest = [clone(fb) for fb in stream]  # next() releases; the engine goes on
    for a, b in zip(rest, reference[1:]):
        assert_same(a, b)
    assert process.stats().full_wait_s > start.full_wait_s


def test_early_close_and_abandoned_streams_leave_the_engine_clean(hf_source, reference):
    pid = hf_source.colocated(COLOCATED, "cpu").pid
    with open_feature_stream(COLOCATED, hf_source, make_batches(6), "cpu") as stream:
        next(stream)  # then leave with batches made, in flight and never sent
    abandoned = open_feature_stream(COLOCATED, hf_source, make_batches(6), "cpu")
    next(abandoned)  # never closed: the next stream closes it
    with open_feature_stream(COLOCATED, hf_source, make_batches(6), "cpu") as stream:
        got = [clone(fb) for fb in stream]
    assert next(abandoned, None) is None
    assert len(got) == 6
    for a, b in zip(got, reference):
        assert_same(a, b)
    assert hf_source.process.pid == pid  # one engine process served every stream


def test_close_after_the_engine_made_every_batch_leaves_no_message_behind(hf_source, reference):
    """A stream closed when the engine has already made all its outstanding batches: the engine
    still answers the cancel (with no seqs), and that answer must not reach the next stream."""
    process = hf_source.colocated(COLOCATED, "cpu")
    start = process.stats().batches
    with open_feature_stream(COLOCATED, hf_source, make_batches(2), "cpu") as stream:
        next(stream)
        deadline = time.monotonic() + 30
        while process.stats().batches - start < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # until the second batch is made: nothing is left to cancel
        assert process.stats().batches - start == 2
    with open_feature_stream(COLOCATED, hf_source, make_batches(1), "cpu") as stream:
        assert_same(next(stream), reference[0])


def test_the_engine_counts_a_batch_before_it_announces_it():
    """A trainer holding a Ready reads stats that count its batch: the count the test above starts from."""
    engine = ToyTarget().build(torch.device("cpu"))
    seen = []

    class Outbox:
        def put(self, msg):
            seen.append((type(msg).__name__, EngineStats.read(stats).batches))

    stats = EngineStats.shared_tensor()
    loop = _EngineLoop(engine, None, Outbox(), stats, torch.device("cpu"), os.getpid())
    loop.ring = allocate_ring(RingSpec(slots=2, tokens=64, aux_width=3 * 8, hidden=8, dtype=torch.float32), "cpu")
    for seq, tokens in enumerate(make_batches(2)):
        loop._produce(Submit(0, seq, PackedTokens.of(tokens)), seq)
    assert seen == [("Ready", 1.0), ("Ready", 2.0)]


def test_oversized_batch_is_refused_in_the_trainer(hf_source, reference):
    big = make_batches(1)[0]
    big = TokenBatch(big.input_ids.repeat(4, 1), big.loss_mask.repeat(4, 1), big.lengths.repeat(4))  # 8 x 24
    with pytest.raises(ValueError, match=r"8 x 24 = 192 tokens does not fit .* 64 tokens"):
        with open_feature_stream(COLOCATED, hf_source, [big], "cpu") as stream:
            next(stream)
    with open_feature_stream(COLOCATED, hf_source, make_batches(1), "cpu") as stream:
        assert_same(next(stream), reference[0])  # the engine is unharmed


def test_source_refuses_a_different_ring_while_running(hf_source):
    hf_source.colocated(COLOCATED, "cpu")
    with pytest.raises(ValueError, match="close the source first"):
        hf_source.colocated(Settings("colocated", slots=3), "cpu")
    with pytest.raises(ValueError, match="engine.slot_tokens"):
        hf_source.colocated(Settings("colocated", slot_tokens=None), "cpu")
    with pytest.raises(ValueError, match="unknown mode 'nearby'"):
        open_feature_stream(Settings("nearby"), hf_source, [], "cpu")


def test_no_feature_bytes_reach_the_disk_or_a_pipe(hf_source, tmp_path):
    """Trainer and engine together write (to storage) and pipe far less than one batch of features.

    ``write_bytes`` in /proc/<pid>/io counts what a process sends to storage, wherever it
    writes (not tmpfs: /dev/shm, where the CPU ring lives, is memory); ``wchar`` counts every
    write() including the queues' pipes. A control shows that saving the same features to
    a file is seen.
    """
    process = hf_source.colocated(COLOCATED, "cpu")
    with open_feature_stream(COLOCATED, hf_source, make_batches(1), "cpu") as stream:
        list(stream)  # warm: first-use imports and caches
    pids = [os.getpid(), process.pid]
    disk0, chars0 = io_counters(pids)
    feature_bytes, kept = 0, []
    with open_feature_stream(COLOCATED, hf_source, make_batches(6), "cpu") as stream:
        for fb in stream:
            feature_bytes += fb.aux.nbytes + fb.final.nbytes
            kept.append(clone(fb))
    disk1, chars1 = io_counters(pids)
    assert feature_bytes > 150_000
    assert disk1 - disk0 < feature_bytes / 20, f"{disk1 - disk0} bytes went to storage"
    assert chars1 - chars0 < feature_bytes / 4, f"{chars1 - chars0} bytes went through write() (pipes, files)"

    before, _ = io_counters([os.getpid()])
    with open(tmp_path / "features.pt", "wb") as f:  # the control: features that do go to disk
        torch.save([(fb.aux, fb.final) for fb in kept], f)
        f.flush()
        os.fsync(f.fileno())
    after, _ = io_counters([os.getpid()])
    if after - before < feature_bytes:
        pytest.skip(f"{tmp_path} is not storage-backed here (write_bytes did not count a saved file)")


# --------------------------------------------------------------------------- lifecycle (toy engine)


def test_engine_exception_reaches_the_trainer_with_its_traceback():
    batches = make_batches(4)
    batches[2].input_ids[0, 0] = 7  # the engine raises on this batch
    for b in batches[:2] + batches[3:]:
        b.input_ids[b.input_ids == 7] = 8
    with TargetSource(ToyTarget(fail_on_token=7)) as source:
        got = []
        with pytest.raises(EngineError) as err:
            with open_feature_stream(COLOCATED, source, batches, "cpu") as stream:
                for fb in stream:
                    got.append(clone(fb))
        pid = source.process.pid
        assert len(got) == 2
        message = str(err.value)
        assert "Traceback" in message and "in features" in message and "ValueError: poisoned batch: token 7" in message
        assert wait_gone(pid) and not source.process.alive
        assert next(stream, None) is None


def test_the_engine_logs_the_line_that_launch_scripts_wait_for(caplog):
    """lab/gpu_runs.py starts a second training once the first's engine has logged TARGET_BUILT; faults.py
    tells that line from a fault's message."""
    caplog.set_level(logging.INFO, logger="trainer.stream.engine_process")
    with TargetSource(ToyTarget()) as source:
        with open_feature_stream(COLOCATED, source, make_batches(1), "cpu") as stream:
            next(stream)
        built = [r.getMessage() for r in caplog.records if TARGET_BUILT.match(r.getMessage())]
        assert len(built) == 1 and f"the engine process {source.process.pid} " in built[0]


def test_a_killed_engine_is_an_error_not_a_hang():
    """The death is seen by the trainer's check of the process: a wait that ran out instead would
    say "gave no answer within ... (engine.wait_timeout_s)", after ten minutes."""
    with TargetSource(ToyTarget()) as source:
        with open_feature_stream(COLOCATED, source, make_batches(50), "cpu") as stream:
            next(stream)
            os.kill(source.process.pid, signal.SIGKILL)
            with pytest.raises(EngineError, match="was killed by signal 9") as err:
                for _ in stream:
                    pass
            assert "gave no answer" not in str(err.value)


def test_closing_the_source_mid_stream_stops_the_engine():
    source = TargetSource(ToyTarget())
    stream = open_feature_stream(COLOCATED, source, make_batches(50), "cpu")
    next(stream)
    pid = source.process.pid
    source.close()
    assert wait_gone(pid, 5.0)
    assert next(stream, None) is None  # the stream was closed with its engine


TRAINER_SCRIPT = """
import sys, time
from tests.fixtures.toy_target import VOCAB, ToyTarget, make_batches
from trainer.stream.feature_stream import TargetSource, open_feature_stream
class Settings:
    mode, slots, slot_tokens, start_timeout_s, wait_timeout_s = "colocated", 2, 64, 120.0, 120.0
source = TargetSource(ToyTarget())
stream = open_feature_stream(Settings(), source, make_batches(100), "cpu")
next(stream)
print(source.process.pid, flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the trainer crashed")
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["sigkill", "raise"])
def test_trainer_death_leaves_no_orphan(how):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_SCRIPT, how], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = trainer.stdout.readline()
        assert line.strip().isdigit(), f"trainer script said {line!r}; stderr: {trainer.stderr.read()}"
        engine_pid = int(line)
        assert alive(engine_pid)
        if how == "sigkill":
            trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=60)
        if how == "raise":
            assert trainer.returncode == 1 and "the trainer crashed" in trainer.stderr.read()
        assert wait_gone(engine_pid, 15.0), f"engine {engine_pid} outlived its trainer ({how})"
    finally:
        trainer.kill()
        trainer.wait()


# --------------------------------------------------------------------------- config and benchmark


def test_engine_config_modes():
    from hydra import compose, initialize_config_dir

    from trainer.config import EngineConfig, register_schema, to_config

    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=["engine.mode=colocated", "data.max_tokens=2048"]))
    assert cfg.engine.mode == "colocated" and cfg.engine.slot_tokens == 2048 and cfg.engine.slots >= 2
    with pytest.raises(ValueError, match="engine.mode"):
        EngineConfig(mode="remote")
    with pytest.raises(ValueError, match="engine.slots"):
        EngineConfig(slots=1)
