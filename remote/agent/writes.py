"""Low-level pieces every write shares: flags for opening without following a link, digests,
and a failed write said as one line that names the file, the cause and what to do."""

from __future__ import annotations

import errno
import hashlib
import os

from patcher.core.errors import AgentError

from .faults import checkpoint

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# The largest target file the agent reads: patcher's target files are a few dozen KiB, and what
# it reads it sends whole and the controller parses (a 2 MB file once took a minute and 4 GB
# there). The controller sends its limit with each request (`file_limit`, from
# PATCHER_TARGET_FILE_LIMIT_MIB where patcher runs); a bundle's agent reads that variable itself.
FILE_LIMIT_VARIABLE = "PATCHER_TARGET_FILE_LIMIT_MIB"
DEFAULT_FILE_LIMIT_MIB = 0.25
FILE_LIMIT = {"bytes": 0}  # 0: not set by a request


def file_limit() -> int:
    """The limit in bytes: the request's, else the variable's, else the default."""
    if FILE_LIMIT["bytes"] > 0:
        return FILE_LIMIT["bytes"]
    try:
        mib = float(os.environ.get(FILE_LIMIT_VARIABLE, DEFAULT_FILE_LIMIT_MIB))
    except ValueError:
        mib = DEFAULT_FILE_LIMIT_MIB
    if not 0 < mib < 2**20:  # nan, inf, nonsense: the default
        mib = DEFAULT_FILE_LIMIT_MIB
    return int(mib * 2**20)


def set_file_limit(value) -> None:
    """A request's `file_limit` (bytes), when it carries one that is a positive whole number."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        FILE_LIMIT["bytes"] = value


# What a write that failed leaves, said with every failure: the transaction's guarantee.
LEFT_AS_IS = (
    "every file is its old or its new bytes (`patcher status` says which; the next apply completes a run cut short)"
)


def file_flags(path: str, dir_fd: int | None = None) -> str:
    """ "immutable" or "append-only" when the file carries that attribute (chattr +i / +a), else ""."""
    try:
        import fcntl
        import struct

        fd = os.open(path, os.O_RDONLY | NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
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
            f"clear it with `chattr -{attribute[0]} {path}` and run the command again; {LEFT_AS_IS}",
        )
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return AgentError(
            "os-error",
            f"cannot write {path}: {exc.strerror}; free space on the filesystem that holds "
            f"{os.path.dirname(path)} (`df {os.path.dirname(path)}`) and run the command again; {LEFT_AS_IS}",
        )
    if exc.errno == errno.EROFS:
        return AgentError(
            "not-writable",
            f"cannot write {path}: its filesystem is mounted read-only; remount it read-write and run the "
            f"command again; {LEFT_AS_IS}",
        )
    if isinstance(exc, PermissionError):
        return AgentError(
            "not-writable",
            f"cannot write {path}: permission denied; run as a user who can write there (the environment's "
            f"owner, or --sudo on a remote host); {LEFT_AS_IS}",
        )
    return AgentError("os-error", f"cannot write {path}: {exc.strerror}; {LEFT_AS_IS}")


def replace_entry(folder: int, name: str, data: bytes, create, finish, failure) -> None:
    """Put `data` at `name` in the folder open as `folder`, atomically: a temporary of a random
    name that `create(tmp)` opens O_EXCL there (never through a link), written and fsynced,
    `finish(fd)` (its mode and owner), renamed over `name`, the folder fsynced. On any error the
    temporary goes; an OSError is raised as `failure(exc)`."""
    while True:
        tmp = ".patcher-" + os.urandom(8).hex() + ".tmp"
        try:
            fd = create(tmp)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            finish(fh.fileno())
        checkpoint("temp-written:" + name)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException as exc:
        try:
            os.unlink(tmp, dir_fd=folder)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise failure(exc) from None
        raise
    try:
        os.fsync(folder)
    except OSError:
        pass
