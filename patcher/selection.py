"""Which patches, and which of their edits, hold for the versions a target has installed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .model import Edit, Patch


def condition_holds(spec: str, version: str | None) -> bool:
    """PEP 440 containment with pre-releases allowed explicitly.

    A vLLM nightly such as 0.16.0rc2.dev45+g1a2b3c4 is what it is: a pre-release of 0.16.0,
    so it satisfies ">=0.12.0" and not ">=0.16.0". Local labels (+cpu) do not matter.
    """
    if version is None:
        return False
    try:
        return SpecifierSet(spec, prereleases=True).contains(Version(version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return False


def failed_conditions(conditions: Mapping[str, str], versions: Mapping[str, str | None]) -> list[str]:
    out = []
    for name, spec in conditions.items():
        have = versions.get(name)
        if have is None:
            out.append(f"{name} is not installed (needs {spec})")
        elif not condition_holds(spec, have):
            out.append(f"{name} {have} does not satisfy {spec}")
    return out


@dataclass
class Selection:
    patch: Patch
    selected: bool
    reason: str
    edits: list[Edit] = field(default_factory=list)

    @property
    def edit_names(self) -> list[str]:
        return [e.name for e in self.edits]


def select_patches(
    patches: Sequence[Patch], versions: Mapping[str, str | None]
) -> dict[str, Selection]:
    """Select by version conditions alone; a patch whose `needs` are not selected is not either."""
    out: dict[str, Selection] = {}
    for patch in patches:
        failed = failed_conditions(patch.requires, versions)
        if failed:
            out[patch.id] = Selection(patch, False, "; ".join(failed))
            continue
        edits = [e for e in patch.edits if not failed_conditions(e.when, versions)]
        if not edits:
            reasons = {r for e in patch.edits for r in failed_conditions(e.when, versions)}
            out[patch.id] = Selection(patch, False, "no edit applies: " + "; ".join(sorted(reasons)))
            continue
        missing = [n for n in patch.needs if not (n in out and out[n].selected)]
        if missing:
            out[patch.id] = Selection(patch, False, f"needs {', '.join(missing)}, which is not selected")
            continue
        out[patch.id] = Selection(patch, True, "selected: " + describe(patch, versions), edits)
    return out


def describe(patch: Patch, versions: Mapping[str, str | None]) -> str:
    """e.g. "speculators 0.3.0 (>=0.3.0,<0.4.0), vllm 0.16.0 (>=0.11.1, >=0.12.0)"."""
    parts = []
    for name, specs in patch.conditions().items():
        unique = list(dict.fromkeys(specs))
        parts.append(f"{name} {versions.get(name)} ({', '.join(unique)})")
    return ", ".join(parts)
