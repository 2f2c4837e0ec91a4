"""lab/gpu_runs.py on the CPU: the exact commands of each sequence (a fake runner), a failed command stopping
its sequence, the real runner's logs, the study's split, the dp analysis against the stored device outputs, and
lab/device_run.sh handing every subcommand it documents to the program."""

import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from lab import gpu_runs
from lab.gpu_runs import PYTHON, Step
from trainer import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
DEVICE_RUN = ROOT / "lab" / "device_run.sh"
# the subcommands the shell itself runs
SHELL = ("setup-sglang", "setup-deps", "setup-gguf", "bg", "collect", "wait", "ckpt-out", "ckpt-in")
DP_RUNS = ROOT / "docs" / "device_runs"
GPU_MARK = "mark." + "gpu"  # spelled apart: this file marks no gpu test


class FakeRunner:
    """Records each step, writes its log (``name`` line by line) and answers the exit code asked for it."""

    def __init__(self, codes: dict[str, int] | None = None):
        self.codes = codes or {}
        self.steps: list[Step] = []

    def __call__(self, step: Step) -> int:
        self.steps.append(step)
        if step.log is not None:
            step.log.parent.mkdir(parents=True, exist_ok=True)
            step.log.write_text("".join(f"{step.name} line {i}\n" for i in range(30)) + "tau = 2.5\n")
        return self.codes.get(step.name, 0)

    @property
    def argvs(self) -> list[tuple[str, ...]]:
        return [s.argv for s in self.steps]


def test_recipe_hands_its_own_arguments_to_recipe_py_and_writes_under_its_name(tmp_path):
    run = FakeRunner()
    argv = ["recipe", "/c", "--phases", "training", "--recipe", "gen", "--train-s", "300", "--res", str(tmp_path)]
    assert gpu_runs.main(argv, runner=run) == 0
    out = str(tmp_path / "gen")
    assert run.argvs == [(PYTHON, "launch/recipe.py", "--corpora", "/c", "--out", out, "--phases", "training", "--train-s", "300")]
    assert run.steps[0].log is None  # to the screen as it comes (the background job's log)


def test_faults_hands_its_own_arguments_to_faults_py(tmp_path):
    run = FakeRunner()
    assert gpu_runs.main(["faults", "--faults", "engine_kill", "nan", "--res", str(tmp_path), "--budget-s", "100"], runner=run) == 0
    r = tmp_path / "faults"
    assert run.argvs == [(PYTHON, "lab/faults.py", "--out", str(r), "--faults", "engine_kill", "nan", "--budget-s", "100")]
    assert run.steps[0].log == r / "faults.log"


def test_a_sequence_refuses_arguments_it_does_not_know(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_runs.main(["genbench", "--res", str(tmp_path), "--phases", "x"], runner=FakeRunner())
    assert e.value.code == 2 and "unrecognized arguments: --phases x" in capsys.readouterr().err


def test_baseline_trains_the_default_then_measures_tau_on_the_three_heldout_files(tmp_path, capsys):
    run = FakeRunner()
    assert gpu_runs.main(["baseline", "/c", "--res", str(tmp_path)], runner=run) == 0
    r = tmp_path / "baseline"
    assert run.argvs == [
        (PYTHON, "-m", "trainer", f"hydra.run.dir={r / 'run'}"),
        (PYTHON, "-m", "serving.sglang_eval", str(r / "run" / "export" / "sglang"), "--prompts")
        + ("/c/heldout_sharegpt.jsonl", "/c/heldout_codeio.jsonl", "/c/heldout_evals.jsonl")
        + ("--k", "6", "3", "--max-new-tokens", "128", "--json", str(r / "tau.json")),
    ]
    assert [s.log for s in run.steps] == [r / "train.log", r / "tau.log"]
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "tau = 2.5" and "baseline: tau line 29" not in out  # the tau lines of its log, not its tail


def _answers(path: Path, n: int) -> None:
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(n)))


def no_waiting(seconds: float) -> None:
    raise AssertionError("the sequence waited for answers that are there")


