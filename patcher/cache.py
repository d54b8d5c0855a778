"""The controller's cache folder ($PATCHER_CACHE, default ~/.cache/patcher), trusted only when it
is the running user's own.

What it holds can become code: transform results are written into site-packages, the declaration
index names the codemods to call, the demo environment's python is run. patcher is often run as
root (`sudo -E`, `env_keep HOME`, a CI job sharing PATCHER_CACHE), so a cache another user can
write would let them put their code into a target. The rule is ssh's for ~/.ssh: the folder and
every folder and file under it that patcher reads must belong to the running user and be
writable by no one else. Checked by owner and mode rather than by a keyed digest (the key would
have to live somewhere the same user keeps, with no gain) or by recomputing (which is the cache's
whole saving). A cache that fails is not used: patcher warns once and runs without it (slower,
never different); the demo, which cannot run without its environment, refuses with the fix.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

_warned: set[str] = set()


def cache_root() -> Path:
    return Path(os.environ.get("PATCHER_CACHE", "~/.cache/patcher")).expanduser()


def untrusted_reason(path: Path, root: Path | None = None) -> str | None:
    """Why `path` (a folder or file in the cache, existing or not) must not be trusted: the
    first of root..path that exists and belongs to another user or is writable by group or others."""
    root = root or cache_root()
    try:
        rel = path.relative_to(root)
    except ValueError:
        return f"{path} is not inside the cache {root}"
    me = os.geteuid()
    current = root
    for part in ("", *rel.parts):
        current = current / part if part else current
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            return None  # patcher makes the rest itself, as its own
        except OSError as exc:
            return f"{current}: {exc.strerror}"
        if stat.S_ISLNK(info.st_mode) and current != root:
            return f"{current} is a symbolic link"
        if stat.S_ISLNK(info.st_mode):  # the root itself may be a link (to a bigger disk): judge where it points
            info = os.stat(current)
        if info.st_uid != me:
            return f"{current} belongs to uid {info.st_uid}, not to this user (uid {me})"
        if info.st_mode & 0o022:
            return f"{current} is writable by {'group and others' if info.st_mode & 0o002 else 'its group'}"
    return None


def trusted(path: Path) -> bool:
    """Whether patcher may read and write `path` in the cache; warns once per cache when not."""
    root = cache_root()
    reason = untrusted_reason(path, root)
    if reason is None:
        return True
    if str(root) not in _warned:
        _warned.add(str(root))
        sys.stderr.write(
            f"warning: not using the cache {root}: {reason}; `chmod go-w` it, or set PATCHER_CACHE to a "
            "folder of your own (without it patcher is only slower)\n"
        )
    return False


def trusted_subfolder(name: str) -> Path | None:
    """$PATCHER_CACHE/name when it may be used, else None (and one warning)."""
    folder = cache_root() / name
    return folder if trusted(folder) else None


def write_cache_file(path: Path, data: bytes) -> None:
    """Keep `data` at `path` in the cache as this user's own (folders 0755 and files 0644 whatever
    the umask, so the next run trusts them); a cache that cannot be written is only slower."""
    from .output_files import OutputFileError, write_output_file

    if not trusted(path.parent):
        return
    try:
        make_cache_folder(path.parent)
        write_output_file(path, data, 0o644)
    except (OSError, OutputFileError):
        pass


def make_cache_folder(folder: Path) -> None:
    """Create `folder` in the cache and the cache folders above it that are missing, 0755 whatever
    the umask (so the next run trusts them); OSError when it cannot."""
    root = cache_root()
    missing = [p for p in (folder, *folder.parents) if p == root or root in p.parents]
    for part in reversed(missing):
        if not part.exists():
            part.mkdir(mode=0o755)
            os.chmod(part, 0o755)
