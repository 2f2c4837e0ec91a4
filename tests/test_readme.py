"""Every command of the README's bash blocks after the set-up line runs as written: its module or script
exists, its ``--help`` exits 0, and the README's own arguments parse (argparse stopped right after parsing)
or, for the Hydra app (``python -m trainer``, ``launch/train.py`` under ``deepspeed``), compose into a
typed config, so a misspelt flag or key in the README fails here. Nothing is run past its parse."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_config import _compose
from trainer.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PYTHONS = ("python", "python3", ".venv/bin/python")
HYDRA_APPS = ("trainer", "launch/train.py")  # python -m trainer, and the DeepSpeed launcher's script
ENV = re.compile(r"[A-Z_][A-Z0-9_]*=")  # VAR=value before a command
# runpy runs a module already imported here (by this test's imports or an earlier command) afresh, as -m does
pytestmark = pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")


def readme_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, argv) of each command of the bash blocks after the first (the set-up line); ``&&`` parts apart,
    comments and leading VAR=value dropped."""
    commands, block, lines = [], -1, text.splitlines()
    inside = False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            block += inside
            continue
        if not inside or block == 0:
            continue
        words = shlex.split(line, comments=True)
        while words:
            part = words[: words.index("&&")] if "&&" in words else words
            words = words[len(part) + 1 :]
            while part and ENV.match(part[0]):
                part = part[1:]
            if part:
                commands.append((number, part))
    return commands


COMMAND_LINES = readme_commands(README.read_text())


def entry(argv: list[str]) -> tuple[str, list[str]]:
    """(a module ``-m`` runs or a script path, its arguments) of a README command."""
    if argv[0] in PYTHONS and argv[1] == "-m":
        return argv[2], argv[3:]
    if argv[0] in PYTHONS and argv[1].endswith(".py"):
        return argv[1], argv[2:]
    if argv[0] == "streamdraft":
        return COMMANDS[argv[1]][0], argv[2:]
    if argv[0] == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        launcher = parse_args(argv[1:])
        return launcher.user_script, launcher.user_args
    raise AssertionError(f"a command this test does not know: {shlex.join(argv)}")


class Parsed(Exception):
    """Raised right after an argparse parser parsed the README's arguments: nothing of the tool runs."""


def run_as_main(target: str, args: list[str], monkeypatch) -> None:
    """``target`` (a module or a script) as ``__main__`` with ``args``, stopped after its parse: Parsed, or the
    SystemExit argparse raises (``--help``: 0, an error: 2). The outermost ``parse_args`` / ``parse_known_args``
    call stops it; those inside it (``parse_args`` calls ``parse_known_args``, a subcommand its own parser) run."""
    depth = [0]

    def stopping(original):
        def parse(self, argv=None, namespace=None):
            depth[0] += 1
            try:
                parsed = original(self, argv, namespace)
            finally:
                depth[0] -= 1
            if depth[0]:
                return parsed
            raise Parsed(parsed)

        return parse

    for name in ("parse_args", "parse_known_args"):
        monkeypatch.setattr(argparse.ArgumentParser, name, stopping(getattr(argparse.ArgumentParser, name)))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what each tool sets first, undone after the test
    monkeypatch.setattr(sys, "argv", [target, *args])
    if target.endswith(".py"):
        runpy.run_path(str(ROOT / target), run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def assert_help_exits_0(target: str, monkeypatch) -> None:
    if target == "pytest":  # pytest in this pytest's process would take it over
        assert subprocess.run([sys.executable, "-m", "pytest", "--help"], capture_output=True, cwd=ROOT).returncode == 0
        return
    try:
        run_as_main(target, ["--help"], monkeypatch)  # the Hydra app prints its help and returns
    except SystemExit as e:
        assert e.code in (0, None), f"{target} --help exited {e.code}"


@pytest.mark.parametrize("argv", [argv for _, argv in COMMAND_LINES], ids=[f"README.md:{n}" for n, _ in COMMAND_LINES])
def test_each_readme_command_exists_and_its_arguments_parse(argv, monkeypatch):
    target, args = entry(argv)
    if target.endswith(".py"):
        assert (ROOT / target).is_file(), f"{target}: no such script"
    assert_help_exits_0(target, monkeypatch)
    if target in HYDRA_APPS:
        _compose(*args)
    elif target != "pytest":
        with pytest.raises(Parsed):
            run_as_main(target, args, monkeypatch)


def test_the_reader_finds_each_command_of_a_line_and_skips_the_set_up_block():
    text = (
        "```bash\npip install x && python -m trainer\n```\n"
        "```bash\n# a comment\nA=1 B=2 python -m trainer.corpora fetch && python -m serving.verify RUN --target 'a b'  # why\n```\n"
        "```python\nprint()\n```\n"
    )
    assert readme_commands(text) == [
        (6, ["python", "-m", "trainer.corpora", "fetch"]),
        (6, ["python", "-m", "serving.verify", "RUN", "--target", "a b"]),
    ]
    assert len(COMMAND_LINES) > 40  # the README's usage block was read
    with pytest.raises(AssertionError, match="a command this test does not know: make all"):
        entry(["make", "all"])


def test_a_misspelt_flag_or_key_fails_and_nothing_runs_past_the_parse(monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as e:
        run_as_main("trainer.regenerate", ["--output", str(tmp_path / "o.jsonl"), "--no-such-flag"], monkeypatch)
    assert e.value.code == 2
    with pytest.raises(Parsed):
        run_as_main("trainer.corpora", ["prepare", "--out", str(tmp_path / "corpora")], monkeypatch)
    assert not (tmp_path / "corpora").exists()
    with pytest.raises(Exception, match="draft.ttt_step"):
        _compose("draft.ttt_step=7")
