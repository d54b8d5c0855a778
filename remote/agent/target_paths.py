"""The declared target files: which files a request may touch, where each one lives, and every
read, write and bytecode removal of one, made through folder descriptors that never follow a link."""

from __future__ import annotations

import errno
import os

from patcher.core.errors import AgentError

from .detect import find_distributions
from .state import HELD
from .writes import (
    CLOEXEC,
    FILE_LIMIT_VARIABLE,
    LEFT_AS_IS,
    NOFOLLOW,
    file_flags,
    file_limit,
    replace_entry,
    sha256_bytes,
    write_failure,
)


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


_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC
_REINSTALL = "put the package's own file back (pip install --force-reinstall the package) and run patcher again"


class NotTextFile(AgentError):
    """A target file patcher will not read: not a regular file (a fifo, a device), over the size
    limit, or not UTF-8. Facts report it in the file's entry (`refused`: planning then touches
    nothing and says why, and status still reports every other file); anywhere else it refuses
    the request (exit 3)."""

    def __init__(self, message: str) -> None:
        super().__init__("hostile-path", message)


def not_utf8(path: str, data: bytes, exc: UnicodeDecodeError) -> NotTextFile:
    return NotTextFile(
        f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): it is not the "
        f"package's Python source; {_REINSTALL}"
    )


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
                f"patcher); put the real folder or file back in its place and run patcher again; {LEFT_AS_IS}",
            )
        return type(exc)(exc.errno, exc.strerror, shown)

    def open_folder(self) -> int:
        """The file's folder, opened from the entry one folder at a time (the caller closes it).
        FileNotFoundError when a folder is missing."""
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC)
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
                fd = os.open(self.name, os.O_RDONLY | NOFOLLOW | CLOEXEC | os.O_NONBLOCK, dir_fd=folder)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self.refusal(self.name, folder, self.path, exc) from None
            with os.fdopen(fd, "rb") as fh:
                return self._read_regular(fh)
        finally:
            os.close(folder)

    def _read_regular(self, fh) -> bytes:
        """The bytes of an open file that is a regular file within the size limit (file_limit()),
        else NotTextFile: a fifo or a device is never read (one opened without a writer would
        read as empty, one with a writer could feed the agent forever)."""
        import stat

        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            kinds = ((stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
            kind = next((word for test, word in kinds if test(info.st_mode)), "socket or other special file")
            raise NotTextFile(
                f"{self.path} is not a regular file (a {kind}): patcher reads plain files only; {_REINSTALL}"
            )
        limit = file_limit()
        data = fh.read(limit + 1)  # a file growing since fstat is caught too
        if max(info.st_size, len(data)) > limit:
            raise NotTextFile(
                f"{self.path} is {max(info.st_size, len(data))} bytes, over the {limit / 2**20:g} MiB a target file "
                f"may have (patcher's are a few dozen KiB): it is not the package's file; {_REINSTALL}, or set "
                f"{FILE_LIMIT_VARIABLE} where patcher runs to a larger number of MiB"
            )
        return data

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

    def owner(self) -> int | None:
        """The file's owner (uid), read through its folder without following a link; None: absent."""
        folder = self.open_folder()
        try:
            return os.stat(self.name, dir_fd=folder, follow_symlinks=False).st_uid
        except FileNotFoundError:
            return None
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

        def create(tmp: str) -> int:
            try:
                return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600, dir_fd=folder)
            except FileExistsError:
                raise
            except OSError as exc:
                raise write_failure(exc, self.path, folder) from None

        def finish(fd: int) -> None:  # the mode and owner the file had (a new one: 0644, ours)
            if ref is None:
                os.fchmod(fd, 0o644)
                return
            os.fchmod(fd, ref.st_mode & 0o7777)
            if hasattr(os, "fchown") and (ref.st_uid != os.getuid() or ref.st_gid != os.getgid()):
                try:
                    os.fchown(fd, ref.st_uid, ref.st_gid)
                except PermissionError:
                    pass

        replace_entry(
            folder, self.name, data, create, finish, failure=lambda exc: write_failure(exc, self.path, folder)
        )

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