def test_study_splits_the_given_recipes_answers_and_runs_the_study_on_them(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_runs.time, "sleep", no_waiting)
    answers = tmp_path / "r5" / "answered.jsonl"
    _answers(answers, 2500)
    (tmp_path / "r5" / "answered.done").touch()
    run = FakeRunner()
    argv = ["study", "/c", "--recipe", "r5", "--res", str(tmp_path), "--steps", "300", "--parallel", "8", "--devices", "0", "1"]
    assert gpu_runs.main(argv, runner=run) == 0
    r = tmp_path / "study"
    assert run.argvs == [
        (PYTHON, "lab/study.py", "--out", str(r), "--base-file", str(r / "data" / "base.jsonl"))
        + ("--synthetic", str(r / "data" / "more.jsonl"), "--sizes", "2", "16", "4", "1", "--max-steps", "300", "--parallel", "8")
        + ("--devices", "0", "1", "--", "draft.draft_vocab_size=32000", "schedule.lr=5e-4", "data.max_len=2048", "data.max_tokens=16384")
        + ("data.answer_tokens=128", "data.holdout_fraction=0.05", "trainer.spec_tokens=6", "trainer.log_every=50")
        + ("trainer.eval_prompts=64", "trainer.eval_max_new_tokens=128", "trainer.eval_prompts_file=/c/heldout_sharegpt.jsonl")
        + ("data.heldout_prompt_files=[/c/heldout_evals.jsonl,/c/heldout_codeio.jsonl,/c/heldout_chitchat.jsonl]",)
    ]
    assert run.steps[0].env == {"OMP_NUM_THREADS": "4"}
    assert len((r / "data" / "more.jsonl").read_text().splitlines()) == 1500


def test_the_study_waits_for_the_recipes_greedy_answers(tmp_path, monkeypatch, capsys):
    done = tmp_path / "answered.done"
    sleeps = []

    def sleep(seconds: float) -> None:  # the recipe's greedy pass ends while the study waits
        sleeps.append(seconds)
        done.touch()

    monkeypatch.setattr(gpu_runs.time, "sleep", sleep)
    gpu_runs.wait_for(done)
    assert sleeps == [5.0] and capsys.readouterr().out == f"waiting for {done}\n"


def test_genbench_runs_the_variants_then_the_two_graph_settings(tmp_path):
    run = FakeRunner()
    assert gpu_runs.main(["genbench", "--res", str(tmp_path), "--variants", "sglang", "sglang-r2"], runner=run) == 0
    r, bench = tmp_path / "benches", (PYTHON, "lab/bench_generate.py")
    assert run.argvs == [
        (*bench, "--variants", "sglang", "sglang-r2", "--out", str(r / "generate.json")),
        (
            *bench,
            "--variants",
            "sglang-r4",
            "--sglang-arg",
            "disable_prefill_cuda_graph=true",
            "--out",
            str(r / "generate_noprefillgraph.json"),
        ),
        (*bench, "--variants", "sglang", "--sglang-arg", "cuda_graph_max_bs_decode=1024", "--out", str(r / "generate_cg1024.json")),
    ]
    assert [s.log.name for s in run.steps] == ["generate.log", "generate_noprefillgraph.log", "generate_cg1024.log"]
    again = FakeRunner()
    gpu_runs.main(["genbench", "--res", str(tmp_path)], runner=again)
    assert again.argvs[0][3:8] == ("hf-b256", "hf-b256-r4", "sglang", "sglang-r2", "sglang-r4")


def test_perfbench_commands(tmp_path):
    run = FakeRunner()
    assert gpu_runs.main(["perfbench", "--res", str(tmp_path)], runner=run) == 0
    r, stream = tmp_path / "benches", (PYTHON, "lab/bench_throughput.py")
    smol = (*stream, "--target", "smollm2-135m")
    assert run.argvs == [
        (PYTHON, "lab/bench_trainer_memory.py", "--device", "cuda", "--tmp", "/tmp", "--out", str(r / "memory.json")),
        (*stream, "--profile", "--out", str(r / "profile.json")),
        (*smol, "--rows", "8", "--modes", "colocated,sglang", "--out", str(r / "smol_r8.json")),
        (*smol, "--rows", "32", "--modes", "colocated,sglang", "--out", str(r / "smol_r32.json")),
        (*smol, "--rows", "8", "--profile", "--out", str(r / "smol_profile.json")),
        (PYTHON, "lab/bench_generate.py", "--variants", "hf-b256-static-compile", "--out", str(r / "generate_static.json")),
    ]
    assert [s.log.name for s in run.steps] == [
        f"{n}.log" for n in ("memory", "profile", "smol_r8", "smol_r32", "smol_profile", "generate_static")
    ]


