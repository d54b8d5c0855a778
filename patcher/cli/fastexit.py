"""End the process as soon as a command is done (shared by the console script and `python -m patcher.cli`)."""

from __future__ import annotations

import os
import sys


def run_and_exit(command) -> None:
    """Run the click command as the process, and end the process without tearing the
    interpreter down: once libcst is loaded, freeing its objects one by one at exit costs about
    20 ms, a tenth of a whole apply, for memory the system reclaims at once. Everything patcher
    writes is closed before this point; only the standard streams need a flush."""
    try:
        command()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except OSError as exc:
        if not is_stdout_failure(exc):
            raise
        from ..report import report_lost

        code = report_lost(exc, None)
    from .ticker import close_all

    close_all()  # a spinner still drawn (a command that exited mid-step)
    try:
        sys.stdout.flush()
    except OSError as exc:
        from ..report import report_lost

        code = report_lost(exc, code)
    try:
        sys.stderr.flush()
    except OSError:
        pass
    os._exit(code)


def is_stdout_failure(exc: OSError) -> bool:
    """Whether `exc` is stdout refusing what was written to it (checked by writing nothing more)."""
    try:
        os.fstat(sys.stdout.fileno())
        sys.stdout.flush()
    except (OSError, ValueError):
        return True
    return isinstance(exc, BrokenPipeError)
