"""One target, end to end: detect (agent) -> select -> transform -> plan (here) -> write,
verify, record (agent). The same path for every transport."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import __version__
from .core.errors import EXIT_FAILED, EXIT_PENDING, outcome
from .model import Patch
from .patchset.registry import release_lines
from .plan.planning import (
    PatchState,
    TargetPlan,
    after_write,
    detected_names,
    target_files,
    unpatched_path,
    verify_spec,
)
from .plan.target_plan import Mode, plan_target, target_file_limit_bytes
from .report import TargetReport
from .transport.interface import AgentFailure, Transport, TransportError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .core.protocol import (
        ApplyRequest,
        ApplyResult,
        Facts,
        FactsRequest,
        ForgetRequest,
        ForgetResult,
        RunCheckResult,
        TargetFile,
        Verification,
        VerifyRequest,
        VerifySpec,
    )


@dataclass
class RunOptions:
    command: str  # status|plan|apply|rollback|forget|verify
    only: Sequence[str] = ()
    skip: Sequence[str] = ()
    force: bool = False
    force_restore: bool = False  # rollback --force: restore originals pip's RECORD does not vouch for
    verify: bool = True
    diff: bool = False
    forget_all: bool = False
    # Time limits, in seconds (docs/usage.md, "Time limits"): each is enforced by the agent itself, and
    # the controller gives up on an agent that has not answered shortly after.
    lock_timeout: float = 10.0
    facts_timeout: float = 60.0
    write_timeout: float = 120.0
    verify_timeout: float = 600.0
    check: bool = False  # apply/rollback planned and reported, nothing written (Ansible's check mode)
    run_check: bool = False  # verify --run, apply --run-check: the run check after the lock is released
    run_model: str | None = None  # --model: the run check on this checkpoint of the target's (else the tiny Llama)
    tensor_parallel: int = 1  # --tensor-parallel: devices run_model is split over
    progress: Callable[[str], None] = field(default=lambda message: None)

    def write_call(self, request: Mapping[str, Any]) -> tuple[dict, dict]:
        """A writing request (apply, forget) with its time limits, and the call's own arguments."""
        request = {
            **request,
            "lock_timeout": self.lock_timeout,
            "time_limit": self.write_timeout,
            "file_limit": target_file_limit_bytes(),
        }
        budget = self.lock_timeout + self.write_timeout
        limit = f"--lock-timeout {self.lock_timeout:g} + --write-timeout {self.write_timeout:g}"
        if request.get("verify"):
            request["verify"] = {**request["verify"], "timeout": self.verify_timeout}
            budget += self.verify_timeout + self.write_timeout  # the verification, then the record or restore
            limit += f" + --verify-timeout {self.verify_timeout:g} + --write-timeout again to record"
        return request, {"timeout": budget, "limit": limit}


def run_target(transport: Transport, patches: Sequence[Patch], options: RunOptions) -> TargetReport:
    """The whole run on one target; the transport's session ends with it."""
    try:
        return _run_target(transport, patches, options)
    finally:
        transport.close()


def _run_target(transport: Transport, patches: Sequence[Patch], options: RunOptions) -> TargetReport:
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
    except KeyboardInterrupt:
        # Ctrl-C in this thread (a local run): end the agent (it stops at once; any write it was
        # doing is atomic) and say so. A fleet's hosts are interrupted through their transports.
        transport.interrupt()
        return _fail(report, "interrupted", transport.interrupted_message())


def sets_installed_here(patches: Sequence[Patch], installed: set[str]) -> tuple[list[Patch], list[str]]:
    """The patches of the sets that target a distribution installed here, and a note per set that
    does not (its patches have nothing to act on: they stay out of the report)."""
    by_set: dict[str, list[Patch]] = {}
    for patch in patches:
        by_set.setdefault(patch.patch_set, []).append(patch)
    kept: list[Patch] = []
    notes: list[str] = []
    for name, members in by_set.items():
        targets = sorted({p.target.distribution for p in members})
        if set(targets) & installed:
            kept += members
        else:
            label = f"patch set {name}" if name else "patcher's own patches"
            notes.append(f"{label}: not used here ({', '.join(targets)} not installed)")
    return kept, notes


