"""serving.speedup_compare: τ paired by prompt between results files of two exports, the files it refuses."""

import gzip
import json
import math
from pathlib import Path

import pytest

from serving.speedup_compare import main

CONDITIONS = {"prompts": "abc", "target": "/t", "max_new_tokens": 128, "engine": {"attention_backend": "triton"}, "export": "/e"}


def level(taus: list[float | None], tokens: int = 120) -> dict:
    """A level whose requests have these τ (None: a request without a verify step)."""
    reqs = [{"tokens": tokens, "verify_ct": round(tokens / t) if t else None, "latency_s": 0.1, "histogram": None} for t in taus]
    return {"wall_s": 1.0, "requests": reqs}


def results(path: Path, runs: dict, **conditions) -> Path:
    data = {"conditions": CONDITIONS | conditions, "runs": runs, "failed": {}}
    text = json.dumps(data)
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def tree(sets: dict) -> dict:
    return {"sets": {name: dict(levels) for name, levels in sets.items()}}


def test_the_difference_is_paired_by_prompt(tmp_path, capsys):
    plain = tree({"s": {"1": level([1.0, 1.0, 1.0])}})
    base = results(tmp_path / "a.json", {"plain": plain, "8/8/64": tree({"s": {"1": level([2.0, 3.0, 4.0])}})})
    (tmp_path / "b").mkdir()
    other = results(tmp_path / "b" / "speedup.json.gz", {"8/8/64": tree({"s": {"1": level([3.0, 3.0, 5.0])}})})
    out = tmp_path / "rows.json"
    assert main([str(base), str(other), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # differences 1, 0, 1: mean 2/3, sample stdev sqrt(1/3), standard error sqrt(1/3) / sqrt(3) = 1/3
    assert (row["setting"], row["set"], row["concurrency"], row["pairs"]) == ("8/8/64", "s", 1, 3)
    assert row["diff"] == pytest.approx(2 / 3) and row["diff_se"] == pytest.approx(1 / 3)
    assert (row["base_mean_tau"], row["other_mean_tau"]) == (pytest.approx(3.0), pytest.approx(11 / 3))
    printed = capsys.readouterr().out
    assert "b " in printed.splitlines()[2] and "+0.667" in printed and "+2.0" in printed  # the export dir's name, diff, z


def test_only_the_draft_levels_both_measured_and_prompts_both_verified_are_paired(tmp_path):
    base = results(
        tmp_path / "a.json",
        {"6/1/7": tree({"s": {"1": level([2.0, 2.0, 3.0]), "16": level([2.0, 2.0])}}), "3/1/4": tree({"s": {"1": level([2.0])}})},
    )
    other = results(
        tmp_path / "b.json",
        {"plain": tree({"s": {"1": level([1.0])}}), "6/1/7": tree({"s": {"1": level([3.0, None, 4.0])}, "t": {"1": level([2.0])}})},
    )
    out = tmp_path / "rows.json"
    assert main([str(base), str(other), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["setting"], row["set"], row["concurrency"], row["pairs"]) == ("6/1/7", "s", 1, 2)
    assert row["diff"] == pytest.approx(1.0) and row["diff_se"] == pytest.approx(0.0)
    assert (row["base_mean_tau"], row["other_mean_tau"]) == (pytest.approx(2.5), pytest.approx(3.5))  # the pairs' means


def test_one_pair_has_no_standard_error_and_none_no_difference(tmp_path):
    base = results(tmp_path / "a.json", {"6/1/7": tree({"s": {"1": level([2.0]), "4": level([None])}})})
    other = results(tmp_path / "b.json", {"6/1/7": tree({"s": {"1": level([3.0]), "4": level([2.0])}})})
    out = tmp_path / "rows.json"
    assert main([str(base), str(other), "--json", str(out)]) == 0
    one, none = json.loads(out.read_text())["rows"]
    assert one["diff"] == pytest.approx(1.0) and math.isnan(one["diff_se"])
    assert none["pairs"] == 0 and all(math.isnan(none[k]) for k in ("diff", "diff_se", "base_mean_tau", "other_mean_tau"))


@pytest.mark.parametrize("key, value", [("target", "/u"), ("max_new_tokens", 64), ("engine", {"attention_backend": "fa3"})])
def test_files_of_other_conditions_are_refused_by_name(tmp_path, capsys, key, value):
    runs = {"6/1/7": tree({"s": {"1": level([2.0, 3.0])}})}
    base = results(tmp_path / "a.json", runs)
    other = results(tmp_path / "b.json", runs, **{key: value})
    assert main([str(base), str(other)]) == 2
    err = capsys.readouterr().err
    assert f"{other} was measured under other conditions than {base} ({key} differ)" in err


def plain_level(outputs: list[list[int]]) -> dict:
    """The target alone's level with these output ids."""
    return {"wall_s": 1.0, "requests": [{"tokens": len(o), "verify_ct": len(o), "output_ids": o} for o in outputs]}


def test_other_concurrency_lists_pair_where_the_target_alone_agrees_and_name_the_rest(tmp_path, capsys):
    # base measured concurrency 1 and 16, other 1 alone: other prompt hashes, other top-concurrency engine options
    base_plain = tree({"s": {"1": plain_level([[1, 2], [3]]), "16": plain_level([[1, 2], [3]])}, "t": {"1": plain_level([[5]])}})
    base_chain = tree({"s": {"1": level([2.0, 3.0]), "16": level([2.0, 3.0])}, "t": {"1": level([2.0])}})
    engine = {"attention_backend": "triton", "max_running_requests": 16, "cuda_graph_max_bs_decode": 16}
    base = results(tmp_path / "a.json", {"plain": base_plain, "6/1/7": base_chain}, engine=engine)
    other_plain = tree({"s": {"1": plain_level([[1, 2], [3]])}, "t": {"1": plain_level([[6]])}})
    other_chain = tree({"s": {"1": level([3.0, 4.0])}, "t": {"1": level([3.0])}})
    one = engine | {"max_running_requests": 1, "cuda_graph_max_bs_decode": 1}
    other = results(tmp_path / "b.json", {"plain": other_plain, "6/1/7": other_chain}, prompts="def", engine=one)
    out = tmp_path / "rows.json"
    assert main([str(base), str(other), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["set"], row["concurrency"], row["diff"]) == ("s", 1, pytest.approx(1.0))
    err = capsys.readouterr().err
    assert f"{other}: not paired with {base}: 6/1/7 t c=1 (the prompts' hashes differ" in err


@pytest.mark.parametrize("other_outputs", [[[9, 9], [3]], None])
def test_other_prompts_are_refused_when_no_level_of_the_target_alone_agrees(tmp_path, capsys, other_outputs):
    chain = tree({"s": {"1": level([2.0, 3.0])}})
    base = results(tmp_path / "a.json", {"plain": tree({"s": {"1": plain_level([[1, 2], [3]])}}), "6/1/7": chain})
    runs = {"6/1/7": chain} | ({"plain": tree({"s": {"1": plain_level(other_outputs)}})} if other_outputs else {})
    other = results(tmp_path / "b.json", runs, prompts="def")
    assert main([str(base), str(other)]) == 2
    assert f"{other} and {base}: no level measured on the same prompts" in capsys.readouterr().err


def test_another_export_of_the_same_conditions_is_compared(tmp_path):
    runs = {"6/1/7": tree({"s": {"1": level([2.0, 3.0])}})}
    base = results(tmp_path / "a.json", runs)
    other = results(tmp_path / "b.json", runs, export="/another")
    assert main([str(base), str(other)]) == 0


def test_files_sharing_no_draft_level_are_refused(tmp_path, capsys):
    base = results(tmp_path / "a.json", {"6/1/7": tree({"s": {"1": level([2.0])}})})
    other = results(tmp_path / "b.json", {"8/8/64": tree({"s": {"1": level([2.0])}})})
    assert main([str(base), str(other)]) == 2
    assert "share no draft setting, prompt set and concurrency" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"runs": {}}'])
def test_a_file_that_is_not_a_results_file_is_refused_by_name(tmp_path, capsys, text):
    base = results(tmp_path / "a.json", {"6/1/7": tree({"s": {"1": level([2.0])}})})
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main([str(base), str(bad)]) == 2
    assert f"{bad}: not a results file of serving.speedup" in capsys.readouterr().err
