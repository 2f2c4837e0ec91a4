"""The model card of an export: ``README.md`` beside its ``config.json`` and weights, written after
each export's verification and serving eval (engines and verifiers read only those two files).

It says what the draft is for (target, aux ids, chat template), what it was trained on and how
(data, recipe), what was measured (τ, verification) and how to serve it.
"""

from __future__ import annotations

import math
from pathlib import Path

from serving.formats import read_export_config
from trainer.build import Built
from trainer.config import Config, ScheduleConfig
from trainer.report import metrics as M
from trainer.schedule import ScheduleStart

CARD_FILE = "README.md"
SPEEDUP_FILE = "serving.json"  # a serving benchmark's result, when one was written into the export


def write_cards(served: dict, cfg: Config, built: Built, steps: int, prompts_file: Path) -> None:
    """A card in every export dir of ``served`` (``serving.pipeline.export_verify_eval``'s result);
    ``prompts_file``: the run's serving-eval prompts."""
    for engine, export_dir in served["export_dirs"].items():
        path = Path(export_dir)
        (path / CARD_FILE).write_text(model_card(engine, path, served, cfg, built, steps, prompts_file), encoding="utf-8")


def model_card(engine: str, export_dir: Path, served: dict, cfg: Config, built: Built, steps: int, prompts_file: Path) -> str:
    info, shape, parsed = built.target.head.info, built.identity.shape, read_export_config(export_dir)
    template = (
        f"`{cfg.data.chat_template}` (data.chat_template: give it to the server too)" if cfg.data.chat_template else "the tokenizer's"
    )
    lines = [
        f"# EAGLE-3 draft for {built.target.path.name}",
        "",
        f"A StreamDraft export for {engine} (`{parsed.raw['architectures'][0]}`), trained online: the target's hidden",
        "states were streamed to the trainer, never stored.",
        "",
        "## Target",
        "",
        f"- model: `{built.target.path}` ({info.architecture}, {info.num_layers} layers, hidden {info.hidden_size}, "
        f"vocab {info.vocab_size})",
        f"- aux layer ids: {list(info.aux_layer_ids)} (output of decoder layer k); this config writes {parsed.engine_aux_layer_ids}",
        f"- chat template: {template}",
        "",
        "## Draft",
        "",
        f"- {_attention(shape)}, hidden {shape.hidden_size}, MLP {shape.intermediate_size}, "
        f"draft vocab {shape.draft_vocab_size} of {shape.vocab_size} target tokens" + (", fc_norm" if shape.fc_norm else ""),
        f"- feeds back its {'normed' if parsed.norm_output else 'pre-norm'} output at draft steps after the first "
        f"(norm_output {parsed.norm_output})",
        f"- started from: {_started_from(cfg, built)}",
        "",
        *_data(cfg, built),
        "",
        *_recipe(cfg, built, steps),
        "",
        *_measured(served, export_dir, built, prompts_file),
        "",
        "## Serve",
        "",
        "```bash",
        f"python -m serving.launch --engine {engine} --target {built.target.path} --draft {export_dir}   # prints the server command",
        "```",
    ]
    return "\n".join(lines) + "\n"


def _started_from(cfg: Config, built: Built) -> str:
    """The draft the run trained on: draft.init_from's, else one made from the target; and the checkpoint it resumed."""
    start = f"`{cfg.draft.init_from}` (draft.init_from)" if cfg.draft.init_from else "the target's embedding and lm_head rows"
    return start + (f"; resumed from the checkpoint `{built.resume_from}`" if built.resume_from else "")


def _lr(s: ScheduleConfig, start: ScheduleStart) -> str:
    """The peak LR: schedule.lr, or its continue_lr_ratio share on a trained draft (trainer.schedule.ScheduleStart)."""
    if not start.continued:
        return f"lr {s.lr:g}"
    peak = s.lr * s.continue_lr_ratio
    return f"peak lr {peak:g} (lr {s.lr:g} x continue_lr_ratio {s.continue_lr_ratio:g}: a trained draft, from step {start.step})"


