"""Every recipe composes; wrong keys and values fail with a message naming them."""

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from trainer.checkpoint import CHANGEABLE
from trainer.config import Config, ScheduleConfig, register_schema, to_config
from trainer.corpora import leak_checked_files
from trainer.data import DATA_FORMATS, ON_ERROR, OVERLONG
from trainer.schedule import SCHEDULES, RunClock, draft_optimizer, lr_factor, warmup_steps
from trainer.stream.feature_stream import MODES

CONF = Path(__file__).resolve().parents[2] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def _compose(*overrides: str) -> Config:
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def test_default_composes_to_the_embedded_default():
    cfg = _compose()
    assert cfg.target.path is None and list(cfg.data.sources) == ["chatterbot"] and cfg.data.mix is None
    assert cfg.schedule.name == "cosine" and cfg.draft.ttt_steps == 7
    assert cfg.draft.draft_vocab_size == 4096 and cfg.schedule.lr == 1e-3  # sized for the small corpus


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_recipe_composes(name):
    assert isinstance(_compose(f"+experiment={name}"), Config)


def test_grok_100ep_is_constant_lr_for_100_epochs():
    cfg = _compose("+experiment=grok_100ep")
    assert cfg.schedule.name == "constant" and cfg.trainer.epochs == 100 and cfg.schedule.weight_decay > 0


def test_h200_quality_leak_checks_every_held_out_file_prepare_writes():
    cfg = _compose("+experiment=h200_quality")
    assert cfg.data.heldout_prompt_files == [str(f) for f in leak_checked_files(Path("outputs/corpora"))]
    assert cfg.trainer.eval_prompts_file == "outputs/corpora/heldout_sharegpt.jsonl"


def test_h200_quality_trains_on_greedy_and_sampled_answers_and_data_openai_keeps_the_greedy():
    cfg = _compose("+experiment=h200_quality")
    assert {k: v.path for k, v in cfg.data.sources.items()} == {
        "openai": "outputs/corpora/answered.jsonl",
        "sampled": "outputs/corpora/sampled.jsonl",
    }
    assert cfg.draft.intermediate_size == 6144 and cfg.schedule.name == "wsd"
    assert list(_compose("+experiment=h200_quality", "data=openai").data.sources) == ["openai"]


def test_unknown_key_is_refused():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as err:
        _compose("draft.ttt_step=3")
    assert "ttt_step" in str(err.value) + str(err.value.__cause__)


def test_wrong_type_is_refused():
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        _compose("draft.ttt_steps=many")
    assert "ttt_steps" in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize(
    "override, key",
    [
        ("schedule.name=linear", "schedule.name"),
        ("schedule.decay_ratio=0", "schedule.decay_ratio"),
        ("draft.ttt_steps=0", "draft.ttt_steps"),
        ("trainer.threads=0", "trainer.threads: must be >= 1"),
        ("draft.intermediate_size=0", "draft.intermediate_size"),
        ("data.mix={web:1.0}", "data.mix"),
        ("trainer.checkpoint_at_s=[60]", "trainer.checkpoint_at_s: marks a time on trainer.max_time_s's clock, which is not set"),
        ("+experiment=h200_quality trainer.checkpoint_at_s=[240,300]", "trainer.checkpoint_at_s: each of \\[240.0, 300.0\\] must lie"),
        ("trainer.profile_steps=[5]", "trainer.profile_steps: \\[5\\] is not \\[FIRST, LAST\\]"),
        ("trainer.profile_steps=[1,3]", "trainer.profile_steps: .*step 1 compiles the kernels"),
        ("trainer.profile_steps=[4,3]", "trainer.profile_steps: .* needs 2 <= FIRST <= LAST"),
        ("trainer.max_steps=10 trainer.profile_steps=[5,12]", "trainer.profile_steps: .* past trainer.max_steps=10"),
    ],
)
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ValueError, match=key):
        _compose(*override.split())


def test_a_time_capped_run_warms_up_over_its_time_not_its_epochs_steps():
    """A run capped by trainer.max_time_s long before its epochs end (48,120 steps of 30 epochs, 2,400 of them
    in 300 s on an H200) warms up over warmup_ratio of its time: on the H200 the warmup by those steps took
    722 steps, 30 % of the run, and held-out acc_0 came out 0.701 against 0.715 with a 36-step warmup."""
    wsd = _compose("schedule=wsd").schedule  # warmup_ratio 0.015
    total = 48_120
    assert warmup_steps(wsd, total) == 722
    assert lr_factor(wsd, 1, total, time_frac=0.0075) == pytest.approx(0.5)  # half the warmup's time, not 2 / 722
    assert lr_factor(wsd, 36, total, time_frac=0.015) == 1.0
    assert lr_factor(wsd, 36, total, time_frac=0.0) == pytest.approx(37 / 722)  # by steps alone, as before


def test_the_schedule_clock_starts_when_the_first_step_ends():
    """The first step's seconds (its compilation: about 18 of a 300-s budget on an H200) would be longer than the
    whole warmup; the schedule's time axis starts at its end, the time cap still counts them."""
    clock = RunClock(max_time_s=300.0)
    clock.spent_s = 18.0
    assert clock.schedule_frac == pytest.approx(0.06)  # before the first step's end is known: the whole budget's share
    clock.start_s = 18.0
    assert clock.schedule_frac == 0.0 and clock.time_frac == pytest.approx(0.06)
    clock.spent_s = 18.0 + 0.015 * 282.0
    assert clock.schedule_frac == pytest.approx(0.015)
    clock.spent_s = 301.0
    assert clock.schedule_frac == clock.time_frac > 1.0
    assert RunClock().schedule_frac == 0.0


