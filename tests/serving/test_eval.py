"""Speculative-decoding evaluation on the real embedded target: the draft
runner feeds back what training unrolls, and decoding equals plain greedy decoding.

The draft is fitted in the test on the target's own greedy answers to the evaluation
prompts (self-distillation with the real TTT objective, no DeepSpeed): a wiring test, not
a quality number. It reaches τ well above 1 when fed the fused aux features, and ~1 when a
miswired server feeds it the final hidden state, with the same weights.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from models.batch import TokenBatch
from models.draft import Eagle3Draft, draft_shape_for
from models.embedded import embedded_target_dir
from models.generation import stop_ids_of
from models.target import HFTargetEngine, load_tokenizer
from models.vocab_map import build_vocab_map, count_tokens
from serving.eval import EvalResult, Tally, evaluate_export, ratio_se
from serving.eval import main as eval_main
from serving.export import export_both, load_export
from serving.formats import ExportSpec, read_export_config
from serving.pipeline import export_verify_eval
from serving.prompts import (
    PromptSpec,
    ask,
    parse_prompt,
    prompts_from_conversations,
    read_prompt_file,
    render,
    write_prompt_file,
)
from serving.speculative.decode import Generation, speculative_generate, teacher_forced_hits
from serving.speculative.draft_runner import DraftRunner
from serving.speculative.target_runner import TargetRunner, greedy_generate
from serving.verify import verify_export
from tests.fixtures.tiny import TINY_DRAFT, TINY_MLA_DRAFT, tiny_config
from trainer.build import eval_prompt_set
from trainer.ttt import target_labels, ttt_unroll

QUESTIONS = ["What is the capital of France?", "Tell me a joke about computers.", "How do I boil an egg?", "Why is the sky blue?"]
NEW_TOKENS = 24
K = 4


@pytest.fixture(scope="module")
def one_thread():
    """One CPU thread: on a shared 2-core machine, two contending OpenMP threads run ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(one_thread):
    path = embedded_target_dir()
    engine = HFTargetEngine.from_path(path)
    tokenizer = load_tokenizer(path)
    return engine, tokenizer, path


@pytest.fixture(scope="module")
def references(target):
    """Prompt ids and plain greedy answers of the target (also the fitting data)."""
    engine, tokenizer, _ = target
    runner, stops = TargetRunner(engine.model, engine.info.aux_layer_ids), set(stop_ids_of(engine.model.generation_config, tokenizer))
    out = []
    for q in QUESTIONS:
        prompt = render(tokenizer, [{"role": "user", "content": q}])
        out.append((prompt, greedy_generate(runner, torch.tensor(prompt), NEW_TOKENS, stops)))
    return out


def _fit(engine: HFTargetEngine, references, steps: int = 40) -> tuple[Eagle3Draft, object]:
    seqs = [p + g for p, g in references]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, g) in enumerate(references):
        ids[i, : len(p) + len(g)] = torch.tensor(p + g)
        mask[i, len(p) : len(p) + len(g)] = True
    batch = TokenBatch(ids, mask, torch.tensor([len(s) for s in seqs]))
    features = engine.features(batch)
    vocab = build_vocab_map(count_tokens([batch], engine.info.vocab_size), 1024)
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_shape_for(engine.model.config, len(engine.info.aux_layer_ids), 1024))
    draft.init_from_target(engine.embed_weight, engine.lm_head_weight, vocab.draft_to_target)
    labels = target_labels(features.final, engine.lm_head_weight, vocab.draft_to_target, vocab.t2d)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=2e-3)
    for _ in range(steps):
        out = ttt_unroll(draft, ids, mask, batch.lengths, features.aux, labels, vocab.draft_to_target, K, 0.8, False)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return draft, vocab


@pytest.fixture(scope="module")
def fitted_draft(target, references):
    return _fit(target[0], references)


@pytest.fixture(scope="module")
def fitted(target, fitted_draft, tmp_path_factory):
    engine, _, path = target
    draft, vocab = fitted_draft
    spec = ExportSpec.of(
        engine.info.aux_layer_ids,
        norm_output=False,
        target_architecture=engine.info.architecture,
        target_num_layers=engine.info.num_layers,
        num_speculative_tokens=K,
        target_path=str(path),
    )
    return export_both(tmp_path_factory.mktemp("fitted"), draft, vocab, spec)


