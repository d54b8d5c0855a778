"""The command line as users run it, in a subprocess: one helper for every test module."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path


def run_patcher(
    *args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600, clean_ssh: bool = False
) -> subprocess.CompletedProcess:
    """`python -m patcher ARGS`; `env` adds to (never replaces) this process's environment.
    `clean_ssh` leaves out SSH_AUTH_SOCK: a remote test must never use the user's own agent."""
    base = {k: v for k, v in os.environ.items() if not (clean_ssh and k == "SSH_AUTH_SOCK")}
    return subprocess.run(
        [sys.executable, "-m", "patcher", *args],
        capture_output=True, text=True, cwd=cwd, env={**base, **(env or {})}, timeout=timeout,
    )  # fmt: skip


def patcher(*args: str, **kwargs) -> tuple[int, dict | None, str]:
    """(exit code, the JSON document when --json was given, stderr)."""
    proc = run_patcher(*args, **kwargs)
    doc = json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else None
    return proc.returncode, doc, proc.stderr


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def states(doc: dict) -> dict[str, str]:
    """patch id -> state, for the first (or only) target of a JSON document."""
    return {p["id"]: p["state"] for p in doc["targets"][0]["patches"]}