def test_schedules():
    cosine, constant = _compose().schedule, _compose("schedule=constant").schedule
    total = 200
    warm = warmup_steps(cosine, total)
    assert warm == 3
    assert lr_factor(cosine, 0, total) == pytest.approx(1 / 3) and lr_factor(cosine, warm, total) == pytest.approx(1.0)
    assert lr_factor(cosine, total - 1, total) < 0.01
    assert all(lr_factor(constant, s, total) == 1.0 for s in range(warm, total))


def test_wsd_schedule_and_the_time_budget():
    """wsd: warmup, constant, then a linear fall over the last decay_ratio of the run, by steps or by the
    time budget's share spent, whichever is further; cosine reaches its floor when the time ends."""
    wsd = _compose("schedule=wsd", "schedule.decay_ratio=0.25", "schedule.min_lr_ratio=0.1").schedule
    total = 200
    assert warmup_steps(wsd, total) == 3 and lr_factor(wsd, 0, total) == pytest.approx(1 / 3)
    assert all(lr_factor(wsd, s, total) == 1.0 for s in range(3, 151))
    assert lr_factor(wsd, 175, total) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(wsd, 200, total) == pytest.approx(0.1) and lr_factor(wsd, 10_000, total) == pytest.approx(0.1)
    # a time-capped run: at step 10 of 200, with 87.5 % of trainer.max_time_s spent
    assert lr_factor(wsd, 10, total, time_frac=0.875) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(wsd, 10, total, time_frac=1.3) == pytest.approx(0.1)
    assert lr_factor(wsd, 1, total, time_frac=0.9) == pytest.approx(0.1 + 0.9 * 0.4)  # past the warmup by time
    cosine = _compose().schedule
    assert lr_factor(cosine, 10, total, time_frac=0.0) > 0.99
    assert lr_factor(cosine, 10, total, time_frac=1.0) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(cosine, 10, total, time_frac=0.5) == pytest.approx(lr_factor(cosine, 100, total), abs=0.01)
    assert all(lr_factor(_compose("schedule=constant").schedule, 10, total, time_frac=f) == 1.0 for f in (0.5, 1.0))


def test_a_schedule_is_one_function_and_one_yaml(tmp_path, monkeypatch):
    """Each conf/schedule yaml names a function of SCHEDULES and each function has its yaml; a new
    schedule needs nothing else (config.py checks schedule.name against SCHEDULES, lr_factor calls it)."""
    named = {yaml.safe_load(p.read_text())["name"]: p.stem for p in (CONF / "schedule").glob("*.yaml")}
    assert named == {name: name for name in SCHEDULES}
    conf = shutil.copytree(CONF, tmp_path / "conf")
    (conf / "schedule" / "half.yaml").write_text("name: half\nwarmup_ratio: 0.0\n")
    monkeypatch.setitem(SCHEDULES, "half", lambda cfg, done, start: 0.5)
    register_schema()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        half = to_config(compose(config_name="config", overrides=["schedule=half"])).schedule
    assert [lr_factor(half, step, 10) for step in (0, 9)] == [0.5, 0.5]


@pytest.mark.parametrize(
    "override, known",
    [
        ("data.sources.chatterbot.format=csv", DATA_FORMATS),
        ("data.overlong=cut", OVERLONG),
        ("data.on_error=warn", ON_ERROR),
        ("schedule.name=linear", tuple(SCHEDULES)),
        ("engine.mode=remote", MODES),
        ("trainer.resume_allow=[target]", CHANGEABLE),
    ],
)
def test_each_choice_is_checked_against_the_list_beside_its_implementation(override, known):
    with pytest.raises(ValueError) as err:
        _compose(override)
    assert ", ".join(known) in str(err.value)


@pytest.mark.parametrize(
    "override, key",
    [("+trainer.foo=1", "trainer.foo"), ("+foo=1", "foo"), ("+data.sources.chatterbot.colour=red", "data.sources.chatterbot.colour")],
)
def test_an_appended_unknown_key_is_refused(override, key):
    with pytest.raises(ValueError, match=rf"config {key}: unknown key"):
        _compose(override)


@pytest.mark.parametrize("group", ["target=local", "target=kimi_k25"])
def test_a_missing_mandatory_value_names_the_key(group):
    with pytest.raises(ValueError, match=r"config target.path: mandatory value missing .* target.path="):
        _compose(group)
    assert _compose(group, "target.path=/models/x").target.path == "/models/x"


def test_the_draft_optimizer_is_fused_on_a_gpu_and_takes_the_same_step():
    cfg = ScheduleConfig(lr=1e-2, weight_decay=0.1, betas=[0.8, 0.9])
    torch.manual_seed(0)
    start, weights = torch.randn(4, 3), []
    for device in ("cpu", "cuda"):  # the CPU params run the fused kernel's CPU twin when the run is on a GPU
        w = torch.nn.Parameter(start.clone())
        opt = draft_optimizer([w], cfg, torch.device(device))
        assert opt.defaults["fused"] is (device == "cuda") and opt.defaults["betas"] == (0.8, 0.9)
        for _ in range(3):
            w.grad = torch.full_like(w, 0.5)
            opt.step()
        weights.append(w.detach())
    assert torch.allclose(weights[0], weights[1], atol=1e-6) and not torch.allclose(weights[0], start, atol=1e-3)


def test_the_pointwise_chains_compile_on_cuda_unless_the_config_says():
    from trainer.build import pointwise_for

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not pointwise_for(_compose(), cpu).compiled and pointwise_for(_compose(), cuda).compiled
    assert pointwise_for(_compose("draft.compile_pointwise=true"), cpu).compiled
    assert not pointwise_for(_compose("draft.compile_pointwise=false"), cuda).compiled