def test_gputests_finds_the_files_that_mark_gpu_tests(tmp_path):
    (tmp_path / "tests" / "models").mkdir(parents=True)
    (tmp_path / "tests" / "test_a.py").write_text(f"import pytest\n\n@pytest.{GPU_MARK}\ndef test_x(): ...\n")
    (tmp_path / "tests" / "test_b.py").write_text("def test_y(): ...\n")
    (tmp_path / "tests" / "models" / "test_c.py").write_text(f"pytestmark = pytest.{GPU_MARK}\n")
    (tmp_path / "tests" / "helper.py").write_text(f"# {GPU_MARK}\n")
    assert gpu_runs.gpu_test_files(tmp_path) == [Path("tests/models/test_c.py"), Path("tests/test_a.py")]
    assert Path("tests/models/test_sglang_gpu.py") in gpu_runs.gpu_test_files(ROOT)


def test_gputests_one_pytest_a_file_and_with_k_a_file_it_deselects_is_no_failure(tmp_path):
    files = [Path("tests/test_a.py"), Path("tests/test_b.py")]
    base = (PYTHON, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider")
    r = tmp_path / "gputests"
    plain = gpu_runs.gputests_steps(tmp_path, files, None)
    assert [s.argv for s in plain] == [(*base, str(f), "-v", "-s", "-rfEs") for f in files]
    assert [s.log for s in plain] == [r / "test_a.log", r / "test_b.log"] and all(s.ok == {0} for s in plain)
    picked = gpu_runs.gputests_steps(tmp_path, files[:1], "tensor parallel")
    assert picked[0].argv == (*base, "tests/test_a.py", "-v", "-s", "-rfEs", "-k", "tensor parallel")
    assert picked[0].log == r / "test_a_tensor_parallel.log" and picked[0].ok == {0, 5}  # 5: pytest collected nothing
    deselected = {f"gputests: {gpu_runs.gpu_test_files(ROOT)[0]}": 5}
    assert gpu_runs.main(["gputests", "--res", str(tmp_path), "-k", "bf16"], runner=FakeRunner(deselected)) == 0
    assert gpu_runs.main(["gputests", "--res", str(tmp_path)], runner=FakeRunner(deselected)) == 1


def test_dp_trains_on_the_answers_of_the_recipe_it_is_given(tmp_path, monkeypatch):
    _answers(tmp_path / "r5" / "answered.jsonl", 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    run = FakeRunner()
    argv = ["dp", "/c", "sglang-one", "colocated-two", "--recipe", "r5", "--res", str(tmp_path), "--steps", "60", "--dir", "dp_packed"]
    assert gpu_runs.main([*argv, "--trainer-args", "data.packing=true"], runner=run) == 0
    r = tmp_path / "dp_packed"
    common = (
        "+experiment=h200_quality",
        "data=openai",
        f"data.sources.openai.path={tmp_path / 'r5' / 'answered.jsonl'}",
        "trainer.max_steps=60",
        "trainer.log_every=1",
        "trainer.serve_eval=false",
        "trainer.eval_batches=1",
        "trainer.eval_prompts_file=/c/heldout_sharegpt.jsonl",
        "data.heldout_prompt_files=[/c/heldout_evals.jsonl,/c/heldout_codeio.jsonl,/c/heldout_chitchat.jsonl]",
        "data.packing=true",
    )
    launcher = ("-c", "import sys; from deepspeed.launcher.runner import main; sys.exit(main())", "--num_gpus", "2", "--no_local_rank")
    assert run.argvs == [
        (PYTHON, "-m", "trainer", "deepspeed.grad_accum=2", *common, "engine=sglang", f"hydra.run.dir={r / 'sglang-one'}"),
        (PYTHON, *launcher, "launch/train.py", *common, "engine.mode=colocated", f"hydra.run.dir={r / 'colocated-two'}"),
    ]
    assert [s.env for s in run.steps] == [{"CUDA_VISIBLE_DEVICES": "1"}, {}]
    assert [s.log for s in run.steps] == [r / "sglang-one.log", r / "colocated-two.log"]
    summary = json.loads((r / "dp.json").read_text())  # the runs wrote no metrics: no steps, nothing to compare
    assert summary["sglang-one"]["steps"] == 0 and summary["sglang-compare"] == {}


def test_dp_one_gpu_runs_default_to_device_0_and_all_six_runs(tmp_path, monkeypatch):
    _answers(tmp_path / "recipe" / "answered.jsonl", 3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run = FakeRunner()
    assert gpu_runs.main(["dp", "/c", "--res", str(tmp_path)], runner=run) == 0
    assert [s.name for s in run.steps] == [f"dp: {name}" for name in gpu_runs.RUNS]
    assert run.steps[0].argv[:3] == (PYTHON, "-m", "trainer") and run.steps[0].env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert "trainer.max_steps=30" in run.steps[0].argv


def test_dp_without_the_recipes_answers_stops_before_any_run(tmp_path):
    _answers(tmp_path / "recipe" / "answered.jsonl", 3)
    run = FakeRunner()
    with pytest.raises(SystemExit, match="r5/answered.jsonl: no answers"):
        gpu_runs.main(["dp", "/c", "--recipe", "r5", "--res", str(tmp_path)], runner=run)
    assert run.steps == []


def test_a_failed_command_stops_the_sequence_with_its_logs_tail(tmp_path, capsys):
    run = FakeRunner({"genbench": 3})
    assert gpu_runs.main(["genbench", "--res", str(tmp_path)], runner=run) == 1
    assert len(run.steps) == 1  # the two later benches never ran
    err = capsys.readouterr().err
    assert f"genbench failed (exit code 3); {tmp_path / 'benches' / 'generate.log'}, last lines:" in err
    assert "genbench line 29" in err and "genbench line 4\n" not in err  # the last 25 lines of its log


def test_keep_going_runs_the_rest_and_still_fails(tmp_path, capsys):
    run = FakeRunner({"dp: sglang-one": 1})
    _answers(tmp_path / "recipe" / "answered.jsonl", 3)
    assert gpu_runs.main(["dp", "/c", "--res", str(tmp_path), "--keep-going"], runner=run) == 1
    assert len(run.steps) == 6 and (tmp_path / "dp" / "dp.json").is_file()
    assert capsys.readouterr().err.splitlines()[-1] == "dp: failed: dp: sglang-one"


def test_a_failed_command_of_the_study_stops_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_runs.time, "sleep", no_waiting)
    _answers(tmp_path / "recipe" / "answered.jsonl", 10)
    (tmp_path / "recipe" / "answered.done").touch()
    assert gpu_runs.main(["study", "/c", "--res", str(tmp_path)], runner=FakeRunner({"study": 1})) == 1


def test_the_runner_logs_lines_without_progress_bars_and_returns_the_exit_code(tmp_path):
    script = (
        "import os, sys; sys.stdout.write('start\\n 10%|#  | 1/10 [00:01<00:09, 1.00it/s]\\r 20%|## | 2/10 [00:02<00:08, 1.00it/s]\\r');"
        "sys.stdout.write('done\\r\\nwindows line\\n' + os.environ['EXTRA']); sys.exit(3)"
    )
    step = Step("s", (PYTHON, "-c", script), tmp_path / "logs" / "s.log", env={"EXTRA": "last, no newline"})
    assert gpu_runs.run_step(step) == 3
    assert step.log.read_text() == "start\ndone\nwindows line\nlast, no newline\n"


def test_the_runner_streams_a_step_without_a_log_to_the_screen(capsys):
    assert gpu_runs.run_step(Step("s", (PYTHON, "-c", "print('a'); print('b')"))) == 0
    assert capsys.readouterr().out == "a\nb\n"


def test_split_answers_is_the_seeded_shuffle_the_study_always_used(tmp_path):
    answers = tmp_path / "answered.jsonl"
    answers.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(1005)) + "\n\n")
    assert gpu_runs.split_answers(answers, tmp_path / "data") == 1005

    def ids(name: str) -> list[int]:
        return [json.loads(x)["id"] for x in (tmp_path / "data" / f"{name}.jsonl").read_text().splitlines()]

    # the order the shell's own split gave these records (random.Random(0), base = the first 1000)
    assert ids("more") == [430, 911, 776, 394, 864]
    assert ids("base")[:5] == [439, 985, 160, 606, 237] and len(ids("base")) == 1000


