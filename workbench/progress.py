"""Progress of the suite's long fixtures (a vLLM environment's build: minutes) on pytest's own
output, so a run is not silent for 8 minutes.

pytest captures a test's output, fixtures' included, at the file-descriptor level: a line written
to sys.stderr, or to sys.__stderr__ (the same fd 2), lands in the capture and is shown only for a
failing test. So the lines go through pytest's terminal reporter (where its own dots and summary
go: the terminal or the CI log) with capture suspended around each write, which is how pytest
itself lets a line out (capsys.disabled() is the same, for a test). The conftest keeps the config
here at pytest_configure. Plain lines, a spinner never: it would fight pytest's own line. A line
every PATCHER_PROGRESS_EVERY seconds (default 30) while a pip step says nothing
(patcher.cli.ticker, the CLI's own)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import pytest

from patcher.cli.ticker import Ticker

_config: list[pytest.Config] = []


def keep_config(config: pytest.Config) -> None:
    _config[:] = [config]


def terminal_line(line: str) -> None:
    """One line where pytest's own output goes, whatever it captures; stderr outside pytest."""
    config = _config[0] if _config else None
    reporter = config.pluginmanager.getplugin("terminalreporter") if config else None
    capture = config.pluginmanager.getplugin("capturemanager") if config else None
    with capture.global_and_fixture_disabled() if capture else nullcontext():
        if reporter is not None:
            reporter.write_line(line)
            reporter.flush()
        else:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


@contextmanager
def shown(what: str) -> Iterator[Callable[[str], None]]:
    """A progress callback whose lines are shown, prefixed `[what]`, with the time a silent step
    has taken every so often; closed at the end of the block."""
    with Ticker(lambda line: terminal_line(f"[{what}] {line.strip()}"), live=False) as ticker:
        yield ticker.say
