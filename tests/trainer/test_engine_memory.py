"""SGLang's share of the GPU against what the draft trainer beside it needs, refused before any engine starts."""

import pytest
import torch

from models.embedded import embedded_target_dir
from models.memory_plan import CONTEXT_BYTES, GIB, H200_BYTES, draft_counts, draft_trainer_bytes
from tests.fixtures.tiny import tiny_config
from trainer import engine_memory

H100_BYTES = 81_559 * 2**20  # nvidia-smi's total on an 80-GB H100 (HBM3)
H100_FREE, H200_FREE = H100_BYTES - CONTEXT_BYTES, H200_BYTES - CONTEXT_BYTES  # less the trainer's CUDA context


def test_a_fraction_that_leaves_the_trainer_surely_too_little_is_refused_with_one_that_fits():
    free, need = 140 * GIB, 20 * GIB
    engine_memory.check_trainer_room(0.5, free, need, 16384, 16384)  # 70 GiB left
    engine_memory.check_trainer_room(0.92, free, need, 16384, 8192)  # 11.2 GiB: within the estimate's error, let through
    with pytest.raises(ValueError) as e:
        engine_memory.check_trainer_room(0.99, free, need, 16384, 0)
    text = str(e.value)
    assert text.startswith("config engine.sglang.mem_fraction_static=0.99: ") and "leave the draft trainer 1.4 GiB" in text
    assert (
        "needs about 20.0 GiB" in text
        and "a 16384-token batch" in text
        and text.endswith("set engine.sglang.mem_fraction_static=0.85 or less")
    )
    assert (1 - engine_memory.fitting_fraction(free, need)) * free >= need  # the value offered leaves the whole estimate
    with pytest.raises(ValueError, match=r"; set data.max_tokens=2048 or less$"):
        engine_memory.check_trainer_room(0.9, 40 * GIB, 39 * GIB, 65536, 2048)  # no fraction leaves enough
    with pytest.raises(ValueError, match="no batch fits beside the engine on this GPU"):
        engine_memory.check_trainer_room(0.9, 40 * GIB, 39 * GIB, 65536, 0)


def test_the_batch_offered_is_the_largest_multiple_of_max_len_whose_estimate_fits():
    def need(tokens: int) -> float:
        return 1000 + tokens

    assert engine_memory.fitting_tokens(5000, need, 1024, 16384) == 3072
    assert engine_memory.fitting_tokens(50000, need, 1024, 16384) == 16384  # never above the batch asked for
    assert engine_memory.fitting_tokens(1500, need, 1024, 16384) == 0


@pytest.mark.parametrize("free", [H100_FREE, H200_FREE], ids=["H100", "H200"])
def test_the_recipe_s_training_fits_an_80_gb_h100_and_a_141_gb_h200_and_a_batch_too_large_is_refused(free):
    """+experiment=h200_quality engine=sglang (the recipe's training) on either card; the same run at 8 x its batch
    is refused naming the data.max_tokens that fits."""
    from transformers import AutoConfig

    from tests.trainer.test_config import _compose

    config = AutoConfig.from_pretrained(embedded_target_dir())
    cfg = _compose("+experiment=h200_quality", "engine=sglang")
    engine_memory.check_batch_fits(cfg, config, 3, free)
    big = _compose("+experiment=h200_quality", "engine=sglang", f"data.max_tokens={8 * cfg.data.max_tokens}")
    with pytest.raises(ValueError, match=r"set data.max_tokens=(\d+) or less$") as e:
        engine_memory.check_batch_fits(big, config, 3, free)
    fit = int(e.value.args[0].rsplit("data.max_tokens=", 1)[1].split()[0])
    assert cfg.data.max_tokens <= fit < big.data.max_tokens and fit % cfg.data.max_len == 0


def test_the_estimate_covers_the_recipe_s_measured_peak_and_grows_with_the_batch():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(embedded_target_dir())
    d = draft_counts(config, 3, 32000, 6144)  # +experiment=h200_quality's draft
    need = draft_trainer_bytes(d, 16384)
    # the H200 run of that recipe peaked at 16.4 GB (perf/gpu_mem_gb): the check refuses only below half the estimate
    assert engine_memory.SURE_SHORT * need < 16.4e9 < need
    assert draft_trainer_bytes(d, 32768) > need > draft_trainer_bytes(draft_counts(config, 3, 32000), 16384)


def test_the_check_is_for_sglang_on_a_gpu_only(monkeypatch):
    def no_gpu(*_):
        raise AssertionError("asked the GPU")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_gpu)
    cfg = tiny_config()
    engine_memory.check_engine_memory(cfg, None, 3, torch.device("cpu"))  # engine=hf: nothing asked
    sglang = tiny_config("engine=sglang")
    engine_memory.check_engine_memory(sglang, None, 3, torch.device("cpu"))
