"""``python -m serving.verify DIR [--engine sglang|vllm] [--target PATH]``: will this export work
when that engine serves it? Without ``--engine``, DIR is an ``export_both`` root and every format
of ``serving.formats.EXPORT_FORMATS`` is verified in ``DIR/<engine>``.

The checks, each a row of the problem table (exit code 1 when there is any):

* ``format``   the config is this engine's format and parses (``serving/formats.py``);
* ``widths``   the config's widths are the tensors' (a field that is not: one problem, and the
  loader is not replayed, as each tensor would fail on it);
* ``weights``  the engine's loader, replayed (``serving/loaders.py``), consumes every tensor,
  sets every parameter, and every shape matches the config;
* ``vocab``    ``d2t`` / ``t2d`` satisfy the vocab map's invariants (``models/vocab_map.py``);
* ``layers``   the aux layer ids are in range for the target, in the engine's semantics;
* ``target``   the target architecture captures aux hidden states in this engine
  (``serving/aux_capture_table.py``), its widths and vocab match the draft's config (its
  ``hidden_size`` too, unless the export has an embedding of its own), and the draft's
  ``fc`` will actually run (SGLang skips it when the incoming width equals the embedding's).

Without ``--target`` the target facts come from the export's ``streamdraft`` provenance; with it,
from the target's ``config.json`` (its ``text_config`` for a multimodal target).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.aux_support import aux_capture_support, draft_class_known
from models.draft import DraftShape
from models.target_config import read_text_config
from models.vocab_map import VocabMap
from serving.formats import CONFIG_FILE, EXPORT_FORMATS, WEIGHTS_FILE, ExportConfig, format_named, format_of, read_config_file
from serving.loaders import Replay
from serving.usage import PlainHelp

EMBEDDING = "embed_tokens.weight"  # an export's own embedding (serving.formats.tensor_shapes: when not the target's width)


@dataclass(frozen=True)
class Problem:
    check: str  # format | widths | weights | vocab | layers | target
    item: str  # the tensor, parameter or field concerned
    message: str


@dataclass(frozen=True)
class TargetFacts:
    architecture: str | None
    num_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    source: str  # "--target DIR" or "export provenance"


@dataclass
class Report:
    export_dir: Path
    engine: str
    problems: list[Problem] = field(default_factory=list)
    consumed: int = 0
    params_set: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, check: str, item: str, message: str) -> None:
        self.problems.append(Problem(check, item, message))


# --------------------------------------------------------------------------- checks


def _widths(report: Report, s: DraftShape, shapes: dict[str, tuple[int, ...]]) -> bool:
    """The config's widths against the tensors' own; True when every one agrees."""
    widths = {  # config field -> the tensor and dim that has its width, and the config's value
        "hidden_size": ("norm.weight", 0, s.hidden_size),
        "intermediate_size": ("midlayer.mlp.gate_proj.weight", 0, s.intermediate_size),
        "draft_vocab_size": ("lm_head.weight", 0, s.draft_vocab_size),
        "num_aux * target_hidden_size": ("fc.weight", 1, s.num_aux * s.target_hidden_size),
    }
    agree = True
    for item, (tensor, dim, value) in widths.items():
        got = shapes.get(tensor, ())
        if len(got) > dim and got[dim] != value:
            report.add("widths", item, f"{value} in {CONFIG_FILE}, {got[dim]} in the tensors ({tensor} {got}): they must agree")
            agree = False
    return agree


def _weights(report: Report, replay: Replay) -> None:
    verb = EXPORT_FORMATS[replay.engine].unknown_tensor
    for name in replay.dropped + replay.refused:
        report.add("weights", name, f"no {replay.engine} parameter takes this tensor: {replay.engine} {verb}")
    for ckpt, param, got, want in replay.shape_errors:
        report.add("weights", ckpt, f"shape {got} does not fit {replay.engine} parameter {param} {want} (from the config)")
    for param in replay.unset():
        report.add("weights", param, f"{replay.engine} parameter is set by no tensor: it keeps its initial values")
    report.consumed = len(replay.landed)
    report.params_set = len(replay.set_params)


def _vocab(report: Report, tensors: dict, parsed: ExportConfig | None) -> None:
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if t2d is None:
        report.add("vocab", "t2d", "missing: the draft-vocab mask is needed to check the map")
        return
    if d2t is None:
        if parsed is not None and parsed.shape.draft_vocab_size != parsed.shape.vocab_size:
            report.add("vocab", "d2t", "missing: the engine would map draft ids to target ids 0..V_d-1 (identity)")
        return
    try:
        VocabMap(d2t, t2d).validate("d2t/t2d")
    except ValueError as e:
        report.add("vocab", "d2t", str(e))


def _layer_range(report: Report, parsed: ExportConfig, n: int) -> None:
    ids = parsed.engine_aux_layer_ids
    bad, rule = EXPORT_FORMATS[parsed.engine].layer_range(ids, n)
    if bad:
        report.add("layers", "eagle_aux_hidden_state_layer_ids", f"{ids} out of range for a {n}-layer target: {bad} ({rule})")
    if parsed.target_num_layers is not None and parsed.target_num_layers != n:
        report.add(
            "layers",
            "streamdraft.target_num_layers",
            f"the draft was trained on a {parsed.target_num_layers}-layer target, this one has {n}",
        )


def _target(report: Report, parsed: ExportConfig, t: TargetFacts, own_embedding: bool) -> None:
    s, fmt = parsed.shape, EXPORT_FORMATS[parsed.engine]
    if t.architecture is None:
        report.add("target", "architecture", f"unknown target architecture ({t.source}): pass --target DIR to check aux capture")
    else:
        support = aux_capture_support(parsed.engine, t.architecture)
        if not support.known:
            report.add("target", t.architecture, fmt.unknown_architecture(support.version))
        elif not support.supported:
            report.add("target", t.architecture, fmt.no_capture(s, support.version, t.architecture))
    if t.num_layers is not None:
        _layer_range(report, parsed, t.num_layers)
    if t.hidden_size is not None and t.hidden_size != s.target_hidden_size:
        report.add(
            "target",
            "target_hidden_size",
            f"the draft reads {s.target_hidden_size}-wide target states, the target's hidden is {t.hidden_size}",
        )
    if t.hidden_size is not None and t.hidden_size != s.hidden_size and not own_embedding:
        report.add(
            "target",
            "hidden_size",
            f"{s.hidden_size} in {CONFIG_FILE}, the target's is {t.hidden_size}: the draft embeds with the target's embedding"
            " (the export has none of its own)",
        )
    if t.vocab_size is not None and t.vocab_size != s.vocab_size:
        report.add(
            "target",
            "vocab_size",
            f"the draft's vocab_size {s.vocab_size} != the target's {t.vocab_size} (d2t would index the wrong tokens)",
        )
    if fmt.checks_fc_width() and s.num_aux * s.target_hidden_size == s.hidden_size:
        report.add("target", "fc.weight", "num_aux * target_hidden_size == hidden_size: SGLang would skip fc silently")


# --------------------------------------------------------------------------- inputs


def target_facts(target: Path | None, parsed: ExportConfig | None) -> TargetFacts:
    """Target facts from ``target``'s config.json, else from the export's provenance."""
    if target is not None:
        if not target.is_dir():
            raise ValueError(f"--target {target}: pass the target's transformers dir (its config.json is read)")
        architecture, text = read_text_config(target)
        sizes = (text["num_hidden_layers"], text["hidden_size"], text.get("vocab_size"))
        return TargetFacts(architecture, *sizes, f"--target {target}")
    if parsed is None:
        return TargetFacts(None, None, None, None, "export provenance")
    return TargetFacts(parsed.target_architecture, parsed.target_num_layers, None, None, "export provenance")


def _read_weights(path: Path, report: Report) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.Tensor]]:
    if not path.is_file():
        report.add("weights", WEIGHTS_FILE, "the export has no weights file")
        return {}, {}
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            small = {k: f.get_tensor(k) for k in ("d2t", "t2d") if k in shapes}
    except SafetensorError as e:
        report.add("weights", WEIGHTS_FILE, f"not a readable safetensors file ({e})")
        return {}, {}
    return shapes, small


def _replay(engine: str, config: dict, shapes: dict, target_vocab: int | None, report: Report) -> None:
    try:
        replay = EXPORT_FORMATS[engine].replay(config, shapes, target_vocab)
    except (KeyError, TypeError) as e:
        report.add("format", CONFIG_FILE, f"the {engine} loader cannot size its parameters from this config (field {e})")
        return
    _weights(report, replay)


def verify_export(export_dir: str | Path, engine: str, target: str | Path | None = None) -> Report:
    """Every check above for ``export_dir`` served by ``engine``; never raises on a bad export."""
    fmt = format_named(engine)
    export_dir = Path(export_dir)
    report = Report(export_dir, engine)
    try:
        config = read_config_file(export_dir / CONFIG_FILE)
    except ValueError as e:
        report.add("format", CONFIG_FILE, str(e))
        return report
    if format_of(config) is not fmt:
        other = format_of(config).name
        report.add("format", CONFIG_FILE, f"this is a {other} export, not a {engine} one (its aux layer ids are in {other}'s semantics)")
        return report
    parsed = None
    try:
        parsed = fmt.parse(config, CONFIG_FILE)
    except ValueError as e:
        report.add("format", CONFIG_FILE, str(e))
    facts = target_facts(Path(target) if target is not None else None, parsed)
    shapes, small = _read_weights(export_dir / WEIGHTS_FILE, report)
    if shapes:
        if parsed is None or _widths(report, parsed.shape, shapes):
            _replay(engine, config, shapes, facts.vocab_size, report)
        _vocab(report, small, parsed)
    if parsed is not None:
        _draft_class(report, fmt, parsed)
        _target(report, parsed, facts, EMBEDDING in shapes)
    return report


def _draft_class(report: Report, fmt, parsed: ExportConfig) -> None:
    """The engine version the project reads must register the class that serves this draft's layout."""
    cls = fmt.draft_class(parsed.shape)
    known, version = draft_class_known(fmt.name, cls)
    if not known:
        layout = parsed.shape.layout
        report.add("draft", cls, f"{fmt.name} {version} registers no draft class {cls}: it cannot serve a {layout}-layout draft")


