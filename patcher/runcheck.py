"""The run check, controller side: what is sent to the agent's `run-check` operation, and how
its answer reads. The check itself is remote/runcheck.py (run in the target, not under the lock).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core.protocol import RunCheckRequest, RunCheckResult

DEFAULT_TIMEOUT = 1200.0  # seconds for the whole check in the target; measured 1-2 minutes on 2 CPUs

# The files shipped: the driver and the two demo scripts it runs (standard library only at
# module level, so they load in any target; they import the target's own libraries when run).
SHIPPED = {
    "runcheck.py": "patcher.remote.runcheck",
    "tiny_model.py": "patcher.demo.tiny_model",
    "extract.py": "patcher.demo.extract",
}


@lru_cache(maxsize=1)
def shipped_files() -> dict[str, str]:
    out = {}
    for name, module in SHIPPED.items():
        spec = importlib.util.find_spec(module)  # its text, not an import of it
        assert spec is not None and spec.origin is not None, module
        out[name] = Path(spec.origin).read_text(encoding="utf-8")
    return out


def request(timeout: float = DEFAULT_TIMEOUT) -> RunCheckRequest:
    return {"op": "run-check", "files": shipped_files(), "entry": "runcheck.py", "timeout": timeout}


def summary(result: RunCheckResult) -> str:
    """One line: what the run showed (or why it could not run)."""
    cannot_run = result.get("cannot_run")
    if cannot_run:
        return "run check cannot run here: " + cannot_run
    timings = result.get("timings", {})
    figures = f"{timings.get('total_s', '?')}s"
    if result.get("peak_rss_mib"):
        figures += f", peak {result['peak_rss_mib']} MiB"
    if result.get("ok"):
        return (
            f"run check passed on {result.get('device')}: {result.get('prompts')} prompts in "
            f"{result.get('calls')} generate() calls came back whole and in order, largest relative "
            f"error {result.get('max_rel_diff'):.3f} (tolerance {result.get('tolerance')}) ({figures})"
        )
    problems = result.get("problems") or ["no answer"]
    return f"run check FAILED on {result.get('device') or 'the target'}: {problems[0]} ({figures})"
