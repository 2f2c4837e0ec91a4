"""``python -m serving.speedup EXPORT_DIR --prompts FILE...``: how much faster SGLang answers with the
exported draft, in wall-clock time, against the same engine serving the target alone.

Each setting is one SGLang 0.5.14 offline engine with CUDA graphs on (``models/backends/sglang/speedup_engine.py``,
in a process of its own): first the target alone, then the EAGLE-3 draft at each (steps, topk,
draft tokens) of ``--settings`` — chains (topk 1, steps + 1 tokens) and trees. Every engine decodes
the same prompts greedily at each ``--concurrency`` (at most that many requests in flight), and
``serving/speedup_report.py`` reports per setting, prompt set and concurrency: τ, output tokens/s,
per-request tokens/s, time per output token (median, p90), the speedup over the target alone and
how many outputs are token-identical to its greedy ones (every divergence listed). Engine starts
are timed apart from decoding.

The fastest setting per concurrency, by measured speedup, goes into ``EXPORT_DIR/serving.json``,
which ``serving.launch`` reads to print the server command. Results are written to ``--json``
after each setting; run again with the same arguments and the settings already measured are not
run again (a setting that failed is retried). ``--plain-from`` takes the target alone's run from
another export's results file of the same target, prompts and engine, so that several drafts are
measured against one baseline. ``--repeats N`` decodes each level N times in its engine and reports
the repeat of median wall time: one engine's timings drift by more than a draft's cost. Each file's
first turns are decoded (``prompt`` / ``messages`` records; follow-ups are not asked). Needs a CUDA
GPU and SGLang.

    python -m serving.speedup RUN/export/sglang --prompts heldout_sharegpt.jsonl heldout_codeio.jsonl
    python -m serving.speedup RUN/export/sglang --prompts p.jsonl --settings 6/1/7 5/4/8 --concurrency 1 16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from models import hub
from models.backends.registry import BACKENDS
from serving.speedup_report import (
    PLAIN,
    SERVING_FILE,
    TOP_LOGPROBS,
    analyse,
    best_by_concurrency,
    check_counters,
    compact,
    cost_model,
    describe,
    divergence_lines,
    read_results,
    setting_name,
    setting_of,
    table,
    write_json,
)
from serving.usage import PlainHelp

# (steps, topk, draft tokens), the order they run in: the chains the cost model needs first, then
# SGLang's own default for Llama targets (5, 4, 8), then wider and deeper trees
DEFAULT_SETTINGS = ("6/1/7", "3/1/4", "5/4/8", "6/8/32", "6/4/16", "8/8/64", "5/2/8", "8/1/9")
DEFAULT_CONCURRENCY = (1, 4, 16, 64)
CHAIN_ONLY_BACKENDS = ("trtllm_mha",)  # SGLang 0.5.14 refuses topk > 1 on these
PAGED_TREE_BACKENDS = ("flashinfer", "fa3", "triton")  # topk > 1 with page_size > 1 runs on these only
# the conditions --plain-from does not compare: the target alone does not read the export, and a level decoded N
# times reports its median-time repeat, the measurement of one decode (files from before --repeats lack the key)
PLAIN_FROM_FREE = ("export", "export_weights", "repeats")
# the engine options set to the top of --concurrency: the largest batch the engine admits and captures a graph for
TOP_CONCURRENCY_OPTIONS = ("max_running_requests", "cuda_graph_max_bs_decode")


class SettingFailed(RuntimeError):
    """One setting's engine died or hung; the message names the setting and ends with its log tail."""


def parse_setting(text: str) -> tuple[int, int, int]:
    """``"steps/topk/tokens"`` -> (steps, topk, tokens); ValueError naming the setting when SGLang
    would change or refuse it."""
    try:
        steps, topk, tokens = setting_of(str(text))
    except ValueError:
        raise ValueError(f"--settings {text!r}: expected STEPS/TOPK/DRAFT_TOKENS, e.g. 6/1/7 (chain) or 5/4/8 (tree)") from None
    if steps < 1 or topk < 1:
        raise ValueError(f"--settings {text}: steps and topk must be >= 1")
    if topk == 1 and tokens != steps + 1:
        raise ValueError(f"--settings {text}: a chain (topk 1) drafts steps + 1 = {steps + 1} tokens (SGLang would change it)")
    most = topk + (steps - 1) * topk * topk + 1  # the root, topk first-step candidates, topk^2 at each later step
    if topk > 1 and not 2 <= tokens <= most:
        raise ValueError(f"--settings {text}: a tree of {steps} steps at top-{topk} holds 2 to {most} draft tokens")
    return steps, topk, tokens


