"""The command line as users run it, in a subprocess: one helper for every test module."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workbench.patcher_env import patcher_env


def patcher_argv(*args: str) -> list[str]:
    """`python -m patcher ARGS`, as users run it."""
    return [sys.executable, "-m", "patcher", *args]


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
