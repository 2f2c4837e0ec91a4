"""``python -m trainer --help`` (``streamdraft train --help``): the config groups of ``conf/`` and
every key of the composed config with its value and what it means, read from the comments of the
typed schema (``trainer/config.py``): one place says what a key does.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import textwrap
import tokenize
from dataclasses import is_dataclass
from functools import cache
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from trainer.config import register_schema

USAGE = """usage: streamdraft train [KEY=VALUE | GROUP=OPTION | +experiment=NAME ...] [--verbose]
       (python -m trainer; deepspeed --quiet --no_local_rank launch/train.py for several ranks)

Train an EAGLE-3 draft online: the target runs as an engine, its hidden states stream to the trainer.
A wrong key or value is an error that names it; --verbose shows full traces and the libraries' output."""


@cache
def field_comments(schema: type) -> dict[str, str]:
    """Field name -> the comment on its line (or lines) in ``schema``'s source; fields without one are absent."""
    source = textwrap.dedent(inspect.getsource(schema))
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            said = [comments[line] for line in range(node.lineno, node.end_lineno + 1) if line in comments]
            if said:
                out[node.target.id] = said[0]
    return out


def key_lines(node: DictConfig, prefix: str = "") -> list[str]:
    """``key = value  # meaning`` for every leaf of ``node`` (sub-configs and named sources walked)."""
    schema = OmegaConf.get_type(node)
    comments = field_comments(schema) if is_dataclass(schema) else {}
    lines = []
    for key in node.keys():
        full = f"{prefix}{key}"
        if not OmegaConf.is_missing(node, key) and isinstance(node[key], DictConfig):
            lines += key_lines(node[key], f"{full}.")
            continue
        value = "???" if OmegaConf.is_missing(node, key) else _shown(OmegaConf.to_container(node, resolve=False)[key])
        meaning = comments.get(str(key))
        lines.append(f"  {full} = {value}" + (f"  # {meaning}" if meaning else ""))
    return lines


def _shown(value: object) -> str:
    """A value as it is written on the command line: text as is (an ``${interpolation}`` too), the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def help_text(conf_dir: Path, overrides: list[str]) -> str:
    """The help page of the app whose config groups live in ``conf_dir``, its values after ``overrides``."""
    register_schema()
    groups = sorted(p for p in conf_dir.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    group_lines = [f"  {g.name}: {', '.join(sorted(f.stem for f in g.glob('*.yaml')))}" for g in groups]
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return "\n".join(
        [
            USAGE,
            "",
            "config groups (GROUP=OPTION; experiment with +experiment=NAME):",
            *group_lines,
            "",
            "keys (KEY=VALUE), with the values of this composition:",
            *key_lines(cfg),
        ]
    )
