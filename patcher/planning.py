"""From a target's facts and the selection to a plan: per file, the bytes to write (or the
original to restore) and the hash the file must have first; per patch, its state and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from .model import Patch
from .selection import Selection, select_patches

Mode = Literal["apply", "rollback"]
STALE_SUFFIX = "; apply removes it"


@dataclass
class PatchState:
    id: str
    state: str  # applied|pending|not-selected|already-satisfied|modified|anchor-missing|stale|failed
    reason: str
    target: str = ""

    def as_json(self) -> dict:
        return {"id": self.id, "state": self.state, "reason": self.reason, "file": self.target}


@dataclass
class FileChange:
    """One write the agent will carry out: new bytes, or the original restored from backup."""

    path: str
    root: str
    distribution: str
    distribution_version: str
    expected_sha256: str
    original_sha256: str
    current: str
    new_content: str | None  # None: restore the original from its backup
    patches: list[str]
    edits: dict[str, list[str]]
    outcomes: dict[str, str]
    versions: dict[str, str]
    module: str
    attribute_calls: list[dict] = field(default_factory=list)

    def diff(self, original: str | None = None) -> str:
        import difflib  # only where a diff is shown
        new = self.new_content if self.new_content is not None else (original or "")
        return "".join(
            difflib.unified_diff(
                self.current.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"a/{self.path}",
                tofile=f"b/{self.path}",
            )
        )

    def as_request(self) -> dict:
        return {
            "path": self.path,
            "root": self.root,
            "distribution": self.distribution,
            "distribution_version": self.distribution_version,
            "expected_sha256": self.expected_sha256,
            "original_sha256": self.original_sha256,
            "new_content": self.new_content,
            "restore_original": self.new_content is None,
            "patches": self.patches,
            "edits": self.edits,
            "outcomes": self.outcomes,
            "versions": self.versions,
        }


@dataclass
class Conflict:
    kind: str  # modified|anchor-missing|backup-missing|corrupt-state
    message: str
    diff: str = ""


@dataclass
class TargetPlan:
    versions: dict[str, str | None]
    distributions: dict[str, str]
    patches: list[PatchState]
    changes: list[FileChange]
    conflicts: list[Conflict]
    notes: list[str]
    verify_files: list[dict]  # every file patched once the plan is carried out
    cleanup: list[dict] = field(default_factory=list)  # files whose folder holds stale temporaries
    originals: dict[str, str] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        return bool(self.changes)


@dataclass
class _FileWork:
    """One target file between classification and transformation."""

    target: dict
    rel: str
    file_patches: list
    info: dict
    record: dict | None
    kind: str
    interrupted: bool
    applied: list[str]
    applied_edits: dict[str, list[str]]
    pristine: str
    original_sha: str
    desired: list[str]


# Detected in every target whether a patch's condition names them or not: their versions are in
# every report (`versions`), and patches may gate on them (transformers 5 breaks speculators itself).
ALWAYS_DETECTED = ("vllm", "speculators", "transformers", "torch")


def detected_names(patches: Sequence[Patch]) -> list[str]:
    """The import names the agent is asked about: every condition's, and ALWAYS_DETECTED."""
    names = condition_names(patches)
    return names + [n for n in ALWAYS_DETECTED if n not in names]


def condition_names(patches: Sequence[Patch]) -> list[str]:
    names: list[str] = []
    for patch in patches:
        for name in patch.conditions():
            if name not in names:
                names.append(name)
    return names


def target_files(patches: Sequence[Patch]) -> list[dict]:
    seen: dict[str, dict] = {}
    for patch in patches:
        seen.setdefault(patch.target.path, {"distribution": patch.target.distribution, "path": patch.target.path})
    return list(seen.values())


def _with_needs(ids: list[str], by_id: dict[str, Patch]) -> tuple[list[str], dict[str, str]]:
    """Drop patches whose `needs` are not in the set too (repeat until stable)."""
    dropped: dict[str, str] = {}
    keep = list(ids)
    changed = True
    while changed:
        changed = False
        for pid in list(keep):
            missing = [n for n in by_id[pid].needs if n not in keep]
            if missing:
                keep.remove(pid)
                dropped[pid] = f"needs {', '.join(missing)}, which is not part of this run"
                changed = True
    return keep, dropped


