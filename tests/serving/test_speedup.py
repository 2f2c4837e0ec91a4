"""serving.speedup on the CPU: settings and their checks, the grid's resume and failures, the analysis
(speedup, identity, the best setting, the cost model), serving.json and serving.launch reading it, and
the inputs refused before any engine starts. SGLang's engines run on the GPU only: here a stand-in
runner answers each job with the records an engine of known step costs would give."""

import json
from pathlib import Path

import pytest
import torch

from models.draft import DraftShape, Eagle3Draft
from models.vocab_map import build_vocab_map
from serving import speedup
from serving.export import export_draft
from serving.formats import ExportSpec
from serving.launch import main as launch_main
from serving.speedup import Bench, SettingFailed, check_backend, level_sizes, parse_setting, run_grid, summarise
from serving.speedup_report import (
    PLAIN,
    SERVING_FILE,
    analyse,
    best_by_concurrency,
    cost_model,
    first_difference,
    level_stats,
    near_tie,
    nearest_rank,
    serving_choice,
)

STEP_S = 0.004  # the target alone: one token per step
DRAFT_S, VERIFY_S = 0.0005, 0.0045  # a chain of k: k draft steps and one verify per cycle
TOKENS = 32


def test_settings_parse_and_refuse_what_sglang_would_change():
    assert parse_setting("6/1/7") == (6, 1, 7) and parse_setting("5/4/8") == (5, 4, 8)
    with pytest.raises(ValueError, match="steps \\+ 1 = 7"):
        parse_setting("6/1/8")
    with pytest.raises(ValueError, match="2 to 5 draft tokens"):  # 1 step at top-4: the root and 4 candidates
        parse_setting("1/4/6")
    with pytest.raises(ValueError, match="STEPS/TOPK/DRAFT_TOKENS"):
        parse_setting("6,1,7")
    with pytest.raises(ValueError, match="runs chains only"):
        check_backend([(6, 1, 7), (5, 4, 8)], "trtllm_mha", 1)
    with pytest.raises(ValueError, match="page size 16"):
        check_backend([(5, 4, 8)], "flashmla", 16)
    check_backend([(5, 4, 8)], "triton", 16)


def test_levels_take_the_files_first_prompts():
    assert level_sizes(200, [1, 4, 16, 64], 64, 4) == {"1": 64, "4": 64, "16": 64, "64": 200}
    assert level_sizes(10, [1, 64], 64, 4) == {"1": 10, "64": 10}


def _records(name: str, prompts: list[list[int]], c: int) -> dict:
    """What an engine of the stand-in's costs returns for one level: the target alone takes STEP_S a
    token; a chain of k accepts all but every third cycle (τ = k + 1 or 1 alternately)."""
    reqs = []
    for i, ids in enumerate(prompts):
        out = [(ids[0] * 7 + t) % 97 for t in range(TOKENS)]
        if name == PLAIN:
            reqs.append({"latency_s": STEP_S * TOKENS, "tokens": TOKENS, "verify_ct": None, "histogram": None, "output_ids": out})
            continue
        steps = int(name.split("/")[0])
        per_cycle = (steps + 1 + 1 + steps + 1) / 3
        cycles = round(TOKENS / per_cycle)
        if i == 1:  # a bf16 near-tie: one output differs from the target alone's at token 5
            out = out[:5] + [out[5] + 1] + out[6:]
        hist = [0] * (steps + 1)
        hist[steps] = cycles - cycles // 3
        hist[0] = cycles // 3
        latency = cycles * (steps * DRAFT_S + VERIFY_S)
        reqs.append({"latency_s": latency, "tokens": TOKENS, "verify_ct": cycles, "histogram": hist, "output_ids": out})
    return {"wall_s": sum(r["latency_s"] for r in reqs) / c, "requests": reqs}


def _top_records(prompts: list[list[int]]) -> list[dict]:
    """The target alone's top-logprob pass: at each position its own token, the next id 0.05 behind (a near
    tie), the one after far behind."""
    records = []
    for ids in prompts:
        out = [(ids[0] * 7 + t) % 97 for t in range(TOKENS)]
        records.append({"output_ids": out, "top": [[[tok, -0.5], [tok + 1, -0.55], [tok + 2, -3.0]] for tok in out]})
    return records


