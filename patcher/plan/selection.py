"""Which patches, and which of their edits, hold for the versions a target has installed: planning's
selection (patcher/plan/planning.py) with patcher's one PEP 440 (patcher/core/versions.py, the very
code a bundle selects with)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..core.versions import condition_holds  # patcher's one PEP 440, used by every caller from here
from ..model import Edit, Patch
from . import planning


def failed_conditions(conditions: Mapping[str, str], versions: Mapping[str, str | None]) -> list[str]:
    return planning.failed_conditions(dict(conditions), dict(versions), condition_holds)


@dataclass(frozen=True)
class PatchSelection:
    """Planning's Selection of one patch (patcher/plan/planning.py, the one definition a bundle
    runs too), with the Patch and the Edit objects its selected edit names stand for."""

    patch: Patch
    selection: planning.Selection

    @property
    def selected(self) -> bool:
        return bool(self.selection.selected)

    @property
    def reason(self) -> str:
        return str(self.selection.reason)

    @property
    def edits(self) -> list[Edit]:
        chosen = set(self.selection.edits) if self.selection.selected else set()
        return [e for e in self.patch.edits if e.name in chosen]

    @property
    def edit_names(self) -> list[str]:
        return [e.name for e in self.edits]


def select_patches(patches: Sequence[Patch], versions: Mapping[str, str | None]) -> dict[str, PatchSelection]:
    """What a run on a fresh target would apply: planning's selection by version conditions,
    with a patch whose `needs` are not selected left out too (check-upstream, bundle ranges)."""
    specs = [p.spec() for p in patches]
    chosen = planning.select(specs, dict(versions), condition_holds)
    kept = set(planning.selected_with_needs(specs, chosen))
    out: dict[str, PatchSelection] = {}
    for patch in patches:
        sel = chosen[patch.id]
        if sel.selected and patch.id not in kept:
            missing = [n for n in patch.needs if n not in kept]
            sel = planning.Selection(False, f"needs {', '.join(missing)}, which is not selected")
        out[patch.id] = PatchSelection(patch, sel)
    return out


def describe(patch: Patch, versions: Mapping[str, str | None]) -> str:
    """e.g. "speculators 0.3.0 (>=0.3.0,<0.4.0), vllm 0.16.0 (>=0.11.1, >=0.12.0)"."""
    return planning.describe(patch.spec(), dict(versions))
