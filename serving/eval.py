"""``python -m serving.eval EXPORT_DIR``: acceptance length of an exported draft, measured by
real greedy speculative decoding against the transformers target (the number a draft is judged by).

The draft is loaded from the export directory (the bf16 weights an engine would load),
fed the way SGLang feeds it (``serving/speculative/draft_runner.py``), and the target verifies each
chain of k draft tokens in one forward (``serving/speculative/decode.py``). Reported:

* ``accept_len`` τ: tokens per target verify forward (1 = nothing accepted, k + 1 = all);
* ``accept_rate[i]``: fraction of verify steps that accepted at least i + 1 draft tokens
  (vLLM's per-position rate; τ = 1 + Σ accept_rate); ``cond_accept_rate[i]``: the same
  given position i was reached (comparable with training's acc_i);
* with ``--check-greedy``, whether every turn equals plain greedy decoding token for token.

``--feature final`` simulates a miswired server (a target class without aux capture: the
draft gets the final hidden state); the result says whether SGLang would have skipped fc.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from models import hub
from models.generation import stop_ids_of
from serving.export import load_export
from serving.formats import DEFAULT_SPECULATIVE_TOKENS, read_export_config
from serving.prompts import PromptSpec, ask, read_prompt_file, render
from serving.speculative.decode import Generation, speculative_generate, teacher_forced_hits
from serving.speculative.draft_runner import DraftRunner
from serving.speculative.target_runner import FEATURES, TargetRunner, greedy_generate
from serving.usage import PlainHelp


def ratio_se(units: Sequence[tuple[float, float]]) -> float:
    """Standard error of R = Σ num / Σ den over independent units (num, den), by the delta method:
    sqrt(n / (n - 1) · Σ (num_i - R den_i)²) / Σ den. For τ a unit is a turn or a request: its
    tokens per verify step summed and its verify steps. NaN with fewer than two units."""
    units = [(n, d) for n, d in units if d > 0]
    total = sum(d for _, d in units)
    if len(units) < 2 or total == 0:
        return float("nan")
    r = sum(n for n, _ in units) / total
    spread = sum((n - r * d) ** 2 for n, d in units)
    return math.sqrt(len(units) / (len(units) - 1) * spread) / total


DEFAULT_MAX_NEW_TOKENS = 128  # tokens a turn, for an export that does not carry its run's (eval_max_new_tokens)
TF_SPANS = ((2, 16), (17, 64), (65, 128), (129, 256), (257, None))  # answer tokens (from 1) of each tf_acc_0 span


def span_name(first: int, last: int | None) -> str:
    return f"{first}-{last}" if last is not None else f"{first}+"


@dataclass
class Tally:
    """Acceptance counts over cycles, summed across turns."""

    k: int
    reached: list[int] = field(default_factory=list)  # per position: cycles that drafted it with all before accepted
    accepted: list[int] = field(default_factory=list)  # per position: cycles that accepted it
    cycles: int = 0
    new_tokens: int = 0
    per_turn: list[tuple[int, int]] = field(default_factory=list)  # per turn: (tokens per verify summed, verify steps)
    tf_hits: list[int] = field(default_factory=list)  # per TF_SPANS span: teacher_forced_hits summed over turns
    tf_positions: list[int] = field(default_factory=list)
    tf_per_turn: list[tuple[int, int]] = field(default_factory=list)  # per answer: (hits, positions), for the SE

    def __post_init__(self) -> None:
        self.reached, self.accepted = [0] * self.k, [0] * self.k
        self.tf_hits, self.tf_positions = [0] * len(TF_SPANS), [0] * len(TF_SPANS)

    def add_teacher_forced(self, hits: torch.Tensor) -> None:
        """One answer's ``teacher_forced_hits`` [A - 1] (element j: answer token j + 2), into its spans."""
        self.tf_per_turn.append((int(hits.sum()), hits.numel()))
        for i, (first, last) in enumerate(TF_SPANS):
            span = hits[first - 2 : None if last is None else last - 1]
            self.tf_hits[i] += int(span.sum())
            self.tf_positions[i] += span.numel()

    @property
    def tau(self) -> float:
        """Tokens per verify forward so far (1.0 before the first cycle)."""
        return (self.cycles + sum(self.accepted)) / max(self.cycles, 1)

    @property
    def tau_se(self) -> float:
        """Standard error of τ over turns (a ratio of sums; see ``ratio_se``)."""
        return ratio_se(self.per_turn)

    def add(self, gen: Generation) -> None:
        self.new_tokens += len(gen.tokens)
        self.per_turn.append((len(gen.accepted) + sum(min(a, self.k) for a in gen.accepted), len(gen.accepted)))
        for a in gen.accepted:
            self.cycles += 1
            for i in range(min(a + 1, self.k)):
                self.reached[i] += 1
            for i in range(a):
                self.accepted[i] += 1