def _data(config: Config, built: Built) -> list[str]:
    report, cfg = built.data.report(), config.data
    rows = []
    for name, share in report["mix"].items():
        src, counts = cfg.sources[name], report["sources"][name]
        where = f"`{src.path}`" if src.path is not None else "the packaged corpus"
        rows.append(f"- {name} ({src.format}, {where}): {counts['samples']:,} training samples, {share:.0%} of an epoch")
    return [
        "## Data",
        "",
        *rows,
        f"- {report['samples']:,} samples, {report['masked_tokens']:,} tokens under the loss mask (assistant turns), max_len {cfg.max_len}",
        f"- held out for evaluation: {built.data.heldout_rule}",
    ]


def _recipe(cfg: Config, built: Built, steps: int) -> list[str]:
    s, d = cfg.schedule, cfg.draft
    return [
        "## Recipe",
        "",
        f"- {steps:,} optimizer steps of {built.total_steps:,} ({cfg.trainer.epochs} epochs"
        + (f", trainer.max_steps {cfg.trainer.max_steps}" if cfg.trainer.max_steps else "")
        + (f", trainer.max_time_s {cfg.trainer.max_time_s:g}" if cfg.trainer.max_time_s else "")
        + ")",
        f"- schedule {s.name}, {_lr(s, built.schedule_start)}, warmup ratio {s.warmup_ratio:g}, weight decay {s.weight_decay:g}, "
        f"betas {list(s.betas)}",
        f"- TTT {d.ttt_steps} steps, step weights {d.step_decay:g}^k; {built.identity.world} rank(s) x grad_accum "
        f"{cfg.deepspeed.grad_accum}, ZeRO {cfg.deepspeed.zero_stage}, seed {cfg.trainer.seed}",
    ]


def _measured(served: dict, export_dir: Path, built: Built, prompts_file: Path) -> list[str]:
    tau, se = served.get(M.EVAL_ACCEPT_LEN), served.get(M.EVAL_ACCEPT_LEN_SE)
    parsed, origin = read_export_config(export_dir), built.prompt_origin
    if tau is None:
        measured = f"- τ: not measured ({served['serve_eval']})"
    else:
        pm = f" ± {se:.3f}" if se is not None and math.isfinite(se) else ""
        measured = (
            f"- τ (acceptance length, bonus token included) **{tau:.3f}{pm}** on {origin['prompts']} held-out prompts "
            f"({origin['turns']} turns), k = {parsed.num_speculative_tokens}, up to {parsed.eval_max_new_tokens} new tokens a turn: "
            "greedy speculative decoding with the SGLang export, loaded from disk, against the transformers target"
        )
    lines = [
        "## Measured",
        "",
        measured,
        f"- serving.eval on the same prompts: `python -m serving.eval {export_dir.parent / 'sglang'} --prompts {prompts_file}`",
        f"- verified: {'; '.join(text.splitlines()[0] for text in served['verify'].values())}",
    ]
    if (export_dir / SPEEDUP_FILE).is_file():
        lines.append(f"- serving speedup: `{SPEEDUP_FILE}` in this dir")
    return lines


def add_speedup(export_dir: Path, speedup: dict) -> None:
    """The export's card gains the measured best setting per concurrency (``summary["speedup"]``, trainer.speedup)."""
    card = export_dir / CARD_FILE
    if not speedup.get("best") or not card.is_file():
        return
    lines = ["", "## Speedup in SGLang (serving.speedup)", ""]
    for c, b in speedup["best"].items():
        lines.append(f"- concurrency {c}: {b['setting']} (steps/topk/draft tokens), {b['speedup']:.2f}x the target alone")
    lines.append(f"- every setting measured: `{speedup['results']}`; `serving.launch --draft` uses the best (`serving.json`)")
    with card.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _attention(shape) -> str:
    if shape.mla is None:
        return f"llama layout ({shape.num_attention_heads} heads / {shape.num_key_value_heads} KV heads)"
    m = shape.mla
    return (
        f"mla layout ({shape.num_attention_heads} heads; q rank {m.q_lora_rank}, kv latent {m.kv_lora_rank}, "
        f"head {m.qk_nope_head_dim} + rope {m.qk_rope_head_dim}, v {m.v_head_dim})"
    )
