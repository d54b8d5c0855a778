"""The command line as users run it, in a subprocess: one helper for every test module."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def patcher_argv(*args: str) -> list[str]:
    """`python -m patcher ARGS`, as users run it."""
    return [sys.executable, "-m", "patcher", *args]


_session_cache: list[Path] = []


def session_cache() -> Path:
    """A PATCHER_CACHE of this test process's own, made on first use and removed at its exit."""
    if not _session_cache:
        folder = Path(tempfile.mkdtemp(prefix="patcher-test-cache-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _session_cache.append(folder)
    return _session_cache[0]


def patcher_env(env: dict | None = None, clean_ssh: bool = False) -> dict:
    """This process's environment plus `env`, with PYTHONFAULTHANDLER set: a patcher that a test
    finds hanging and sends SIGABRT prints every thread's stack. `clean_ssh` (a remote test)
    leaves out SSH_AUTH_SOCK: a remote test must never use the user's own agent; and sets
    PATCHER_CACHE to session_cache() unless `env` names one: a failed fleet run writes its retry
    file there by default, which must not be the user's own cache (one the user may be about to
    rerun from). Its transform results are then computed once per test session."""
    base = {k: v for k, v in os.environ.items() if not (clean_ssh and k == "SSH_AUTH_SOCK")}
    if clean_ssh:
        base["PATCHER_CACHE"] = str(session_cache())
    return {**base, "PYTHONFAULTHANDLER": "1", **(env or {})}


def run_patcher(
    *args: str,
    env: dict | None = None,
    cwd: Path | None = None,
    timeout: float = 600,
    clean_ssh: bool = False,
    fresh_cwd: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m patcher ARGS`; `env` adds to (never replaces) this process's environment (patcher_env).
    `fresh_cwd` runs it in a new, empty temporary folder (nothing it writes lands in the checkout)."""
    if fresh_cwd:
        with tempfile.TemporaryDirectory(prefix="patcher-test-") as folder:
            return run_patcher(*args, env=env, cwd=Path(folder), timeout=timeout, clean_ssh=clean_ssh)
    return subprocess.run(
        patcher_argv(*args),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=patcher_env(env, clean_ssh),
        timeout=timeout,
    )


def patcher(*args: str, **kwargs) -> tuple[int, dict | None, str]:
    """(exit code, the JSON document when --json was given, stderr); keywords as run_patcher's."""
    code, doc, err, _ = timed_patcher(*args, **kwargs)
    return code, doc, err


def timed_patcher(*args: str, **kwargs) -> tuple[int, dict | None, str, float]:
    """patcher(), and the seconds the command took (a time limit's test checks that it ended)."""
    started = time.monotonic()
    proc = run_patcher(*args, **kwargs)
    doc = json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else None
    return proc.returncode, doc, proc.stderr, time.monotonic() - started


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def states(doc: dict) -> dict[str, str]:
    """patch id -> state, for the first (or only) target of a JSON document."""
    return {p["id"]: p["state"] for p in doc["targets"][0]["patches"]}
