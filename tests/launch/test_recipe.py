"""launch/recipe.py's bookkeeping on the CPU: the phases file, what is left to answer after a resume,
earlier answers carried in, the training figures, and corpora checked before anything starts."""

import gzip
import json

import pytest

from launch import recipe
from trainer.datagen.record_ids import record_id
from trainer.regenerate import unanswered


def test_phases_are_kept_as_they_end_and_tabled(tmp_path):
    phases = recipe.Phases(tmp_path / "phases.json")
    phases.add("generation: greedy", 12.34, new_tokens=100)
    again = recipe.Phases(tmp_path / "phases.json")  # a rerun goes on from the file
    again.add("training process", 20.0, steps=3)
    rows = json.loads((tmp_path / "phases.json").read_text())
    assert [r["phase"] for r in rows] == ["generation: greedy", "training process"] and rows[0]["new_tokens"] == 100
    again.add(recipe.GRID_PHASE, 100.0, settings=["6/8/32"])
    assert again.table().splitlines()[-1].split()[-1] == "32.3"  # the grid is no part of the recipe's time


def _conv(text: str) -> list[dict]:
    return [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]


def test_what_is_left_to_answer_counts_done_ids_and_greedy_repeats(tmp_path):
    convs = [_conv("a"), _conv("b"), _conv("a"), _conv("c")]
    out = tmp_path / "answered.jsonl"
    assert unanswered(convs, out, greedy=True) == 3  # the repeat of "a" comes out of the first
    assert unanswered(convs, out, greedy=False) == 4  # sampled: each is answered
    out.write_text(json.dumps({"id": record_id(convs[0]), "messages": []}) + "\n")
    assert unanswered(convs, out, greedy=True) == 2


def test_earlier_answers_are_carried_in_once(tmp_path):
    source = tmp_path / "answered.jsonl.gz"
    with gzip.open(source, "wt") as f:
        f.write('{"id": "x"}\n')
    out = tmp_path / "out.jsonl"
    recipe.carried(source, out)
    assert out.read_text() == '{"id": "x"}\n'
    out.write_text('{"id": "x"}\n{"id": "y"}\n')
    recipe.carried(source, out)  # a resumed recipe keeps what it wrote since
    assert out.read_text().count("\n") == 2


def test_training_figures_split_the_speedup_from_the_training(tmp_path):
    phases = {"start-up": 20.04, "training": 541.0}
    summary = {"train_time_s": 540.04, "steps": 4000, "wall_time_s": 610.0, "phase_s": phases, "engine_start_s": 41.26}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    runs = {"plain": {"process_s": 60.0, "start_s": 40.0}, "6/1/7": {"process_s": 80.0, "start_s": 55.0}}
    (tmp_path / "speedup.json").write_text(json.dumps({"runs": runs}))
    figures = recipe.training_figures(tmp_path)
    assert figures == {
        "train_s": 540.0,
        "steps": 4000,
        "trainer_wall_s": 610.0,
        "phases_s": {"start-up": 20.0, "training": 541.0},
        "engine_start_s": 41.3,
        "speedup_s": 140.0,
        "speedup_engine_starts_s": 95.0,
        "speedup_settings": 2,
    }


