"""Write new user prompts with the target (``python -m trainer.synthesize``), then, with
``--answer``, have the target answer them (``trainer.regenerate``).

Each prompt comes from a job: a category, a kind of request and a persona from
``trainer/datagen/synth/seeds.py``, plus ``--shots`` example prompts from the **training side** of a
source (default: the embedded chatterbot corpus, split exactly as the trainer splits it:
``--holdout-fraction``/``--split-seed`` or ``--holdout-categories``; held-out prompts are
never shown). The generator's replies are sampled (``--temperature``), cleaned and filtered
(length, English, refusals / meta-text: ``trainer/datagen/synth/filters.py``), and near-duplicates
(MinHash + LSH, ``trainer/data/dedup.py``) of any source prompt, held-out ones included, or
of an earlier kept prompt are dropped. A ``--follow-up-fraction`` of the kept prompts gets a
second user turn: the target answers the prompt (greedy), and the generator writes the
person's next message. Kept prompts go to ``--output`` (``{"id", "turns", "synthetic"}``,
the serving prompt format), dropped ones to ``<output>.rejected.jsonl``; both are written per
batch and a restart resumes. Counts per stage are printed at the end.

    python -m trainer.synthesize --output outputs/synthetic/prompts.jsonl --n-prompts 2000 \\
        --holdout-categories computers food history money movies science sports \\
        --answer outputs/synthetic/answered.jsonl
    python -m trainer.synthesize --engine sglang --output outputs/synthetic/prompts.jsonl --n-prompts 20000 \\
        --answer outputs/synthetic/answered.jsonl          # on a GPU: SGLang's offline engine writes and answers
    python -m trainer data=synthetic data.sources.synthetic.path=outputs/synthetic/answered.jsonl

The generator is a ``trainer.datagen.gen_backend`` backend (``--engine hf | sglang | auto`` and its
options, shared with ``trainer.regenerate``); ``--batch-size`` jobs go to it at a time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from models import hub
from models.generation import GenerationSettings
from serving.usage import PlainHelp
from trainer.config import DataConfig, DataSourceConfig
from trainer.data import DATA_FORMATS, read_chatterbot, read_source
from trainer.data_setup import Holdout, chatterbot_languages_of
from trainer.datagen.record_ids import record_id
from trainer.datagen.replicas import open_generator
from trainer.datagen.synth.filters import FilterSettings
from trainer.datagen.synth.instructions import Example, Planner, examples_of
from trainer.datagen.synth.pipeline import Synthesizer, SynthReport, SynthSettings
from trainer.datagen.synth.seeds import CATEGORIES
from trainer.regenerate import add_generator_arguments, generation_meta, prompt_conversations, regenerate, sized_generator


def source_side(args: argparse.Namespace) -> tuple[tuple[Example, ...], list[tuple[str, str]], str]:
    """(few-shot pool: the training side's first prompts, every prompt to deduplicate against
    as (key, text): all user turns of the source and of held-out categories, the split's description)."""
    cfg = DataConfig(
        sources={"source": DataSourceConfig(format=args.format, path=args.path, languages=list(args.languages))},
        holdout_fraction=args.holdout_fraction,
        holdout_categories=args.holdout_categories,
    )
    holdout = Holdout.of(cfg, args.split_seed)
    convs, _ = read_source(args.format, args.path, languages=args.languages, on_error="skip", name=f"source {args.format}")
    train, _ = holdout.split("source", convs)
    held_categories = read_chatterbot(chatterbot_languages_of(cfg), args.holdout_categories)[0] if args.holdout_categories else []
    known = []
    for prefix, group in (("", convs), ("heldout-category:", held_categories)):
        for conv in group:
            cid = record_id(conv)
            known += [(f"{prefix}{cid}:{i}", m["content"]) for i, m in enumerate(conv) if m["role"] == "user"]
    return examples_of(train, [record_id(c) for c in train]), known, holdout.describe()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.synthesize", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    p.add_argument("--output", required=True, type=Path, help="prompt jsonl to write (appended to; done jobs skipped)")
    p.add_argument("--n-prompts", required=True, type=int, help="prompts to keep")
    p.add_argument(
        "--answer", type=Path, default=None, help="then answer every kept prompt with the target into this OpenAI-messages jsonl"
    )
    p.add_argument("--seed", type=int, default=0, help="jobs and sampling")
    p.add_argument("--temperature", type=float, default=0.9, help="prompt and follow-up writing")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=64, help="per prompt; a prompt not finished within it is dropped")
    p.add_argument("--answer-max-new-tokens", type=int, default=256, help="per answer (follow-up context and --answer), greedy")
    p.add_argument("--follow-up-fraction", type=float, default=0.25)
    p.add_argument("--shots", type=int, default=3, help="example prompts shown per job")
    p.add_argument("--max-jobs", type=int, default=None, help="give up after this many jobs (default: 10 x --n-prompts)")
    p.add_argument("--format", default="chatterbot", choices=DATA_FORMATS, help="the source of example prompts (default: chatterbot)")
    p.add_argument("--path", default=None, help="source file or directory (every format but chatterbot)")
    p.add_argument("--languages", nargs="+", default=["english"], help="chatterbot languages")
    p.add_argument("--holdout-fraction", type=float, default=0.1, help="the trainer's data.holdout_fraction")
    p.add_argument("--split-seed", type=int, default=0, help="the trainer's trainer.seed (hash split)")
    p.add_argument(
        "--holdout-categories", nargs="+", default=None, help="the trainer's data.holdout_categories; also not used as seed categories"
    )
    p.add_argument("--min-chars", type=int, default=FilterSettings.min_chars)
    p.add_argument("--max-chars", type=int, default=FilterSettings.max_chars)
    p.add_argument("--min-words", type=int, default=FilterSettings.min_words)
    p.add_argument("--min-ascii", type=float, default=FilterSettings.min_ascii)
    p.add_argument("--min-stopwords", type=float, default=FilterSettings.min_stopwords)
    add_generator_arguments(p)  # the generator: --engine, --target, --batch-size (jobs per batch), ...
    return p


