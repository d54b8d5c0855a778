"""What every transport is to the run (patcher.target_run.run_target): a way to hand the agent one
request at a time on a target and get its answer back, and the errors that says it could not.
LocalTransport (a subprocess), SshTransport (the system ssh) and AnsibleTransport (an Ansible
action's connection) implement `Transport`; the type checker holds them to it."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

DEFAULT_CALL_TIMEOUT = 900.0


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


class Transport(Protocol):
    """One target's agent, as a run uses it."""

    @property
    def label(self) -> str:
        """How reports name the target (an interpreter path, a host)."""
        ...

    @property
    def invocations(self) -> int:
        """Agent processes started so far (a fleet's JSON reports it)."""
        ...

    def start(self) -> None:
        """Start the agent now, before the first request is ready (idempotent)."""

    def prestart(self) -> None:
        """start(), leaving a failure to start to the first call."""

    def call(self, request: Mapping[str, Any], timeout: float = DEFAULT_CALL_TIMEOUT, limit: str = "") -> Any:
        """One request's result (patcher.core.protocol names its type per operation). `timeout`:
        the seconds the agent itself was given (`limit` names the options that set them). Raises
        AgentFailure for the agent's own refusal, TransportError when no answer came."""
        ...

    def interrupt(self) -> None:
        """End the agent now, from any thread (Ctrl-C): a call waiting on it fails as interrupted."""

    def interrupted_message(self) -> str:
        """What an interruption left, in one line."""
        ...

    def close(self) -> None:
        """End the session: the agent sees the end of its input and exits."""


def agent_bootstrap() -> Any:
    """The agent's bootstrap module (remote/agent/bootstrap.py). By name: installed, remote/ is
    patcher.remote (pyproject maps it), which the type checker, reading the checkout, does not know."""
    return importlib.import_module("patcher.remote.agent.bootstrap")


def agent_texts() -> dict:
    """The agent's module texts as the first line of its input carries them."""
    return agent_bootstrap().module_texts()


def bootstrap() -> str:
    """`python -c` this: the agent's BOOTSTRAP. The first line of input carries the agent's
    module texts, with `"session": true` for a session: then one request per line, one answer
    each, until the end of input."""
    return agent_bootstrap().BOOTSTRAP


def one_line_bootstrap() -> str:
    """bootstrap() as one line of words every common login shell reads alike inside single quotes
    (sh, bash, zsh, ksh, tcsh, fish): no newline (tcsh refuses a quoted one, "Unmatched '''."), no
    quote of its own, no backslash, no `!` or `$`: the program base64-encoded. As in BOOTSTRAP,
    the current folder leaves sys.path before the first import (binascii: a binascii.py planted
    in the login home never runs)."""
    import base64

    encoded = base64.b64encode(bootstrap().encode("utf-8")).decode("ascii")
    return f'import sys;sys.path[:1]==[""]and sys.path.pop(0);import binascii;exec(binascii.a2b_base64("{encoded}"))'
