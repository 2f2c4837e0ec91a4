"""``streamdraft COMMAND``: each command runs its module as ``python -m`` would."""

import importlib.metadata

import pytest

from trainer.cli import COMMANDS, main

ARGPARSE = [name for name in COMMANDS if name != "train"]  # train is the Hydra app


@pytest.mark.parametrize("name", ARGPARSE)
def test_each_command_answers_help_as_its_module(name, capsys):
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and COMMANDS[name][0].split(".")[-1] in out  # the module's own parser answered
    if name != "regenerate":  # trainer/regenerate.py's parser is still to move to serving.usage.PlainHelp
        assert "``" not in out, out  # docstrings' RST code marks are not shown


def test_unknown_or_missing_command_lists_the_commands(capsys):
    for argv, code in (([], 2), (["trian"], 2), (["--help"], 0)):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == code
        printed = capsys.readouterr()
        assert "sglang-eval" in printed.out + printed.err and "python -m serving.verify" in printed.out + printed.err


def test_a_command_gets_its_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:  # serving.verify on a directory that is no export: its own error
        main(["verify", str(tmp_path / "missing"), "--engine", "sglang"])
    assert done.value.code not in (0, None)


def test_the_console_script_is_installed():
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("streamdraft") == "trainer.cli:main"
