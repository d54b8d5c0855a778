"""Which patch sets a run uses: every installed distribution's entry point in the group
`patcher.patch_sets` (patcher's own speculators set is one of them, declared in its pyproject) and
the folders given with `--patches DIR`. A set is a package of `vN_*.py` patch modules with their
`targets` (and optionally `release_lines`) module, laid out as patches/ is.

A set is code the controller imports, as any installed package is: a folder is refused when
another user could have written it. Patch modules never run in a target; only the files they
produce are sent there.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

GROUP = "patcher.patch_sets"
# patcher's own set: its patch ids stay unqualified (`v1-block-hasher`), as state records written
# before patch sets existed name them; every other set's ids read `SET:vN-slug`
FIRST_PARTY = "patcher.patches"
OWN = "patcher's own patches"
SET_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
# where a folder given with --patches is imported: <FOLDER_PACKAGES>.<set name with _>
FOLDER_PACKAGES = "patcher_patch_sets"


class PatchSetError(ValueError):
    """A patch set that cannot be used: the message says which and what to do (exit 2)."""


@dataclass(frozen=True)
class PatchSet:
    name: str  # `speculators`, an entry point's name, or a folder's name
    package: str  # the importable package holding its patch modules
    origin: str  # where it came from, in words: "entry point ... of DIST VERSION", "folder PATH"

    @property
    def qualifier(self) -> str:
        """What its patch ids are prefixed with ("" for patcher's own set)."""
        return "" if self.package == FIRST_PARTY else self.name

    @property
    def folder(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise PatchSetError(f"patch set {self.name}: {self.package} is not a package ({self.origin})")
        return Path(next(iter(spec.submodule_search_locations)))


_folders: list[PatchSet] = []


def installed_sets() -> list[PatchSet]:
    """The sets installed distributions declare, patcher's own first, then by name."""
    found: dict[str, PatchSet] = {}
    for name, value, where in _declared_entry_points():
        if not SET_NAME.match(name):
            raise PatchSetError(f"{where}: name a patch set in lowercase letters, digits and '-'")
        if name in found and found[name].package != value:
            raise PatchSetError(f"two installed patch sets are named {name}: {found[name].origin}; {where}")
        # patcher's own set reads the same however patcher was installed
        found.setdefault(name, PatchSet(name, value, OWN if value == FIRST_PARTY else where))
    if not any(s.package == FIRST_PARTY for s in found.values()):
        # a checkout run without its metadata (PYTHONPATH): patcher's own set is there all the same
        found.setdefault("speculators", PatchSet("speculators", FIRST_PARTY, OWN))
    return sorted(found.values(), key=lambda s: (s.package != FIRST_PARTY, s.name))


@functools.cache
def _declared_entry_points() -> tuple[tuple[str, str, str], ...]:
    """(name, value, where) of every entry point in GROUP that a distribution on sys.path declares,
    read from its entry_points.txt: importlib.metadata would cost a no-op run its imports (tens
    of milliseconds), the same reason patcher.transform.transforms finds libcst's version by name."""
    found = []
    seen: set[str] = set()
    for entry in sys.path:
        try:
            folders = [e for e in os.scandir(entry or ".") if e.name.endswith((".dist-info", ".egg-info"))]
        except OSError:
            continue
        for folder in sorted(folders, key=lambda e: e.name):
            project = folder.name.rsplit(".", 1)[0]
            if project.split("-")[0].lower() in seen:
                continue  # shadowed by the same distribution earlier on sys.path, as importlib.metadata reads it
            seen.add(project.split("-")[0].lower())
            try:
                text = Path(folder.path, "entry_points.txt").read_text(encoding="utf-8")
            except OSError:
                continue
            found += [(n, v, f"entry point {n} = {v} of {project.replace('-', ' ', 1)}") for n, v in _group(text)]
    return tuple(found)


def _group(text: str) -> list[tuple[str, str]]:
    """The `name = value` lines of GROUP's section of an entry_points.txt."""
    entries, inside = [], False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            inside = line == f"[{GROUP}]"
        elif inside and "=" in line and not line.startswith(("#", ";")):
            name, _, value = line.partition("=")
            entries.append((name.strip(), value.strip()))
    return entries


def active_sets() -> list[PatchSet]:
    """What a run uses: the installed sets, then the folders given with --patches."""
    sets = installed_sets()
    names = {s.name for s in sets}
    for folder_set in _folders:
        if folder_set.name in names:
            raise PatchSetError(
                f"--patches {folder_set.origin.removeprefix('folder ')}: an installed patch set is named "
                f"{folder_set.name} too; rename the folder"
            )
        sets.append(folder_set)
    return sets


def use_folders(folders: list[str]) -> None:
    """Make the sets in these folders part of every later run in this process (--patches;
    patcher.patchset.registry.use_folders also forgets the patches loaded so far)."""
    _folders[:] = [import_folder(Path(given)) for given in folders]


def set_name_of_folder(folder: Path) -> str:
    return folder.name.lower().replace("_", "-")


def import_folder(folder: Path) -> PatchSet:
    """A folder of patch modules as the package patcher_patch_sets.<name>, after the trust check."""
    folder = folder.expanduser().absolute()
    if not folder.is_dir():
        raise PatchSetError(f"--patches {folder}: not a folder; name a folder of vN_*.py patch modules")
    if not any(folder.glob("v[0-9]*.py")):
        raise PatchSetError(f"--patches {folder}: no patch module (vN_slug.py) in it; name the folder that holds them")
    reason = untrusted_folder_reason(folder)
    if reason:
        raise PatchSetError(f"--patches {folder}: {reason}; patch modules run in the controller: `chmod go-w` it")
    name = set_name_of_folder(folder)
    if not SET_NAME.match(name):
        raise PatchSetError(f"--patches {folder}: name the folder in letters, digits, '-' and '_' (its set's name)")
    package = f"{FOLDER_PACKAGES}.{name.replace('-', '_')}"
    if FOLDER_PACKAGES not in sys.modules:
        parent = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(FOLDER_PACKAGES, None, is_package=True))
        parent.__path__ = []
        sys.modules[FOLDER_PACKAGES] = parent
    loaded = sys.modules.get(package)
    if loaded is not None:
        if Path(next(iter(loaded.__path__))) != folder:
            raise PatchSetError(f"--patches {folder}: another folder named {folder.name} is already in use")
        return PatchSet(name, package, f"folder {folder}")
    init = folder / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        package, init if init.is_file() else None, submodule_search_locations=[str(folder)]
    )
    if spec is None:
        raise PatchSetError(f"--patches {folder}: cannot be imported as a package")
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    if spec.loader is not None:
        spec.loader.exec_module(module)
    return PatchSet(name, package, f"folder {folder}")


def untrusted_folder_reason(folder: Path) -> str | None:
    """Why a --patches folder must not be imported: it, a file or folder in it, or a folder above
    it (unless sticky, as /tmp is) belongs to another user (root aside) or others can write it."""
    me = os.geteuid()

    def judge(path: Path, inside: bool) -> str | None:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            if inside:
                return f"{path} is a symbolic link"
            info = os.stat(path)
        if info.st_uid not in (me, 0):
            return f"{path} belongs to uid {info.st_uid}, not to this user (uid {me})"
        sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
        if info.st_mode & 0o002 and not (sticky and not inside):
            return f"{path} is writable by others"
        if inside and info.st_mode & 0o020:
            return f"{path} is writable by its group"
        return None

    for above in reversed(folder.parents):
        reason = judge(above, inside=False)
        if reason:
            return reason
    for path in [folder, *sorted(folder.rglob("*"))]:
        if "__pycache__" in path.parts:
            continue
        reason = judge(path, inside=True)
        if reason:
            return reason
    return None
