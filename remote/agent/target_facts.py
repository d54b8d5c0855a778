"""op_facts: what the target holds (interpreter, distributions, the declared files' bytes and
hashes, the state record), read under the lock when the run will write."""

from __future__ import annotations

import sys

from patcher.core.errors import AgentError

from .detect import find_distributions
from .record import backup_name, load_state, read_state_bytes
from .state import HELD, StateFolder, state_dir
from .target_paths import Declared, NotTextFile, TargetPath, not_utf8
from .writes import sha256_bytes

# The type checker's view only (typing itself is not imported: it costs start-up time).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from patcher.core.protocol import (
        DistributionFacts,
        Facts,
        FactsRequest,
        FileFacts,
        Snapshot,
        StateRecord,
        TargetFile,
    )


def op_facts(req: FactsRequest) -> Facts:
    """What the target holds. With "lock": "exclusive" (a run that will write) the lock is
    taken first and kept until the transaction ends, so nothing changes between these facts
    and the writes planned on them; "shared" (status, plan) waits for a writer to finish, and
    reads anyway, saying so, if it is still busy after `lock_timeout`."""
    declared = Declared(req.get("declared", req.get("files", [])))
    mode = req.get("lock")
    if mode in ("exclusive", "shared"):
        HELD.acquire(mode, float(req.get("lock_timeout", 10)), or_shared=True)
    try:
        return _facts(req, declared)
    except BaseException:
        HELD.release()  # the run ends here: it plans nothing on these facts
        raise
    finally:
        if HELD.mode == "shared":
            HELD.release()  # a reader's whole run is this one request


def _facts(req: FactsRequest, declared: Declared) -> Facts:
    lock = HELD.mode or ("busy" if HELD.busy else None)
    dists = find_distributions(req.get("names", []), req.get("files", []))
    declared.know(dists)
    # What the plan depends on, every target file and the record: apply checks it under the
    # lock (request "expect"), not only the files it writes.
    snapshot: Snapshot = {"state_sha256": None, "files": {}}
    held = HELD.folder if HELD.mode == "exclusive" else None
    own = held
    try:
        if own is None:
            own = StateFolder(create=False)
        raw_state = read_state_bytes(own)
        snapshot["state_sha256"] = sha256_bytes(raw_state) if raw_state is not None else None
        state = load_state(own, declared, raw_state)
        state_error = None
    except AgentError as exc:
        state, state_error = {"files": {}}, exc.message
    try:
        files = _file_facts(req.get("files", []), dists, declared, state, own, snapshot)
    finally:
        if own is not None and own is not held:
            own.close()
    for info in dists.values():
        info.pop("record", None)
    return {
        "python": {
            "executable": sys.executable,
            "version": "{}.{}.{}".format(*sys.version_info[:3]),
            "prefix": sys.prefix,
        },
        "state_dir": state_dir(),
        "distributions": dists,
        "files": files,
        "state": state,
        "state_error": state_error,
        "lock": lock,
        "snapshot": snapshot,
    }


def _file_facts(
    targets: list[TargetFile],
    dists: dict[str, DistributionFacts],
    declared: Declared,
    state: StateRecord,
    own,
    snapshot: Snapshot,
) -> dict[str, FileFacts]:
    """Each declared file's bytes and hashes, with its pristine backup when the record has one;
    `snapshot` gets each file's sha256 (what a plan made on these facts depends on)."""
    files: dict[str, FileFacts] = {}
    for target in targets:
        dist = dists.get(target["distribution"])
        rel = target["path"]
        declared.check(rel)
        if dist is None:
            files[rel] = {"exists": False}
            snapshot["files"][rel] = {"root": None, "sha256": None}
            continue
        root = dist["location"]
        path = TargetPath(root, rel)
        try:
            data = path.read()
            content = None if data is None else data.decode("utf-8")
        except NotTextFile as exc:  # said in its entry: every other file is still reported
            data, content, refused = b"", None, exc.message
        except UnicodeDecodeError as exc:
            assert data is not None
            content, refused = None, not_utf8(path.path, data, exc).message
        if data is None:
            files[rel] = {"exists": False, "root": root}
            snapshot["files"][rel] = {"root": root, "sha256": None}
            continue
        if content is None:
            files[rel] = {"exists": True, "root": root, "refused": refused}
            snapshot["files"][rel] = {"root": root, "sha256": None}
            continue
        snapshot["files"][rel] = {"root": root, "sha256": sha256_bytes(data)}
        entry: FileFacts = {
            "exists": True,
            "root": root,
            "temporaries": path.temporaries(),
            "sha256": sha256_bytes(data),
            "record_sha256": dist["record"].get(rel),
            "content": content,
            "writable": path.writable(),
        }
        recorded = state["files"].get(rel)
        if recorded:
            # the record was checked (load_state): the name is made from a validated digest
            original = own.read(backup_name(recorded["original_sha256"]), "backups")
            try:
                entry["original"] = None if original is None else original.decode("utf-8")
                entry["original_intact"] = (
                    original is not None and sha256_bytes(original) == recorded["original_sha256"]
                )
            except UnicodeDecodeError:
                entry["original"] = None
                entry["original_intact"] = False
        files[rel] = entry
    return files