def test_missing_corpora_stop_the_recipe_before_anything_starts(tmp_path):
    with pytest.raises(SystemExit, match="no train_prompts.jsonl.gz"):
        recipe.main(["--corpora", str(tmp_path), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_sampled_pass_answers_the_sources_asked_for(tmp_path):
    records = [{"id": f"p{i}", "prompt": f"question {i}", "source": source} for i, source in enumerate(["sharegpt", "codeio", "evals"])]
    with gzip.open(tmp_path / "train_prompts.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    base = ["--corpora", str(tmp_path), "--out", str(tmp_path / "out")]

    def asked(extra: list[str]) -> tuple[list[str], list[str]]:
        (_, every, _, _, greedy), (_, some, _, _, sampled) = recipe.generation_passes(recipe._parser().parse_args(base + extra))
        assert greedy.temperature == 0.0 and sampled.temperature == 0.6
        return [c[0]["content"] for c in every], [c[0]["content"] for c in some]

    assert asked([]) == (["question 0", "question 1", "question 2"], ["question 0"])  # ShareGPT's by default
    assert asked(["--sampled-sources", "codeio", "evals"])[1] == ["question 1", "question 2"]
    with pytest.raises(ValueError, match="no record of source followups"):
        asked(["--sampled-sources", "followups"])


def test_the_training_time_is_the_experiments_unless_given(tmp_path):
    from tests.trainer.test_config import _compose

    base = ["--corpora", str(tmp_path), "--out", str(tmp_path / "out")]

    def trained_s(extra: list[str]) -> float:
        overrides = recipe.train_overrides(recipe._parser().parse_args(base + extra), tmp_path / "a.jsonl", tmp_path / "s.jsonl")
        return _compose(*(o for o in overrides if not o.startswith("hydra."))).trainer.max_time_s

    assert trained_s([]) == 300  # h200_quality's: the recipe from nothing in 20 minutes of one H200
    assert trained_s(["--train-s", "120"]) == 120


def test_the_grid_resumes_the_trainings_speedup_results_and_bad_settings_stop_it_first(tmp_path):
    corpora, out = tmp_path / "corpora", tmp_path / "out"
    corpora.mkdir()
    with gzip.open(corpora / "train_prompts.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "p0", "prompt": "q", "source": "sharegpt"}) + "\n")
    for name in recipe.HELDOUT:
        (corpora / f"heldout_{name}.jsonl").write_text("")
    base = ["--corpora", str(corpora), "--out", str(out)]
    for bad, says in ((["--grid", "6/1/9"], "a chain"), (["--grid", "6/8/32", "--engine", "hf"], "SGLang engine")):
        with pytest.raises(SystemExit, match=says):
            recipe.main(base + bad)
        assert not out.exists()  # refused before anything is made
    args = recipe._parser().parse_args(base + ["--grid", "6/8/32", "8/8/64"])
    run = out / "run"
    with pytest.raises(SystemExit, match="speedup.json is missing"):
        recipe.speedup_grid_argv(args, run)
    run.mkdir(parents=True)
    export = str(run / "export" / "sglang")
    (run / "speedup.json").write_text(json.dumps({"conditions": {"export": export, "target": "/cache/smollm2"}, "runs": {}}))
    argv = recipe.speedup_grid_argv(args, run)
    assert argv[1:4] == ["-m", "serving.speedup", export]
    assert argv[argv.index("--target") + 1] == "/cache/smollm2" and argv[argv.index("--json") + 1] == str(run / "speedup.json")
    assert argv[argv.index("--settings") + 1 :] == ["6/8/32", "8/8/64"]
    prompts = [str(corpora / "heldout_sharegpt.jsonl"), str(corpora / "heldout_codeio.jsonl")]
    assert argv[argv.index("--prompts") + 1 : argv.index("--target")] == prompts


def test_the_generation_engines_are_sized_to_the_gpu_before_any_starts(tmp_path, monkeypatch):
    """On an 80-GB H100: --replicas 4 refused with what fits, the default (auto) two engines."""
    import torch

    from tests.trainer.test_gen_memory import CARDS

    corpora = tmp_path / "corpora"
    corpora.mkdir()
    with gzip.open(corpora / "train_prompts.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "p0", "prompt": "q", "source": "sharegpt"}) + "\n")
    for name in recipe.HELDOUT:
        (corpora / f"heldout_{name}.jsonl").write_text("")
    opened = []

    def open_generator(settings):
        opened.append(settings)
        raise KeyboardInterrupt  # no engine here: stop the recipe where it would start them

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: CARDS["H100"])
    monkeypatch.setattr(recipe, "open_generator", open_generator)
    base = ["--corpora", str(corpora), "--out", str(tmp_path / "out"), "--phases", "generation"]
    with pytest.raises(SystemExit, match=r"^--replicas 4 at --mem-fraction-static 0.8: (.|\n)*what fits: --replicas 2 or"):
        recipe.main(base + ["--replicas", "4"])
    assert opened == []
    with pytest.raises(KeyboardInterrupt):
        recipe.main(base)
    assert [g.replicas for g in opened] == [2] and dict(opened[0].sglang_args)["disable_prefill_cuda_graph"] is True
