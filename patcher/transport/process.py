"""One agent process on a target, whatever starts it: its session, one JSON line in and one
marked line out per request, pumps that keep the controller's memory bounded and a writer thread
that keeps it from blocking on a target that does not read, its end. Transports compose one
(LocalTransport, SshTransport) and explain, as its `Explainer`, how their way in fails."""

from __future__ import annotations

import collections
import json
import math
import os
import queue
import secrets
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from .answer_shape import checked_answer
from .interface import DEFAULT_CALL_TIMEOUT, AgentFailure, TransportError, agent_texts


class Explainer(Protocol):
    """What a transport tells its AgentProcess: how to start the agent, and what each way of
    failing means on its way in, in words for the user."""

    @property
    def label(self) -> str: ...

    def command(self) -> list[str]:
        """The argv that starts the target's Python with the agent's BOOTSTRAP."""
        ...

    def cannot_start(self, exc: OSError) -> TransportError: ...

    def ended(self, returncode: int, stderr: bytes, noise: list[str], outcome_hint: str) -> TransportError:
        """The agent's process ended before it answered (`noise`: its last lines on stdout that
        were not answers; `outcome_hint`: what an unanswered write left, or "")."""
        ...

    def agent_failure(self, kind: str, message: str) -> AgentFailure: ...

    def startup_allowance(self, answered: bool) -> float:
        """Seconds the first answer may take beyond the agent's own limits (connecting)."""
        ...

    def status_command(self) -> str:
        """The command that shows this target's state, for messages."""
        ...


CHUNK = 1 << 16  # bytes read at a time from a target's output; noise is kept to one chunk a line
ANSWER_LIMIT_VARIABLE = "PATCHER_ANSWER_LIMIT_MIB"
DEFAULT_ANSWER_LIMIT_MIB = 256  # an answer carries target files' bytes: a few MiB at most in practice


# What a target prints on stdout that is not an answer (a login banner, a wrapper's or a .pth
# file's lines): a few lines in practice. Past the limit the session ends: a target printing
# millions of lines would otherwise keep the controller reading (and, once, queueing) them.
NOISE_LIMIT_VARIABLE = "PATCHER_NOISE_LIMIT_MIB"
DEFAULT_NOISE_LIMIT_MIB = 1


def _mib(variable: str, default: float) -> int:
    """The limit a variable sets in MiB, in bytes (one chunk at least); not a finite number: the default."""
    try:
        mib = float(os.environ.get(variable, default))
    except ValueError:
        mib = default
    return max(CHUNK, int((mib if math.isfinite(mib) else default) * 2**20))


def answer_limit_bytes() -> int:
    return _mib(ANSWER_LIMIT_VARIABLE, DEFAULT_ANSWER_LIMIT_MIB)


def noise_limit_bytes() -> int:
    return _mib(NOISE_LIMIT_VARIABLE, DEFAULT_NOISE_LIMIT_MIB)


class TooLong:
    """Put in place of an answer line longer than the limit (the line itself is dropped)."""

    def __init__(self, size: int) -> None:
        self.size = size


class TooNoisy:
    """Put on the answers' queue once the target printed more than the noise limit (then unread)."""


NOISE_LINE_KEPT = 1024  # bytes kept of each noise line (messages show 200 characters of the last)


class NoiseLines:
    """The last lines of a target's noise, a start of each, whatever the reads' boundaries."""

    def __init__(self, kept: collections.deque[str]) -> None:
        self.kept = kept
        self.partial = b""  # the start of the line not yet ended

    def add(self, block: bytes) -> None:
        last = block.rfind(b"\n")
        if last < 0:
            self.partial += block[: NOISE_LINE_KEPT - len(self.partial)]
            return
        most = self.kept.maxlen or 1
        pieces = block[:last].rsplit(b"\n", most)
        if len(pieces) > most:
            del pieces[0]  # lines before the last `most`
        else:
            pieces[0] = self.partial + pieces[0][:NOISE_LINE_KEPT]
        for piece in pieces:
            if text := piece[:NOISE_LINE_KEPT].decode("utf-8", "replace").strip():
                self.kept.append(text)
        self.partial = block[last + 1 : last + 1 + NOISE_LINE_KEPT]

    def end(self) -> None:
        if text := self.partial.decode("utf-8", "replace").strip():
            self.kept.append(text)
        self.partial = b""