def stand_in(calls: list[str], fail: set[str] = frozenset()):
    def runner(job, log_path, timeout_s, name):
        calls.append(name)
        if name in fail:
            raise SettingFailed(f"setting {name}: the engine process exited with code 1; log {log_path} is empty")
        sets = {s: {c: _records(name, ids, int(c)) for c, ids in levels.items()} for s, levels in job["sets"].items()}
        lowest = str(min(job["concurrency"]))
        tops = {s: _top_records(levels[lowest]) for s, levels in job["sets"].items() if job["top_logprobs"]}
        return {"start_s": 30.0, "sglang": "0.5.14", "device": "stand-in", "sets": sets, "top_logprobs": tops}

    return runner


SHAPE = DraftShape(64, 96, 4, 2, 16, 48, 3, 300, 100, 1e-5, 500000.0, 512)


def _bench(tmp_path: Path) -> Bench:
    """A real (tiny, untrained) SGLang export and two prompt sets of token ids."""
    export = tmp_path / "export" / "sglang"
    torch.manual_seed(0)
    counts = torch.randint(1, 1000, (SHAPE.vocab_size,), generator=torch.Generator().manual_seed(0))
    vocab = build_vocab_map(counts, SHAPE.draft_vocab_size)
    export_draft(export, "sglang", Eagle3Draft(SHAPE), vocab, ExportSpec.of([1, 7, 12], norm_output=False))
    prompts = [[p, p + 1] for p in range(1, 9)]
    sets = {"chat": {"1": prompts[:4], "4": prompts}, "code": {"1": prompts[:4], "4": prompts}}
    return Bench(export, tmp_path / "target", sets, [2], [1, 4], TOKENS, {"attention_backend": "triton"}, 60.0)


def _decode(ids):
    return " ".join(map(str, ids))


def test_the_grid_runs_plain_first_resumes_and_retries_a_failed_setting(tmp_path):
    bench, results, calls = _bench(tmp_path), tmp_path / "speedup.json", []
    data = run_grid(bench, ["6/1/7", "3/1/4", "5/4/8"], results, _decode, stand_in(calls, fail={"5/4/8"}))
    assert calls == [PLAIN, "6/1/7", "3/1/4", "5/4/8"]
    assert set(data["runs"]) == {PLAIN, "6/1/7", "3/1/4"} and "5/4/8" in data["failed"]
    assert json.loads(results.read_text())["runs"].keys() == data["runs"].keys()  # written after each setting
    calls.clear()
    data = run_grid(bench, ["6/1/7", "3/1/4", "5/4/8"], results, _decode, stand_in(calls))
    assert calls == ["5/4/8"] and not data["failed"]  # the measured ones are not run again; the failed one is
    other = Bench(**(vars(bench) | {"max_new_tokens": 64}))
    with pytest.raises(ValueError, match="other conditions \\(max_new_tokens differ\\)"):
        run_grid(other, ["6/1/7"], results, _decode, stand_in(calls))


def test_a_failing_target_alone_stops_the_grid_with_the_settings_name(tmp_path):
    with pytest.raises(SettingFailed, match="setting plain"):
        run_grid(_bench(tmp_path), ["6/1/7"], tmp_path / "s.json", _decode, stand_in([], fail={PLAIN}))


def test_speedup_identity_and_divergences_come_from_the_records(tmp_path):
    data = run_grid(_bench(tmp_path), ["6/1/7", "3/1/4"], tmp_path / "s.json", _decode, stand_in([]))
    rows = analyse(data["runs"])
    chain6 = next(r for r in rows if (r["setting"], r["set"], r["concurrency"]) == ("6/1/7", "chat", 4))
    plain = next(r for r in rows if (r["setting"], r["set"], r["concurrency"]) == (PLAIN, "chat", 4))
    cycles = round(TOKENS / ((6 + 1 + 1 + 6 + 1) / 3))
    assert chain6["tau"] == pytest.approx(TOKENS / cycles)
    assert chain6["speedup"] == pytest.approx(STEP_S * TOKENS / (cycles * (6 * DRAFT_S + VERIFY_S)))
    assert chain6["cycle_ms"] == pytest.approx(1e3 * (6 * DRAFT_S + VERIFY_S))
    assert plain["speedup"] == 1.0 and plain["identical_to_concurrency_1"] == 4
    assert chain6["identical"] == 7 and chain6["requests"] == 8  # prompt 1 diverged
    (d,) = data["runs"]["6/1/7"]["sets"]["chat"]["4"]["divergences"]
    assert d["prompt"] == 1 and d["at_token"] == 5 and d["plain"] != d["draft"]
    assert "output_ids" not in data["runs"]["6/1/7"]["sets"]["chat"]["4"]["requests"][0]  # kept for the target alone only
    assert "output_ids" in data["runs"][PLAIN]["sets"]["chat"]["4"]["requests"][0]


