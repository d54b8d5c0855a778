"""The environment a test or a benchmark starts patcher with: its own PATCHER_CACHE, never the
user's agent or cache (shared by tests/support/cli.py and workbench/race_stress.py)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["patcher_env", "session_cache"]

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