def plan_target(
    facts: dict,
    patches: Sequence[Patch],
    mode: Mode = "apply",
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
    force: bool = False,
) -> TargetPlan:
    dists = facts["distributions"]
    versions = {name: (dists[name]["version"] if name in dists else None) for name in condition_names(patches)}
    selections = select_patches(patches, versions)
    by_id = {p.id: p for p in patches}
    order = {p.id: i for i, p in enumerate(patches)}
    state_files = facts["state"]["files"]
    states: dict[str, PatchState] = {}
    changes: list[FileChange] = []
    conflicts: list[Conflict] = []
    notes: list[str] = []
    verify_files: list[dict] = []
    cleanup: list[dict] = []
    originals: dict[str, str] = {}
    if facts.get("state_error"):
        conflicts.append(Conflict("corrupt-state", facts["state_error"]))

    work: list[_FileWork] = []
    for target in target_files(patches):
        rel = target["path"]
        file_patches = [p for p in patches if p.target.path == rel]
        info = facts["files"].get(rel, {"exists": False})
        if not info.get("exists"):
            for p in file_patches:
                sel = selections[p.id]
                reason = sel.reason if not sel.selected else f"{rel} is not installed"
                states[p.id] = PatchState(p.id, "not-selected", reason, rel)
            continue
        record = state_files.get(rel)
        current_sha = info["sha256"]
        if info.get("temporaries"):
            cleanup.append({"root": info["root"], "path": rel})
            notes.append(f"{rel}: an interrupted run left {len(info['temporaries'])} temporary file(s) beside it")
        kind, applied, applied_edits = _classify(info, record)
        interrupted = kind == "interrupted"
        if interrupted:
            kind = "patched"
            notes.append(f"{rel}: an interrupted run left it patched but unrecorded; apply completes it")
        if kind == "replaced":
            notes.append(
                f"{rel}: pip replaced it (now {p_dist(file_patches, dists)}); the earlier record is "
                "superseded by this run, or cleared with `patcher forget`"
            )
        if kind == "modified" and not force:
            diff_base = info.get("original") if record else None
            diff = _diff(diff_base, info["content"], rel) if diff_base else ""
            conflicts.append(
                Conflict(
                    "modified",
                    f"{info['root']}/{rel} was changed by hand since patcher last wrote it "
                    "(or was never pristine); review the diff, then reinstall the package or "
                    "rerun with --force to adopt the current bytes as the new original",
                    diff,
                )
            )
            for p in file_patches:
                states[p.id] = PatchState(p.id, "modified", "file changed by hand", rel)
            continue
        if kind == "patched" and not info.get("original_intact"):
            conflicts.append(
                Conflict(
                    "backup-missing",
                    f"the pristine backup of {rel} is missing or damaged; reinstall the package "
                    "(pip install --force-reinstall) and run `patcher forget`",
                )
            )
            continue
        pristine = info["original"] if kind == "patched" else info["content"]
        original_sha = record["original_sha256"] if kind == "patched" else current_sha
        originals[rel] = pristine

        # What the file should carry after this run.
        if mode == "apply":
            requested = [
                p.id
                for p in file_patches
                if selections[p.id].selected and (not only or p.id in only) and p.id not in skip
            ]
            kept = [pid for pid in applied if pid in by_id and selections[pid].selected]
            desired = sorted(set(requested) | set(kept), key=order.__getitem__)
        else:
            desired = [pid for pid in applied if pid in by_id and only and pid not in only]
        work.append(_FileWork(target, rel, file_patches, info, record, kind, interrupted,
                              applied, applied_edits, pristine, original_sha, desired))

    # `needs` may cross files (a generator patch relying on a worker patch): filter globally.
    wanted = [pid for w in work for pid in w.desired]
    kept_ids, dropped = _with_needs(sorted(set(wanted), key=order.__getitem__), by_id)
    for w in work:
        target, rel, file_patches, info, record = w.target, w.rel, w.file_patches, w.info, w.record
        kind, interrupted, applied, applied_edits = w.kind, w.interrupted, w.applied, w.applied_edits
        pristine, original_sha, current_sha = w.pristine, w.original_sha, info["sha256"]
        desired = [pid for pid in w.desired if pid in kept_ids]
        edits = {
            pid: (selections[pid].edit_names if selections[pid].selected else applied_edits.get(pid, []))
            for pid in desired
        }

        outcomes: dict[str, str] = {}
        if (
            kind == "patched"
            and not interrupted
            and desired == applied
            and edits == {k: applied_edits.get(k) for k in desired}
        ):
            outcomes = dict((record or {}).get("outcomes") or {pid: "applied" for pid in desired})
            new_content: str | None = info["content"]  # nothing to do: no parse at all
        elif not desired:
            new_content = None if kind == "patched" else info["content"]
        else:
            from .transforms import transform_source

            steps = [(by_id[pid], [e for e in by_id[pid].edits if e.name in edits[pid]]) for pid in desired]
            result = transform_source(pristine, steps, filename=rel)
            missing = [o for o in result.outcomes if o.outcome == "anchor-missing"]
            for o in missing:
                conflicts.append(Conflict("anchor-missing", o.message))
                states[o.patch_id] = PatchState(o.patch_id, "anchor-missing", o.message, rel)
            if missing:
                for p in file_patches:
                    states.setdefault(p.id, _idle_state(p, selections[p.id], applied, rel))
                continue
            outcomes = {o.patch_id: o.outcome for o in result.outcomes}
            new_content = result.result

        for p in file_patches:
            sel = selections[p.id]
            if p.id in desired:
                if outcomes.get(p.id) == "already-satisfied":
                    states[p.id] = PatchState(p.id, "already-satisfied", "the file already has this change", rel)
                elif p.id in applied and kind == "patched":
                    states[p.id] = PatchState(p.id, "applied", sel.reason if sel.selected else "kept", rel)
                else:
                    states[p.id] = PatchState(p.id, "pending", sel.reason, rel)
            elif p.id in dropped:
                states[p.id] = PatchState(p.id, "not-selected", dropped[p.id], rel)
            else:
                states[p.id] = _idle_state(p, sel, applied if kind == "patched" else [], rel, mode)

        target_sha_matches = new_content is not None and new_content == info["content"]
        if desired and new_content is not None:
            verify_files.append(
                {
                    "module": file_patches[0].target.module,
                    "attribute_calls": [
                        {"receiver": c.receiver, "method": c.method, "implementation": c.implementation}
                        for pid in desired
                        for c in by_id[pid].attribute_calls
                    ],
                }
            )
        # Adopting a hand edit, or completing an interrupted run, is recorded even when no
        # byte changes.
        adopting = (kind == "modified" and force) or interrupted
        if not adopting and (target_sha_matches or (new_content is None and kind != "patched")):
            continue
        changes.append(
            FileChange(
                path=rel,
                root=info["root"],
                distribution=target["distribution"],
                distribution_version=dists[target["distribution"]]["version"],
                expected_sha256=current_sha,
                original_sha256=original_sha,
                current=info["content"],
                new_content=new_content,
                patches=desired,
                edits=edits,
                outcomes=outcomes,
                versions={k: v for k, v in versions.items() if v is not None},
                module=file_patches[0].target.module,
            )
        )

    ordered = [states[p.id] for p in patches if p.id in states]
    return TargetPlan(
        versions=versions,
        distributions={k: v["name"] for k, v in dists.items()},
        patches=ordered,
        changes=changes,
        conflicts=conflicts,
        notes=notes,
        verify_files=verify_files,
        cleanup=cleanup,
        originals=originals,
    )