def main(argv: Sequence[str] | None = None) -> SynthReport:
    hub.offline()
    args = _parser().parse_args(argv)
    generator, batch_size = sized_generator(args)
    writer = GenerationSettings(args.max_new_tokens, args.temperature, args.top_p, batch_size, args.seed)
    answer = GenerationSettings(args.answer_max_new_tokens, 0.0, 1.0, batch_size, args.seed)
    filters = FilterSettings(args.min_chars, args.max_chars, args.min_words, args.min_ascii, args.min_stopwords)
    settings = SynthSettings(args.n_prompts, writer, answer, filters, args.max_jobs)
    pool, known, split = source_side(args)
    categories = {k: v for k, v in CATEGORIES.items() if k not in set(args.holdout_categories or ())}
    planner = Planner(categories, pool, args.seed, args.shots, args.follow_up_fraction)
    backend = open_generator(generator)
    try:
        meta = {
            "generator": str(backend.path),
            "engine": backend.name,
            "seed": args.seed,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "source": args.path or args.format,
            "split": split,
        }
        print(
            f"source {args.path or args.format}: {len(pool)} training prompts as examples, {len(known)} prompts to deduplicate "
            f"against (split: {split}); {len(categories)} categories; generator {backend.path} ({backend.name}, {batch_size} a batch)"
        )
        report = Synthesizer(backend, planner, settings, known, meta).run(args.output)
        print(report.line())
        print(json.dumps(report.as_dict()))
        if report.kept < args.n_prompts:
            print(f"WARNING: {report.kept} of {args.n_prompts} prompts kept within {settings.job_cap} jobs (--max-jobs)")
        if args.answer is not None:
            convs, extras = prompt_conversations(args.output)
            answered = regenerate(convs, backend, args.answer, answer, generation_meta(backend, answer), extras=extras)
            print(answered.line())
    finally:
        backend.close()
    return report


if __name__ == "__main__":
    main()
