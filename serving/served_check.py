"""``python -m serving.served_check EXPORT_DIR --target TARGET_DIR``: the width SGLang hands the draft
when it serves this target with this export, checked before a user's first request.

The field failure this exists for: a target class that does not switch aux capture on hands the
draft its last hidden state (H values a token) instead of the concatenated aux states (A x H), SGLang
skips ``fc`` because the width then equals the draft's embedding width, and every draft token is
rejected. A checkpoint replay (``serving.verify``) cannot see it: the export is right, the server's
target class is wrong.

The check builds the target the way an SGLang EAGLE-3 server builds it: a ``ModelRunner`` with
SGLang's own speculative settings and this export as the draft, so SGLang's serving code reads the
export's ``eagle_config`` and switches the capture on (or fails to) for the class it builds. One
prefill of a few tokens then gives the width of the hidden states the EAGLE-3 worker would hand
the draft's ``fc``; it must equal the width ``fc`` was trained on (``fc.weight``'s input columns).
Exit code 0 when they agree, 1 with the cause named when they do not. Needs a CUDA GPU and SGLang.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from models import hub
from serving.usage import PlainHelp

WEIGHTS = "model.safetensors"
PROBE_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8)  # any ids below the target's vocab: the width does not depend on them


@dataclass(frozen=True)
class TrainedWidth:
    """What an export says its draft was trained on."""

    fc_in: int  # fc.weight's input columns: num_aux x target_hidden_size
    target_hidden: int  # the config's target_hidden_size
    aux_ids: tuple[int, ...]  # eagle_config.eagle_aux_hidden_state_layer_ids, as the engine reads them


def trained_width(export_dir: Path) -> TrainedWidth:
    """The widths of an SGLang export, from its config.json and the shape of ``fc.weight``."""
    config_file, weights = export_dir / "config.json", export_dir / WEIGHTS
    for f in (config_file, weights):
        if not f.is_file():
            raise ValueError(f"{f}: missing; pass an SGLang export dir (RUN/export/sglang)")
    config = json.loads(config_file.read_text())
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids or "target_hidden_size" not in config:
        raise ValueError(f"{config_file}: needs target_hidden_size and eagle_config.eagle_aux_hidden_state_layer_ids")
    with safe_open(str(weights), framework="pt") as f:
        if "fc.weight" not in f.keys():
            raise ValueError(f"{weights}: has no fc.weight: not an EAGLE-3 draft")
        fc_in = f.get_slice("fc.weight").get_shape()[1]
    return TrainedWidth(fc_in, config["target_hidden_size"], tuple(ids))


def width_problem(trained: TrainedWidth, served_class: str, served: int | None, target_hidden: int) -> str | None:
    """None when the served width is the trained one; else one line naming the cause."""
    if served == trained.fc_in:
        return None
    if served is None:
        return f"SGLang's {served_class} hands the draft no hidden states: it cannot serve an EAGLE-3 draft"
    if served == target_hidden:
        return (
            f"SGLang's {served_class} hands the draft its last hidden state ({served} values a token), not the "
            f"{len(trained.aux_ids)} aux states at {list(trained.aux_ids)} the draft was trained on ({trained.fc_in}): aux capture "
            "is not switched on for this class, SGLang would skip fc and accept no draft token"
        )
    if trained.target_hidden != target_hidden:
        return (
            f"the draft was trained on a {trained.target_hidden}-wide target (fc takes {trained.fc_in} values a token); "
            f"this target is {target_hidden} wide and SGLang's {served_class} hands {served}: export a draft trained on this target"
        )
    return f"SGLang's {served_class} hands the draft {served} values a token; its fc was trained on {trained.fc_in}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.served_check", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    p.add_argument("export_dir", type=Path, help="an SGLang export (RUN/export/sglang)")
    p.add_argument("--target", type=Path, required=True, help="the target dir the server loads")
    p.add_argument("--load-format", default="auto", help="SGLang's load_format (dummy: random weights of the target's shapes)")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    return p


def main(argv: list[str] | None = None) -> int:
    hub.offline()
    args = _parser().parse_args(argv)
    import torch

    from models.backends.sglang.preflight import read_target_shape
    from models.backends.sglang.target import SGLangTarget, served_width

    trained = trained_width(args.export_dir)
    hidden = read_target_shape(args.target).hidden_size
    factory = SGLangTarget(
        path=str(args.target),
        attention_backend=args.attention_backend,
        load_format=args.load_format,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=4 * len(PROBE_TOKENS),
    )
    served_class, served = served_width(factory, str(args.export_dir), torch.device("cuda", 0), PROBE_TOKENS)
    problem = width_problem(trained, served_class, served, hidden)
    if problem is not None:
        print(f"served check failed for {args.export_dir} on {args.target}: {problem}", file=sys.stderr)
        return 1
    print(f"served check: SGLang's {served_class} hands the draft {served} values a token, the width its fc was trained on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
