"""SGLang generation engines sized to the GPU before any starts: the embedded SmolLM2 target on an 80-GB
H100 and a 141-GB H200, by the arithmetic of ``trainer.datagen.gen_memory`` (nothing runs on a GPU)."""

import pytest
import torch

from models.embedded import embedded_target_dir
from models.memory_plan import CONTEXT_BYTES, H200_BYTES
from trainer.datagen import gen_backend as G
from trainer.datagen import gen_memory as M
from trainer.datagen.replicas import fit_generator, gen_target

H100_BYTES = 81_559 * 2**20  # nvidia-smi's total on an 80-GB H100 (HBM3)
# what torch.cuda.mem_get_info can report before any engine starts: at most the card, at least the card less
# the CUDA context of the process asking
CARDS = {"H100": (H100_BYTES - CONTEXT_BYTES, H100_BYTES), "H200": (H200_BYTES - CONTEXT_BYTES, H200_BYTES)}


@pytest.fixture(scope="module")
def smollm2():
    return gen_target(embedded_target_dir())


def plan(free, replicas, target, sampled=True, given=None):
    return M.plan_generation(free, 0.8, replicas, target, sampled, given or {})


def test_the_target_s_sizes_come_from_its_dir(smollm2):
    # 30 layers x 3 KV heads x 64 x keys and values x bf16; SmolLM2's vocab and context; its bf16 weights file
    assert (smollm2.kv_bytes_per_token, smollm2.vocab, smollm2.context) == (23040, 49152, 8192)
    assert smollm2.weight_bytes == (embedded_target_dir() / "model.safetensors").stat().st_size


@pytest.mark.parametrize("free", CARDS["H100"], ids=["after-context", "whole-card"])
def test_four_sampling_engines_are_refused_on_an_h100_and_two_fit(free, smollm2):
    """The recipe's defaults on an H100: four engines' pools left too little for the sampled pass's sampler."""
    with pytest.raises(ValueError) as e:
        plan(free, 4, smollm2)
    text = str(e.value)
    assert text.startswith("--replicas 4 at --mem-fraction-static 0.8: 4 SGLang engine(s) would need about ")
    assert "[4096 running requests x 49152 vocab]" in text and "what fits: --replicas 2 or --mem-fraction-static 0.6" in text
    assert plan(free, 2, smollm2).replicas == 2
    assert plan(free, None, smollm2).replicas == 2  # auto
    assert plan(free, 4, smollm2, sampled=False).replicas == 4  # the greedy pass alone fits
    fraction = float(text.rsplit("--mem-fraction-static ", 1)[1].split()[0])
    assert M.plan_generation(free, fraction, 4, smollm2, True, {}).replicas == 4  # the fraction offered fits


@pytest.mark.parametrize("free", CARDS["H200"], ids=["after-context", "whole-card"])
def test_four_sampling_engines_fit_an_h200(free, smollm2):
    assert plan(free, 4, smollm2).replicas == 4
    assert plan(free, None, smollm2).replicas == M.MOST_REPLICAS == 4
    with pytest.raises(ValueError, match="--replicas 5 at"):
        plan(free, 5, smollm2)


def test_a_replica_s_room_beyond_its_pool_is_weights_context_request_table_and_sampler(smollm2):
    pool = 700_000  # SmolLM2's running requests reach SGLang's 4,096 cap
    requests = M.running_requests(pool, smollm2.context)
    table = (requests + 1) * (smollm2.context + 4) * 4
    sampled = smollm2.weight_bytes + CONTEXT_BYTES + table + 25 * requests * smollm2.vocab
    assert requests == 4096 and M.room_bytes(smollm2, pool, True) == int(sampled)
    assert M.room_bytes(smollm2, pool, False) == int(sampled - 19 * requests * smollm2.vocab)
    assert M.room_bytes(smollm2, pool, True, given_requests=1024) < M.room_bytes(smollm2, pool, True)


def test_running_requests_follow_sglang_s_rule():
    assert M.running_requests(700_000, 8192) == 4096  # the cap
    assert M.running_requests(20_000, 8192) == 2048  # the floor
    assert M.running_requests(3_000, 128) == 1500  # half the pool tokens
    assert M.running_requests(700_000, 8192, given=512) == 512


def test_given_sglang_args_enter_the_arithmetic(smollm2):
    free = CARDS["H100"][0]
    assert plan(free, 4, smollm2, given={"max_running_requests": 1024}).replicas == 4  # a smaller sampler batch
    assert plan(free, 2, smollm2, given={"max_total_tokens": 1000}).pool_tokens == 1000  # a lower pool wins


def test_a_target_too_large_for_the_card_is_refused_without_a_fraction(smollm2):
    huge = M.GenTarget(smollm2.kv_bytes_per_token, smollm2.vocab, smollm2.context, 200 * 10**9)
    with pytest.raises(ValueError, match="no fraction fits one engine on this GPU$"):
        plan(CARDS["H100"][0], None, huge)


def test_fit_generator_sizes_sglang_settings_from_the_memory_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: CARDS["H100"])
    auto = fit_generator(G.GeneratorSettings(name="sglang", replicas=None, sglang_args=(("max_total_tokens", 10**9),)), True)
    pool = M.pool_tokens(CARDS["H100"][0], 0.8, 2, gen_target(embedded_target_dir()))
    assert auto.replicas == 2 and auto.sglang_args == (("max_total_tokens", pool),)
    with pytest.raises(ValueError, match="--replicas 4 at --mem-fraction-static 0.8"):
        fit_generator(G.GeneratorSettings(name="sglang", replicas=4), True)
    assert fit_generator(G.GeneratorSettings(replicas=None), True).replicas == 1  # transformers: one, no GPU asked


def test_a_target_dir_without_weights_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8}')
    with pytest.raises(ValueError, match=f"{tmp_path}: no \\*.safetensors weights"):
        gen_target(tmp_path)