@dataclass
class EvalResult:
    k: int
    feature: str
    accept_len: float  # τ
    accept_len_se: float  # its standard error over turns
    accept_rate: list[float]  # [k]
    cond_accept_rate: list[float]  # [k]
    tf_acc_0: float  # the draft's first token with the true prefix at every answer position (training's acc_0)
    tf_acc_0_se: float  # its standard error over answers (ratio_se)
    tf_acc_0_by_span: dict[str, float]  # the same, per span of answer tokens (TF_SPANS) that has any
    cycles: int
    new_tokens: int
    turns: int
    fc_skipped: bool
    greedy_checked: int
    greedy_mismatches: list[str]
    wall_s: float

    @classmethod
    def of(cls, tally: Tally, feature: str, turns: int, fc_skipped: bool, mismatches: list[str], checked: int, wall: float):
        cycles = max(tally.cycles, 1)
        rate = [a / cycles for a in tally.accepted]
        cond = [a / r if r else 0.0 for a, r in zip(tally.accepted, tally.reached)]
        counts = (tally.cycles, tally.new_tokens, turns, fc_skipped, checked, mismatches, wall)
        tf_acc = sum(tally.tf_hits) / max(sum(tally.tf_positions), 1)
        spans = zip(TF_SPANS, tally.tf_hits, tally.tf_positions)
        by_span = {span_name(*span): hits / n for span, hits, n in spans if n}
        return cls(tally.k, feature, tally.tau, tally.tau_se, rate, cond, tf_acc, ratio_se(tally.tf_per_turn), by_span, *counts)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {
            f"{prefix}/accept_len": self.accept_len,
            f"{prefix}/accept_len_se": self.accept_len_se,
            f"{prefix}/tf_acc_0": self.tf_acc_0,
            f"{prefix}/tf_acc_0_se": self.tf_acc_0_se,
            f"{prefix}/spec_cycles": float(self.cycles),
        }
        out |= {f"{prefix}/tf_acc_0_tokens_{name}": acc for name, acc in self.tf_acc_0_by_span.items()}
        for i, (r, c) in enumerate(zip(self.accept_rate, self.cond_accept_rate)):
            out[f"{prefix}/accept_rate_{i}"] = r
            out[f"{prefix}/cond_accept_rate_{i}"] = c
        return out

    def summary(self) -> str:
        lines = [
            f"accept length tau = {self.accept_len:.3f} ± {self.accept_len_se:.3f} tokens per target forward "
            f"(k = {self.k}, {self.cycles} verify steps, {self.new_tokens} tokens, {self.turns} turns, {self.wall_s:.1f} s, "
            f"features: {self.feature})",
            "position  accept_rate  cond_accept_rate",
        ]
        lines += [f"{i + 1:>8}  {r:>11.3f}  {c:>16.3f}" for i, (r, c) in enumerate(zip(self.accept_rate, self.cond_accept_rate))]
        lines.append(f"teacher-forced acc_0 on these answers (every position, true prefix): {self.tf_acc_0:.3f} ± {self.tf_acc_0_se:.3f}")
        spans = ", ".join(f"{name}: {acc:.3f}" for name, acc in self.tf_acc_0_by_span.items())
        lines.append(f"  by answer token (the first is the prefill's): {spans}")
        if self.fc_skipped:
            lines.append(
                "WARNING: fc skipped: the draft was fed features as wide as its embedding (the target's final hidden "
                "state, not the fused aux layers): SGLang skips fc silently and acceptance collapses"
            )
        if self.greedy_checked:
            verdict = "identical" if not self.greedy_mismatches else f"{len(self.greedy_mismatches)} MISMATCH(ES)"
            lines.append(f"greedy check: {self.greedy_checked} turns vs plain greedy decoding: {verdict}")
            lines += [f"  {m}" for m in self.greedy_mismatches]
        return "\n".join(lines)


