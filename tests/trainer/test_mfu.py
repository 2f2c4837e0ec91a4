"""perf/mfu and perf/stall_share on every logged step, from the FLOP count the benchmark uses."""

import json

import pytest

from tests.fixtures.tiny import tiny_config
from trainer.components import Window
from trainer.data_setup import train_batcher
from trainer.flops import H200_BF16_PEAK_TFLOPS, device_peak_tflops, flops_per_token
from trainer.loop import Trainer
from trainer.metrics_sink import MetricsSink
from trainer.report import metrics as M


def test_peak_is_the_config_value_else_the_h200_on_cuda_else_none():
    assert device_peak_tflops(None, "cpu") is None
    assert device_peak_tflops(None, "cuda") == H200_BF16_PEAK_TFLOPS == 790.0
    assert device_peak_tflops(2.5, "cpu") == 2.5


@pytest.mark.slow
def test_trainer_logs_mfu_and_stall_per_step_from_the_benchmark_count(tmp_path):
    trainer = Trainer(tiny_config("trainer.max_steps=3", "trainer.peak_tflops=0.001"), tmp_path)
    trainer.metrics.sink = MetricsSink(trainer.cfg.wandb, tmp_path, {})
    trainer._train()
    trainer.metrics.finish(exit_code=0)
    rows = [json.loads(line) for line in (tmp_path / M.METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    loader = trainer.data.train_loader(train_batcher(trainer.cfg.data, trainer.target.pad_id), 0, 1)
    config, shape = trainer.target.engine.model.config, trainer.ds_model.module.draft.shape
    for row, batch in zip(rows, loader.epoch_batches(0)):  # log_every 1, grad_accum 1: a row a batch
        per_token = flops_per_token(config, shape, batch.input_ids.shape[1], trainer.cfg.draft.ttt_steps)["total"]
        assert row[M.MFU] / row[M.TOKENS_PER_S] == pytest.approx(per_token / 1e9, rel=1e-6)  # peak 1e9 FLOP/s
        assert 0 < row[M.STALL_SHARE] < 1
    trainer.metrics.peak_tflops = None  # a CPU run without trainer.peak_tflops
    assert M.MFU not in trainer.metrics.row(Window(tokens=1, flops=1.0, steps=1))