def test_a_near_tie_is_held_to_the_noise_floor_with_fp32_slack():
    """On the H200 one bf16 gap came back as 0.25 in the noise floor and 0.2500000000000001 at a divergence."""
    assert near_tie(0.2500000000000001, 0.25) and near_tie(-0.25, 0.25) and near_tie(0.0, 0.0)
    assert not near_tie(0.5000000000000001, 0.25) and not near_tie(0.3125, 0.25)
    assert not near_tie(None, 0.25) and not near_tie(0.0, None)


def test_divergences_carry_the_targets_margin_and_near_ties_are_counted(tmp_path):
    """The target alone's own outputs at concurrency 4 leave those at 1 once, at a margin of 0.05 (the noise
    floor); the chain's divergences at a margin of 0.05 either way are near ties, one to a token beyond the
    target's top ones is not."""

    def runner(job, log_path, timeout_s, name):
        run = stand_in([])(job, log_path, timeout_s, name)
        level = run["sets"]["chat"]["4"]["requests"]
        if name == PLAIN:
            level[2]["output_ids"][3] += 1  # batch-shape noise: the near-tie token
        else:
            level[3]["output_ids"][7] += 50  # a token the target did not rank among its top 3
        return run

    data = run_grid(_bench(tmp_path), ["6/1/7"], tmp_path / "s.json", _decode, runner)
    rows = {(r["setting"], r["set"], r["concurrency"]): r for r in analyse(data["runs"])}
    plain = rows[(PLAIN, "chat", 4)]
    assert plain["self_margins"] == [pytest.approx(0.05)] and plain["noise_floor"] == pytest.approx(0.05)
    assert rows[(PLAIN, "code", 4)]["noise_floor"] is None  # no own divergence in that set
    tie, noise, far = data["runs"]["6/1/7"]["sets"]["chat"]["4"]["divergences"]
    assert (tie["prompt"], tie["at_token"], tie["beyond_top"]) == (1, 5, False) and tie["margin"] == pytest.approx(0.05)
    assert (noise["prompt"], noise["at_token"]) == (2, 3) and noise["margin"] == pytest.approx(-0.05)  # the target's own pick moved
    assert (far["prompt"], far["at_token"], far["beyond_top"]) == (3, 7, True) and far["margin"] == pytest.approx(2.5)
    chain = rows[("6/1/7", "chat", 4)]
    assert chain["identical"] == 5 and chain["near_ties"] == 2
    assert rows[("6/1/7", "code", 4)]["near_ties"] == 0  # a divergence, but no noise floor to hold it to
    text = summarise(data, tmp_path / "s.json", _bench(tmp_path).export_dir)
    assert "6/1/7 chat c=4 prompt 1 token 5 (margin 0.050)" in text and "prompt 3 token 7 (margin > 2.500)" in text
    assert "tie: divergences at a margin within 0.050" in text


def test_a_margin_needs_the_same_prefix_in_the_top_logprob_record():
    from serving.speedup_report import margin_at

    top = {"output_ids": [1, 2, 3], "top": [[[1, -0.1], [9, -0.2]], [[2, -0.1], [8, -0.3]], [[3, -0.1]]]}
    assert margin_at(top, [1, 2, 3], [1, 8, 3], 1) == {"margin": pytest.approx(0.2), "beyond_top": False}
    assert margin_at(top, [1, 5, 3], [1, 5, 4], 2)["margin"] is None  # the record decoded another prefix
    assert margin_at(top, [1, 2], [1, 2, 3], 2)["margin"] is None  # one output ended there
    assert margin_at(None, [1, 2, 3], [1, 8, 3], 1)["margin"] is None  # a prompt beyond the pass