def _fail(report: TargetReport, kind: str, message: str) -> TargetReport:
    report.status, report.exit_code = outcome(kind)
    report.message = message
    return report


def _run(transport: Transport, patches: Sequence[Patch], options: RunOptions, report: TargetReport) -> TargetReport:
    """One pass over a target: detect, select and plan; then, for a writing command, write,
    verify and record (the agent does all three in one request). `report` is filled step by step."""
    # Every request declares the patches' target files: the agent reads, writes and records
    # nothing else, whatever the state record on the target says.
    declared = target_files(p.spec() for p in patches)
    facts = _detect(transport, patches, options, report, declared)
    if options.command == "forget":
        return _forget(transport, options, report, declared)
    targets = {p.target.distribution for p in patches}
    if not targets & set(facts["distributions"]):
        names = ", ".join(sorted(targets))
        return _fail(
            report,
            "usage",
            f"{names} is not installed in {report.python}; name the environment's interpreter with --python PATH",
        )
    patches, unused = sets_installed_here(patches, set(facts["distributions"]))
    mode: Mode = "rollback" if options.command == "rollback" else "apply"
    plan = _plan(facts, patches, mode, options, report)
    report.notes = [*unused, *report.notes]
    if plan.conflicts:
        return _conflicted(plan, report)
    if options.command == "verify":
        return _verify(transport, plan, report, options)
    if options.command in ("status", "plan") or options.check:
        return _planned_only(plan, report, options)
    if not plan.pending:
        return _nothing_to_write(transport, plan, facts, declared, report, options)
    result = _write(transport, plan, facts, declared, mode, options)
    return _record(transport, plan, result, mode, report, options)


def _detect(
    transport: Transport,
    patches: Sequence[Patch],
    options: RunOptions,
    report: TargetReport,
    declared: list[TargetFile],
) -> Facts:
    """Detect: the agent's facts (Python, installed distributions, target files, state record),
    read under the target's lock; the report takes what it shows of them."""
    options.progress(f"{transport.label}: reading installed versions and target files")
    # A run that may write takes the target's lock before it reads anything and keeps it to the
    # end of its transaction: it plans on exactly what it writes over. status and plan wait
    # for a writer to finish (a shared lock) rather than report its work half done.
    # Check mode (Ansible's --check) plans what apply or rollback would do and writes nothing, not
    # even the lock and the folders it lives in: it reads as status does.
    writes = options.command in ("apply", "rollback", "forget") and not options.check
    request: FactsRequest = {
        "op": "facts",
        "names": detected_names(patches),
        "files": declared,
        "declared": declared,
        "lock": "exclusive" if writes else "shared",
        "lock_timeout": options.lock_timeout,
        # The wait for the lock comes first, then the facts' own limit.
        "time_limit": options.facts_timeout + options.lock_timeout,
        "file_limit": target_file_limit_bytes(),
    }
    facts: Facts = transport.call(
        request,
        timeout=options.facts_timeout + options.lock_timeout,
        limit=f"--lock-timeout {options.lock_timeout:g} + --facts-timeout {options.facts_timeout:g}",
    )
    report.python = facts["python"]["executable"]
    report.facts = facts
    report.state_dir = facts["state_dir"]
    installed = {name: d for name, d in facts["distributions"].items()}
    report.versions = {name: d["version"] for name, d in installed.items()}
    report.distributions = {name: d["name"] for name, d in installed.items()}
    return facts


def _forget(
    transport: Transport, options: RunOptions, report: TargetReport, declared: list[TargetFile]
) -> TargetReport:
    """`patcher forget`: the agent drops state records (the files stay as they are)."""
    forget: ForgetRequest = {"op": "forget", "all": options.forget_all, "declared": declared}
    request, limits = options.write_call(forget)
    result: ForgetResult = transport.call(request, **limits)
    report.files = [{"path": p, "action": "forgotten"} for p in result["forgotten"]]
    report.status = "changed" if result["forgotten"] else "ok"
    report.message = f"forgot {len(result['forgotten'])} record(s)"
    return report


