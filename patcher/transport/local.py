"""Move the agent and its JSON into a target interpreter and back. Nothing else.

A transport is a way to start the target's Python with `-c BOOTSTRAP`; the local one
runs it as a subprocess. Another way to start a process on a target (ssh, a container exec) is
a subclass that changes `command()` (and how a failure to start or answer is explained).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from ..agent.bootstrap import BOOTSTRAP, module_texts


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


def agent_texts() -> dict:
    """The agent's module texts as the first line of its input carries them (patcher.agent.bootstrap)."""
    return module_texts()


def bootstrap() -> str:
    """`python -c` this: the agent's BOOTSTRAP. The first line of input carries the agent's
    module texts, with `"session": true` for a session: then one request per line, one answer
    each, until the end of input. The controller starts it before it has a request, so the
    interpreter start and the agent's compilation overlap the controller's own start; facts and
    apply share the interpreter."""
    return BOOTSTRAP


CHUNK = 1 << 16  # bytes read at a time from a target's output; noise is kept to one chunk a line
ANSWER_LIMIT_VARIABLE = "PATCHER_ANSWER_LIMIT_MIB"
DEFAULT_ANSWER_LIMIT_MIB = 256  # an answer carries target files' bytes: a few MiB at most in practice


def answer_limit_bytes() -> int:
    try:
        mib = float(os.environ.get(ANSWER_LIMIT_VARIABLE, DEFAULT_ANSWER_LIMIT_MIB))
    except ValueError:
        mib = DEFAULT_ANSWER_LIMIT_MIB
    return max(CHUNK, int(mib * 2**20))


class TooLong:
    """Put in place of an answer line longer than the limit (the line itself is dropped)."""

    def __init__(self, size: int) -> None:
        self.size = size


def _drain_line(stream) -> None:
    """Read and drop the rest of a line, a chunk at a time."""
    while (rest := stream.readline(CHUNK)) and not rest.endswith(b"\n"):
        pass


GRACE = 1.0  # seconds the controller waits beyond the agent's own limit: the agent's answer says more
DEFAULT_CALL_TIMEOUT = 900.0


def _end_of_input(proc: subprocess.Popen) -> None:
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except (OSError, ValueError):
        pass


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill the agent's whole process session (started with its own): the agent and its
    verification, or ssh and a ProxyJump's inner ssh."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except OSError:
            pass