def pump_answers(
    out, mark: bytes, answer_limit: int, noise_limit: int, lines: queue.Queue, noise: collections.deque[str]
) -> None:
    """Read a target's stdout to its end, putting on `lines` each answer (a line that starts with
    `mark`, whole, up to `answer_limit` bytes; past it a TooLong), then None; past `noise_limit`
    bytes of anything else, a TooNoisy (and the rest unread). Noise is counted, its last lines kept.

    Reads in bulk and splits with bytes methods: a target printing millions of short lines costs a
    few calls a chunk, and this thread waits in read() with the interpreter's lock released, so the
    caller's own work (and its deadline) goes on at full speed."""
    head = b""  # the start of a line, shorter than the mark and a prefix of it: an answer or not
    answer: list[bytes] | None = None  # the parts of the answer being read
    size = 0  # its bytes so far
    skipping = False  # in the rest of an answer over the limit
    at_line_start = True
    noisy = 0
    noise_lines = NoiseLines(noise)
    while data := out.read1(CHUNK):
        if head:
            data, head = head + data, b""
        pos, end = 0, len(data)
        while pos < end:
            if answer is not None or skipping:
                newline = data.find(b"\n", pos)
                stop = end if newline < 0 else newline + 1
                if answer is not None:
                    size += stop - pos
                    if size > answer_limit:
                        lines.put(TooLong(size))
                        answer, skipping = None, True
                    else:
                        answer.append(data[pos:stop])
                if newline >= 0:
                    if answer is not None:
                        lines.put(b"".join(answer))
                    answer, skipping, at_line_start = None, False, True
                pos = stop
                continue
            if at_line_start:
                rest = data[pos : pos + len(mark)]
                if rest == mark:
                    answer, size = [], 0
                    continue
                if len(rest) < len(mark) and mark.startswith(rest):
                    head = data[pos:]  # too short to tell: wait for more
                    break
            # Noise, up to the next line that starts with the mark, or to a last line that may.
            found = data.find(b"\n" + mark, pos)
            if found >= 0:
                stop, at_line_start = found + 1, True
            else:
                last = data.rfind(b"\n", pos)
                at_line_start = last >= 0 and mark.startswith(data[last + 1 :])
                stop = last + 1 if at_line_start else end
            noisy += stop - pos
            noise_lines.add(data[pos:stop])
            if noisy > noise_limit:
                if not noise:
                    noise_lines.end()  # no line ended yet: the start of the one that did not
                lines.put(TooNoisy())
                return  # unread from here: the caller ends the session
            pos = stop
    if answer:
        lines.put(b"".join(answer))  # the last line, without its end
    noise_lines.add(head)
    noise_lines.end()
    lines.put(None)


def pump_stderr(err, kept: list[bytes], keep: int = 200) -> None:
    """Read a target's stderr to its end, keeping its first `keep` lines (a chunk of each)."""
    while data := err.read1(CHUNK):
        if len(kept) < keep:
            kept.extend(line[:CHUNK] for line in data.splitlines(keepends=True)[: keep - len(kept)])


GRACE = 1.0  # seconds the controller waits beyond the agent's own limit: the agent's answer says more


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


