"""Rewrite patcher/cli/help_text.py, the `patcher --help` the console script answers without click,
from click's own rendering (tests/test_cli_entry.py fails until this is run after a CLI change).

    .venv/bin/python scripts/write_help_text.py
"""

from __future__ import annotations

import json
from pathlib import Path

from patcher.cli.entry import render_help

PATH = Path(__file__).resolve().parent.parent / "patcher" / "cli" / "help_text.py"


def text() -> str:
    return (
        '"""`patcher --help`, as click renders it on an 80-column screen '
        '(written by `python scripts/write_help_text.py`)."""\n\n'
        # double-quoted, as `ruff format` writes a string (tests/test_lint.py checks the format)
        f"HELP = {json.dumps(render_help(), ensure_ascii=False)}\n"
    )


if __name__ == "__main__":
    PATH.write_text(text(), encoding="utf-8")
    print(f"wrote {PATH}")
