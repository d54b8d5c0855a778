"""patcher's own folder in the target, <sys.prefix>/share/patcher (state.json, lock,
backups/<sha256>.py), trusted only when it is owned like the files it guards, every entry reached
through a folder descriptor without following a link; and the lock on it, held from a writing
run's facts to the end of its transaction."""

from __future__ import annotations

import errno
import os
import sys
import time

from patcher.core.errors import AgentError

from .writes import CLOEXEC, NOFOLLOW, replace_entry, write_failure

STATE_DIR_PARTS = ("share", "patcher")


def state_dir() -> str:
    return os.path.join(sys.prefix, *STATE_DIR_PARTS)


def environment_owner():
    """(uid, gid) of sys.prefix when root works on an environment another user owns, else None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    info = os.stat(sys.prefix)
    return None if info.st_uid == 0 else (info.st_uid, info.st_gid)


def user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


class NotYours(AgentError):
    """A user other than root would write what another user owns: a file it replaces becomes its
    writer's (only root can give a file away), and a state folder it creates is trusted by no
    other user's run, so the owner could neither roll back nor run patcher there. Refused before
    anything is written; said as not writable (exit 1), with the user to run patcher as."""

    def __init__(self, what: str, owner: int) -> None:
        you = user_name(os.geteuid())
        super().__init__(
            "not-writable",
            f"{what} {user_name(owner)}'s, and written by {you} it would become {you}'s (only root can give a "
            f"file back), which {user_name(owner)} could then neither roll back nor run patcher on; nothing was "
            f"written: run patcher as {user_name(owner)}, or as root, which keeps every file's owner",
        )


def check_creator(path: str) -> None:
    """Before a user other than root creates `path` (share/ or share/patcher) in an environment
    another user owns: refuse (NotYours) where it could create it. Where it cannot, the create
    fails as not writable, as before."""
    if not hasattr(os, "geteuid") or os.geteuid() == 0:
        return
    owner = os.stat(sys.prefix).st_uid
    if owner != os.geteuid() and os.access(os.path.dirname(path), os.W_OK):
        raise NotYours(f"{path} would be created in {sys.prefix}, which is", owner)


def make_folder(name: str, dir_fd=None) -> None:
    """mkdir mode 0755 whatever the umask (022 for the call: the agent's one thread that
    creates): under umask 000 root once made share/ 0777, and a third user could then replace
    share/patcher or plant files there. FileExistsError when it exists."""
    umask = os.umask(0o022)
    try:
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    finally:
        os.umask(umask)


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
            for folder in (share, self.path):  # share/ may be a link (then it exists)
                if os.path.lexists(folder):
                    continue
                check_creator(folder)
                try:
                    make_folder(folder)
                    self._own(folder)
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
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC, dir_fd=dir_fd)
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
                    make_folder(where, self.fd)
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
            fd = os.open(name, flags | NOFOLLOW | CLOEXEC, mode, dir_fd=folder)
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
        replace_entry(
            folder,
            name,
            data,
            create=lambda tmp: self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, where, mode=0o600),
            finish=lambda fd: os.fchmod(fd, 0o644),
            failure=lambda exc: write_failure(exc, self.shown(name, where)),
        )

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
        except NotYours:
            self.release()
            if or_shared:
                return self.acquire("shared", timeout)  # as for a user who cannot write: said at the first write
            raise
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
