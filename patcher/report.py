"""What a run says about each target: the JSON contract (schema_version 1) and exit codes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# Exit codes (their meanings: EXIT_MEANINGS) and the error kinds' codes live in core/errors.py, shared
# with the agent and the bundle; with several targets the highest code wins.
from .core.errors import (  # noqa: F401  (re-exported for fleet.py and the tests)
    ERROR_KINDS,
    EXIT_CONFLICT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_PENDING,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from .plan.planning import PatchState

if TYPE_CHECKING:
    from .core.protocol import Facts, RunCheckResult

SCHEMA_VERSION = 1


@dataclass
class TargetReport:
    target: str
    python: str | None = None
    versions: dict = field(default_factory=dict)
    distributions: dict = field(default_factory=dict)
    status: str = "ok"  # ok|changed|failed|unreachable|timed-out|rolled-back|interrupted
    exit_code: int = EXIT_OK
    patches: list[PatchState] = field(default_factory=list)
    message: str = ""
    notes: list[str] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)  # what changed (or would), with diffs on request
    problems: list[str] = field(default_factory=list)  # verification findings, conflicts
    state_dir: str | None = None
    checkpoints: list[str] | None = None  # the agent's write steps, reported when a test asks
    run_check: RunCheckResult | None = None  # the run check's answer (verify --run, apply --run-check)
    facts: Facts | None = field(default=None, repr=False)  # the agent's facts (not in the JSON)
    command_wrote: bool = False  # this run wrote files

    def as_json(self) -> dict:
        return {
            "target": self.target,
            "python": self.python,
            "versions": self.versions,
            "distributions": self.distributions,
            "status": self.status,
            "exit_code": self.exit_code,
            "message": self.message,
            "notes": self.notes,
            "problems": self.problems,
            "state_dir": self.state_dir,
            "files": self.files,
            "patches": [p.as_json() for p in self.patches],
            **({"checkpoints": self.checkpoints} if self.checkpoints is not None else {}),
            **({"run_check": self.run_check} if self.run_check is not None else {}),
        }


def document(command: str, reports: list[TargetReport]) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "exit_code": overall_exit(reports),
        "targets": [r.as_json() for r in reports],
    }


def overall_exit(reports: list[TargetReport]) -> int:
    return max((r.exit_code for r in reports), default=EXIT_OK)


def report_lost(exc: OSError, code: int | None) -> int:
    """The report could not be written to stdout: one line on stderr that says so and what the run
    itself ended with, and EXIT_REPORT_LOST (exit 1 would say everything was rolled back). The
    command line's and a fleet run's (patcher/fleet/fleet_run.py) alike."""
    import os
    import sys

    from .core.errors import EXIT_REPORT_LOST, meaning

    try:  # what is still buffered for stdout goes nowhere (no second error at exit)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    ended = (
        f"the run itself ended with exit {code} ({meaning(code).split(':')[0].split(',')[0]})"
        if code is not None
        else "the run was cut short where it wrote its report"
    )
    cause = exc.strerror or type(exc).__name__
    try:
        print(
            f"patcher: its report could not be written to stdout ({cause}); {ended}; every file is its old "
            "or its new bytes: `patcher status` shows each target as it is now (exit 8)",
            file=sys.stderr,
        )
    except OSError:
        pass
    return EXIT_REPORT_LOST
