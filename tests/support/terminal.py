"""How a test starts a process it will send SIGINT to: as a terminal's foreground job has it."""

from __future__ import annotations

import signal


def sigint_as_at_a_terminal() -> None:
    """A Popen preexec_fn (in the child before it runs): SIGINT handled by default, as for a
    command at a terminal. A suite started in the background by a shell without job control
    (`.ci/run &`, `nohup ... &`) runs with SIGINT ignored, which every child inherits, and Python
    then keeps ignoring it: the child would never see the test's Ctrl-C (a fresh-clone run's
    thread dump showed patcher waiting on, unaware). Only signal.signal runs between fork and
    exec (no lock is taken there: PLW1509 does not apply)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
