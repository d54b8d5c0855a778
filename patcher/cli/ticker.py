"""That a long step is still running: apply's verification (tens of seconds), the run check, a
demo environment's build (minutes with no line from pip). Each progress line is said through a
`Ticker`; until the next one, a terminal shows a spinner and the elapsed time under it (rich's
Progress, transient: it leaves nothing behind), and a pipe or a CI log gets a plain line every
`every` seconds. Only stderr is written, so --json's stdout stays the document alone."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

PLAIN_EVERY = 30.0  # seconds between a pipe's "still running" lines; PATCHER_PROGRESS_EVERY sets another
_open: list[Ticker] = []  # closed by close_all() before the process ends (fastexit: no atexit)


def on_terminal(stream: Any = None) -> bool:
    """Whether `stream` (stderr) is a terminal that can draw a spinner."""
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty()) and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):  # closed or not a file
        return False


def plain_every() -> float:
    """PATCHER_PROGRESS_EVERY (seconds, > 0) or PLAIN_EVERY: a CI that ends a job silent for N
    minutes, or a test that cannot wait 30 s, sets it."""
    try:
        every = float(os.environ.get("PATCHER_PROGRESS_EVERY", PLAIN_EVERY))
    except ValueError:
        return PLAIN_EVERY
    return every if every > 0 else PLAIN_EVERY


def elapsed_line(seconds: float) -> str:
    return f"  ... {seconds:.0f} s so far"


class Ticker:
    """`say(line)` prints the line; until the next say() or close(), the time since is shown
    (spinner on a terminal, a line every `every` s otherwise: plain_every()). `write` prints one line where the
    output goes (stderr; the tests' terminal); `live`: draw a spinner (None: when stderr is a
    terminal). Safe to call from several threads."""

    def __init__(self, write: Callable[[str], None], live: bool | None = None, every: float | None = None) -> None:
        self.write = write
        self.every = every if every is not None else plain_every()
        self.lock = threading.RLock()
        self.since: float | None = None  # when the last line was said; None: nothing running
        self.closed = False
        self.live = on_terminal() if live is None else live
        self._progress: Any = None
        self._task: Any = None
        self._wake = threading.Condition(self.lock)
        self._thread: threading.Thread | None = None
        _open.append(self)

    def say(self, line: str) -> None:
        with self.lock:
            if self.closed:
                self.write(line)
                return
            if self.live:
                self._say_live(line)
            else:
                self.write(line)
                self.since = time.monotonic()
                self._start_plain()
                self._wake.notify_all()

    def close(self) -> None:
        """Stop showing time (the step's outcome follows); later lines are printed plainly."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.since = None
            self._wake.notify_all()
            if self._progress is not None:
                self._progress.stop()  # the spinner's line goes, the cursor comes back
                self._progress = None
        if self in _open:
            _open.remove(self)

    def __enter__(self) -> Ticker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ a terminal: rich

    def _say_live(self, line: str) -> None:
        from rich.console import Console
        from rich.markup import escape
        from rich.progress import Progress, SpinnerColumn, TimeElapsedColumn

        if self._progress is None:
            console = Console(stderr=True, highlight=False, soft_wrap=True)
            # redirect_*: other writes to stderr while the spinner shows are printed above it
            self._progress = Progress(SpinnerColumn(), TimeElapsedColumn(), console=console, transient=True)
            self._task = self._progress.add_task("", total=None)
            self._progress.start()
        self._progress.console.print(escape(line))
        self._progress.reset(self._task)  # the elapsed time counts from this line

    # ------------------------------------------------------------ a pipe: a line now and then

    def _start_plain(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._plain_loop, name="patcher-ticker", daemon=True)
            self._thread.start()

    def _plain_loop(self) -> None:
        with self.lock:
            while not self.closed:
                since = self.since
                if since is None:
                    self._wake.wait()
                    continue
                told = since
                # every `every` seconds after the line, until another line comes
                while not self.closed and self.since == since:
                    self._wake.wait(timeout=max(0.0, told + self.every - time.monotonic()))
                    if self.closed or self.since != since:
                        break
                    if time.monotonic() >= told + self.every:
                        told += self.every
                        try:
                            self.write(elapsed_line(told - since))
                        except (OSError, ValueError):  # stderr closed: nothing to tell anyone
                            self.closed = True


def close_all() -> None:
    """Close every ticker still open: before the process ends, so a terminal gets its cursor back."""
    while _open:
        _open[-1].close()  # close() takes it off the list
