"""SGLang's share of the GPU against what the draft trainer beside it needs, refused before any engine starts."""

import pytest
import torch

from models.embedded import embedded_target_dir
from models.memory_plan import GIB, draft_counts, draft_trainer_bytes
from tests.fixtures.tiny import tiny_config
from trainer import engine_memory


def test_a_fraction_that_leaves_the_trainer_surely_too_little_is_refused_with_one_that_fits():
    free, need = 140 * GIB, 20 * GIB
    engine_memory.check_trainer_room(0.5, free, need, 16384)  # 70 GiB left
    engine_memory.check_trainer_room(0.92, free, need, 16384)  # 11.2 GiB: within the estimate's error, let through
    with pytest.raises(ValueError) as e:
        engine_memory.check_trainer_room(0.99, free, need, 16384)
    text = str(e.value)
    assert text.startswith("config engine.sglang.mem_fraction_static=0.99: ") and "leave the draft trainer 1.4 GiB" in text
    assert "needs about 20.0 GiB" in text and "a 16384-token batch" in text and "set engine.sglang.mem_fraction_static=0.85 or less" in text
    assert (1 - engine_memory.fitting_fraction(free, need)) * free >= need  # the value offered leaves the whole estimate
    with pytest.raises(ValueError, match="lower data.max_tokens"):
        engine_memory.check_trainer_room(0.9, 40 * GIB, 39 * GIB, 65536)  # no fraction leaves enough


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


def test_the_fault_scripts_oom_fraction_is_refused_on_an_h200():
    """launch/faults.py's oom_fraction on its GPU runs: 1 % of an H200 beside its batch is surely too little (at the
    default 1,024-token batch it was not, and the H200 run went on into training instead of being refused)."""
    from transformers import AutoConfig

    import launch.faults as F
    from tests.trainer.test_config import _compose

    cfg = _compose(*F.SGLANG_RUN, *F.GPU_RUN, *F.EVERY_RUN, *F.OOM_FRACTION)
    d = draft_counts(AutoConfig.from_pretrained(embedded_target_dir()), 3, cfg.draft.vocab_size, cfg.draft.intermediate_size)
    need = draft_trainer_bytes(d, cfg.data.max_tokens)
    assert cfg.engine.sglang.max_total_tokens is None
    with pytest.raises(ValueError, match="set engine.sglang.mem_fraction_static=0.9[0-9] or less"):
        engine_memory.check_trainer_room(cfg.engine.sglang.mem_fraction_static, 139 * GIB, need, cfg.data.max_tokens)