def check_backend(settings: list[tuple[int, int, int]], backend: str, page_size: int) -> None:
    """ValueError for the first tree the attention backend cannot run (SGLang 0.5.14's rules)."""
    for s in settings:
        if s[1] > 1 and backend in CHAIN_ONLY_BACKENDS:
            raise ValueError(f"--settings {setting_name(s)}: attention backend {backend} runs chains only (topk 1)")
        if s[1] > 1 and page_size > 1 and backend not in PAGED_TREE_BACKENDS:
            raise ValueError(f"--settings {setting_name(s)}: topk > 1 with page size {page_size} runs on {PAGED_TREE_BACKENDS} only")


def level_sizes(n: int, concurrency: list[int], min_prompts: int, per_slot: int) -> dict[str, int]:
    """Prompts decoded at each concurrency: ``per_slot`` per request in flight, at least ``min_prompts``,
    at most the file's ``n`` (each level takes the file's first prompts)."""
    return {str(c): min(n, max(min_prompts, per_slot * c)) for c in concurrency}


@dataclass(frozen=True)
class Bench:
    export_dir: Path
    target: Path
    sets: dict[str, dict[str, list[list[int]]]]  # prompt set -> concurrency -> prompt ids
    stop_ids: list[int]
    concurrency: list[int]
    max_new_tokens: int
    engine: dict  # sglang.Engine options beside the target and the draft
    timeout_s: float
    repeats: int = 1  # times each level is decoded; its median-time repeat is reported

    def conditions(self) -> dict:
        """What the numbers depend on; a results file measured under other conditions is not resumed."""
        weights = sorted(self.export_dir.glob("*.safetensors"))
        digest = hashlib.sha256()
        for path in weights:
            digest.update(path.read_bytes())
        prompts = hashlib.sha256(json.dumps([self.sets, self.stop_ids]).encode()).hexdigest()[:16]
        return {
            "export": str(self.export_dir),
            "export_weights": digest.hexdigest()[:16],
            "target": str(self.target),
            "prompts": prompts,
            "levels": {name: {c: len(ids) for c, ids in levels.items()} for name, levels in self.sets.items()},
            "concurrency": self.concurrency,
            "max_new_tokens": self.max_new_tokens,
            "repeats": self.repeats,
            "engine": self.engine,
            "top_logprobs": TOP_LOGPROBS,
        }

    def job(self, name: str) -> dict:
        draft = None if name == PLAIN else str(self.export_dir)
        setting = None if name == PLAIN else list(setting_of(name))
        return {
            "target": str(self.target),
            "draft": draft,
            "setting": setting,
            "engine": self.engine,
            "concurrency": self.concurrency,
            "max_new_tokens": self.max_new_tokens,
            "repeats": self.repeats,
            "stop_ids": self.stop_ids,
            "sets": self.sets,
            "top_logprobs": TOP_LOGPROBS if name == PLAIN else 0,
        }


def run_engine(job: dict, log_path: Path, timeout_s: float, name: str) -> dict:
    """One engine in its own process (the sglang backend's ``speedup_engine``); its result, or SettingFailed."""
    with tempfile.TemporaryDirectory(prefix="speedup-") as tmp:
        job_path, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", BACKENDS["sglang"].serving.speedup_engine, str(job_path), str(out)]
        with open(log_path, "wb") as log:  # its own process group: SGLang's scheduler and detokenizer go with it
            proc = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                end_group(proc)
                raise SettingFailed(f"setting {name} ({describe(name)}): no result within {timeout_s:.0f} s; {tail(log_path)}") from None
            except BaseException:  # a stop signal: the engine goes too
                end_group(proc)
                raise
        if code != 0 or not out.is_file():
            raise SettingFailed(f"setting {name} ({describe(name)}): the engine process exited with code {code}; {tail(log_path)}")
        return json.loads(out.read_text())


def end_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return f"log {path}, last lines:\n" + "\n".join(text[-lines:]) if text else f"log {path} is empty"


