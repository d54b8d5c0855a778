"""Answers and time limits: each request gets one answer line (`MARK JSON`), its own or the
watchdog's when the phase it was armed for runs too long; stop_now ends the agent at once."""

from __future__ import annotations

import json
import os
import sys

# The type checker's view only (typing itself is not imported: it costs start-up time).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import _thread

    from patcher.core.protocol import Answer

MARK = ""  # the controller's marker for this run (session.main sets it): every answer line starts with it
# Requests read and answered: one answer per request, the request's own or the watchdog's.
ANSWER: dict = {"lock": None, "read": 1, "answered": 0}
CHILD: list = []  # the verification process while it runs: ended with the agent


def answer_once(answer: Answer) -> bool:
    """Write the answer to the current request unless one was written already (the watchdog's)."""
    lock = ANSWER["lock"]
    if lock is not None:
        lock.acquire()
    try:
        if ANSWER["answered"] >= ANSWER["read"]:
            return False
        ANSWER["answered"] = ANSWER["read"]
        WATCHDOG.disarm()
        # A line of its own, even after a partial line something else printed.
        sys.stdout.write("\n" + MARK + " " + json.dumps(answer) + "\n")
        sys.stdout.flush()
        return True
    finally:
        if lock is not None:
            lock.release()


def stop_now(code: int) -> None:
    """End this process at once (and the verification it runs): every write is atomic and the
    intent recorded first, so stopping anywhere leaves each file its old or its new bytes."""
    for child in CHILD:
        try:
            child.kill()
        except OSError:
            pass
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


class Watchdog:
    """Answers `timeout` and ends the agent when the phase it was armed for runs too long.
    (`_thread`, built in, rather than `threading`: importing that costs more than a facts request.)"""

    def __init__(self) -> None:
        self.cancel: _thread.LockType | None = None

    def arm(self, seconds, what: str, option: str, after: str = "") -> None:
        """`what` takes too long after `seconds` (None: no limit), set by the controller's
        `option`; `after` says what that leaves.
        The bundle calls the operations directly, outside a session: it arms nothing."""
        self.disarm()
        if seconds is None or ANSWER["lock"] is None:
            return
        import _thread

        cancel = _thread.allocate_lock()
        cancel.acquire()
        self.cancel = cancel

        def watch() -> None:
            if not cancel.acquire(timeout=float(seconds)):  # not disarmed in time
                self._expire(float(seconds), what, option, after)

        _thread.start_new_thread(watch, ())

    def disarm(self) -> None:
        if self.cancel is not None:
            self.cancel.release()
            self.cancel = None

    def _expire(self, seconds: float, what: str, option: str, after: str) -> None:
        message = f"{what} took longer than {seconds:g}s ({option}); the agent stopped" + after
        if answer_once({"ok": False, "error": {"kind": "timeout", "message": message}}):
            stop_now(3)


WATCHDOG = Watchdog()