class LocalTransport:
    """The target interpreter on this machine (`--python PATH`): one agent process per run,
    started by `start()` (or the first call) and ended by `close()`.

    The agent runs in a session of its own: a Ctrl-C at the terminal reaches patcher only,
    which then ends the agent (`interrupt()`), so the outcome is reported, not guessed from a
    killed process. Its answers are the lines that start with `self.mark`, a marker chosen
    here for this session (noise on stdout, such as a login banner, is never taken for one)."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.invocations = 0
        self.mark = "patcher-answer:" + secrets.token_hex(12)
        self._op = ""
        self._in_flight = ""  # the operation whose answer is awaited
        self._wrote = False  # an apply or forget was answered on this session
        self._answered = False  # anything was answered on this session
        self._interrupted = False
        self._proc: subprocess.Popen | None = None
        self._noise: list[str] = []  # the last lines on stdout that were not answers

    @property
    def label(self) -> str:
        return self.python

    def command(self) -> list[str]:
        return [self.python, "-c", bootstrap()]

    def __enter__(self) -> LocalTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- the session

    def start(self) -> None:
        """Start the agent now (idempotent), before the first request is ready."""
        if self._proc is not None:
            return
        if self._interrupted:
            raise TransportError("interrupted", self.interrupted_message())
        self.invocations += 1
        try:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise self._cannot_start(exc) from None
        proc = self._proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None  # pipes
        out, err = proc.stdout, proc.stderr
        lines: queue.Queue = queue.Queue()
        stderr: list[bytes] = []
        self._lines, self._stderr = lines, stderr

        # The pumps hold the process and its pipes, not this object: a transport dropped without
        # close() is collected, and its finalizer ends the session (the agent sees end of input).
        # Both pumps read in chunks, so a target printing a huge line (before Python starts, say)
        # costs the controller at most one chunk of it: only answers are kept whole, up to a limit.
        mark = self.mark.encode("ascii") + b" "
        answer_limit = answer_limit_bytes()

        def pump_out() -> None:
            while chunk := out.readline(CHUNK):
                if chunk.startswith(mark):
                    parts, size = [chunk], len(chunk)
                    while not parts[-1].endswith(b"\n") and (more := out.readline(CHUNK)):
                        size += len(more)
                        if size > answer_limit:
                            lines.put(TooLong(size))
                            _drain_line(out)
                            parts = []
                            break
                        parts.append(more)
                    if parts:
                        lines.put(b"".join(parts))
                else:
                    lines.put(chunk)  # noise: its first chunk only
                    if not chunk.endswith(b"\n"):
                        _drain_line(out)
            lines.put(None)

        def pump_err() -> None:
            while chunk := err.readline(CHUNK):
                if len(stderr) < 200:
                    stderr.append(chunk)
                if not chunk.endswith(b"\n"):
                    _drain_line(err)

        # What the agent is sent goes through a writer thread: a write to a pipe blocks once the
        # pipe is full (64 KiB), and the agent's module texts alone are more than that. A target that never reads its input (a hung interpreter) would otherwise hold the
        # caller in a write, past every time limit; a Ctrl-C would then block again in the
        # flush of closing stdin. The caller only ever waits on answers, with its deadline.
        outbox: queue.Queue = queue.Queue()

        stdin = proc.stdin
        assert stdin is not None  # Popen(stdin=PIPE)

        def pump_in() -> None:
            while (data := outbox.get()) is not None:
                try:
                    stdin.write(data)
                    stdin.flush()
                except (OSError, ValueError):
                    break  # the agent has ended, or was ended: what it said is read by the caller
            _end_of_input(proc)

        self._outbox = outbox
        self._pumps = [
            threading.Thread(target=target, daemon=True, name=f"agent-{self.label}") for target in (pump_out, pump_err)
        ]
        for pump in [*self._pumps, threading.Thread(target=pump_in, daemon=True, name=f"agent-in-{self.label}")]:
            pump.start()
        weakref.finalize(self, outbox.put, None)
        self._send({"agent": agent_texts(), "mark": self.mark, "session": True})

    def prestart(self) -> None:
        """start(), for a caller that has other work to do first: a failure to start is
        reported by the first call instead (which tries again)."""
        try:
            self.start()
        except TransportError:
            pass

    def _send(self, payload: Mapping[str, Any]) -> None:
        """Queue one line for the agent (the writer thread writes it; see start())."""
        self._outbox.put(json.dumps(payload).encode("utf-8") + b"\n")

    def call(self, request: Mapping[str, Any], timeout: float = DEFAULT_CALL_TIMEOUT, limit: str = "") -> Any:
        """One round trip on the session (started by the first call if not yet). `timeout`: the
        seconds the agent itself was given for the request (`limit` names the options that
        set them); past them and a short grace, the session is ended and the call fails.
        The answer's result, as the operation defines it (patcher.core.protocol: Facts,
        ApplyResult, ...): the caller names its type."""
        self._op = request.get("op", "")
        if self._interrupted:
            raise TransportError("interrupted", self.interrupted_message())
        if self._proc is None:
            self.start()
        wait = timeout + GRACE + self._startup_allowance()
        self._in_flight = self._op
        self._send(request)
        deadline = time.monotonic() + wait
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._end_session()
                raise TransportError("timeout", self._no_answer(timeout, limit)) from None
            if line is None:
                if self._interrupted:
                    raise TransportError("interrupted", self.interrupted_message())
                raise self._ended()
            if isinstance(line, TooLong):
                self._end_session()
                raise TransportError(
                    "usage",
                    f"{self.label}: the agent's answer is over {answer_limit_bytes() / 2**20:g} MiB (the limit); "
                    f"set {ANSWER_LIMIT_VARIABLE} to a larger number of MiB to allow it",
                )
            text = line.decode("utf-8", "replace").rstrip("\r\n")
            if text.startswith(self.mark + " "):
                break
            if text.strip():
                self._noise = (self._noise + [text.strip()])[-5:]
        self._in_flight = ""
        self._answered = True
        try:
            answer = json.loads(text[len(self.mark) + 1 :])
        except ValueError:
            raise TransportError("usage", f"{self.label}: the agent's answer is not JSON: {text[:200]}") from None
        if self._op in ("apply", "forget"):
            self._wrote = True
        if not answer.get("ok"):
            error = answer.get("error", {})
            raise self._agent_failure(error.get("kind", "unknown"), error.get("message", "agent failed"))
        return answer["result"]

    def interrupt(self) -> None:
        """End the session now, from any thread (Ctrl-C): the agent sees the end of its input
        and stops; a call waiting on it fails with `interrupted`."""
        self._interrupted = True
        self._end_session()

    def _end_session(self) -> None:
        """End the session's processes now; close() reaps them. Over ssh the remote agent sees
        its input end when the connection goes, and stops there too (remote/agent.py session())."""
        proc = self._proc
        if proc is None:
            return
        # Killed first: closing its input flushes what is still buffered, which blocks while
        # the agent is alive and not reading. The writer thread then ends on the broken pipe.
        _kill_session(proc)
        self._outbox.put(None)

    def close(self) -> None:
        """End the session: the agent sees the end of its input and exits."""
        if self._proc is None:
            return
        self._outbox.put(None)  # after what is queued: the agent sees the end of its input
        self._reap(timeout=10)

    def _ended(self) -> TransportError:
        """The agent ended before answering: why, from its exit status and messages."""
        returncode = self._reap(timeout=30)
        return self._classify(returncode, b"".join(self._stderr))

    def _reap(self, timeout: float) -> int:
        """Wait for the agent to exit (kill it after `timeout`), collect its pipes; its status."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None  # after start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
        for pump in self._pumps:
            pump.join(timeout=5)  # the process has exited: its pipes reach their end
        proc.stdout.close()
        proc.stderr.close()
        returncode = proc.returncode
        self._proc = None
        return returncode

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            _kill_session(self._proc)
            self._proc.wait()

    def _startup_allowance(self) -> float:
        """Seconds the first answer may take beyond the agent's own limits (connecting)."""
        return 0.0

    def status_command(self) -> str:
        return f"patcher status --python {self.python}"

    def interrupted_message(self) -> str:
        if self._in_flight in ("apply", "forget"):
            return (
                f"interrupted during {self._in_flight}; the agent was stopped: every file is either its old or "
                f"its new bytes (written atomically); run `{self.status_command()}` to see which"
            )
        if self._wrote:
            return f"interrupted after the files were written; run `{self.status_command()}` to see the result"
        return "interrupted before anything was written"

    def _no_answer(self, timeout: float, limit: str) -> str:
        what = f"no answer to the {self._op} request within {timeout:g}s" + (f" ({limit})" if limit else "")
        if not self._answered:
            return (
                f"{self.label}: {what}: {self.python} did not start or does not answer as a Python 3.9+ "
                "interpreter (name one with --python), or the target is slow (raise the limit)"
            )
        return f"{self.label}: {what}" + self._outcome_hint()

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
        if self._op not in ("apply", "forget"):
            return ""
        return (
            f"; the outcome of this {self._op} on {self.label} is unknown: every file there is either its old or "
            f"its new bytes (written atomically); run `{self.status_command()}` to see which"
        )

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
        if not lines and self._noise:
            detail += f"; it printed {self._noise[-1][:200]!r}"
        return TransportError(
            "usage",
            f"{self.label} did not answer as a Python 3.9+ interpreter ({detail}); name one with --python PATH",
        )