def verify_exports(dirs: dict[str, Path], target: str | Path | None = None) -> dict[str, Report]:
    """``verify_export`` of every format of ``EXPORT_FORMATS``, ``dirs`` giving each one's export dir."""
    missing = sorted(set(EXPORT_FORMATS) - set(dirs))
    if missing:
        raise ValueError(f"no export dir given for engine(s) {missing}")
    return {engine: verify_export(dirs[engine], engine, target) for engine in EXPORT_FORMATS}


# --------------------------------------------------------------------------- output


def format_report(report: Report) -> str:
    head = f"{report.export_dir} for {report.engine}"
    if report.ok:
        return f"OK  {head}: {report.consumed} tensors consumed, {report.params_set} parameters set, no problems"
    rows = [("check", "item", "problem")] + [(p.check, p.item, p.message) for p in report.problems]
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    lines = [f"FAIL  {head}: {len(report.problems)} problem(s)"]
    lines += [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.verify", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    parser.add_argument("export_dir", type=Path, help="an export dir (with --engine), else an export_both root")
    parser.add_argument("--engine", choices=list(EXPORT_FORMATS), default=None, help="verify DIR for this engine only")
    parser.add_argument("--target", type=Path, default=None, help="target model dir (its config.json) to check against")
    args = parser.parse_args(argv)
    try:
        if args.engine is not None:
            reports = [verify_export(args.export_dir, args.engine, args.target)]
        else:
            reports = list(verify_exports({engine: args.export_dir / engine for engine in EXPORT_FORMATS}, args.target).values())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(format_report(r) for r in reports))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