def test_the_best_setting_is_the_fastest_not_the_longest_accepted(tmp_path):
    data = run_grid(_bench(tmp_path), ["6/1/7", "3/1/4"], tmp_path / "s.json", _decode, stand_in([]))
    rows = analyse(data["runs"])
    best = best_by_concurrency(rows)
    speed = {r["setting"]: r["speedup"] for r in rows if r["concurrency"] == 1 and r["set"] == "chat"}
    tau = {r["setting"]: r["tau"] for r in rows if r["concurrency"] == 1 and r["set"] == "chat" and "tau" in r}
    assert tau["6/1/7"] > tau["3/1/4"]
    assert best["1"]["setting"] == max(("6/1/7", "3/1/4"), key=speed.get)
    assert best["1"]["num_draft_tokens"] == int(best["1"]["setting"].split("/")[2])


def test_the_cost_model_recovers_the_draft_step_and_the_verify(tmp_path):
    data = run_grid(_bench(tmp_path), ["6/1/7", "3/1/4"], tmp_path / "s.json", _decode, stand_in([]))
    model = cost_model(analyse(data["runs"]))["chat @ 1"]
    assert model["draft_ms"] == pytest.approx(1e3 * DRAFT_S) and model["verify_ms"] == pytest.approx(1e3 * VERIFY_S)
    assert model["step_ms"] == pytest.approx(1e3 * STEP_S)
    for s in model["settings"].values():
        assert s["model"] == pytest.approx(s["speedup"], rel=0.02) and s["draft_free"] > s["speedup"]


def test_summary_writes_serving_json_that_serving_launch_reads(tmp_path, capsys):
    bench, results = _bench(tmp_path), tmp_path / "s.json"
    data = run_grid(bench, ["6/1/7", "3/1/4"], results, _decode, stand_in([]))
    text = summarise(data, results, bench.export_dir)
    assert "outputs that differ from the target alone's: 8" in text  # prompt 1, in two sets at two levels, for each chain
    choice = serving_choice(bench.export_dir, 3)  # 3 is nearer 4 than 1
    assert choice["concurrency"] == 4 and choice["file"].endswith(SERVING_FILE)
    capsys.readouterr()
    target = tmp_path / "target"
    assert launch_main(["--engine", "sglang", "--target", str(target), "--draft", str(bench.export_dir), "--concurrency", "4"]) == 0
    out = capsys.readouterr()
    steps, topk, tokens = choice["setting"].split("/")
    assert f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}" in out.out
    assert "measured best at concurrency 4" in out.err
    assert launch_main(["--engine", "sglang", "--target", str(target), "--draft", str(bench.export_dir), "--num-steps", "2"]) == 0
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in capsys.readouterr().out


def test_a_corrupt_serving_json_is_named(tmp_path):
    (tmp_path / SERVING_FILE).write_text("{")
    with pytest.raises(ValueError, match="not a serving.speedup result"):
        serving_choice(tmp_path, 1)
    assert serving_choice(tmp_path / "none", 1) is None


def test_helpers():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1 and first_difference([1, 2], [1, 2, 3]) == 2
    assert nearest_rank([5, 1, 4, 2, 3], 0.9) == 5 and nearest_rank([5, 1, 4, 2, 3], 0.5) == 3


@pytest.mark.slow
def test_inputs_are_refused_before_an_engine_starts(tmp_path, capsys):
    from models.embedded import embedded_target_dir
    from tests.serving.test_verify import _export_draft

    target = embedded_target_dir()
    dirs = _export_draft(target, tmp_path / "export")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    base = ["--prompts", str(prompts), "--target", str(target)]
    assert speedup.main([str(dirs["vllm"]), *base]) == 2
    assert "exported for vllm, not sglang" in capsys.readouterr().err
    assert speedup.main([str(dirs["sglang"]), "--prompts", str(prompts), "--target", str(tmp_path / "nothing")]) == 2
    assert "not a transformers model dir" in capsys.readouterr().err
    assert speedup.main([str(dirs["sglang"]), *base, "--settings", "5/4/8", "--attention-backend", "trtllm_mha"]) == 2
    assert "runs chains only" in capsys.readouterr().err
    assert not (tmp_path / "export" / "speedup.json").exists()  # nothing written


