"""op_apply and op_forget: one transaction per environment under the lock. Check every file,
take pristine backups, record the intent, write, verify (restoring every file when that fails)
and record the result; forget drops record entries of files pip has since replaced."""

from __future__ import annotations

import errno
import os

from patcher.core.errors import AgentError

from .answers import WATCHDOG
from .detect import find_distributions
from .faults import checkpoint
from .record import backup_name, load_state, read_state_bytes, save_state
from .state import Lock, NotYours, StateFolder
from .target_paths import Declared, TargetPath
from .writes import sha256_bytes, write_failure

# The type checker's view only (typing itself is not imported: it costs start-up time).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from patcher.core.protocol import (
        ApplyItem,
        ApplyRequest,
        ApplyResult,
        ForgetRequest,
        ForgetResult,
        RecordEntry,
        Snapshot,
        StateRecord,
    )

WRITES_HINT = (
    ": every file is either its old or its new bytes (written atomically); run `patcher status` to see which, "
    "then the command again"
)


def check_snapshot(expect: Snapshot, declared: Declared, own: StateFolder) -> None:
    """Refuse (stale-plan) if the record or any target file is not what the plan was made on.
    Paths come from the declared files, never from the request's copy of the facts."""
    for rel, seen in sorted(expect.get("files", {}).items()):
        path = declared.target(rel)
        current = path.sha256() if path is not None else None
        if current != seen.get("sha256"):
            raise AgentError(
                "stale-plan",
                f"{path.path if path is not None else rel} changed since the plan was made (sha256 {current}, expected "
                f"{seen.get('sha256')}); run the command again",
            )
    raw = read_state_bytes(own)
    if (sha256_bytes(raw) if raw is not None else None) != expect.get("state_sha256"):
        raise AgentError(
            "stale-plan",
            f"the state record {own.shown('state.json')} changed since the plan was made; run the command again",
        )


def op_apply(req: ApplyRequest) -> ApplyResult:
    """Carry out a plan: each item writes new bytes or restores the original, as one transaction:
    check every file, take pristine backups, record the intent, write, verify (restoring every
    file when that fails) and record the result."""
    items = req.get("files", [])
    declared = Declared(req.get("declared"))
    with Lock(float(req.get("lock_timeout", 10))) as lock:
        own = lock.folder
        checkpoint("locked")
        WATCHDOG.arm(req.get("time_limit"), "writing the files", "--write-timeout", WRITES_HINT)
        expect = req.get("expect")
        if expect is not None:
            check_snapshot(expect, declared, own)
        state = load_state(own, declared)
        _remove_temporaries(own, declared, items + req.get("cleanup", []))
        previous = _check_items(items, declared, state)
        _check_restores(own, declared, state, items, bool(req.get("force_restore")))
        _take_backups(own, items, previous)
        new_bytes = _record_intent(own, declared, state, items)
        _write_files(items, previous, new_bytes)
        verification = None
        spec = req.get("verify")
        if spec and items:
            from .verification import run_verification  # compiled only for a run that verifies

            verification = run_verification(spec)
            WATCHDOG.arm(req.get("time_limit"), "recording the result", "--write-timeout", WRITES_HINT)
            checkpoint("verified")
            if not verification["ok"]:
                _restore(own, state, items, previous)
                return {"status": "rolled-back", "verification": verification}
        _record_result(own, state, items, req.get("written_by", "patcher"))
        return {"status": "changed" if items else "ok", "verification": verification}


def _remove_temporaries(own: StateFolder, declared: Declared, items: list) -> None:
    """The temporary files an interrupted run left beside the target files and among patcher's own."""
    for item in items:
        _installed(declared, item["path"]).remove_temporaries()
    own.remove_temporaries()
    own.remove_temporaries("backups")