def test_split_answers_keeps_a_record_that_holds_a_line_separator_whole(tmp_path):
    answers = tmp_path / "answered.jsonl"
    records = ['{"text": "a\u2028b"}', '{"text": "c"}', '{"text": "d"}']
    answers.write_text("\n".join(records) + "\n", encoding="utf-8")
    assert gpu_runs.split_answers(answers, tmp_path / "data", base=2) == 3
    data = tmp_path / "data"
    written = (data / "base.jsonl").read_text(encoding="utf-8").split("\n")[:2] + [(data / "more.jsonl").read_text(encoding="utf-8")[:-1]]
    assert sorted(written) == sorted(records)


STORED_DP = sorted(p.parent for p in DP_RUNS.glob("*/*/dp.json"))


def test_the_stored_dp_runs_are_there():
    assert [p.relative_to(DP_RUNS).as_posix() for p in STORED_DP] == [
        "2026-11-30-h200-x2-dp/dp",
        "2026-12-01-h200-x2-soft-ce/dp",
        "2026-12-01-h200-x2-soft-ce/dp_packed",
        "2026-12-01-h200-x2-soft-ce/dp_rep",
    ]


@pytest.mark.parametrize("folder", STORED_DP, ids=lambda p: p.relative_to(DP_RUNS).as_posix())
def test_dp_summary_reproduces_the_stored_dp_json_from_the_stored_metrics(folder):
    """Every figure the stored dp.json holds, exactly (the older ones lack the whole-run rates, added later)."""
    stored = json.loads((folder / "dp.json").read_text())
    summary = gpu_runs.dp_summary(folder)
    assert list(summary) == list(stored)
    for run, figures in stored.items():
        assert {k: summary[run][k] for k in figures} == figures, run