def test_the_trainer_refuses_the_phase_it_cannot_run_before_anything_starts(tmp_path):
    from tests.fixtures.tiny import tiny_config
    from trainer.preflight import check_inputs
    from trainer.speedup_phase import check_speedup

    check_speedup(tiny_config())  # off by default
    with pytest.raises(ValueError, match="trainer.speedup.enabled: the speedup is measured in SGLang on a CUDA GPU"):
        check_speedup(tiny_config("trainer.speedup.enabled=true"))
    with pytest.raises(ValueError, match="trainer.speedup.enabled: the speedup is measured in SGLang on a CUDA GPU"):
        check_inputs(tiny_config("trainer.speedup.enabled=true"), tmp_path)  # with the run's other inputs, before anything starts
    with pytest.raises(ValueError, match="config trainer.speedup.settings: 6/1/8: a chain"):
        tiny_config("trainer.speedup.settings=[6/1/8]")


def test_the_trainer_summary_shows_the_measured_speedup(tmp_path, monkeypatch):
    from tests.fixtures.tiny import tiny_config
    from trainer import speedup_phase
    from trainer.model_card import add_speedup
    from trainer.report.report import speedup_figures

    def measured(argv):
        results = Path(argv[argv.index("--json") + 1])
        best = {"1": {"setting": "5/4/8", "speedup": 2.25, "num_steps": 5, "topk": 4, "num_draft_tokens": 8}}
        results.write_text(json.dumps({"best": best, "failed": {"8/8/64": "setting 8/8/64: ..."}}))
        assert argv[argv.index("--settings") + 1 : argv.index("--concurrency")] == ["6/1/7", "5/4/8"]
        assert argv[argv.index("--repeats") + 1] == "2"
        return 1

    monkeypatch.setattr(speedup_phase, "speedup_main", measured)
    cfg = tiny_config(
        "trainer.speedup.enabled=true",
        "trainer.speedup.settings=[6/1/7,5/4/8]",
        "trainer.speedup.repeats=2",
        "trainer.eval_prompts_file=p.jsonl",
    )
    export = tmp_path / "export" / "sglang"
    export.mkdir(parents=True)
    (export / "README.md").write_text("# card\n")
    entry = speedup_phase.measure_speedup(cfg, export, tmp_path / "target", tmp_path)["speedup"]
    add_speedup(export, entry)
    card = (export / "README.md").read_text()
    assert card.startswith("# card\n") and "- concurrency 1: 5/4/8 (steps/topk/draft tokens), 2.25x the target alone" in card
    assert entry["exit_code"] == 1 and entry["failed"] == ["8/8/64"]
    figures = dict(speedup_figures(entry))
    assert figures["speedup in SGLang, concurrency 1"] == "2.25x the target alone (tree: 5 steps, top-4, 8 tokens: 5/4/8)"
    assert figures["speedup settings that failed"] == "8/8/64"
    assert speedup_phase.measure_speedup(tiny_config(), tmp_path, tmp_path, tmp_path) == {}


def test_an_engine_process_that_dies_is_named_with_its_log(tmp_path):
    """The real engine process, which cannot start SGLang on this machine: the setting, the exit code
    and the log's last lines come back; no result is taken."""
    job = _bench(tmp_path).job("6/1/7")
    with pytest.raises(SettingFailed, match="setting 6/1/7 \\(chain of 6\\): the engine process exited with code 1") as e:
        speedup.run_engine(job, tmp_path / "logs" / "6-1-7.log", 120.0, "6/1/7")
    assert "sglang" in str(e.value) and (tmp_path / "logs" / "6-1-7.log").is_file()


