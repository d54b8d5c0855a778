"""The `patcher` console script. `--version` and `--help` are answered here, without loading
the command line (click and the commands' modules cost several times a bare interpreter start,
bench/local.py); everything else goes to patcher.cli.

The help text is click's own, rendered for an 80-column screen and kept in patcher/cli/help_text.py;
tests/test_cli_entry.py fails when it no longer matches (regenerate: `python scripts/generate.py`).
"""

from __future__ import annotations

import os
import sys

from .. import __version__
from .fastexit import run_and_exit


def _screen_width() -> int:
    try:
        return int(os.environ.get("COLUMNS", "")) or os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]  # None: AttributeError, below
    except (ValueError, OSError, AttributeError):
        return 80


def main() -> None:
    args = sys.argv[1:]
    if args == ["--version"]:
        sys.stdout.write(f"patcher, version {__version__}\n")
        return
    # click wraps help to min(screen, 80) - 2 columns: the kept text is right for 80 and wider.
    if args in (["--help"], ["-h"]) and _screen_width() >= 80:
        from .help_text import HELP

        sys.stdout.write(HELP)
        return
    from .patcher_command import main as cli_main

    run_and_exit(cli_main)


def render_help() -> str:
    """click's top-level help, as an 80-column (or wider) screen shows it: 78 columns."""
    from click.testing import CliRunner

    from .patcher_command import main as cli_main

    result = CliRunner().invoke(cli_main, ["--help"], prog_name="patcher", terminal_width=78)
    assert result.exit_code == 0, result.output
    return result.output


if __name__ == "__main__":  # `python -m patcher.cli.entry` is the console script too
    main()
