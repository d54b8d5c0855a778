"""The agent's entry: one request, or a session of one request per line until the input ends;
each request served by its operation, every failure said as an answer of a known kind."""

from __future__ import annotations

import errno
import json
import os
import sys

from patcher.core.errors import AgentError

from . import answers
from .answers import ANSWER, WATCHDOG, answer_once, stop_now
from .faults import FAULT, FAULT_POINTS
from .writes import LEFT_AS_IS, set_file_limit

# The type checker's view only (typing itself is not imported: it costs start-up time).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from patcher.core.protocol import Answer

# Each operation, as `module:function` of this package: a module is compiled when its operation
# is first asked for (a status run compiles neither verification nor the transaction).
OPERATIONS: dict = {
    "facts": "target_facts:op_facts",
    "apply": "transaction:op_apply",
    "forget": "transaction:op_forget",
    "verify": "verification:op_verify",
    "verify-here": "verification:op_verify_here",
    "run-check": "verification:op_run_check",
}


def operation(name: str):
    """The function that serves operation `name`, or None for an unknown one."""
    where = OPERATIONS.get(name)
    if where is None:
        return None
    module, function = where.split(":")
    return getattr(__import__(module, globals(), None, [function], 1), function)


def serve(req: dict) -> None:
    op = operation(req.get("op") or "")
    FAULT.update(req.get("fault") or {})
    set_file_limit(req.get("file_limit"))
    limit = req.get("time_limit")
    if limit is not None and req.get("op") in ("apply", "forget"):
        seconds = float(limit) + float(req.get("lock_timeout", 10))  # re-armed for the writes once locked
        WATCHDOG.arm(seconds, f"the {req['op']} request", "--lock-timeout + --write-timeout")
    else:
        WATCHDOG.arm(limit, f"the {req.get('op')} request", f"--{req.get('op')}-timeout")
    try:
        if op is None:
            raise AgentError("usage", f"unknown operation {req.get('op')!r}")
        answer: Answer = {"ok": True, "result": op(req)}
        if req.get("fault") is not None:
            answer["result"]["checkpoints"] = FAULT_POINTS
    except AgentError as exc:
        answer = {"ok": False, "error": {"kind": exc.kind, "message": exc.message}}
    except PermissionError as exc:
        answer = {
            "ok": False,
            "error": {
                "kind": "not-writable",
                "message": f"permission denied: {exc.filename}; run as a user who can write there",
            },
        }
    except OSError as exc:
        kind = "not-writable" if exc.errno in (errno.EROFS, errno.EACCES) else "os-error"
        where = f": {exc.filename}" if exc.filename is not None else " (the system named no file)"
        answer = {"ok": False, "error": {"kind": kind, "message": f"{exc.strerror}{where}; {LEFT_AS_IS}"}}
    except Exception as exc:  # a bug: said as an answer, not as a session that ends without one  # noqa: BLE001
        answer = {"ok": False, "error": {"kind": "internal", "message": f"agent error: {type(exc).__name__}: {exc}"}}
    answer_once(answer)


def main(first: dict) -> None:
    """BOOTSTRAP's entry: the first line of input is the agent and either one request or a session."""
    answers.MARK = first.get("mark", "")
    if not first.get("session"):
        serve(first)
        return
    session()


def session() -> None:
    """One request per line until the input ends. A reader thread keeps reading while a
    request is served: when the input ends then, nobody waits for the answer any more (the
    controller gave up or was interrupted, or the connection dropped), and the agent stops."""
    import _queue
    import _thread

    lock = _thread.allocate_lock()
    ANSWER.update(lock=lock, read=0, answered=0)
    requests: _queue.SimpleQueue = _queue.SimpleQueue()

    def read() -> None:
        stdin = sys.stdin.buffer
        while True:
            line = stdin.readline()
            if not line.strip():
                break
            with lock:
                ANSWER["read"] += 1
            requests.put(line)
        with lock:
            if ANSWER["answered"] < ANSWER["read"]:
                stop_now(4)  # holding the lock: no answer can start after this point
        requests.put(None)

    _thread.start_new_thread(read, ())
    while True:
        line = requests.get()
        if line is None:
            break
        serve(json.loads(line.decode("utf-8")))
    # Every answer is flushed and every file closed: skip the interpreter's teardown.
    sys.stdout.flush()
    os._exit(0)
