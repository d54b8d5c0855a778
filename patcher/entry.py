"""The `patcher` console script. `--version` and `--help` are answered here, without loading
the command line (click and the commands' modules cost several times a bare interpreter start,
bench/local.py); everything else goes to patcher.cli.

The help text is click's own, rendered for an 80-column screen and kept in patcher/help_text.py;
tests/test_cli_entry.py fails when it no longer matches (regenerate: `python -m patcher.entry`).
"""

from __future__ import annotations

import os
import sys

from . import __version__


def _screen_width() -> int:
    try:
        return int(os.environ.get("COLUMNS", "")) or os.get_terminal_size(sys.__stdout__.fileno()).columns
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
    from .cli import main as cli_main

    run_and_exit(cli_main)


def run_and_exit(command) -> None:
    """Run the click command as the process, and end the process without tearing the
    interpreter down: once libcst is loaded, freeing its objects one by one at exit costs about
    20 ms, a tenth of a whole apply, for memory the system reclaims at once. Everything patcher
    writes is closed before this point; only the standard streams need a flush."""
    import os

    try:
        command()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, OSError):
        code = code or 1
    os._exit(code)


def render_help() -> str:
    """click's top-level help, as an 80-column (or wider) screen shows it: 78 columns."""
    from click.testing import CliRunner

    from .cli import main as cli_main

    result = CliRunner().invoke(cli_main, ["--help"], prog_name="patcher", terminal_width=78)
    assert result.exit_code == 0, result.output
    return result.output


def write_help() -> None:
    from pathlib import Path

    path = Path(__file__).with_name("help_text.py")
    path.write_text(
        '"""`patcher --help`, as click renders it on an 80-column screen (written by `python -m patcher.entry`)."""\n\n'
        f"HELP = {render_help()!r}\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    write_help()