def test_a_draft_slower_than_the_target_alone_is_said_so(tmp_path, capsys):
    bench, results = _bench(tmp_path), tmp_path / "s.json"
    data = run_grid(bench, ["6/1/7"], results, _decode, stand_in([]))
    for level in (lv for s in data["runs"]["6/1/7"]["sets"].values() for lv in s.values()):
        for r in level["requests"]:
            r["latency_s"] *= 10  # ten times slower than the stand-in's costs
        level["wall_s"] *= 10
    text = summarise(data, results, bench.export_dir)
    assert "slower than the target alone here: serve it without the draft" in text
    capsys.readouterr()
    assert launch_main(["--engine", "sglang", "--target", str(tmp_path), "--draft", str(bench.export_dir)]) == 0
    assert "no measured setting beat the target alone at concurrency 1" in capsys.readouterr().err


def test_the_engine_options_of_a_job():
    from models.backends.sglang.speedup_engine import engine_options, request_record

    job = {"target": "/t", "draft": None, "setting": None, "engine": {"attention_backend": "triton", "max_running_requests": 64}}
    assert _bench(Path("/nonexistent")).job(PLAIN)["top_logprobs"] == 5 and _bench(Path("/none")).job("6/1/7")["top_logprobs"] == 0
    plain = engine_options(job)
    assert plain["model_path"] == "/t" and plain["skip_tokenizer_init"] and plain["max_running_requests"] == 64
    assert not any(k.startswith("speculative") for k in plain)
    tree = engine_options(job | {"draft": "/d", "setting": [5, 4, 8]})
    assert (tree["speculative_algorithm"], tree["speculative_draft_model_path"]) == ("EAGLE3", "/d")
    assert (tree["speculative_num_steps"], tree["speculative_eagle_topk"], tree["speculative_num_draft_tokens"]) == (5, 4, 8)
    out = {"output_ids": [5, 6, 2], "meta_info": {"completion_tokens": 3, "spec_verify_ct": 2, "spec_correct_drafts_histogram": [1, 1]}}
    assert request_record(0.5, out) == {"latency_s": 0.5, "tokens": 3, "verify_ct": 2, "histogram": [1, 1], "output_ids": [5, 6, 2]}


def test_a_draft_request_without_speculative_counters_is_an_error_not_a_gap_in_tau(tmp_path):
    def runner(job, log_path, timeout_s, name):
        run = stand_in([])(job, log_path, timeout_s, name)
        if name != PLAIN:
            run["sets"]["code"]["4"]["requests"][3]["verify_ct"] = None
        return run

    with pytest.raises(ValueError, match="setting 6/1/7, code at concurrency 4, prompt 3: SGLang reported no speculative counters"):
        run_grid(_bench(tmp_path), ["6/1/7"], tmp_path / "s.json", _decode, runner)
    assert list(json.loads((tmp_path / "s.json").read_text())["runs"]) == [PLAIN]  # nothing of the setting kept


def test_serving_launch_refuses_zero_steps_rather_than_defaulting(tmp_path, capsys):
    with pytest.raises(ValueError, match="must be >= 1"):
        launch_main(["--engine", "sglang", "--target", str(tmp_path), "--num-steps", "0"])


def test_the_top_logprob_pass_keeps_token_and_logprob_pairs():
    """SGLang's ``output_top_logprobs``: per position (logprob, token id, text) triples, or None."""
    import asyncio

    from models.backends.sglang.speedup_engine import top_logprob_pass

    class Engine:
        async def async_generate(self, input_ids, sampling_params, return_logprob, top_logprobs_num):
            assert return_logprob and top_logprobs_num == 2
            positions = [[(-0.123456, 7, None), (-0.3, 9, None)], None]
            return {"output_ids": [7, 8], "meta_info": {"output_top_logprobs": positions}}

    records = asyncio.run(top_logprob_pass(Engine(), [[1, 2]], {"temperature": 0.0}, 2))
    assert records == [{"output_ids": [7, 8], "top": [[[7, -0.1235], [9, -0.3]], []]}]


def test_the_engine_settings_every_engine_shares():
    args = speedup._parser().parse_args(["/e", "--prompts", "p.jsonl", "--concurrency", "1", "16", "--fp32-lm-head"])
    settings = speedup.engine_settings(args)
    assert settings["max_running_requests"] == settings["cuda_graph_max_bs_decode"] == 16
    assert settings["enable_fp32_lm_head"] and not settings["enable_deterministic_inference"]
    assert settings["attention_backend"] == "triton" and settings["disable_prefill_cuda_graph"]
    assert not speedup.engine_settings(speedup._parser().parse_args(["/e", "--prompts", "p.jsonl"]))["enable_fp32_lm_head"]