class AgentProcess:
    """One agent process and its session: started by `start()` (or the first call), one request
    at a time, ended by `close()`. A transport owns one and says, as `via` (an `Explainer`), how
    to start it and how to explain what went wrong its own way in.

    The agent runs in a session of its own: a Ctrl-C at the terminal reaches patcher only,
    which then ends the agent (`interrupt()`), so the outcome is reported, not guessed from a
    killed process. Its answers are the lines that start with `self.mark`, a marker chosen
    here for this session (noise on stdout, such as a login banner, is never taken for one)."""

    def __init__(self, python: str) -> None:
        self.python = python  # the target interpreter, as messages name it
        self.invocations = 0
        self.mark = "patcher-answer:" + secrets.token_hex(12)
        self.op = ""  # the operation of the last call
        self._in_flight = ""  # the operation whose answer is awaited
        self._wrote = False  # an apply or forget was answered on this session
        self.answered = False  # anything was answered on this session
        self._interrupted = False
        self.proc: subprocess.Popen | None = None
        # the last lines on stdout that were not answers (kept by the reader, for messages)
        self._noise: collections.deque[str] = collections.deque(maxlen=5)

    # -------------------------------------------------------------- the session

    def start(self, via: Explainer) -> None:
        """Start the agent now (idempotent), before the first request is ready."""
        if self.proc is not None:
            return
        if self._interrupted:
            raise TransportError("interrupted", self.interrupted_message(via))
        self.invocations += 1
        try:
            self.proc = subprocess.Popen(
                via.command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise via.cannot_start(exc) from None
        proc = self.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None  # pipes
        out, err = proc.stdout, proc.stderr
        lines: queue.Queue = queue.Queue()
        stderr: list[bytes] = []
        self._lines, self._stderr = lines, stderr

        # The pumps hold the process and its pipes, not this object: a transport dropped without
        # close() is collected with its AgentProcess, whose finalizer ends the session (the agent
        # sees end of input).
        # Both pumps read in chunks, so a target printing a huge line (before Python starts, say)
        # costs the controller at most one chunk of it: only answers are kept whole, up to a limit.
        mark = self.mark.encode("ascii") + b" "
        answer_limit, noise_limit = answer_limit_bytes(), noise_limit_bytes()
        noise = self._noise

        def pump_out() -> None:
            pump_answers(out, mark, answer_limit, noise_limit, lines, noise)

        def pump_err() -> None:
            pump_stderr(err, stderr)

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
            threading.Thread(target=target, daemon=True, name=f"agent-{via.label}") for target in (pump_out, pump_err)
        ]
        for pump in [*self._pumps, threading.Thread(target=pump_in, daemon=True, name=f"agent-in-{via.label}")]:
            pump.start()
        weakref.finalize(self, outbox.put, None)
        self._send({"agent": agent_texts(), "mark": self.mark, "session": True})

    def prestart(self, via: Explainer) -> None:
        """start(), for a caller that has other work to do first: a failure to start is
        reported by the first call instead (which tries again)."""
        try:
            self.start(via)
        except TransportError:
            pass

    def _send(self, payload: Mapping[str, Any]) -> None:
        """Queue one line for the agent (the writer thread writes it; see start())."""
        self._outbox.put(json.dumps(payload).encode("utf-8") + b"\n")

    def call(self, via: Explainer, request: Mapping[str, Any], timeout: float, limit: str) -> Any:
        """One round trip on the session (started by the first call if not yet). `timeout`: the
        seconds the agent itself was given for the request (`limit` names the options that
        set them); past them and a short grace, the session is ended and the call fails.
        The answer's result, as the operation defines it (patcher.core.protocol: Facts,
        ApplyResult, ...): the caller names its type."""
        self.op = request.get("op", "")
        if self._interrupted:
            raise TransportError("interrupted", self.interrupted_message(via))
        if self.proc is None:
            self.start(via)
        wait = timeout + GRACE + via.startup_allowance(self.answered)
        self._in_flight = self.op
        self._send(request)
        deadline = time.monotonic() + wait
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self._end_session()
            raise TransportError("timeout", self._no_answer(via, timeout, limit)) from None
        if line is None:
            if self._interrupted:
                raise TransportError("interrupted", self.interrupted_message(via))
            raise self._ended(via)
        if isinstance(line, TooLong):
            self._end_session()
            raise TransportError(
                "usage",
                f"{via.label}: the agent's answer is over {answer_limit_bytes() / 2**20:g} MiB (the limit); "
                f"set {ANSWER_LIMIT_VARIABLE} to a larger number of MiB to allow it",
            )
        if isinstance(line, TooNoisy):
            self._end_session()
            raise TransportError(
                "usage",
                f"{via.label}: the target printed over {noise_limit_bytes() / 2**20:g} MiB that is not an answer "
                f"(the limit; its last line: {self._noise[-1][:200] if self._noise else ''!r}): something in "
                f"{self.python} or the login prints it (a .pth file, a wrapper, a shell's startup file); "
                f"remove it, or set {NOISE_LIMIT_VARIABLE} to a larger number of MiB{self.outcome_hint(via)}",
            )
        text = line.decode("utf-8", "replace").rstrip("\r\n")  # an answer: only answers are queued (pump_out)
        self._in_flight = ""
        self.answered = True
        if self.op in ("apply", "forget"):
            self._wrote = True  # answered: whatever its shape, the agent had the request
        answer = checked_answer(self.op, text[len(self.mark) + 1 :], via.label, self.python, self.outcome_hint(via))
        if not answer["ok"]:
            raise via.agent_failure(answer["error"]["kind"], answer["error"]["message"])
        return answer["result"]

    def interrupt(self) -> None:
        """End the session now, from any thread (Ctrl-C): the agent sees the end of its input
        and stops; a call waiting on it fails with `interrupted`."""
        self._interrupted = True
        self._end_session()

    def _end_session(self) -> None:
        """End the session's processes now; close() reaps them. Over ssh the remote agent sees
        its input end when the connection goes, and stops there too (remote/agent/session.py session())."""
        proc = self.proc
        if proc is None:
            return
        # Killed first: closing its input flushes what is still buffered, which blocks while
        # the agent is alive and not reading. The writer thread then ends on the broken pipe.
        _kill_session(proc)
        self._outbox.put(None)

    def close(self) -> None:
        """End the session: the agent sees the end of its input and exits."""
        if self.proc is None:
            return
        self._outbox.put(None)  # after what is queued: the agent sees the end of its input
        self._reap(timeout=10)

    def _ended(self, via: Explainer) -> TransportError:
        """The agent ended before answering: why, from its exit status and messages."""
        returncode = self._reap(timeout=30)
        return via.ended(returncode, b"".join(self._stderr), list(self._noise), self.outcome_hint(via))

    def _reap(self, timeout: float) -> int:
        """Wait for the agent to exit (kill it after `timeout`), collect its pipes; its status."""
        proc = self.proc
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
        self.proc = None
        return returncode

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _kill_session(self.proc)
            self.proc.wait()

    def interrupted_message(self, via: Explainer) -> str:
        if self._in_flight in ("apply", "forget"):
            return (
                f"interrupted during {self._in_flight}; the agent was stopped: every file is either its old or "
                f"its new bytes (written atomically); run `{via.status_command()}` to see which"
            )
        if self._wrote:
            return f"interrupted after the files were written; run `{via.status_command()}` to see the result"
        return "interrupted before anything was written"

    def _no_answer(self, via: Explainer, timeout: float, limit: str) -> str:
        what = f"no answer to the {self.op} request within {timeout:g}s" + (f" ({limit})" if limit else "")
        if not self.answered:
            return (
                f"{via.label}: {what}: {self.python} did not start or does not answer as a Python 3.9+ "
                "interpreter (name one with --python), or the target is slow (raise the limit)"
            )
        return f"{via.label}: {what}" + self.outcome_hint(via)

    def outcome_hint(self, via: Explainer) -> str:
        """What an apply or forget whose answer never came left, for a message that says so."""
        if self.op not in ("apply", "forget"):
            return ""
        return (
            f"; the outcome of this {self.op} on {via.label} is unknown: every file there is either its old or "
            f"its new bytes (written atomically); run `{via.status_command()}` to see which"
        )


class AgentSession:
    """The Transport protocol's session methods, served by the transport's own AgentProcess with
    the transport as its Explainer: what LocalTransport and SshTransport share (each explains its
    failures its own way, through the Explainer methods it defines)."""

    agent: AgentProcess

    @property
    def invocations(self) -> int:
        return self.agent.invocations

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.agent.start(self)  # type: ignore[arg-type]  # a subclass is the Explainer

    def prestart(self) -> None:
        self.agent.prestart(self)  # type: ignore[arg-type]

    def call(self, request: Mapping[str, Any], timeout: float = DEFAULT_CALL_TIMEOUT, limit: str = "") -> Any:
        return self.agent.call(self, request, timeout, limit)  # type: ignore[arg-type]

    def interrupt(self) -> None:
        self.agent.interrupt()

    def interrupted_message(self) -> str:
        return self.agent.interrupted_message(self)  # type: ignore[arg-type]

    def close(self) -> None:
        self.agent.close()