def test_dp_summary_compares_two_ranks_with_one_gpu():
    summary = gpu_runs.dp_summary(DP_RUNS / "2026-11-30-h200-x2-dp" / "dp")
    assert summary["sglang-compare"]["speedup_vs_one_gpu"] == pytest.approx(1.728, abs=1e-3)
    assert summary["sglang-compare"]["speedup_vs_one_gpu_run"] > 1.5
    assert summary["sglang-one"]["steps"] == 40 and summary["sglang-two"]["stall_share_per_rank"][1] == pytest.approx(0.0204, abs=1e-4)


def documented_subcommands() -> list[str]:
    """The subcommands device_run.sh's header documents (``#   lab/device_run.sh NAME ...``)."""
    return re.findall(r"^#\s+lab/device_run\.sh ([a-z0-9-]+)", DEVICE_RUN.read_text(), flags=re.M)


def test_every_subcommand_device_run_documents_is_the_shells_or_the_programs():
    names = documented_subcommands()
    assert len(names) == len(set(names)) == 18
    assert set(names) == set(SHELL) | set(gpu_runs.SEQUENCES)
    arms = re.findall(r"^([a-z0-9|*-]+)\)$", DEVICE_RUN.read_text(), flags=re.M)
    assert arms == [*SHELL, "*"]  # the rest goes to the program