def _check_items(items: list[ApplyItem], declared: Declared, state: StateRecord) -> dict:
    """Check everything before touching anything: a plan made on other bytes is refused.
    rel -> (TargetPath, bytes before, record entry before): what a failed verification restores.
    A link on the way to a file or its __pycache__ is refused here, before anything is written."""
    previous = {}
    for item in items:
        path = _installed(declared, item["path"])
        before = path.read()
        current = None if before is None else sha256_bytes(before)
        if current != item["expected_sha256"]:
            raise AgentError(
                "stale-plan",
                f"{path.path} changed since the plan was made (sha256 {current}, expected "
                f"{item['expected_sha256']}); run the command again",
            )
        owner = path.owner() if hasattr(os, "geteuid") and os.geteuid() != 0 else None
        if owner is not None and owner != os.geteuid():  # replaced by us, it would become ours
            raise NotYours(f"{path.path} is", owner)
        path.check_bytecode_folder()
        attribute = path.flags()
        if attribute:
            raise write_failure(PermissionError(errno.EPERM, "Operation not permitted"), path.path, attribute=attribute)
        if not path.writable():
            raise AgentError(
                "not-writable",
                f"{path.path} is not writable by this user; run as the environment's owner (or --sudo on a remote host)",
            )
        previous[item["path"]] = (path, before, state["files"].get(item["path"]))
    return previous


def pip_sha256(declared: Declared, rel: str) -> str | None:
    """The sha256 pip's RECORD gives for a declared file (None: not installed, or not listed)."""
    name = declared.distribution[rel]
    found = find_distributions([name], [{"distribution": name, "path": rel}])
    return found[name]["record"].get(rel) if name in found else None


def _check_restores(
    own: StateFolder, declared: Declared, state: StateRecord, items: list[ApplyItem], force: bool
) -> None:
    """An original about to be restored must be the bytes pip installed, where its RECORD says
    which, unless the record says it was adopted with --force (the state folder's owner and mode
    are checked: only root or the environment's owner can have said so) or `force_restore`."""
    for item in items:
        if not item.get("restore_original") or force:
            continue
        entry = state["files"].get(item["path"])
        if entry is not None and entry.get("original_adopted"):
            continue
        expected = pip_sha256(declared, item["path"])
        data = own.read(backup_name(item["original_sha256"]), "backups")
        if expected is None or data is None:
            continue  # nothing to compare with; a missing backup is refused where it is read
        actual = sha256_bytes(data)
        if actual != expected:
            raise AgentError(
                "backup-missing",
                f"refusing to restore {_installed(declared, item['path']).path} from "
                f"{own.shown(backup_name(item['original_sha256']), 'backups')}: its sha256 {actual} is not the "
                f"{expected} pip's RECORD gives, and the record does not say it was adopted with --force; "
                "reinstall the package (pip install --force-reinstall) and run `patcher forget`, or, if you "
                "know this backup is the original you want back, run `patcher rollback --force`",
            )


def _take_backups(own: StateFolder, items: list[ApplyItem], previous: dict) -> None:
    """Pristine backups, taken once and checked."""
    for item in items:
        path, before, _ = previous[item["path"]]
        original_sha = item["original_sha256"]
        backup = backup_name(original_sha)
        kept = own.read(backup, "backups")
        if kept is not None and sha256_bytes(kept) == original_sha:
            continue
        if sha256_bytes(before) != original_sha:
            raise AgentError(
                "backup-missing",
                f"the pristine copy of {path.path} ({own.shown(backup, 'backups')}) is missing or damaged; "
                "reinstall the package (pip install --force-reinstall) and run `patcher forget`",
            )
        own.write(backup, before, "backups")
        checkpoint("backup-written:" + item["path"])


def _record_intent(own: StateFolder, declared: Declared, state: StateRecord, items: list[ApplyItem]) -> dict:
    """Record the intent, then write: a crash between leaves a file that is either its old or its
    new bytes, and the record knows both hashes. rel -> the bytes to write."""
    new_bytes = {}
    for item in items:
        data = _bytes_to_write(own, item)
        new_bytes[item["path"]] = data
        state["files"][item["path"]] = _pending_entry(declared, state, item, data)
    if items:
        save_state(own, state)
        checkpoint("intent-recorded")
    return new_bytes


def _bytes_to_write(own: StateFolder, item: ApplyItem) -> bytes:
    """The item's new bytes, or its pristine backup (checked) when it restores the original."""
    if not item.get("restore_original"):
        return item["new_content"].encode("utf-8")  # type: ignore[union-attr]  # not restored: new text
    data = own.read(backup_name(item["original_sha256"]), "backups")
    if data is None or sha256_bytes(data) != item["original_sha256"]:
        raise AgentError(
            "backup-missing",
            f"the pristine backup of {item['path']} is missing or damaged; reinstall the "
            "package (pip install --force-reinstall) and run `patcher forget`",
        )
    return data