def test_a_second_export_takes_the_target_alone_from_the_first_ones_results(tmp_path):
    first, calls = _bench(tmp_path / "a"), []
    run_grid(first, ["6/1/7"], tmp_path / "a.json", _decode, stand_in(calls))
    second = Bench(**(vars(_bench(tmp_path / "b")) | {"target": first.target}))
    data = run_grid(second, ["6/1/7"], tmp_path / "b.json", _decode, stand_in(calls), plain=tmp_path / "a.json")
    assert calls == [PLAIN, "6/1/7", "6/1/7"]  # the target alone ran once, for the first export
    assert data["runs"][PLAIN] == json.loads((tmp_path / "a.json").read_text())["runs"][PLAIN]
    assert data["plain_from"] == str(tmp_path / "a.json") and analyse(data["runs"])  # speedups against the taken run
    thrice = Bench(**(vars(second) | {"repeats": 3}))  # a repeat count of its own: the same target-alone measurement
    assert run_grid(thrice, [], tmp_path / "r.json", _decode, stand_in(calls), plain=tmp_path / "a.json")["runs"][PLAIN]
    older = json.loads((tmp_path / "a.json").read_text())
    del older["conditions"]["repeats"]  # measured before --repeats existed
    (tmp_path / "old.json").write_text(json.dumps(older))
    assert run_grid(second, [], tmp_path / "o.json", _decode, stand_in(calls), plain=tmp_path / "old.json")["runs"][PLAIN]
    assert calls == [PLAIN, "6/1/7", "6/1/7"]
    other = Bench(**(vars(second) | {"max_new_tokens": 64}))
    with pytest.raises(ValueError, match="a.json was measured under other conditions \\(max_new_tokens differ\\)"):
        run_grid(other, ["6/1/7"], tmp_path / "c.json", _decode, stand_in(calls), plain=tmp_path / "a.json")
    for bad in ("{not json", "[1, 2]"):
        (tmp_path / "d.json").write_text(bad)
        with pytest.raises(ValueError, match="--plain-from .*d.json: not a results file"):
            run_grid(second, ["6/1/7"], tmp_path / "e.json", _decode, stand_in(calls), plain=tmp_path / "d.json")


def test_a_level_decoded_several_times_reports_its_median_repeat_and_every_wall_time(tmp_path):
    from models.backends.sglang.speedup_engine import median_repeat

    runs = [{"wall_s": w, "requests": [{"latency_s": w, "tokens": 10, "verify_ct": None, "histogram": None}]} for w in (7.5, 4.9, 5.1)]
    picked = median_repeat(runs)
    assert picked["wall_s"] == 5.1 and picked["requests"][0]["latency_s"] == 5.1 and picked["repeat_wall_s"] == [7.5, 4.9, 5.1]
    assert level_stats(picked)["tokens_per_s"] == 10 / 5.1 and level_stats(picked)["repeat_wall_s"] == [7.5, 4.9, 5.1]
    assert median_repeat(runs[:2])["wall_s"] == 4.9  # the faster of two
    bench, calls = _bench(tmp_path), []
    run_grid(bench, ["6/1/7"], tmp_path / "s.json", _decode, stand_in(calls))
    again = Bench(**(vars(bench) | {"repeats": 3}))
    assert again.job("6/1/7")["repeats"] == 3
    with pytest.raises(ValueError, match="other conditions \\(repeats differ\\)"):
        run_grid(again, ["6/1/7"], tmp_path / "s.json", _decode, stand_in(calls))


def test_a_levels_cycle_is_its_median_request_and_its_fast_mode_the_tenth_percentile():
    reqs = [{"latency_s": ms / 1e3 * 10, "tokens": 30, "verify_ct": 10, "histogram": [0, 10]} for ms in range(1, 21)]
    stats = level_stats({"wall_s": 2.0, "requests": reqs})  # cycles of 1, 2, ... 20 ms
    assert stats["cycle_ms"] == pytest.approx(10.5) and stats["cycle_p10_ms"] == pytest.approx(2.0) and stats["tau"] == 3.0
