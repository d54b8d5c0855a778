"""Fault injection for the crash tests: a request may name one point at which the agent kills
itself with SIGKILL (or pauses), so tests can prove every write step is crash-safe. The points
are the `checkpoint()` calls of the write steps; tests set them through PATCHER_FAULT."""

from __future__ import annotations

import os
import time

FAULT: dict = {}  # the request's point: {"at", "nth", "action", "seconds", "until"}
FAULT_POINTS: list = []  # every point passed, in order: the tests enumerate them from here


def checkpoint(name: str) -> None:
    FAULT_POINTS.append(name)
    if FAULT.get("at") != name or FAULT_POINTS.count(name) != int(FAULT.get("nth", 1)):
        return
    if FAULT.get("action") == "pause":
        # Until the file `until` exists (tests release the pause when the other run is where
        # they want it), at most `seconds`.
        deadline = time.monotonic() + float(FAULT.get("seconds", 5))
        while time.monotonic() < deadline and not (FAULT.get("until") and os.path.exists(FAULT["until"])):
            time.sleep(0.01)
        return
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
