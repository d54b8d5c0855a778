"""The target interpreter on this machine (`--python PATH`), started as a subprocess with the
agent's BOOTSTRAP. The session itself (patcher.transport.process.AgentProcess) is the same for
every transport that starts a process; this module says how this one starts and fails.
"""

from __future__ import annotations

from .interface import AgentFailure, TransportError, bootstrap
from .process import AgentProcess, AgentSession


class LocalTransport(AgentSession):
    """The target interpreter on this machine: one agent process per run, started by `start()`
    (or the first call) and ended by `close()` (patcher.transport.interface.Transport)."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.agent = AgentProcess(python)

    @property
    def label(self) -> str:
        return self.python

    def command(self) -> list[str]:
        return [self.python, "-c", bootstrap()]

    # -------------------------------------------------------------- what went wrong (local)

    def cannot_start(self, exc: OSError) -> TransportError:
        if isinstance(exc, FileNotFoundError):
            return TransportError(
                "usage", f"{self.python} does not exist; name the environment's interpreter with --python PATH"
            )
        if isinstance(exc, PermissionError):
            return TransportError(
                "usage", f"{self.python} cannot be executed; name a Python interpreter with --python PATH"
            )
        return TransportError(
            "usage", f"{self.python} is not a Python interpreter ({exc.strerror}); name one with --python PATH"
        )

    def agent_failure(self, kind: str, message: str) -> AgentFailure:
        return AgentFailure(kind, message)

    def startup_allowance(self, answered: bool) -> float:
        return 0.0

    def status_command(self) -> str:
        return f"patcher status --python {self.python}"

    def ended(self, returncode: int, stderr: bytes, noise: list[str], outcome_hint: str) -> TransportError:
        if returncode < 0:
            return TransportError(
                "unreachable",
                f"{self.label}: the agent was killed by signal {-returncode} before it answered; every "
                "file is either its old or its new bytes: run `patcher status`, then the command again",
            )
        lines = stderr.decode("utf-8", "replace").strip().splitlines()
        detail = lines[-1] if lines else f"exit status {returncode}"
        if not lines and noise:
            detail += f"; it printed {noise[-1][:200]!r}"
        return TransportError(
            "usage",
            f"{self.label} did not answer as a Python 3.9+ interpreter ({detail}); name one with --python PATH",
        )
