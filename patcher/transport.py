"""Move the agent and its JSON into a target interpreter and back. Nothing else.

A transport is a way to start the target's Python with `-c BOOTSTRAP`; the local one runs it
as a subprocess. Another way to start a process on a target (ssh, a container exec) is a
subclass that changes `command()`.
"""

from __future__ import annotations

import json
import subprocess
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
    from .remote import agent

    return Path(agent.__file__).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def bootstrap() -> str:
    from .remote.agent import BOOTSTRAP

    return BOOTSTRAP


class LocalTransport:
    """The target interpreter on this machine (`--python PATH`)."""

    def __init__(self, python: str) -> None:
        self.python = python

    @property
    def label(self) -> str:
        return self.python

    def command(self) -> list[str]:
        return [self.python, "-c", bootstrap()]

    def call(self, request: dict, timeout: float = 900) -> dict:
        payload = json.dumps({"agent": agent_source(), **request}).encode("utf-8")
        try:
            proc = subprocess.run(
                self.command(),
                input=payload,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                timeout=timeout,
            )
        except FileNotFoundError:
            raise TransportError(
                "usage", f"{self.python} does not exist; name the environment's interpreter with --python PATH"
            ) from None
        except PermissionError:
            raise TransportError(
                "usage", f"{self.python} cannot be executed; name a Python interpreter with --python PATH"
            ) from None
        except OSError as exc:
            raise TransportError(
                "usage", f"{self.python} is not a Python interpreter ({exc.strerror}); name one with --python PATH"
            ) from None
        except subprocess.TimeoutExpired:
            raise TransportError("unreachable", f"{self.label}: no answer within {timeout:g}s") from None
        return parse_answer(self.label, proc)


def parse_answer(label: str, proc: subprocess.CompletedProcess) -> dict:
    if proc.returncode < 0:
        raise TransportError(
            "unreachable",
            f"{label}: the agent was killed by signal {-proc.returncode} before it answered; every "
            "file is either its old or its new bytes: run `patcher status`, then the command again",
        )
    lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        stderr = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = stderr[-1] if stderr else f"exit status {proc.returncode}"
        raise TransportError(
            "usage",
            f"{label} did not answer as a Python 3.9+ interpreter ({detail}); name one with --python PATH",
        ) from None
    if not answer.get("ok"):
        error = answer.get("error", {})
        raise AgentFailure(error.get("kind", "unknown"), error.get("message", "agent failed"))
    return answer["result"]
