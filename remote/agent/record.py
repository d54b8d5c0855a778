"""The state record (state.json): read, checked entry by entry against the declared files and
their digests (backups are named from them), written atomically."""

from __future__ import annotations

import json

from patcher.core.errors import AgentError

from .state import StateFolder, state_dir

# The type checker's view only (typing itself is not imported: it costs start-up time).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from patcher.core.protocol import StateRecord

    from .target_paths import Declared

SCHEMA_VERSION = 1


def is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and not value.strip("0123456789abcdef")


def backup_name(sha) -> str:
    """backups/<sha256>.py: the name is made from a validated digest, never from a record's text."""
    if not is_sha256(sha):
        raise AgentError(
            "corrupt-state",
            f"refusing {sha!r} as a backup's sha256 (not 64 lowercase hex digits): the state record "
            f"{state_dir()}/state.json was edited; restore it from a copy, or move it aside, "
            "reinstall the package (pip install --force-reinstall) and apply again",
        )
    return sha + ".py"


def read_state_bytes(folder: StateFolder) -> bytes | None:
    return folder.read("state.json") if folder.fd >= 0 else None


def load_state(folder: StateFolder, declared: Declared, raw: bytes | None = None) -> StateRecord:
    path = folder.shown("state.json")
    if raw is None:
        raw = read_state_bytes(folder)
    if raw is None:
        return {"schema_version": SCHEMA_VERSION, "files": {}}
    try:
        state: StateRecord = json.loads(raw.decode("utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("files"), dict):
            raise ValueError("no files table")  # noqa: TRY004 - one path to corrupt-state with the JSON errors
    except ValueError as exc:
        raise AgentError(
            "corrupt-state",
            f"the state record {path} is unreadable ({exc}); restore it from a copy or move it "
            "aside and run `patcher forget` to start over (backups stay in backups/)",
        ) from None
    version = state.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise AgentError(
            "corrupt-state",
            f"the state record {path} has schema version {version!r}, newer than this patcher "
            f"understands ({SCHEMA_VERSION}); upgrade patcher",
        )
    check_record(state, declared, path)
    return state


def check_record(state: StateRecord, declared: Declared, path: str) -> None:
    """Every entry names a declared file and carries sha256 digests where digests belong: the
    record is as writable as the environment, and backups' names are made from its digests."""

    def refuse(what: str) -> None:
        raise AgentError(
            "corrupt-state",
            f"the state record {path} {what}: it was edited by hand or by another program; nothing "
            "was read or written through it. Restore it from a copy, or move it aside, reinstall the "
            "package (pip install --force-reinstall) and apply again",
        )

    for rel, entry in state["files"].items():
        if rel not in declared.distribution:
            refuse(f"has an entry for {rel!r}, which is none of the files patcher's patches rewrite")
        if not isinstance(entry, dict) or not is_sha256(entry.get("original_sha256")):
            refuse(f"gives {rel} an original sha256 that is not 64 lowercase hex digits")
        if entry.get("patched_sha256") is not None and not is_sha256(entry["patched_sha256"]):
            refuse(f"gives {rel} a patched sha256 that is not 64 lowercase hex digits")
        pending = entry.get("pending")
        if pending is not None and not (isinstance(pending, dict) and is_sha256(pending.get("sha256"))):
            refuse(f"gives {rel} a pending write without a valid sha256")


def save_state(folder: StateFolder, state: StateRecord) -> None:
    state["schema_version"] = SCHEMA_VERSION
    data = json.dumps(state, indent=2, sort_keys=True).encode("utf-8") + b"\n"
    folder.write("state.json", data)