def _runners(engine, export_dir, feature="aux"):
    parsed = read_export_config(export_dir)
    draft, vocab, _ = load_export(export_dir, embed_weight=engine.embed_weight)
    return TargetRunner(engine.model, parsed.aux_layer_ids, feature), DraftRunner(draft, vocab.draft_to_target, parsed.norm_output)


# --------------------------------------------------------------------------- (a) and (b)


def test_exported_draft_verifies_and_decodes_exactly_greedy_with_tau_above_one(target, references, fitted):
    engine, tokenizer, path = target
    for name in ("sglang", "vllm"):
        assert verify_export(fitted[name], name, path).ok
    runner, draft = _runners(engine, fitted["sglang"])
    stops = set(stop_ids_of(engine.model.generation_config, tokenizer))
    accepted = []
    for prompt, greedy in references:
        gen = speculative_generate(runner, draft, torch.tensor(prompt), K, NEW_TOKENS, stops)
        assert gen.tokens == greedy  # token for token
        accepted += gen.accepted
    tau = 1 + sum(accepted) / len(accepted)
    assert tau > 1.5, f"tau {tau:.2f}"
    assert not draft.fc_skipped


def test_miswired_server_is_flagged_and_accepts_about_one(target, fitted):
    engine, tokenizer, _ = target
    prompts = [PromptSpec(({"role": "user", "content": q},)) for q in QUESTIONS[:2]]
    result = evaluate_export(fitted["sglang"], engine.model, tokenizer, prompts, k=K, max_new_tokens=20, feature="final")
    assert result.fc_skipped and "fc skipped" in result.summary()
    assert result.accept_len < 1.2, result.summary()


# --------------------------------------------------------------------------- parts


@pytest.mark.parametrize("shape", [TINY_DRAFT, TINY_MLA_DRAFT], ids=["llama", "mla"])
def test_draft_runner_equals_the_ttt_unroll(shape):
    """Serving (extend rows + chain steps on a KV cache) feeds back what the TTT unroll trains on."""
    torch.manual_seed(0)
    draft = Eagle3Draft(shape).eval()
    t, steps = 6, 3
    aux, ids = torch.randn(1, t, 72), torch.randint(0, 50, (1, t + steps))
    for norm_output in (False, True):
        with torch.no_grad():  # training: step j, row r reads token r + 1 + j at position r + j
            hidden, cache, trained = draft.project(aux), [], []
            for j in range(steps):
                out, _ = draft.step(ids[:, 1 + j : 1 + j + t], hidden, torch.arange(t)[None] + j, cache)
                hidden = draft.norm(out) if norm_output else out
                trained.append(hidden[0])
        runner = DraftRunner(draft, torch.arange(20), norm_output)  # serving: extend rows 0..t-1, chain from row t-1
        feedback, _ = runner.extend(ids[0, 1 : 1 + t], aux[0])
        assert torch.allclose(feedback, trained[0], atol=1e-5)
        for j in range(1, steps):
            feedback, _ = runner.step(ids[0, t + j : t + j + 1], feedback[-1:])
            assert torch.allclose(feedback[-1], trained[j][-1], atol=1e-5), (norm_output, j)
        assert runner.length == t + steps - 1
        runner.crop(t)
        assert runner.length == t


def test_target_features_are_the_training_capture(target):
    engine, _, _ = target
    ids = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 30, 2, 198])
    batch = TokenBatch(ids[None], torch.ones(1, 10, dtype=torch.bool), torch.tensor([10]))
    runner = TargetRunner(engine.model, engine.info.aux_layer_ids)
    _, first = runner.forward(ids[:6])
    _, rest = runner.forward(ids[6:])  # KV-cached continuation
    assert torch.allclose(torch.cat([first, rest]), engine.features(batch).aux[0], atol=1e-4)
    runner.crop(7)
    assert runner.length == 7


