"""Files patcher writes outside any target: a bundle, a retry file, a check-upstream report.

They are often written by root into shared folders (/tmp, a CI workspace), so they are written
the way no other user can redirect or keep: a temporary of a random name created with O_EXCL
(never through a link or a file someone made beforehand), 0600 until it is whole, then given its
mode and renamed over the destination. A destination that is not a regular file (a device, a
folder, a fifo) is refused before anything is written, and nothing is left behind on any error.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a fifo",
    stat.S_IFSOCK: "a socket",
}


_HINTS = {
    # a sticky folder (/tmp) keeps another user's file: the rename over it is refused
    errno.EPERM: "a file of another user is in the way in a shared folder: remove it or name another path",
    errno.EACCES: "name a path in a folder you can write",
    errno.ENOSPC: "free space on that file system or name another path",
}


class OutputFileError(Exception):
    """One line: the path, what went wrong, what to do."""


def check_destination(path: str | Path) -> None:
    """Refuse, before any work, a destination write_output_file would refuse: something that is
    not a regular file (or a link, which is replaced, never followed), or a missing folder."""
    path = Path(path)
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise OutputFileError(
                f"cannot write {path}: the folder {path.parent} does not exist; create it first"
            ) from None
        return
    except OSError as exc:
        raise OutputFileError(f"cannot write {path}: {exc.strerror}; name a file in a folder you can write") from None
    if not (stat.S_ISREG(found.st_mode) or stat.S_ISLNK(found.st_mode)):
        kind = _KINDS.get(stat.S_IFMT(found.st_mode), "not a regular file")
        raise OutputFileError(f"{path} is {kind}, not a file patcher may replace: name a file path")


def write_output_file(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    path = Path(path)
    check_destination(path)
    folder = path.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        hint = _HINTS.get(exc.errno or 0, "name a path in a folder you can write")
        raise OutputFileError(f"cannot write {path}: {exc.strerror} in {folder}; {hint}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # a link at `path` is replaced, never written through
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise OutputFileError(
                f"cannot write {path}: {exc.strerror}; {_HINTS.get(exc.errno or 0, 'name another path')}"
            ) from None
        raise