def _pending_entry(declared: Declared, state: StateRecord, item: ApplyItem, data: bytes) -> RecordEntry:
    """The file's record entry with the write it is about to get as `pending`."""
    entry: RecordEntry = dict(state["files"].get(item["path"]) or {})  # type: ignore[assignment]  # a copy
    entry.update(
        {
            "root": declared.root(item["path"]),
            "distribution": declared.distribution[item["path"]],
            "distribution_version": item["distribution_version"],
            "original_sha256": item["original_sha256"],
        }
    )
    entry.setdefault("patched_sha256", None)
    entry.setdefault("patches", [])
    before = state["files"].get(item["path"])
    if before is None or before["original_sha256"] != item["original_sha256"]:
        # a new original: adopted (--force) when pip's RECORD gives other bytes; rollback checks
        # every other original against RECORD before restoring it
        expected = pip_sha256(declared, item["path"])
        entry["original_adopted"] = expected is not None and expected != item["original_sha256"]
    entry["pending"] = {
        "sha256": sha256_bytes(data),
        "patches": item["patches"],
        "edits": item.get("edits", {}),
        "outcomes": item.get("outcomes", {}),
        "versions": item.get("versions", {}),
    }
    return entry


def _write_files(items: list[ApplyItem], previous: dict, new_bytes: dict) -> None:
    """Each file atomically, then its stale bytecode removed."""
    for item in items:
        path = previous[item["path"]][0]
        path.write(new_bytes[item["path"]])
        checkpoint("file-written:" + item["path"])
        path.remove_bytecode()
        checkpoint("bytecode-removed:" + item["path"])


def _restore(own: StateFolder, state: StateRecord, items: list[ApplyItem], previous: dict) -> None:
    """The verification failed: every file gets its bytes back, then the record its entries."""
    for item in items:
        path, before, _ = previous[item["path"]]
        path.write(before)
        checkpoint("file-restored:" + item["path"])
        path.remove_bytecode()
    for item in items:
        old_entry = previous[item["path"]][2]
        if old_entry is None:
            state["files"].pop(item["path"], None)
        else:
            state["files"][item["path"]] = old_entry
    save_state(own, state)
    checkpoint("restore-recorded")


def _record_result(own: StateFolder, state: StateRecord, items: list[ApplyItem], written_by: str) -> None:
    """The pending writes become the record (a restored original drops its entry and, once
    no entry needs it, its backup)."""
    for item in items:
        entry = state["files"][item["path"]]
        pending = entry.pop("pending")
        if item.get("restore_original"):
            state["files"].pop(item["path"], None)
            _drop_backup_if_unused(own, state, item["original_sha256"])
            continue
        entry["patched_sha256"] = pending["sha256"]
        entry["patches"] = pending["patches"]
        entry["edits"] = pending["edits"]
        entry["outcomes"] = pending["outcomes"]
        entry["versions"] = pending["versions"]
        entry["written_by"] = written_by
    if items:
        save_state(own, state)
        checkpoint("result-recorded")


def _installed(declared: Declared, rel: str) -> TargetPath:
    """A declared file that is installed (a plan for it was made on facts)."""
    path = declared.target(rel)
    if path is None:
        raise AgentError("stale-plan", f"{rel} is no longer installed; run the command again")
    return path


def _drop_backup_if_unused(own: StateFolder, state: StateRecord, sha: str) -> None:
    if any(e.get("original_sha256") == sha for e in state["files"].values()):
        return
    own.unlink(backup_name(sha), "backups")


def op_forget(req: ForgetRequest) -> ForgetResult:
    """Drop record entries of files whose bytes are neither the recorded original nor patched."""
    declared = Declared(req.get("declared"))
    with Lock(float(req.get("lock_timeout", 10))) as lock:
        own = lock.folder
        WATCHDOG.arm(req.get("time_limit"), "forgetting records", "--write-timeout")
        state = load_state(own, declared)  # every entry declared, every digest checked
        forgotten = []
        for rel, entry in list(state["files"].items()):
            path = declared.target(rel)  # None: its distribution is no longer installed
            current = path.sha256() if path is not None and not req.get("all") else None
            known = {entry.get("original_sha256"), entry.get("patched_sha256")}
            if entry.get("pending"):
                known.add(entry["pending"]["sha256"])
            if req.get("all") or current not in known:
                state["files"].pop(rel)
                _drop_backup_if_unused(own, state, entry["original_sha256"])
                forgotten.append(rel)
        save_state(own, state)
        return {"forgotten": forgotten}