def test_prompt_formats_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "hi"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]},
        {"turns": ["first", "second", "third"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = read_prompt_file(path)
    assert [s.turns for s in specs] == [1, 1, 3] and specs[1].context[0]["role"] == "system"
    assert len(read_prompt_file(path, limit=2)) == 2
    for bad, message in [
        ({"prompt": ""}, "non-empty"),
        ({"prompt": "a", "turns": ["b"]}, "exactly one"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "end with a user"),
        ({"messages": [{"role": "bot", "content": "q"}]}, "role"),
        ({"turns": []}, "non-empty list"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_prompt(bad, "x.jsonl:1")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        read_prompt_file(tmp_path / "bad.jsonl")


def test_written_prompts_read_back_equal(tmp_path):
    conversations = [
        [{"role": "user", "content": "one"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "again"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "s"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "s"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "more"},
        ],
    ]
    specs = prompts_from_conversations(conversations)
    assert [s.turns for s in specs] == [1, 2, 1, 2]
    assert read_prompt_file(write_prompt_file(specs, tmp_path / "eval_prompts.jsonl")) == specs
    with pytest.raises(ValueError, match="follow_ups"):
        parse_prompt({"messages": [{"role": "user", "content": "q"}], "follow_ups": [""]}, "x.jsonl:1")


def test_the_serving_eval_asks_each_held_out_prompt_once():
    def conv(q, a):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    held = {"a": [conv("hi", "hello"), conv("hi", "hey"), conv("bye", "ciao")], "b": [conv("bye", "see you"), conv("how?", "so")]}
    data = SimpleNamespace(mix=SimpleNamespace(names=("a", "b")), eval_conversations=held, heldout_rule="hash")
    prompts, origin = eval_prompt_set(tiny_config("trainer.eval_prompts=3"), data)
    assert [p.context[0]["content"] for p in prompts] == ["hi", "bye", "how?"]
    assert origin["sources"] == {"a": 2, "b": 1} and origin["prompts"] == 3


def test_later_turns_see_the_generated_answers():
    seen = []

    def answer(messages):
        seen.append([m["content"] for m in messages])
        return f"answer {len(seen)}"

    assert ask(PromptSpec(({"role": "user", "content": "q1"},), ("q2", "q3")), answer) == 3
    assert seen == [["q1"], ["q1", "answer 1", "q2"], ["q1", "answer 1", "q2", "answer 2", "q3"]]


def test_eval_cli_reports_tau_and_checks_greedy(fitted, target, tmp_path, capsys):
    _, _, path = target
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": [QUESTIONS[0], "Say it again."]}) + "\n")
    out = tmp_path / "r.json"
    code = eval_main(
        [
            str(fitted["vllm"]),
            "--target",
            str(path),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--check-greedy",
            "--json",
            str(out),
        ]
    )
    printed, progress = capsys.readouterr()
    assert code == 0 and "accept length tau" in printed and "identical" in printed
    assert f"serving eval: loading the target {path}" in progress and "serving eval: 100%" in progress
    assert "1/1" in progress and "τ so far" in progress  # a bar over the prompts, tau so far
    result = json.loads(out.read_text())
    assert result["turns"] == 2 and result["k"] == K and len(result["accept_rate"]) == K
    assert result["accept_len"] == pytest.approx(1 + sum(result["accept_rate"]))


def test_export_verify_eval_for_the_training_loop(target, fitted_draft, tmp_path):
    engine, tokenizer, path = target
    draft, vocab = fitted_draft
    prompts = [PromptSpec(({"role": "user", "content": q},)) for q in QUESTIONS[:2]]
    metrics = export_verify_eval(
        draft,
        vocab,
        engine.info,
        engine.model,
        tokenizer,
        prompts,
        tmp_path / "export",
        norm_output=False,
        k=K,
        max_new_tokens=16,
        target_dir=path,
    )
    assert metrics["eval/verify_problems"] == 0 and metrics["eval/accept_len"] > 1.5
    assert [f"eval/accept_rate_{i}" in metrics for i in range(K)] == [True] * K
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["sglang", "vllm"]
    assert metrics["verify"]["vllm"].startswith("OK")
    exported = tmp_path / "export" / "sglang"
    assert read_export_config(exported).eval_max_new_tokens == 16  # serving.eval's defaults are the run's: the same tau
    assert evaluate_export(exported, engine.model, tokenizer, prompts).accept_len == metrics["eval/accept_len"]
    with pytest.raises(ValueError, match="2 aux layer ids"):  # a draft the engines cannot serve never gets evaluated
        other_ids = HFTargetEngine(engine.model, aux_layer_ids=[1, 14])  # the same model, two aux layers
        export_verify_eval(draft, vocab, other_ids.info, other_ids.model, tokenizer, prompts, tmp_path / "bad", norm_output=False)
    unevaluated = export_verify_eval(
        draft, vocab, engine.info, None, tokenizer, prompts, tmp_path / "plain", norm_output=False, k=K, target_dir=path
    )
    assert (
        unevaluated["eval/verify_problems"] == 0
        and "eval/accept_len" not in unevaluated
        and unevaluated["verify"]["sglang"].startswith("OK")
    )


def test_tau_standard_error_over_turns_equals_the_delta_method():
    tally = Tally(3)
    for accepted in ([3, 3], [0, 0, 0, 1], [2]):  # per turn: τ 4.0, 1.25, 3.0
        tally.add(Generation(tokens=[0] * (len(accepted) + sum(accepted)), accepted=accepted))
    units = [(8, 2), (5, 4), (3, 1)]
    r = 16 / 7
    by_hand = math.sqrt(3 / 2 * sum((n - r * d) ** 2 for n, d in units)) / 7
    assert tally.tau == pytest.approx(r) and tally.tau_se == pytest.approx(by_hand)
    assert ratio_se([(2, 1), (2, 1), (2, 1)]) == 0.0 and math.isnan(ratio_se([(2, 1)]))


def test_teacher_forced_spans_count_each_answer_token_once():
    """Element j of teacher_forced_hits is answer token j + 2: spans 2-16, 17-64, ... split the answer by it."""
    tally = Tally(3)
    tally.add_teacher_forced(torch.arange(299) % 2 == 0)  # answer of 300 tokens: token n a hit when n is even
    tally.add_teacher_forced(torch.ones(10, dtype=torch.bool))  # answer of 11 tokens: all hits (span 2-16 only)
    assert tally.tf_positions == [15 + 10, 48, 64, 128, 44]
    assert tally.tf_hits == [8 + 10, 24, 32, 64, 22]
    result = EvalResult.of(tally, "aux", 2, False, [], 0, 1.0)
    assert result.tf_acc_0_by_span == {"2-16": 18 / 25, "17-64": 0.5, "65-128": 0.5, "129-256": 0.5, "257+": 0.5}
    assert result.tf_acc_0 == pytest.approx((18 + 24 + 32 + 64 + 22) / (25 + 48 + 64 + 128 + 44))
    assert result.metrics()["eval/tf_acc_0_tokens_2-16"] == 18 / 25 and "by answer token" in result.summary()
    assert tally.tf_per_turn == [(150, 299), (10, 10)]  # the SE's units: each answer's hits and positions
    assert result.tf_acc_0_se == pytest.approx(ratio_se([(150, 299), (10, 10)])) and result.tf_acc_0_se > 0
    assert result.metrics()["eval/tf_acc_0_se"] == result.tf_acc_0_se and f"± {result.tf_acc_0_se:.3f}" in result.summary()
    empty = EvalResult.of(Tally(3), "aux", 0, False, [], 0, 1.0)
    assert empty.tf_acc_0_by_span == {} and empty.tf_acc_0 == 0.0 and math.isnan(empty.tf_acc_0_se)


def test_teacher_forced_acc_0_is_the_training_step_0_accuracy_on_the_same_answers(target, references, fitted):
    """serving.eval's teacher-forced acc_0 (runners, KV caches) counts what training's acc_0 counts
    (engine features, TTT step 0) on the same answers: the positions the draft proposes first."""
    engine, _, _ = target
    parsed = read_export_config(fitted["sglang"])
    draft, vocab, _ = load_export(fitted["sglang"], embed_weight=engine.embed_weight)
    runner = TargetRunner(engine.model, parsed.aux_layer_ids)
    draft_runner = DraftRunner(draft, vocab.draft_to_target, parsed.norm_output)
    served, trained = [0, 0], [0, 0]
    for prompt, answer in references:
        answer_hits = teacher_forced_hits(runner, draft_runner, torch.tensor(prompt), answer)
        hits, positions = int(answer_hits.sum()), answer_hits.numel()
        ids = torch.tensor([prompt + answer])  # [1, P + A]
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt) + 1 :] = True  # x_{P+1} ..: the first answer token comes from the prefill
        batch = TokenBatch(ids, mask, torch.tensor([ids.shape[1]]))
        features = engine.features(batch)
        labels = target_labels(features.final, engine.lm_head_weight, vocab.draft_to_target, vocab.t2d)
        with torch.no_grad():
            out = ttt_unroll(draft, ids, mask, batch.lengths, features.aux, labels, vocab.draft_to_target, 1, 0.8, False)
        served = [served[0] + hits, served[1] + positions]
        trained = [trained[0] + int(out.correct[0]), trained[1] + int(out.valid[0])]
    assert served[1] == trained[1] == sum(len(a) - 1 for _, a in references)
    assert served == trained and 0 < served[0] < served[1], (served, trained)