def p_dist(file_patches: Sequence[Patch], dists: dict) -> str:
    name = file_patches[0].target.distribution
    return f"{dists[name]['name']} {dists[name]['version']}" if name in dists else name


def _idle_state(p: Patch, sel: Selection, applied: list[str], rel: str, mode: str = "apply") -> PatchState:
    """A patch this run leaves out: stale if the file still carries it, else why not."""
    if p.id in applied:
        if mode == "rollback":
            return PatchState(p.id, "pending", "rolled back by this run", rel)
        return PatchState(p.id, "stale", f"no longer selected: {sel.reason}{STALE_SUFFIX}", rel)
    if not sel.selected:
        return PatchState(p.id, "not-selected", sel.reason, rel)
    return PatchState(p.id, "pending", "selected; left out by --only/--skip", rel)


def _classify(info: dict, record: dict | None) -> tuple[str, list[str], dict[str, list[str]]]:
    """pristine | patched | interrupted | replaced | modified, with the patches the file carries."""
    current = info["sha256"]
    if record:
        if current == record.get("patched_sha256"):
            return "patched", list(record.get("patches", [])), dict(record.get("edits", {}))
        pending = record.get("pending")
        if pending and current == pending.get("sha256"):
            # An interrupted run wrote this file but did not record the result: it carries
            # the pending set, not yet verified; the next apply rewrites it, verifies, records.
            if pending.get("patches"):
                return "interrupted", list(pending["patches"]), dict(pending.get("edits", {}))
            return "pristine", [], {}
        if current == record.get("original_sha256"):
            return "pristine", [], {}
        if info.get("record_sha256") and current == info["record_sha256"]:
            return "replaced", [], {}
        return "modified", [], {}
    if info.get("record_sha256") in (None, current):
        return "pristine", [], {}
    return "modified", [], {}


def _diff(a: str, b: str, rel: str) -> str:
    import difflib  # only where a diff is shown
    return "".join(
        difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True), fromfile=f"expected/{rel}", tofile=f"found/{rel}"
        )
    )
