"""What a codemod run says about each patch: plain data, shared by transforms.py (which runs
and caches the codemods) and combined.py (the traversal that produces it), so neither imports
the other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Outcome = Literal["applied", "already-satisfied", "anchor-missing"]


@dataclass
class PatchOutcome:
    patch_id: str
    outcome: Outcome
    message: str = ""
    edits: dict[str, str] = field(default_factory=dict)  # edit name -> applied|satisfied|anchor-missing


@dataclass
class FileTransform:
    source: str
    result: str
    outcomes: list[PatchOutcome]

    @property
    def changed(self) -> bool:
        return self.result != self.source

    def outcome(self, patch_id: str) -> PatchOutcome:
        return next(o for o in self.outcomes if o.patch_id == patch_id)
