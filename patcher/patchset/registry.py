"""Find every patch declared in `patcher.patches`, in canonical order (by vN)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from functools import cache
from pathlib import Path

from ..model import ConnectorDrift, Patch, ReleaseLine


class UnknownPatch(ValueError):
    pass


@cache
def load_patches(package: str = "patcher.patches", *, indexed: bool = True) -> tuple[Patch, ...]:
    """Every patch of `package`. With `indexed`, from the declaration index when it is current
    (codemods imported on first use, see patcher.patchset.declarations), else by importing the modules."""
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
def release_lines(package: str = "patcher.patches") -> tuple[ReleaseLine, ...]:
    """The release lines the package's `release_lines` module declares (RELEASE_LINES): the releases
    a target must be on for patcher to answer for it (see patcher.plan.planning.coverage)."""
    try:
        declared = importlib.import_module(f"{package}.release_lines")
    except ModuleNotFoundError:
        return ()
    return tuple(getattr(declared, "RELEASE_LINES", ()))


def declared_drift(package: str = "patcher.patches") -> tuple[ConnectorDrift, ...]:
    """The package's `connector_drift` module's CONNECTOR_DRIFT: what an hs-connectors release is
    known to meet on a vLLM release (none where the patch set declares none)."""
    try:
        declared = importlib.import_module(f"{package}.connector_drift")
    except ImportError:
        return ()
    return tuple(getattr(declared, "CONNECTOR_DRIFT", ()))


def import_patches(package: str = "patcher.patches") -> tuple[Patch, ...]:
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
    """Map `vN` or full ids to full ids; unknown ones raise UnknownPatch."""
    by_any = {p.id: p.id for p in patches} | {p.short_id: p.id for p in patches}
    out = []
    for item in wanted:
        if item not in by_any:
            known = ", ".join(p.id for p in patches)
            raise UnknownPatch(f"unknown patch id {item!r}; known: {known} (or their vN short forms)")
        out.append(by_any[item])
    return out
