"""``streamdraft COMMAND [ARGS]``: one entry point for every tool; ``streamdraft X ARGS`` runs exactly
what ``python -m MODULE ARGS`` runs (the module's own ``__main__`` block), so both stay the same.

    streamdraft train +experiment=smoke          # python -m trainer
    streamdraft verify RUN/export --target DIR   # python -m serving.verify
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence

from models import hub

COMMANDS = {  # command -> (module run as __main__, what it does)
    "train": ("trainer", "train a draft (the Hydra app; overrides as arguments)"),
    "regenerate": ("trainer.regenerate", "the target answers a source's or a prompt file's user turns"),
    "synthesize": ("trainer.synthesize", "the target writes new prompts (and answers them)"),
    "corpora": ("trainer.corpora", "fetch / prepare the real prompt corpora (train + held-out files)"),
    "report": ("trainer.report", "PNG panels and a Markdown report of a run dir"),
    "dashboard": ("trainer.dashboard", "the wandb workspace of the project's panels"),
    "verify": ("serving.verify", "replay each engine's loader over an export"),
    "eval": ("serving.eval", "acceptance length by speculative decoding against the transformers target"),
    "sglang-eval": ("serving.sglang_eval", "acceptance length in SGLang's own EAGLE-3 decoding (GPU)"),
    "served-check": ("serving.served_check", "the width SGLang hands the draft on the served target, before the first request (GPU)"),
    "serve": ("serving.launch", "the SGLang / vLLM server command for an export"),
    "bench": ("serving.bench", "load a running server with requests"),
    "speedup": ("serving.speedup", "wall-clock speedup in SGLang with the draft, chains and trees (GPU)"),
    "speedup-compare": ("serving.speedup_compare", "drafts' acceptance length paired by prompt, from speedup results files"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {text}  (python -m {module})" for name, (module, text) in COMMANDS.items())
    return f"usage: streamdraft COMMAND [ARGS]   (streamdraft COMMAND --help for its arguments)\n\ncommands:\n{rows}"


def main(argv: Sequence[str] | None = None) -> None:
    hub.offline()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if args else 2)
    if args[0] not in COMMANDS:
        print(f"streamdraft: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    module = COMMANDS[args[0]][0]
    sys.argv = [f"streamdraft {args[0]}", *args[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
