"""The command line: a user error in one to three lines, the full trace on request, the run's own log."""

import subprocess
import sys
import warnings

import pytest
from hydra import compose, initialize_config_dir

from tests.fixtures.tiny import ROOT, TINY, child_env
from trainer import console
from trainer.config import did_you_mean, register_schema, to_config


def _trainer(run_dir, *args, env_extra=None):
    cmd = [sys.executable, "-m", "trainer", f"hydra.run.dir={run_dir}", *args]
    return subprocess.run(cmd, env=child_env(**(env_extra or {})), cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "override, says",
    [
        ("draft.ttt_steps=0", "error: config draft.ttt_steps: must be >= 1"),
        ("draft.ttt_step=3", "error: Could not override 'draft.ttt_step': Key 'ttt_step' not in 'DraftConfig'"),
        ("+trainer.foo=1", "error: config trainer.foo: unknown key"),
        ("target=local", "error: config target.path: mandatory value missing"),
    ],
)
def test_a_config_error_is_a_few_lines(tmp_path, override, says):
    out = _trainer(tmp_path, override)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith(says) and len(lines) <= 3 and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    "override, says",
    [
        ("schedule=wsdd", "Could not find 'schedule/wsdd'; did you mean wsd? (options in 'schedule': constant, cosine, wsd)"),
        ("trainer.max_step=5", "Key 'max_step' not in 'TrainConfig'; did you mean trainer.max_steps?"),
        ("scheduel=wsd", "Key 'scheduel' not in 'Config'; did you mean schedule?"),
        ("draft.vocab_size=1024", "Key 'vocab_size' not in 'DraftConfig'; did you mean draft.draft_vocab_size?"),
        (
            "+trainer.max_step=5",
            "config trainer.max_step: unknown key (not in the schema, trainer/config.py): remove it or fix its "
            "spelling; did you mean trainer.max_steps?",
        ),
    ],
)
def test_a_short_error_keeps_the_fix(override, says):
    register_schema()
    with pytest.raises(console.USER_ERRORS) as err:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            to_config(compose(config_name="config", overrides=[override]))
    lines = console.short_error(err.value).splitlines()
    assert says in lines[0] and len(lines) == 2, lines


def test_a_config_file_with_an_unknown_key_names_the_file_and_the_fix(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ndraft:\n  vocab_size: 2048\n")
    register_schema()
    with pytest.raises(console.USER_ERRORS) as err:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            to_config(compose(config_name="config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "+experiment=mine"]))
    lines = console.short_error(err.value).splitlines()
    says = "ConfigKeyError raised while composing config: Key 'vocab_size' not in 'DraftConfig'; did you mean draft.draft_vocab_size?"
    assert lines[0] == f"error: In 'experiment/mine': {says}" and len(lines) == 2, lines


def test_a_far_off_key_gets_no_guess():
    assert did_you_mean("zzz", ["max_steps", "epochs"]) == ""


@pytest.mark.slow
def test_verbose_and_hydra_full_error_give_the_trace(tmp_path):
    for out in (
        _trainer(tmp_path, "draft.ttt_steps=0", "--verbose"),
        _trainer(tmp_path, "draft.ttt_steps=0", env_extra={"HYDRA_FULL_ERROR": "1"}),
    ):
        assert out.returncode == 1 and "Traceback" in out.stderr and "draft.ttt_steps: must be >= 1" in out.stderr


@pytest.mark.slow
def test_an_input_error_in_the_run_is_short_and_leaves_no_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    out = _trainer(run_dir, *TINY, "draft.draft_vocab_size=60000")
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr
    error = out.stderr[out.stderr.index("error: ") :].strip().splitlines()  # after the weight-loading progress bar
    assert error[0].startswith("error: config draft.draft_vocab_size: 60000 is above the target's vocabulary") and len(error) <= 3
    assert not run_dir.exists(), "a run that never started left its run dir"


def test_quiet_filters_the_torch_gloo_notice_and_nothing_else(monkeypatch):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet_libraries()
        warnings.warn(
            "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single` instead.",
            FutureWarning,
        )
        warnings.warn("`torch.distributed.all_reduce_coalesced` will be deprecated.", FutureWarning)
    assert [str(w.message) for w in seen] == ["`torch.distributed.all_reduce_coalesced` will be deprecated."]


def test_deepspeeds_op_notice_is_dropped_and_nothing_else(monkeypatch, capsys):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    with console.without_notices():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("a line of the run")
    assert capsys.readouterr().out == "a line of the run\n"
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    with console.without_notices():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    assert "built successfully" in capsys.readouterr().out


def test_a_rank_other_than_0_shows_only_errors_on_the_console(monkeypatch, tmp_path):
    import logging

    import transformers

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.setenv("RANK", "1")
    console_handler, file_handler = logging.StreamHandler(), logging.FileHandler(tmp_path / "rank1.log")
    root = logging.getLogger()
    levels = {h: h.level for h in root.handlers}  # pytest's capture handlers are stream handlers too
    root.addHandler(console_handler)
    root.addHandler(file_handler)
    try:
        console.log_levels()
        assert console_handler.level == logging.ERROR and file_handler.level == logging.NOTSET
        assert not transformers.utils.logging.is_progress_bar_enabled()
    finally:
        root.removeHandler(console_handler)
        root.removeHandler(file_handler)
        file_handler.close()
        for handler, level in levels.items():
            handler.setLevel(level)
        transformers.utils.logging.enable_progress_bar()
        logging.captureWarnings(False)


@pytest.mark.parametrize("overrides", [[], ["engine=sglang", "+experiment=h200_quality"]])
def test_help_names_the_app_its_groups_and_what_every_key_means(overrides):
    from trainer.__main__ import CONF_DIR
    from trainer.help import help_text

    text = help_text(CONF_DIR, overrides)
    assert text.startswith("usage: streamdraft train ") and "powered by Hydra" not in text and "``" not in text
    assert "  schedule: constant, cosine, wsd" in text
    keys = [line for line in text.splitlines() if line.startswith("  ") and " = " in line]
    assert any(k.startswith("  trainer.max_time_s = ") and "  # caps the run's training seconds" in k for k in keys)
    assert [k for k in keys if "  # " not in k] == []  # every key says what it means (trainer/config.py's comments)


def test_help_on_the_command_line_is_the_apps(tmp_path):
    out = _trainer(tmp_path / "run", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: streamdraft train") and not (tmp_path / "run").exists()
