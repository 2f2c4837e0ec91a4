"""Input paths are checked before DeepSpeed or the target start; a failed start writes nothing: no run dir,
and an existing one as it was."""

import subprocess
import sys

import pytest
import torch

import trainer.build
import trainer.loop
from tests.fixtures.tiny import TINY, child_env, tiny_config
from trainer.loop import run


@pytest.fixture
def nothing_heavy(monkeypatch):
    """DeepSpeed's start fails the test: a preflight error must come first."""

    def started(*args):
        raise AssertionError("init_parallel ran before the inputs were checked")

    monkeypatch.setattr(trainer.loop, "init_parallel", started)


def sharegpt(path) -> list[str]:
    return ["data=sharegpt", f"data.sources.sharegpt.path={path}"]


def test_a_missing_data_file_is_named_before_anything_starts(nothing_heavy, tmp_path):
    with pytest.raises(ValueError, match=r"^config data\.sources\.sharegpt\.path: '.*nowhere\.jsonl' does not exist"):
        run(tiny_config(*sharegpt(tmp_path / "nowhere.jsonl")), tmp_path)


def test_an_empty_data_file_is_named_and_called_empty(nothing_heavy, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"config data\.sources\.sharegpt\.path: .*empty\.jsonl is empty \(no record\)"):
        run(tiny_config(*sharegpt(tmp_path / "empty.jsonl")), tmp_path)


def test_a_resume_path_that_is_no_run_is_refused_before_anything_starts(nothing_heavy, tmp_path):
    (tmp_path / "not_a_run").mkdir()
    with pytest.raises(ValueError, match="trainer.resume: .*not_a_run is neither a checkpoint nor a run dir"):
        run(tiny_config(f"trainer.resume={tmp_path / 'not_a_run'}"), tmp_path)
    with pytest.raises(ValueError, match="trainer.resume: .*gone does not exist"):
        run(tiny_config(f"trainer.resume={tmp_path / 'gone'}"), tmp_path)


def test_a_corrupt_target_config_is_one_line_naming_the_file(nothing_heavy, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n "hidden_size": 8,,\n}')
    with pytest.raises(ValueError) as err:
        run(tiny_config("target=local", f"target.path={target}"), tmp_path)
    message = str(err.value)
    assert message.startswith(f"config target.path: {target / 'config.json'}: not valid JSON") and "line 2" in message
    assert len(message.splitlines()) == 1


def test_an_initial_draft_that_is_no_draft_dir_is_refused_before_anything_starts(nothing_heavy, tmp_path):
    with pytest.raises(ValueError, match="config draft.init_from: .*gone is not a directory"):
        run(tiny_config(f"draft.init_from={tmp_path / 'gone'}"), tmp_path)
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config draft.init_from: .*draft has no model.safetensors"):
        run(tiny_config(f"draft.init_from={tmp_path / 'draft'}"), tmp_path)


def test_trainer_threads_sets_torchs_threads_first(nothing_heavy, tmp_path):
    before = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match="trainer.eval_prompts_file"):
            run(tiny_config(f"trainer.threads={before + 1}", f"trainer.eval_prompts_file={tmp_path / 'none.jsonl'}"), tmp_path)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_data_file_that_is_not_utf8_is_named_before_the_target_loads(tmp_path, monkeypatch, on_error):
    def loaded(*args):
        raise AssertionError("the target loaded before the data was read")

    monkeypatch.setattr(trainer.build, "load_target", loaded)
    (tmp_path / "binary.jsonl").write_bytes(b"\xe0\x80\x00\x01 binary\n")
    said = {"raise": r"binary.jsonl:1: not UTF-8 \(byte 0xe0 at column 1", "skip": r"binary.jsonl\): no training sample .* 1 malformed"}
    with pytest.raises(ValueError, match=said[on_error]):
        run(tiny_config(*sharegpt(tmp_path / "binary.jsonl"), f"data.on_error={on_error}"), tmp_path / "run")


def test_a_missing_prompt_file_is_named(nothing_heavy, tmp_path):
    with pytest.raises(ValueError, match="config trainer.eval_prompts_file: .*prompts.jsonl is not a file"):
        run(tiny_config(f"trainer.eval_prompts_file={tmp_path / 'prompts.jsonl'}"), tmp_path)


def files_of(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("fails_in", ["preflight", "build"])
def test_a_failed_start_in_an_existing_run_dir_changes_nothing_there(tmp_path, fails_in):
    """A run's records and an earlier failed start's dir (Hydra's files only) stay byte for byte, before the
    target loads (a missing target) or after it (a prompt file that does not parse)."""
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    args = (
        ["target=local", f"target.path={tmp_path / 'nowhere'}"]
        if fails_in == "preflight"
        else [f"trainer.eval_prompts_file={tmp_path / 'bad.jsonl'}"]
    )
    earlier, failed = tmp_path / "runs" / "a", tmp_path / "runs" / "failed"
    for run_dir in (earlier, failed):
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "overrides.yaml").write_text("- trainer.max_steps=3\n")
        (run_dir / "__main__.log").write_text("the earlier run's log\n")
    (earlier / "checkpoints" / "step_3").mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {d: files_of(d) for d in (earlier, failed)}
    for run_dir in (earlier, failed):
        cmd = [sys.executable, "-m", "trainer", f"hydra.run.dir={run_dir}", *TINY, *args]
        out = subprocess.run(cmd, env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and "\nerror: " in f"\n{out.stderr}", out.stderr
        assert files_of(run_dir) == before[run_dir] and (earlier / "checkpoints" / "step_3").is_dir()


@pytest.mark.parametrize("bad", ["data", "target"])
def test_the_command_line_says_a_bad_input_in_one_line_and_leaves_no_run_dir(tmp_path, bad):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],,}')
    args = sharegpt(tmp_path / "nowhere.jsonl") if bad == "data" else ["target=local", f"target.path={tmp_path / 'target'}"]
    run_dir = tmp_path / "outputs" / "run"
    cmd = [sys.executable, "-m", "trainer", f"hydra.run.dir={run_dir}", *args]
    out = subprocess.run(cmd, env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: config {bad}") and len(lines) <= 3, out.stderr
    assert "Loading weights" not in out.stderr and not run_dir.exists() and not (tmp_path / "outputs").exists()