def _plan(facts: Facts, patches: Sequence[Patch], mode: Mode, options: RunOptions, report: TargetReport) -> TargetPlan:
    """Select and plan (patcher.plan.target_plan): each patch's state and each file's change; the report
    takes the patch states, notes and file entries."""
    plan = plan_target(facts, patches, mode, options.only, options.skip, options.force, release_lines())
    report.patches = plan.patches
    report.notes = plan.notes
    if facts.get("lock") == "busy":
        report.notes = [
            (
                f"another patcher run held the lock for {options.lock_timeout:g}s: this shows the "
                "files as that run had left them so far"
            )
        ] + report.notes
    report.files = [_file_entry(change, plan, options.diff) for change in plan.changes]
    return plan


def _conflicted(plan: TargetPlan, report: TargetReport) -> TargetReport:
    """A file patcher does not know (changed by hand, another tool): exit 3; a release patcher does
    not cover, or a vLLM that cannot find its platform: exit 7. Nothing written."""
    report.status, report.exit_code = outcome(plan.conflicts[0].kind)
    report.message = plan.conflicts[0].message
    report.problems = [c.message for c in plan.conflicts]
    for conflict in plan.conflicts:
        if conflict.diff:
            report.files.append({"path": "", "action": "modified", "diff": conflict.diff})
    return report


def _planned_only(plan: TargetPlan, report: TargetReport, options: RunOptions) -> TargetReport:
    """status, plan, and apply/rollback in check mode: the plan is the answer (plan exits 2 when
    something is pending)."""
    if options.command != "status" and plan.pending:
        report.exit_code = EXIT_PENDING
        report.message = f"{len(plan.changes)} file(s) would change"
    else:
        report.message = "nothing to do" if not plan.pending else f"{len(plan.changes)} file(s) pending"
    if not any(p.state in ("pending", "applied", "stale") for p in plan.patches) and not plan.pending:
        report.message = "no patch selected: " + _why_none(plan)
        path = _unpatched_path(report)
        if path:
            report.message = f"nothing to do: {path}"
            report.notes = [*report.notes, *_connector_drift_notes(report)]
    return report


def _nothing_to_write(
    transport: Transport,
    plan: TargetPlan,
    facts: Facts,
    declared: list[TargetFile],
    report: TargetReport,
    options: RunOptions,
) -> TargetReport:
    """Every selected patch in place: at most the temporary files an interrupted run left go."""
    if plan.cleanup:
        cleanup: ApplyRequest = {
            "op": "apply",
            "files": [],
            "cleanup": plan.cleanup,
            "expect": facts.get("snapshot"),
            "declared": declared,
        }
        request, limits = options.write_call(cleanup)
        transport.call(request, **limits)
        report.status = "changed"
        report.message = "removed temporary files an interrupted run left; the patches were already in place"
        return report
    report.message = (
        "nothing to do: no selected patch is applied, so there is nothing to roll back"
        if options.command == "rollback"
        else "nothing to do: every selected patch is already in place"
    )
    if not any(p.state in ("applied", "already-satisfied", "pending") for p in plan.patches):
        report.message = "nothing to do; no patch selected: " + _why_none(plan)
        path = _unpatched_path(report)
        if path:
            report.message = f"nothing to do: {path}"
            report.notes = [*report.notes, *_connector_drift_notes(report)]
    return _then_run_check(transport, report, options)


def _unpatched_path(report: TargetReport) -> str:
    """speculators 0.5+ (a release line no source patch serves): the path its extraction takes."""
    from .plan.selection import condition_holds

    assert report.facts is not None
    return unpatched_path(report.facts, [x.as_json() for x in release_lines()], condition_holds)


