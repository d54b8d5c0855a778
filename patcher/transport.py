"""Move the agent and its JSON into a target interpreter and back. Nothing else.

A transport is a way to start the target's Python with `-c SESSION_BOOTSTRAP`; the local one
runs it as a subprocess. Another way to start a process on a target (ssh, a container exec) is
a subclass that changes `command()` (and how a failure to start or answer is explained).
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
import weakref
from functools import lru_cache
from pathlib import Path


class TransportError(Exception):
    """The agent could not be reached or did not answer. `kind` maps to an exit code."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class AgentFailure(Exception):
    """The agent answered with an error of its own (locked, conflict, not-writable, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@lru_cache(maxsize=1)
def agent_source() -> str:
    import importlib.util

    spec = importlib.util.find_spec("patcher.remote.agent")  # its text, not an import of it
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def bootstrap() -> str:
    """The agent's BOOTSTRAP, read from its source (importing the agent module would cost
    more than a no-op run's own work)."""
    import ast

    source = agent_source()
    start = source.index("\nBOOTSTRAP = (") + len("\nBOOTSTRAP = ")
    end = source.index("\n)\n", start) + 2
    return ast.literal_eval(source[start:end])


@lru_cache(maxsize=1)
def session_bootstrap() -> str:
    """The agent's BOOTSTRAP (same version check), as a session: the first line is the agent's
    source, compiled once; then one request per line, one answer each, until the end of input.
    The controller starts it before it has a request, so the interpreter start and the agent's
    compilation overlap the controller's own start; facts and apply share the interpreter."""
    head, sep, _ = bootstrap().partition("d=json.loads(")
    if not sep:
        raise RuntimeError("unexpected agent BOOTSTRAP")
    return head + (
        "line=sys.stdin.buffer.readline()\n"
        "if not line.strip():sys.exit(0)\n"
        "d=json.loads(line.decode('utf-8'))\n"
        "ns={'__name__':'patcher_agent','AGENT_SOURCE':d['agent']}\n"
        "exec(compile(d['agent'],'<patcher-agent>','exec'),ns)\n"
        "while True:\n"
        " line=sys.stdin.buffer.readline()\n"
        " if not line.strip():break\n"
        " ns['serve'](json.loads(line.decode('utf-8')))\n"
        # Every answer is flushed and every file closed: skip the interpreter's teardown.
        "sys.stdout.flush()\n"
        "import os\n"
        "os._exit(0)\n"
    )


def _end_of_input(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
    except (OSError, ValueError):
        pass


class LocalTransport:
    """The target interpreter on this machine (`--python PATH`): one agent process per run,
    started by `start()` (or the first call) and ended by `close()`."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.invocations = 0
        self._op = ""
        self._proc: subprocess.Popen | None = None

    @property
    def label(self) -> str:
        return self.python

    def command(self) -> list[str]:
        return [self.python, "-c", session_bootstrap()]

    def __enter__(self) -> "LocalTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- the session

    def start(self) -> None:
        """Start the agent now (idempotent), before the first request is ready."""
        if self._proc is not None:
            return
        self.invocations += 1
        try:
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        except OSError as exc:
            raise self._cannot_start(exc) from None
        proc = self._proc
        lines: queue.Queue = queue.Queue()
        stderr: list[bytes] = []
        self._lines, self._stderr = lines, stderr

        # The pumps hold the process and its pipes, not this object: a transport dropped without
        # close() is collected, and its finalizer ends the session (the agent sees end of input).
        def pump_out() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        def pump_err() -> None:
            for line in proc.stderr:
                if len(stderr) < 200:
                    stderr.append(line)

        self._pumps = [
            threading.Thread(target=target, daemon=True, name=f"agent-{self.label}") for target in (pump_out, pump_err)
        ]
        for pump in self._pumps:
            pump.start()
        weakref.finalize(self, _end_of_input, proc)
        self._send({"agent": agent_source()})

    def prestart(self) -> None:
        """start(), for a caller that has other work to do first: a failure to start is
        reported by the first call instead (which tries again)."""
        try:
            self.start()
        except TransportError:
            pass

    def _send(self, payload: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(payload).encode("utf-8") + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the agent has ended: what it said before (or why it ended) is read next

    def call(self, request: dict, timeout: float = 900) -> dict:
        """One round trip on the session (started by the first call if not yet)."""
        self._op = request.get("op", "")
        if self._proc is None:
            self.start()
        self._send(request)
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._kill()
                raise TransportError(
                    "unreachable", f"{self.label}: no answer within {timeout:g}s" + self._outcome_hint()
                ) from None
            if line is None:
                raise self._ended()
            text = line.decode("utf-8", "replace").strip()
            if text.startswith("{"):
                break
        try:
            answer = json.loads(text)
        except ValueError:
            raise TransportError("usage", f"{self.python} answered something that is not JSON: {text[:200]}") from None
        if not answer.get("ok"):
            error = answer.get("error", {})
            raise self._agent_failure(error.get("kind", "unknown"), error.get("message", "agent failed"))
        return answer["result"]

    def close(self) -> None:
        """End the session: the agent sees the end of its input and exits."""
        if self._proc is None:
            return
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        self._reap(timeout=10)

    def _ended(self) -> TransportError:
        """The agent ended before answering: why, from its exit status and messages."""
        returncode = self._reap(timeout=30)
        return self._classify(returncode, b"".join(self._stderr))

    def _reap(self, timeout: float) -> int:
        """Wait for the agent to exit (kill it after `timeout`), collect its pipes; its status."""
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
        for pump in self._pumps:
            pump.join(timeout=5)  # the process has exited: its pipes reach their end
        self._proc.stdout.close()
        self._proc.stderr.close()
        returncode = self._proc.returncode
        self._proc = None
        return returncode

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    # -------------------------------------------------------------- what went wrong (local)

    def _cannot_start(self, exc: OSError) -> TransportError:
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

    def _outcome_hint(self) -> str:
        return ""

    def _agent_failure(self, kind: str, message: str) -> AgentFailure:
        return AgentFailure(kind, message)

    def _classify(self, returncode: int, stderr: bytes) -> TransportError:
        if returncode < 0:
            return TransportError(
                "unreachable",
                f"{self.label}: the agent was killed by signal {-returncode} before it answered; every "
                "file is either its old or its new bytes: run `patcher status`, then the command again",
            )
        lines = stderr.decode("utf-8", "replace").strip().splitlines()
        detail = lines[-1] if lines else f"exit status {returncode}"
        return TransportError(
            "usage",
            f"{self.label} did not answer as a Python 3.9+ interpreter ({detail}); name one with --python PATH",
        )
