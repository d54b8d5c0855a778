"""The run check, controller side: what is sent to the agent's `run-check` operation, and how
its answer reads. The check itself is remote/run_check_driver.py (run in the target, not under the lock).
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.protocol import RunCheckRequest, RunCheckResult

DEFAULT_TIMEOUT = 1200.0  # seconds for the whole check in the target; measured 1-2 minutes on 2 CPUs

# The files shipped: the driver and the two scripts of this package it runs (standard library only at
# module level, so they load in any target; they import the target's own libraries when run).
SHIPPED = {
    "run_check_driver.py": "patcher.remote.run_check_driver",
    "tiny_model.py": "patcher.run_check.tiny_model",
    "extract.py": "patcher.run_check.extract",
}


@lru_cache(maxsize=1)
def shipped_files() -> dict[str, str]:
    out = {}
    for name, module in SHIPPED.items():
        spec = importlib.util.find_spec(module)  # its text, not an import of it
        assert spec is not None and spec.origin is not None, module
        out[name] = Path(spec.origin).read_text(encoding="utf-8")
    return out


# Host memory counted as available for transformers' reference of a --model checkpoint, in MiB, at
# most: it can only lower MemAvailable (a test makes the reference not fit; a shared host keeps
# room for others). Read where patcher runs and sent to the target.
MEMORY_CAP_VARIABLE = "PATCHER_RUN_CHECK_MEMORY_MIB"


def memory_cap_mib() -> int | None:
    """PATCHER_RUN_CHECK_MEMORY_MIB, or None; a value that is not a positive integer: ValueError."""
    text = os.environ.get(MEMORY_CAP_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{MEMORY_CAP_VARIABLE}={text!r}: give a positive number of MiB")
    return int(text)


def request(
    timeout: float = DEFAULT_TIMEOUT, model: str | None = None, tensor_parallel: int = 1, memory_cap: int | None = None
) -> RunCheckRequest:
    args = ["--tensor-parallel", str(tensor_parallel)]
    if model is not None:
        args += ["--model", model]
    if memory_cap is not None:
        args += ["--memory-cap-mib", str(memory_cap)]
    return {
        "op": "run-check",
        "files": shipped_files(),
        "entry": "run_check_driver.py",
        "timeout": timeout,
        "args": args,
    }


def summary(result: RunCheckResult) -> str:
    """One line: what the run showed (or why it could not run)."""
    if result.get("usage_error"):
        return "run check: " + str(result["usage_error"])
    cannot_run = result.get("cannot_run")
    if cannot_run:
        return "run check cannot run here: " + cannot_run
    timings = result.get("timings", {})
    figures = f"{timings.get('total_s', '?')}s"
    if result.get("peak_rss_mib"):
        figures += f", peak {result['peak_rss_mib']} MiB"
    where = str(result.get("device") or "the target")
    if result.get("model"):
        where += f" with {result['model']} at tensor parallel {result.get('tensor_parallel_size', 1)}"
    if result.get("ok") and result.get("model"):
        compared = (
            f"largest relative error {result['max_rel_diff']:.3f} (tolerance {result.get('tolerance')}); "
            if result.get("compared") and result.get("max_rel_diff") is not None
            else ""
        )
        return (
            f"run check passed on {where}: {result.get('prompts')} prompts in {result.get('calls')} generate() "
            f"calls came back whole, in order and finite; {compared}{result.get('reference_reason')} ({figures})"
        )
    if result.get("ok"):
        return (
            f"run check passed on {where}: {result.get('prompts')} prompts in "
            f"{result.get('calls')} generate() calls came back whole and in order, largest relative "
            f"error {result.get('max_rel_diff'):.3f} (tolerance {result.get('tolerance')}) ({figures})"
        )
    problems = result.get("problems") or ["no answer"]
    return f"run check FAILED on {where}: {problems[0]} ({figures})"