def load_results(path: Path, conditions: dict) -> dict:
    """The results file to go on with: empty when absent, ValueError when measured under other conditions."""
    if not path.is_file():
        return {"conditions": conditions, "runs": {}, "failed": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a results file of serving.speedup ({e}); remove it or choose another --json") from None
    if data.get("conditions") != conditions:
        changed = sorted(k for k in conditions if data.get("conditions", {}).get(k) != conditions[k])
        raise ValueError(f"{path} was measured under other conditions ({', '.join(changed)} differ): choose another --json or remove it")
    return data


def plain_from(path: Path, conditions: dict) -> dict:
    """The target alone's run in another results file, measured under ``conditions`` but for the export
    (the target alone does not read it) and the repeat count; ValueError naming the file and the conditions
    that differ."""
    try:
        data = read_results(path)
    except ValueError as e:
        raise ValueError(f"--plain-from {e}") from None
    theirs = data["conditions"]
    changed = sorted(k for k in conditions if k not in PLAIN_FROM_FREE and theirs.get(k) != conditions[k])
    if changed:
        raise ValueError(f"--plain-from {path} was measured under other conditions ({', '.join(changed)} differ)")
    if PLAIN not in data["runs"]:
        raise ValueError(f"--plain-from {path}: holds no run of the target alone")
    return data["runs"][PLAIN]


def run_grid(bench: Bench, names: list[str], results_path: Path, decode, runner=run_engine, plain: Path | None = None) -> dict:
    """The target alone (or its run in ``plain``, another results file), then each setting not measured
    yet; the results file is rewritten after each."""
    data = load_results(results_path, bench.conditions())
    if plain is not None and PLAIN not in data["runs"]:
        data["runs"][PLAIN] = plain_from(plain, data["conditions"])
        data["plain_from"] = str(plain)
        write_json(results_path, data)
        print(f"{PLAIN}: taken from {plain}, not run again", flush=True)
    for name in [PLAIN, *names]:
        if name in data["runs"]:
            print(f"{name}: measured earlier ({results_path}), not run again", flush=True)
            continue
        print(f"{name} ({describe(name)}): starting its engine", flush=True)
        start = time.perf_counter()
        try:
            run = runner(bench.job(name), results_path.parent / "speedup_logs" / f"{name.replace('/', '-')}.log", bench.timeout_s, name)
        except SettingFailed as e:
            if name == PLAIN:
                raise
            print(f"FAILED {e}", flush=True)
            data["failed"][name] = str(e)
            write_json(results_path, data)
            continue
        run["process_s"] = time.perf_counter() - start
        if name != PLAIN:
            check_counters(name, run)
        data["runs"][name] = compact(run, data["runs"].get(PLAIN), decode)
        data["failed"].pop(name, None)
        write_json(results_path, data)
        print(f"{name}: engine start {run['start_s']:.0f} s, {run['process_s']:.0f} s in all", flush=True)
    return data


def summarise(data: dict, results_path: Path, export_dir: Path) -> str:
    """Analysis into the results file, the best settings into ``EXPORT_DIR/serving.json``; the table."""
    rows = analyse(data["runs"])
    best = best_by_concurrency(rows)
    data |= {"rows": rows, "best": best, "cost_model": cost_model(rows)}
    write_json(results_path, data)
    if best:
        device = data["runs"][PLAIN]["device"]
        write_json(
            export_dir / SERVING_FILE,
            {"engine": "sglang", "measured_by": "python -m serving.speedup", "results": str(results_path), "device": device}
            | {"max_new_tokens": data["conditions"]["max_new_tokens"], "best": best},
        )
    starts = {name: run["start_s"] for name, run in data["runs"].items()}
    lines = [table(rows, starts)]
    for c, b in best.items():
        slower = "; every setting measured is slower than the target alone here: serve it without the draft" if b["speedup"] < 1 else ""
        lines.append(f"best at concurrency {c}: {b['setting']} ({describe(b['setting'])}), {b['speedup']:.2f}x{slower}")
    diverged = divergence_lines(data["runs"])
    lines.append(f"outputs that differ from the target alone's: {len(diverged)}")
    lines += [f"  {line}" for line in diverged]
    lines += [f"FAILED {msg.splitlines()[0]}" for msg in data["failed"].values()]
    return "\n".join(lines)


def build_bench(args: argparse.Namespace) -> tuple[Bench, list[str], object]:
    """Every input checked before an engine starts: the settings, the export, the target, the prompts."""
    from models.generation import stop_ids_of
    from serving.launch import check_draft_engine
    from serving.prompts import read_prompt_file, render
    from serving.verify import format_report, verify_export

    settings = [parse_setting(s) for s in args.settings]
    check_backend(settings, args.attention_backend, args.page_size)
    if min(args.concurrency) < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        raise ValueError("--concurrency values, --max-new-tokens and --repeats must be >= 1")
    if not (args.export_dir / "config.json").is_file():
        raise ValueError(f"{args.export_dir}: not an export dir (no config.json); python -m trainer writes RUN/export/sglang")
    check_draft_engine(args.export_dir, "sglang")
    target = args.target if args.target is not None else _embedded_target()
    if not (target / "config.json").is_file():
        raise ValueError(f"--target {target}: not a transformers model dir (no config.json)")
    report = verify_export(args.export_dir, "sglang", target)
    if not report.ok:
        raise ValueError(f"the export fails verification:\n{format_report(report)}")
    tokenizer, generation = _tokenizer(target)
    sets = {}
    for path in args.prompts:
        if path.stem in sets:
            raise ValueError(f"--prompts: two files named {path.stem}; each prompt set is reported by its file's name")
        ids = [render(tokenizer, list(p.context)) for p in read_prompt_file(path)]
        sizes = level_sizes(len(ids), sorted(args.concurrency), args.min_prompts, args.per_slot)
        sets[path.stem] = {c: ids[:n] for c, n in sizes.items()}
    stop = stop_ids_of(generation, tokenizer)
    engine = engine_settings(args)
    bench = Bench(args.export_dir, target, sets, stop, sorted(args.concurrency), args.max_new_tokens, engine, args.timeout, args.repeats)
    return bench, [setting_name(s) for s in settings], tokenizer.decode


def engine_settings(args: argparse.Namespace) -> dict:
    """The ``sglang.Engine`` options every engine of the grid shares (beside the target and the draft)."""
    top = max(args.concurrency)
    return {
        "attention_backend": args.attention_backend,
        "page_size": args.page_size,
        "mem_fraction_static": args.mem_fraction_static,
        **{option: top for option in TOP_CONCURRENCY_OPTIONS},
        "disable_prefill_cuda_graph": not args.prefill_graph,
        "enable_deterministic_inference": args.deterministic,
        "enable_fp32_lm_head": args.fp32_lm_head,
    }


def _embedded_target() -> Path:
    from models.embedded import embedded_target_dir

    return embedded_target_dir()


def _tokenizer(target: Path):
    from transformers import GenerationConfig

    from models.target import load_tokenizer

    generation = GenerationConfig.from_pretrained(target) if (target / "generation_config.json").is_file() else None
    return load_tokenizer(target), generation


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.speedup", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    p.add_argument("export_dir", type=Path, help="an SGLang export (RUN/export/sglang)")
    p.add_argument("--prompts", type=Path, nargs="+", required=True, help="prompt jsonl files (serving/prompts.py), each reported apart")
    p.add_argument("--target", type=Path, default=None, help="the target's transformers dir (default: the embedded target)")
    p.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), help="STEPS/TOPK/DRAFT_TOKENS per engine, in run order")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY), help="requests in flight")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--repeats", type=int, default=1, help="times each level is decoded in its engine; the repeat of median wall time is reported"
    )
    p.add_argument("--min-prompts", type=int, default=64, help="prompts per level at least (the file's, if fewer)")
    p.add_argument("--per-slot", type=int, default=4, help="prompts per request in flight")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.3)
    p.add_argument("--prefill-graph", action="store_true", help="capture SGLang's prefill CUDA graphs too (a longer start)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="SGLang's batch-invariant kernels in every engine: the identity check without bf16 batch-shape noise (slower)",
    )
    p.add_argument(
        "--fp32-lm-head",
        action="store_true",
        help="SGLang's fp32 logits in every engine: no exact bf16 ties between the top tokens (the identity check)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds an engine may take, start and decoding")
    p.add_argument("--json", type=Path, default=None, help="results file (default: EXPORT_DIR/../speedup.json); resumed")
    p.add_argument(
        "--plain-from",
        type=Path,
        default=None,
        help="another export's results file of the same target, prompts and engine: its target-alone run is used, not run again",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    hub.offline()
    args = _parser().parse_args(argv)
    try:
        bench, names, decode = build_bench(args)
        results = args.json or args.export_dir.parent / "speedup.json"
        data = run_grid(bench, names, results, decode, plain=args.plain_from)
    except (ValueError, SettingFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summarise(data, results, args.export_dir))
    print(f"results: {results}; best settings: {args.export_dir / SERVING_FILE}")
    return 1 if data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