def test_device_run_hands_the_other_subcommands_to_the_program_as_given(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RES": "/r"}
    done = subprocess.run(
        ["bash", str(DEVICE_RUN), "dp", "/c d", "sglang-two", "--steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["lab/gpu_runs.py", "dp", "--res", "/r", "/c d", "sglang-two", "--steps", "3"]
    assert gpu_runs.parse(["recipe", "--res", "/r", "/c", "--phases", "training"]).rest == ["--phases", "training"]


def _env(res: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "RES": str(res), "HOME": str(res.parent)}


def _device_run(args: list[str], res: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEVICE_RUN), *args], cwd=ROOT, env=_env(res), capture_output=True, text=True, timeout=120)


def test_bg_then_wait_collects_the_jobs_exit_code_and_results(tmp_path):
    res, out = tmp_path / "res", tmp_path / "out"
    out.mkdir()
    started = _device_run(["bg", "job", "0", "bash", "-c", "sleep 2; echo done"], res)
    assert started.returncode == 0 and "started job on GPU 0" in started.stdout
    waited = _device_run(["wait", "job", "60", str(out)], res)
    assert waited.returncode == 0, waited.stderr
    assert "== job: exit 0" in waited.stdout and "done" in waited.stdout
    with tarfile.open(out / "res.tgz") as tar:
        assert {"./job.log", "./job.rc"} <= set(tar.getnames())
    assert sorted(p.name for p in out.iterdir()) == ["res.tgz"]  # nothing half-written left beside it


def test_wait_returns_at_its_limit_with_a_collection_of_a_job_still_running(tmp_path):
    """A command cut at its time limit: the job outlives the wait, and what was collected comes back all the same."""
    res, out = tmp_path / "res", tmp_path / "out"
    out.mkdir()
    res.mkdir()
    (res / "long.log").write_text("step 1\n")
    waited = _device_run(["wait", "long", "2", str(out)], res)
    assert waited.returncode == 0, waited.stderr
    assert "== long: running" in waited.stdout and (out / "res.tgz").is_file()
    refused = _device_run(["wait", "long"], res)
    assert refused.returncode != 0 and "give the seconds to wait at most" in refused.stderr
    refused = _device_run(["wait", "long", "2"], res)
    assert refused.returncode == 2 and "wait: give BACK_DIR, the folder the host hands back" in refused.stderr
    refused = _device_run(["collect"], res)
    assert refused.returncode == 2 and "collect: give BACK_DIR" in refused.stderr


def test_wait_fails_at_once_for_a_job_this_host_never_started(tmp_path):
    """A host started afresh is bare: waiting there for a job would spend the command's whole MAX_S."""
    res, out = tmp_path / "res", tmp_path / "out"
    out.mkdir()
    res.mkdir()
    waited = _device_run(["wait", "gone", "600", str(out)], res)
    assert waited.returncode == 3 and "no job gone on this host" in waited.stderr
    assert list(out.iterdir()) == []


def test_the_kernel_caches_collected_on_one_host_are_restored_on_a_bare_one(tmp_path):
    """collect JIT=1 packs SGLang's builds and torch.compile's apart (a file over the limit loses only itself);
    setup-sglang unpacks every archive it is given into the bare host's home."""
    res, out = tmp_path / "res", tmp_path / "out"
    out.mkdir()
    for d in (".cache/tvm-ffi/rmsnorm", ".triton/cache/ab", ".cache/torchinductor/fx"):  # no flashinfer cache here
        (res.parent / d).mkdir(parents=True)
        (res.parent / d / "kernel.so").write_text(d)
    env = {"JIT": "1"}
    collected = subprocess.run(
        ["bash", str(DEVICE_RUN), "collect", str(out)], cwd=ROOT, env=_env(res) | env, capture_output=True, text=True
    )
    assert collected.returncode == 0, collected.stderr
    with tarfile.open(out / "jitcache.tgz") as tar:
        assert {".cache/tvm-ffi/rmsnorm/kernel.so", ".triton/cache/ab/kernel.so"} <= set(tar.getnames())
        assert not any("torchinductor" in n for n in tar.getnames())
    with tarfile.open(out / "inductor.tgz") as tar:
        assert ".cache/torchinductor/fx/kernel.so" in tar.getnames()

    bare, wheels, bin_dir = tmp_path / "bare", tmp_path / "wheels", tmp_path / "bin"
    for d in (bare, wheels, bin_dir):
        d.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 0\n")  # neither pip nor the import check runs here
    (bin_dir / "python3").chmod(0o755)
    env = _env(bare / "res") | {"HOME": str(bare), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    argv = ["bash", str(DEVICE_RUN), "setup-sglang", str(wheels), str(out / "jitcache.tgz"), str(out / "inductor.tgz")]
    restored = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    assert restored.returncode == 0, restored.stderr
    for d in (".cache/tvm-ffi/rmsnorm", ".triton/cache/ab", ".cache/torchinductor/fx"):
        assert (bare / d / "kernel.so").read_text() == d


def test_the_program_runs_as_a_script():
    done = subprocess.run([sys.executable, "lab/gpu_runs.py", "dp", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "sglang-one-ga1" in done.stdout


def test_sweep_trains_each_variant_then_measures_them_against_one_target_alone(tmp_path, capsys):
    class Trains(FakeRunner):  # a training writes its export, except the one asked to fail
        def __call__(self, step: Step) -> int:
            code = super().__call__(step)
            if step.name.endswith("training") and code == 0:
                (Path(step.argv[step.argv.index("--out") + 1]) / "run" / "export" / "sglang").mkdir(parents=True)
            return code

    run, r = Trains({"sweep: v8 training": 1}), tmp_path
    argv = ["sweep", "/c", "--res", str(r), "--answered", "/a/answered.jsonl.gz", "--sampled", "/a/sampled.jsonl.gz", "--keep-going"]
    argv += [
        "--variant",
        "v8",
        "draft.draft_vocab_size=8000",
        "--variant",
        "v16",
        "draft.draft_vocab_size=16000",
        "--variant",
        "w",
        "draft.intermediate_size=1536",
    ]
    assert gpu_runs.main([*argv, "--steps", "100"], runner=run) == 1  # v8's training failed; the rest ran
    cap = ("trainer.speedup.enabled=false", "trainer.max_steps=100", "trainer.max_time_s=null")
    answers = ("--answered", "/a/answered.jsonl.gz", "--sampled", "/a/sampled.jsonl.gz", "--phases", "training")
    train = [
        (PYTHON, "launch/recipe.py", "--corpora", "/c", "--out", str(r / n), *answers, "--trainer-args", *cap, o)
        for n, o in (("v8", "draft.draft_vocab_size=8000"), ("v16", "draft.draft_vocab_size=16000"), ("w", "draft.intermediate_size=1536"))
    ]
    prompts = ("--prompts", "/c/heldout_sharegpt.jsonl", "/c/heldout_codeio.jsonl", "--settings", "8/8/64", "--concurrency", "1", "16")
    prompts += ("--repeats", "3")
    speed = [
        (PYTHON, "-m", "serving.speedup", str(r / n / "run" / "export" / "sglang"), *prompts, "--json", str(r / n / "speedup.json"))
        for n in ("v16", "w")
    ]
    assert run.argvs == [*train, speed[0], (*speed[1], "--plain-from", str(r / "v16" / "speedup.json"))]
    assert "sweep: v8 has no export (its training failed), no speedup" in capsys.readouterr().err
    again = Trains()
    assert gpu_runs.main([*argv[:8], "--variant", "v32", "--plain-from", str(r / "w" / "speedup.json")], runner=again) == 0
    assert again.argvs[-1][-2:] == ("--plain-from", str(r / "w" / "speedup.json"))
    with pytest.raises(SystemExit, match="names must differ"):
        gpu_runs.main([*argv[:8], "--variant", "a", "--variant", "a", "x=1"], runner=FakeRunner())


ENGINE_LINE = "the engine process 7 (SGLangTarget on cuda:0): target built in 26.0 s; ring of 3 x 16384 tokens\n"


def test_side_by_side_starts_each_training_once_the_one_before_built_its_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_runs, "POLL_S", 0.01)
    r, events, second = tmp_path, [], threading.Event()
    (r / "a").mkdir()
    (r / "a" / "train.log").write_text(ENGINE_LINE)  # an earlier run's log: no sign of this run's engine
    os.utime(r / "a" / "train.log", (1e9, 1e9))

    class SideBySide(FakeRunner):
        def __call__(self, step: Step) -> int:
            code = super().__call__(step)
            if not step.name.endswith("training"):
                return code
            out = Path(step.argv[step.argv.index("--out") + 1])
            events.append(f"{out.name} started")
            if out.name == "a":
                time.sleep(0.1)  # the earlier log stays in place a while: it must not start b
                events.append("a built")
                (out / "train.log").write_text("starting\nloading shards: 100%|#| 1/1\r" + ENGINE_LINE)  # after a bar's redraw
                events.append(f"a saw b start: {second.wait(30)}")
            else:
                second.set()
            (out / "run" / "export" / "sglang").mkdir(parents=True)
            return code

    run = SideBySide()
    argv = ["sweep", "/c", "--res", str(r), "--answered", "/a.gz", "--sampled", "/s.gz", "--side-by-side", "--concurrency", "1"]
    assert gpu_runs.main([*argv, "--variant", "a", "x=1", "--variant", "b", "x=2"], runner=run) == 0
    assert events == ["a started", "a built", "b started", "a saw b start: True"]
    assert [s.name for s in run.steps[2:]] == ["sweep: a speedup", "sweep: b speedup"]  # after both trainings


def test_side_by_side_starts_the_next_training_when_the_one_before_ended_without_an_engine(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_runs, "POLL_S", 0.01)
    run = FakeRunner({"sweep: a training": 1, "sweep: b training": 1})
    argv = ["sweep", "/c", "--res", str(tmp_path), "--answered", "/a.gz", "--sampled", "/s.gz", "--side-by-side", "--keep-going"]
    assert gpu_runs.main([*argv, "--variant", "a", "--variant", "b"], runner=run) == 1
    assert [s.name for s in run.steps] == ["sweep: a training", "sweep: b training"]
    assert "sweep: failed: sweep: a training, sweep: b training" in capsys.readouterr().err


def test_budget_runs_one_trunk_then_each_shorter_decay_from_its_kept_checkpoint(tmp_path):
    class Trunk(FakeRunner):  # the trunk keeps a checkpoint past its mark (and one before it); every run exports
        def __call__(self, step: Step) -> int:
            code = super().__call__(step)
            out = Path(step.argv[step.argv.index("--out") + 1]) if "--out" in step.argv else None
            if out is not None:
                (out / "run" / "export" / "sglang").mkdir(parents=True)
            if step.name.endswith("speedup"):
                Path(step.argv[step.argv.index("--json") + 1]).write_text("{}")
            if out is not None and out.name == "t10":
                for n, spent, kept in ((1900, 239.0, True), (2000, 240.2, True), (2100, 260.0, False)):
                    d = out / "run" / "checkpoints" / f"step_{n}"
                    (d / ckpt.STATE_TAG).mkdir(parents=True)
                    (d / ckpt.META_FILE).write_text(json.dumps({"position": {"train_s": spent}, "kept": kept}))
            return code

    run, r = Trunk(), tmp_path
    argv = ["budget", "/c", "--res", str(r), "--answered", "/a/a.jsonl.gz", "--sampled", "/a/s.jsonl.gz", "--minutes", "10", "5"]
    assert gpu_runs.main(argv, runner=run) == 0
    head = ("--answered", "/a/a.jsonl.gz", "--sampled", "/a/s.jsonl.gz", "--phases", "training", "--trainer-args")
    trunk = (PYTHON, "launch/recipe.py", "--corpora", "/c", "--out", str(r / "t10"), *head, "trainer.speedup.enabled=false")
    branch = (PYTHON, "launch/recipe.py", "--corpora", "/c", "--out", str(r / "t5"), *head, "trainer.speedup.enabled=false")
    resume = f"trainer.resume={r / 't10' / 'run' / 'checkpoints' / 'step_2000'}"
    same = (f"data.sources.openai.path={r / 't10' / 'answered.jsonl'}", f"data.sources.sampled.path={r / 't10' / 'sampled.jsonl'}")
    assert run.argvs[0] == (*trunk, "trainer.max_time_s=600", "trainer.checkpoint_at_s=[240]")
    assert run.argvs[1] == (*branch, "trainer.max_time_s=300", resume, *same)  # the trunk's data, which the resume checks
    assert [s.name for s in run.steps[2:]] == ["budget: t5 speedup", "budget: t10 speedup", "budget: tau against training time"]
    plot = ("lab/budget_plot.py", "--out", str(r / "budget"), "--setting", "6/1/7", "--concurrency", "1")
    assert run.argvs[4] == (PYTHON, *plot, str(r / "t5"), str(r / "t10"))
    assert run.argvs[2][run.argvs[2].index("--settings") :][:4] == ("--settings", "6/1/7", "--concurrency", "1")
    assert run.argvs[3][-2:] == ("--plain-from", str(r / "t5" / "speedup.json"))
    empty = tmp_path / "none"
    assert gpu_runs.main([*argv[:2], "--res", str(empty), *argv[4:]], runner=FakeRunner()) == 1  # no trunk checkpoint
    run, more = Trunk(), ("trainer.profile_steps=[200,202]", "trainer.log_every=20")
    assert gpu_runs.main([*argv[:2], "--res", str(tmp_path / "more"), *argv[4:], "--trainer-args", *more], runner=run) == 0
    assert run.argvs[0][-2:] == more and run.argvs[1][-2:] == more  # the trunk's and the branch's


def test_the_budgets_stable_share_is_h200_qualitys_schedule():
    from tests.trainer.test_config import _compose

    assert gpu_runs.STABLE_SHARE == pytest.approx(1 - _compose("+experiment=h200_quality").schedule.decay_ratio)
