"""One target, end to end: detect (agent) -> select -> transform -> plan (here) -> write,
verify, record (agent). The same path for every transport."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

from . import __version__
from .model import Patch
from .core.errors import EXIT_CONFLICT, EXIT_FAILED, EXIT_PENDING, outcome
from .planning import PatchState, TargetPlan, after_write, condition_names, plan_target, target_files
from .report import TargetReport
from .transport import AgentFailure, TransportError


@dataclass
class RunOptions:
    command: str  # status|plan|apply|rollback|forget
    only: Sequence[str] = ()
    skip: Sequence[str] = ()
    force: bool = False
    verify: bool = True
    diff: bool = False
    forget_all: bool = False
    lock_timeout: float = 10.0
    progress: Callable[[str], None] = field(default=lambda message: None)


def run_target(transport, patches: Sequence[Patch], options: RunOptions) -> TargetReport:
    """The whole run on one target; the transport's session ends with it."""
    try:
        return _run_target(transport, patches, options)
    finally:
        transport.close()


def _run_target(transport, patches: Sequence[Patch], options: RunOptions) -> TargetReport:
    report = TargetReport(target=transport.label)
    try:
        try:
            return _run(transport, patches, options, report)
        except AgentFailure as exc:
            if exc.kind != "stale-plan":
                raise
            # Another run changed the files while this one waited for the lock: plan again, once.
            options.progress(f"{transport.label}: files changed while waiting for the lock; planning again")
            report = TargetReport(target=transport.label)
            return _run(transport, patches, options, report)
    except TransportError as exc:
        return _fail(report, exc.kind, exc.message)
    except AgentFailure as exc:
        return _fail(report, exc.kind, exc.message)


def _fail(report: TargetReport, kind: str, message: str) -> TargetReport:
    report.status, report.exit_code = outcome(kind)
    report.message = message
    return report


def _run(transport, patches: Sequence[Patch], options: RunOptions, report: TargetReport) -> TargetReport:
    options.progress(f"{transport.label}: reading installed versions and target files")
    facts = transport.call(
        {"op": "facts", "names": condition_names(patches), "files": target_files(patches)}
    )
    report.python = facts["python"]["executable"]
    report.state_dir = facts["state_dir"]
    targets = {p.target.distribution for p in patches}
    installed = {name: d for name, d in facts["distributions"].items()}
    report.versions = {name: d["version"] for name, d in installed.items()}
    report.distributions = {name: d["name"] for name, d in installed.items()}
    if options.command == "forget":
        result = transport.call({"op": "forget", "all": options.forget_all, "lock_timeout": options.lock_timeout})
        report.files = [{"path": p, "action": "forgotten"} for p in result["forgotten"]]
        report.status = "changed" if result["forgotten"] else "ok"
        report.message = f"forgot {len(result['forgotten'])} record(s)"
        return report
    if not targets & set(installed):
        names = ", ".join(sorted(targets))
        return _fail(
            report,
            "usage",
            f"{names} is not installed in {report.python}; name the environment's interpreter "
            "with --python PATH",
        )

    mode = "rollback" if options.command == "rollback" else "apply"
    plan = plan_target(facts, patches, mode, options.only, options.skip, options.force)
    report.patches = plan.patches
    report.notes = plan.notes
    report.files = [_file_entry(change, plan, options.diff) for change in plan.changes]
    if plan.conflicts:
        report.status, report.exit_code = "failed", EXIT_CONFLICT
        report.message = plan.conflicts[0].message
        report.problems = [c.message for c in plan.conflicts]
        for conflict in plan.conflicts:
            if conflict.diff:
                report.files.append({"path": "", "action": "modified", "diff": conflict.diff})
        return report
    if options.command in ("status", "plan"):
        if options.command == "plan" and plan.pending:
            report.exit_code = EXIT_PENDING
            report.message = f"{len(plan.changes)} file(s) would change"
        else:
            report.message = "nothing to do" if not plan.pending else f"{len(plan.changes)} file(s) pending"
        if not any(p.state in ("pending", "applied", "stale") for p in plan.patches) and not plan.pending:
            report.message = "no patch selected: " + _why_none(plan)
        return report
    if not plan.pending and plan.cleanup:
        transport.call({"op": "apply", "files": [], "cleanup": plan.cleanup, "lock_timeout": options.lock_timeout})
        report.status = "changed"
        report.message = "removed temporary files an interrupted run left; the patches were already in place"
        return report
    if not plan.pending:
        report.message = "nothing to do: every selected patch is already in place"
        if not any(p.state in ("applied", "already-satisfied", "pending") for p in plan.patches):
            report.message = "nothing to do; no patch selected: " + _why_none(plan)
        return report

    verify = options.verify and mode == "apply" and bool(plan.verify_files)
    options.progress(
        f"{transport.label}: writing {len(plan.changes)} file(s)" + (" and verifying" if verify else "")
    )
    request = {
        "op": "apply",
        "files": [change.as_request() for change in plan.changes],
        "cleanup": plan.cleanup,
        "verify": {"files": plan.verify_files, "import_prefixes": ["vllm"]} if verify else None,
        "lock_timeout": options.lock_timeout,
        "written_by": f"patcher {__version__}",
    }
    fault = os.environ.get("PATCHER_FAULT")  # crash tests only: see remote/agent.py checkpoint()
    if fault:
        request["fault"] = json.loads(fault)
    result = transport.call(request)
    report.checkpoints = result.get("checkpoints")
    changed_ids = {pid for change in plan.changes for pid in change.patches}
    if result["status"] == "rolled-back":
        report.status, report.exit_code = "rolled-back", EXIT_FAILED
        report.problems = result["verification"]["problems"]
        report.message = "verification failed, every file restored: " + report.problems[0]
        report.patches = [
            PatchState(p.id, "failed", "verification failed; restored", p.target) if p.id in changed_ids else p
            for p in plan.patches
        ]
        return report
    report.status = "changed"
    report.patches = after_write(plan.patches, plan.changes, mode)
    verified = result.get("verification")
    if mode == "rollback":
        restored = sum(1 for change in plan.changes if change.new_content is None)
        report.message = f"{restored} file(s) restored to their original bytes" + (
            f", {len(plan.changes) - restored} recomputed without the rolled-back patches"
            if restored < len(plan.changes) else ""
        )
    else:
        report.message = f"{len(plan.changes)} file(s) written" + (", verified" if verified else ", not verified")
    return report


def _why_none(plan: TargetPlan) -> str:
    reasons = sorted({p.reason for p in plan.patches if p.state == "not-selected"})
    return "; ".join(reasons) or "no patch applies"


def _file_entry(change, plan: TargetPlan, with_diff: bool) -> dict:
    entry = {
        "path": change.path,
        "action": "restore" if change.new_content is None else "write",
        "patches": change.patches,
        "expected_sha256": change.expected_sha256,
    }
    if with_diff:
        entry["diff"] = change.diff(plan.originals.get(change.path))
    return entry
