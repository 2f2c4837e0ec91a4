"""Command-line help as a user reads it: the tools' ``--help`` is built from docstrings, whose RST
code marks (a pair of backticks around a name) are dropped from the descriptions and argument texts."""

from __future__ import annotations

import argparse

CODE_MARK = "``"


class PlainHelp(argparse.HelpFormatter):
    """argparse's formatter without RST code marks."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace(CODE_MARK, ""))

    def _expand_help(self, action: argparse.Action) -> str:
        return super()._expand_help(action).replace(CODE_MARK, "")
