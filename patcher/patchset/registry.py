"""Find every patch of the sets a run uses (patcher.patchset.sets): patcher's own first, then each
other set's, each in canonical order (by vN); a set's patch ids are qualified by its name."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from ..model import ConnectorDrift, Patch, ReleaseLine
from . import sets
from .sets import FIRST_PARTY, active_sets


class UnknownPatch(ValueError):
    pass


def load_patches(package: str | None = None, *, indexed: bool = True) -> tuple[Patch, ...]:
    """Every patch of `package`, or (by default) of every set the run uses. With `indexed`, from the
    declaration index when it is current (codemods imported on first use, see
    patcher.patchset.declarations), else by importing the modules."""
    if package is not None:
        return set_patches(package, indexed=indexed)
    return tuple(p for patch_set in active_sets() for p in set_patches(patch_set.package, indexed=indexed))


def patches_of_sets(names: Sequence[str]) -> tuple[tuple[Patch, ...], tuple[ReleaseLine, ...]]:
    """The patches and release lines of the sets in use named `names` (all of them for none);
    UnknownPatch names the sets there are."""
    in_use = active_sets()
    unknown = [n for n in names if n not in {s.name for s in in_use}]
    if unknown:
        known = ", ".join(s.name for s in in_use)
        raise UnknownPatch(f"no patch set named {', '.join(unknown)} is in use; in use: {known}")
    chosen = [s for s in in_use if not names or s.name in names]
    patches = tuple(p for s in chosen for p in set_patches(s.package))
    return patches, tuple(line for s in chosen for line in release_lines(s.package))


def use_folders(folders: list[str]) -> None:
    """Use the patch sets in these folders from now on, beside the installed ones (--patches);
    PatchSetError says why one cannot be used."""
    sets.use_folders(folders)
    forget_loaded()


def forget_loaded() -> None:
    """Load every set's patches again on next use (the sets in use, or their files, changed)."""
    set_patches.cache_clear()
    release_lines.cache_clear()


@cache
def set_patches(package: str, *, indexed: bool = True) -> tuple[Patch, ...]:
    patches = _declared_patches(package, indexed)
    qualifier = _qualifier(package)
    return tuple(qualified(p, qualifier) for p in patches) if qualifier else patches


def _qualifier(package: str) -> str:
    for patch_set in active_sets():
        if patch_set.package == package:
            return patch_set.qualifier
    return "" if package == FIRST_PARTY else package.rpartition(".")[2].replace("_", "-")


def qualified(patch: Patch, qualifier: str) -> Patch:
    """A set's patch with its id, and the ids it needs, prefixed by the set's name."""
    if patch.patch_set:
        raise ValueError(f"{patch.id}: a patch module declares its id without a set (vN-slug)")
    return dataclasses.replace(
        patch, id=f"{qualifier}:{patch.id}", needs=tuple(f"{qualifier}:{n}" for n in patch.needs)
    )


def _declared_patches(package: str, indexed: bool) -> tuple[Patch, ...]:
    if not indexed:
        return import_patches(package)
    from .declarations import index_path, read_index, write_index

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return import_patches(package)
    path = index_path(Path(next(iter(spec.submodule_search_locations))))
    patches = read_index(path)
    if patches is None:
        patches = import_patches(package)
        write_index(path, patches)
    return patches


@cache
def release_lines(package: str | None = None) -> tuple[ReleaseLine, ...]:
    """The release lines the package's `release_lines` module declares (RELEASE_LINES), or (by
    default) every set's: the releases a target must be on for patcher to answer for it (see
    patcher.plan.planning.coverage)."""
    if package is None:
        return tuple(line for patch_set in active_sets() for line in release_lines(patch_set.package))
    try:
        declared = importlib.import_module(f"{package}.release_lines")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.release_lines":
            raise
        return ()
    return tuple(getattr(declared, "RELEASE_LINES", ()))


def declared_drift(package: str = FIRST_PARTY) -> tuple[ConnectorDrift, ...]:
    """The package's `connector_drift` module's CONNECTOR_DRIFT: what an hs-connectors release is
    known to meet on a vLLM release (none where the patch set declares none)."""
    try:
        declared = importlib.import_module(f"{package}.connector_drift")
    except ImportError:
        return ()
    return tuple(getattr(declared, "CONNECTOR_DRIFT", ()))


def import_patches(package: str = FIRST_PARTY) -> tuple[Patch, ...]:
    pkg = importlib.import_module(package)
    found: list[Patch] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if not (info.name.startswith("v") and info.name[1:2].isdigit()):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        patch = getattr(module, "PATCH", None)
        if not isinstance(patch, Patch):
            raise TypeError(f"{package}.{info.name} declares no PATCH")
        if patch.module_name != info.name:
            raise ValueError(f"{package}.{info.name} declares {patch.id}: name the module {patch.module_name}.py")
        found.append(patch)
    found.sort(key=lambda p: p.number)
    numbers = [p.number for p in found]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"two patches share a number: {[p.id for p in found]}")
    return tuple(found)


def resolve_ids(patches: tuple[Patch, ...], wanted: list[str]) -> list[str]:
    """Map `vN`, full ids and their `SET:` forms to full ids; unknown ones raise UnknownPatch, and
    so does a bare form two sets share (`v1` where another set has a v1 too)."""
    first_party = next((s.name for s in active_sets() if s.package == FIRST_PARTY), "speculators")
    names: dict[str, set[str]] = {}
    for p in patches:
        forms = {p.id, p.short_id, p.local_id, f"v{p.number}"}
        if not p.patch_set:
            forms |= {f"{first_party}:{p.local_id}", f"{first_party}:v{p.number}"}
        for form in forms:
            names.setdefault(form, set()).add(p.id)
    out = []
    for item in wanted:
        found = names.get(item, set())
        if len(found) > 1:
            choices = ", ".join(sorted(p.short_id for p in patches if p.id in found))
            raise UnknownPatch(f"patch id {item!r} names a patch of several sets ({choices}): qualify it as SET:vN")
        if not found:
            known = ", ".join(p.id for p in patches)
            raise UnknownPatch(f"unknown patch id {item!r}; known: {known} (or their vN short forms)")
        out.append(next(iter(found)))
    return out