def _connector_drift_notes(report: TargetReport) -> list[str]:
    """On the speculators 0.5+ path: what the installed KV connector is known to meet on the
    installed vLLM (patches/connector_drift.py's CONNECTOR_DRIFT, which check-upstream keeps exact), one
    note each, so `status` does not read as an all-clear where a connector silently misbehaves."""
    from .patchset.registry import declared_drift
    from .plan.selection import condition_holds

    assert report.facts is not None
    dists = report.facts["distributions"]
    vllm = dists["vllm"]["version"] if dists.get("vllm") else None
    notes = []
    for drift in declared_drift():
        installed = dists.get(drift.distribution.replace("-", "_"))
        if not (installed and vllm and condition_holds(drift.vllm, vllm)):
            continue
        if drift.connector and not condition_holds(drift.connector, installed["version"]):
            continue
        notes.append(
            f"{drift.distribution} {installed['version']} on vllm {vllm}: {drift.path}: {drift.subject}; "
            f"{drift.why} (a vLLM outside {drift.vllm} avoids it; `patcher check-upstream` lists the releases)"
        )
    return notes


def _write(
    transport: Transport, plan: TargetPlan, facts: Facts, declared: list[TargetFile], mode: Mode, options: RunOptions
) -> ApplyResult:
    """Write and verify: one apply request; the agent writes every change atomically, verifies
    the result in a fresh interpreter (apply) and records it, or restores every file. Its answer."""
    verify = options.verify and mode == "apply" and bool(plan.verify_files)
    options.progress(
        f"{transport.label}: writing {len(plan.changes)} file(s)"
        + (", then verifying them in a fresh interpreter (every file is restored if that fails)" if verify else "")
    )
    apply: ApplyRequest = {
        "op": "apply",
        "files": [change.as_request() for change in plan.changes],
        "cleanup": plan.cleanup,
        "verify": verify_spec(plan.verify_files, facts) if verify else None,
        "expect": facts.get("snapshot"),
        "written_by": f"patcher {__version__}",
        "declared": declared,
    }
    if options.force_restore:
        apply["force_restore"] = True
    request, limits = options.write_call(apply)
    fault = os.environ.get("PATCHER_FAULT")  # crash tests only: see remote/agent/faults.py checkpoint()
    if fault:
        request["fault"] = json.loads(fault)
    return transport.call(request, **limits)


def _record(
    transport: Transport, plan: TargetPlan, result: ApplyResult, mode: Mode, report: TargetReport, options: RunOptions
) -> TargetReport:
    """Record: the report of what the write did (rolled back on a failed verification, or the
    patches' states after it), then the run check when asked."""
    report.checkpoints = result.get("checkpoints")
    changed_ids = {pid for change in plan.changes for pid in change.patches}
    if result["status"] == "rolled-back":
        report.status, report.exit_code = "rolled-back", EXIT_FAILED
        assert result["verification"] is not None  # a rollback follows a failed verification
        report.problems = result["verification"]["problems"]
        report.message = "verification failed, every file restored: " + report.problems[0]
        report.patches = [
            PatchState(p.id, "failed", "verification failed; restored", p.target) if p.id in changed_ids else p
            for p in plan.patches
        ]
        return report
    report.status = "changed"
    report.command_wrote = True
    report.patches = after_write(plan.patches, plan.changes, mode)
    verified = result.get("verification")
    if mode == "rollback":
        restored = sum(1 for change in plan.changes if change.new_content is None)
        report.message = f"{restored} file(s) restored to their original bytes" + (
            f", {len(plan.changes) - restored} recomputed without the rolled-back patches"
            if restored < len(plan.changes)
            else ""
        )
    else:
        report.message = f"{len(plan.changes)} file(s) written" + (", verified" if verified else ", not verified")
        return _then_run_check(transport, report, options)
    return report


def _verify_spec(plan: TargetPlan, facts: Facts) -> VerifySpec:
    """What the static verification checks: every target file that is installed (as it is now),
    with the attribute calls of the patches that are (or would be) in it."""
    files = list(plan.verify_files)
    listed = {f["module"] for f in files}
    for rel in sorted(r for r, info in facts["files"].items() if info.get("exists")):
        module = rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        if module not in listed:
            files.append({"module": module, "attribute_calls": []})
    return verify_spec(files, facts)


