"""Generation replicas (``--replicas N``): real transformers engines in spawned worker
processes on the CPU, on a tiny random Llama with the real SmolLM2 tokenizer."""

import json
import multiprocessing as mp
import os
import signal

import pytest

from models import generation
from tests.fixtures.tiny_generator import save_tiny_generator
from tests.trainer.test_data_regenerate import CONVS, first_prompts, open_tiny
from trainer import regenerate as R
from trainer.datagen import gen_backend as G
from trainer.datagen.replicas import ReplicatedBackend, kv_bytes_per_token, open_generator, replica_settings

SETTINGS = generation.GenerationSettings(max_new_tokens=5, batch_size=2)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny_generator(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="module")
def replicated(tiny_target):
    backend = open_generator(G.GeneratorSettings(target=str(tiny_target), device="cpu", dtype="float32", replicas=2))
    yield backend
    backend.close()


def test_each_replica_gets_one_engine_and_its_own_seed():
    settings = G.GeneratorSettings(name="sglang", mem_fraction_static=0.8, replicas=4, seed=7, sglang_args=(("max_total_tokens", 1000),))
    for k in range(4):
        r = replica_settings(settings, k)
        assert (r.replicas, r.seed, r.name, r.mem_fraction_static, r.sglang_args) == (1, 7 + k, "sglang", 0.8, settings.sglang_args)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, 16-bit: 23,040 bytes a token
    assert kv_bytes_per_token({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}) == 23040
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        G.GeneratorSettings(replicas=0)
    with pytest.raises(ValueError, match="resolved by fit_generator"):
        open_generator(G.GeneratorSettings(replicas=None))


def test_replicas_give_one_engines_greedy_replies_in_prompt_order(replicated, tiny_target):
    one = open_tiny(tiny_target)
    prompts = [G.chat_ids(one.tokenizer, p) for p in first_prompts()]
    assert replicated.name == "hf" and replicated.stop_ids == one.stop_ids and len(replicated.procs) == 2
    assert replicated.generate(prompts, SETTINGS, 0) == one.generate(prompts, SETTINGS, 0)
    assert replicated.generate(prompts[:1], SETTINGS, 0) == one.generate(prompts[:1], SETTINGS, 0)  # replica 1 idle
    assert replicated.generate([], SETTINGS, 0) == []


def test_regenerate_with_replicas_writes_what_one_engine_writes(replicated, tiny_target, tmp_path):
    settings = R.GenerationSettings(max_new_tokens=4, batch_size=4)
    one = R.regenerate(CONVS, open_tiny(tiny_target), tmp_path / "one.jsonl", settings, {}, progress=False)
    two = R.regenerate(CONVS, replicated, tmp_path / "two.jsonl", settings, {}, progress=False)
    assert one.written == two.written == len(CONVS) and one.new_tokens == two.new_tokens

    def records(name):
        return [json.loads(line) for line in (tmp_path / name).read_text().split("\n") if line]

    assert records("one.jsonl") == records("two.jsonl")


def test_the_command_line_asks_for_replicas_and_scales_the_default_call():
    args = R._parser().parse_args(["--output", "o.jsonl", "--device", "cpu", "--replicas", "3"])
    generator, batch = R.sized_generator(args)
    assert (generator.replicas, batch) == (3, 3 * G.default_batch_size("hf", "cpu"))
    given = R._parser().parse_args(["--output", "o.jsonl", "--device", "cpu", "--replicas", "3", "--batch-size", "5"])
    assert R.sized_generator(given)[1] == 5
    auto = R._parser().parse_args(["--output", "o.jsonl", "--device", "cpu", "--replicas", "auto"])
    assert R.generator_of(auto).replicas is None and R.sized_generator(auto)[0].replicas == 1  # transformers: one


def test_a_failed_generation_names_the_replica_and_the_others_stay_usable(replicated):
    outside = len(replicated.tokenizer) + 10**6  # a token id no embedding row has
    with pytest.raises(RuntimeError, match=r"replica 0 of 2 failed:\n(.|\n)*IndexError"):
        replicated.generate([[1, outside], [2, outside]], SETTINGS, 0)
    prompts = [[1, 2, 3], [4, 5, 6]]
    assert [r.new_tokens for r in replicated.generate(prompts, SETTINGS, 0)] == [5, 5]


def test_a_replica_that_cannot_start_is_reported_and_nothing_is_left_running(tiny_target):
    before = set(mp.active_children())
    with pytest.raises(RuntimeError, match=r"replica 0 of 2 failed:\n(.|\n)*no_such_device"):
        ReplicatedBackend(G.GeneratorSettings(target=str(tiny_target), device="no_such_device", replicas=2))
    assert set(mp.active_children()) == before


def test_a_replica_that_dies_is_named_with_its_exit_code(replicated):
    """Last in the file: it kills one of the module's replicas."""
    os.kill(replicated.procs[1].pid, signal.SIGKILL)
    replicated.procs[1].join()
    with pytest.raises(RuntimeError, match=f"replica 1 of 2 died \\(exit code {-signal.SIGKILL}\\)"):
        replicated.generate([[1, 2], [3, 4]], SETTINGS, 0)
    assert [r.new_tokens for r in replicated.generate([[1, 2]], SETTINGS, 0)] == [5]  # replica 0 still answers
    replicated.close()
    assert replicated.procs == [] and not any(p.name.startswith("replica-") for p in mp.active_children())