def evaluate(
    target: TargetRunner,
    draft: DraftRunner,
    tokenizer,
    prompts: list[PromptSpec],
    k: int,
    max_new_tokens: int,
    check_greedy: bool = False,
) -> EvalResult:
    """Speculative decoding over every turn of ``prompts``; see the module docstring."""
    if not prompts:
        raise ValueError("no prompts to evaluate on")
    device = next(target.model.parameters()).device
    stops, tally, mismatches, checked, turns = set(stop_ids_of(target.model.generation_config, tokenizer)), Tally(k), [], 0, 0
    start = time.perf_counter()

    def answer(messages) -> str:
        nonlocal checked
        prompt = torch.tensor(render(tokenizer, messages), device=device)
        gen = speculative_generate(target, draft, prompt, k, max_new_tokens, stops)
        tally.add(gen)
        tally.add_teacher_forced(teacher_forced_hits(target, draft, prompt, gen.tokens))
        if check_greedy:
            checked += 1
            reference = greedy_generate(target, prompt, max_new_tokens, stops)
            if reference != gen.tokens:
                at = next((i for i, (a, b) in enumerate(zip(reference, gen.tokens)) if a != b), min(len(reference), len(gen.tokens)))
                mismatches.append(f"turn {checked}: first difference at generated token {at}")
        return tokenizer.decode([t for t in gen.tokens if t not in stops], skip_special_tokens=True)

    with tqdm(total=len(prompts), desc="serving eval", unit="prompt", leave=False) as bar:  # stderr
        for spec in prompts:
            turns += ask(spec, answer)
            bar.update(1)
            bar.set_postfix_str(f"τ so far {tally.tau:.2f}")
    return EvalResult.of(tally, target.feature, turns, draft.fc_skipped, mismatches, checked, time.perf_counter() - start)


def evaluate_export(
    export_dir: str | Path,
    model,
    tokenizer,
    prompts: list[PromptSpec],
    k: int | None = None,
    max_new_tokens: int | None = None,
    feature: str = "aux",
    check_greedy: bool = False,
) -> EvalResult:
    """Load ``export_dir`` onto the transformers target ``model`` and ``evaluate`` it.

    The aux layers captured are the export's (what the serving engine would capture); ``k``
    defaults to the export's ``num_speculative_tokens`` and ``max_new_tokens`` to the tokens a
    turn of the run's own serving eval (``eval_max_new_tokens``; DEFAULT_MAX_NEW_TOKENS for an
    export without it), so the same prompts give the run's τ.
    """
    parsed = read_export_config(export_dir)
    param = next(model.parameters())
    draft, vocab, _ = load_export(export_dir, embed_weight=_shared_embedding(model, parsed), dtype=param.dtype)
    draft = draft.to(param.device)
    k = k if k is not None else (parsed.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)
    max_new_tokens = max_new_tokens if max_new_tokens is not None else (parsed.eval_max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
    target = TargetRunner(model, parsed.aux_layer_ids, feature)
    runner = DraftRunner(draft, vocab.draft_to_target.to(param.device), parsed.norm_output)
    return evaluate(target, runner, tokenizer, prompts, k, max_new_tokens, check_greedy)


def _shared_embedding(model, parsed):
    s = parsed.shape
    return model.get_input_embeddings().weight.detach() if s.hidden_size == s.target_hidden_size else None


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.eval", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    p.add_argument("export_dir", type=Path)
    p.add_argument("--target", type=Path, default=None, help="target transformers dir or .gguf (default: the embedded target)")
    p.add_argument("--prompts", type=Path, required=True, help="jsonl with prompt / messages / turns (a run's: RUN/eval_prompts.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts from --prompts")
    p.add_argument("--k", type=int, default=None, help="draft tokens per cycle (default: the export's)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"tokens a turn (default: the run's trainer.eval_max_new_tokens, from the export; else {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument("--feature", choices=FEATURES, default="aux", help="final: simulate a server without aux capture")
    p.add_argument("--check-greedy", action="store_true", help="also run plain greedy decoding and compare")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    hub.offline()
    args = _parser().parse_args(argv)
    from models.embedded import embedded_target_dir
    from models.target import HFTargetEngine, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target_path = args.target if args.target is not None else embedded_target_dir()
        prompts = read_prompt_file(args.prompts, args.limit)
        print(f"serving eval: loading the target {target_path} ({args.dtype}, {args.device})", file=sys.stderr, flush=True)
        engine = HFTargetEngine.from_path(target_path, device=args.device, dtype=getattr(torch, args.dtype))
        result = evaluate_export(
            args.export_dir,
            engine.model,
            load_tokenizer(target_path),
            prompts,
            args.k,
            args.max_new_tokens,
            args.feature,
            args.check_greedy,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.summary())
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 1 if result.greedy_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