def _verify(transport: Transport, plan: TargetPlan, report: TargetReport, options: RunOptions) -> TargetReport:
    """`patcher verify`: the static check (a fresh interpreter), then with --run the run check."""
    options.progress(f"{transport.label}: binding the patched files' vLLM calls in a fresh interpreter")
    assert report.facts is not None  # read before any plan
    verify: VerifyRequest = {
        "op": "verify",
        "spec": {**_verify_spec(plan, report.facts), "timeout": options.verify_timeout},
    }
    result: Verification = transport.call(
        verify,
        timeout=options.verify_timeout + 5,
        limit=f"--verify-timeout {options.verify_timeout:g}",
    )
    found = list(result["problems"])
    report.problems = list(report.problems) + found
    if found:
        report.status, report.exit_code = "failed", EXIT_FAILED
        report.message = f"verification failed ({len(found)} problem(s)): {found[0]}"
        unapplied = [p for p in report.patches if p.state in ("pending", "stale")]
        if unapplied:  # the files are not (all) patched yet: what is listed is what apply is for
            hint = f"{len(unapplied)} selected patch(es) are not applied to these files: `patcher apply` applies them and verifies again"
            report.notes = [*report.notes, hint]
        if not options.run_check:
            return report
    else:
        report.message = "verified: every patched module imports and its vLLM calls bind"
    return _then_run_check(transport, report, options)


def _then_run_check(transport: Transport, report: TargetReport, options: RunOptions) -> TargetReport:
    """The run check, when asked, after the lock is released: a failure is exit 1. Files are not
    restored automatically: the lock is free while it runs, so another run may have changed them."""
    if not options.run_check:
        return report
    from .core.errors import EXIT_USAGE
    from .run_check.request import DEFAULT_TIMEOUT, memory_cap_mib, request, summary

    try:
        memory_cap = memory_cap_mib()
    except ValueError as exc:
        report.status, report.exit_code = "failed", max(report.exit_code, EXIT_USAGE)
        report.message = f"run check: {exc}"
        return report
    if options.run_model is None:
        what = "a tiny Llama through speculators and vLLM, compared with transformers"
    else:
        what = f"{options.run_model} at tensor parallel {options.tensor_parallel} through speculators and vLLM"
    options.progress(f"{transport.label}: run check: {what}")
    result: RunCheckResult = transport.call(
        request(model=options.run_model, tensor_parallel=options.tensor_parallel, memory_cap=memory_cap),
        timeout=DEFAULT_TIMEOUT + 120,
    )
    report.run_check = result
    line = summary(result)
    if result.get("usage_error"):
        # a bad --model / --tensor-parallel, found where the checkpoint is: one line, exit 2
        report.status, report.exit_code = "failed", max(report.exit_code, EXIT_USAGE)
        report.problems = [*report.problems, line]
        report.message = line
        return report
    if result.get("ok"):
        report.message = f"{report.message}; {line}"
        return report
    report.status, report.exit_code = "failed", max(report.exit_code, EXIT_FAILED)
    report.problems = list(report.problems) + list(result.get("problems") or [line])
    if report.command_wrote:
        line += "; the files stay as written: `patcher rollback` restores them"
    report.message = f"{report.message}; {line}" if report.message else line
    return report


def _why_none(plan: TargetPlan) -> str:
    """Why no patch is selected, each fact once: a distribution that is not installed is said once
    (each patch's own range is in its reason), the others as each patch's reason says."""
    facts: dict[str, None] = {}
    for p in plan.patches:
        if p.state != "not-selected" or p.reason.startswith("withdrawn: "):  # never selected: not why
            continue
        for part in p.reason.removeprefix("no edit applies: ").split("; "):
            name, _, rest = part.partition(" is not installed (needs ")
            facts[f"{name} is not installed" if rest else part] = None
    return "; ".join(sorted(facts)) or "no patch applies"


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
