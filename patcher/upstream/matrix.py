"""Each patch against each release of the distribution it patches: what would its codemods do?

A file is transformed once per release, by every patch that targets it, in canonical order,
with all of their edits (vLLM's side is the gates' business, see gates.py): exactly what
`apply` does on the newest vLLM. The condition on the patched distribution then decides:

    applies            selected, and its codemods rewrite the file
    already-satisfied  selected, and the file already has the patched shape (fixed upstream)
    anchor-missing     selected, and a codemod does not find what it anchors on: drift
    not-selected       outside the patch's condition, or the release does not ship the file;
                       what the codemods would say there is still shown, for information
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..model import Patch
from ..plan.selection import condition_holds
from ..transform.transforms import transform_source
from .sources import ReleaseFiles
from .wheels import write_atomic

STATUS_FROM_OUTCOME = {
    "applied": "applies",
    "already-satisfied": "already-satisfied",
    "anchor-missing": "anchor-missing",
}


@dataclass
class Cell:
    patch_id: str
    distribution: str
    version: str
    file: str
    status: str  # applies | already-satisfied | anchor-missing | not-selected | unreadable
    selected: bool
    reason: str  # why (not) selected, or what is missing
    codemod: str = ""  # what the codemods say regardless of selection: applied|already-satisfied|anchor-missing|no file
    edits: dict[str, str] = field(default_factory=dict)
    message: str = ""

    @property
    def drift(self) -> bool:
        return self.selected and self.status == "anchor-missing"

    def to_json(self) -> dict:
        return {
            "patch": self.patch_id,
            "distribution": self.distribution,
            "version": self.version,
            "file": self.file,
            "status": self.status,
            "selected": self.selected,
            "reason": self.reason,
            "codemod": self.codemod,
            "edits": self.edits,
            "message": self.message,
        }


def first_in_range(spec: str, releases: Sequence[str]) -> str | None:
    hits = [r for r in releases if condition_holds(spec, r)]
    return min(hits, key=Version) if hits else None


def window(patch: Patch, releases: Sequence[str], since: str | None) -> list[str]:
    """The patch's own range on its distribution, and every newer release (or from `since` on)."""
    distribution = patch.target.distribution
    if since is None:
        spec = patch.requires.get(distribution)
        start = first_in_range(spec, releases) if spec else None
        if start is None and spec:  # no release in range: from the range's lower bound on
            lows = [s.version for s in SpecifierSet(spec) if s.operator in (">=", ">", "==", "~=")]
            start = min(lows, key=Version) if lows else None
        since = start
    return [r for r in releases if since is None or Version(r) >= Version(since)]


TRANSFORMS_FILE = ".transforms.json"


def codemod_fingerprint(group: Sequence[Patch]) -> str:
    """What a transform's result depends on besides the file: the patches (ids, edits, order),
    and every line of code that can change a result (the patch package, the engine's transform
    code, libcst's version: patcher.transform.transforms' fingerprint). A change to any of them transforms
    again."""
    from ..transform.transforms import code_fingerprint

    digest = hashlib.sha256(code_fingerprint().encode())
    for patch in group:
        digest.update(json.dumps([patch.id, [e.name for e in patch.edits]]).encode())
    return digest.hexdigest()


def edits_on(patch: Patch, distribution: str, version: str) -> list:
    """The patch's edits a target on this release of its own distribution selects: an edit may be
    gated on it (v8's guard edit is for speculators 0.3.0 only)."""
    return [e for e in patch.edits if distribution not in e.when or condition_holds(e.when[distribution], version)]


def transform_cached(
    files: ReleaseFiles, path: str, source: str, group: Sequence[Patch], version: str = ""
) -> dict[str, dict]:
    """Per patch: outcome, edits, message of transforming `path` with `group` (cached beside the file);
    with `version` (of the file's distribution), only the edits that release selects."""
    steps = [(p, edits_on(p, p.target.distribution, version) if version else list(p.edits)) for p in group]
    chosen = json.dumps([[p.id, [e.name for e in edits]] for p, edits in steps])
    key = hashlib.sha256(source.encode()).hexdigest() + ":" + codemod_fingerprint(group) + ":" + chosen
    cache_file = files.root / TRANSFORMS_FILE
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached.get(path, {}):
        return cached[path][key]
    result = transform_source(source, steps, filename=path)
    outcomes = {o.patch_id: {"outcome": o.outcome, "edits": o.edits, "message": o.message} for o in result.outcomes}
    cached[path] = {key: outcomes}  # only the latest per file
    write_atomic(cache_file, json.dumps(cached, indent=1).encode())
    return outcomes


def release_cells(
    patches: Sequence[Patch],
    distribution: str,
    version: str,
    files: ReleaseFiles,
    in_window: Callable[[Patch], bool],
) -> list[Cell]:
    """Every cell of one release: one transform per target file."""
    cells: list[Cell] = []
    by_file: dict[str, list[Patch]] = {}
    for patch in patches:
        if patch.target.distribution == distribution and in_window(patch):
            by_file.setdefault(patch.target.path, []).append(patch)
    for path, group in by_file.items():
        source = files.read(path)
        outcomes = {} if source is None else transform_cached(files, path, source, group, version)
        for patch in group:
            spec = patch.requires.get(distribution)
            in_range = spec is None or condition_holds(spec, version)
            outcome = outcomes.get(patch.id)
            codemod = outcome["outcome"] if outcome else "no file"
            edits = dict(outcome["edits"]) if outcome else {}
            message = outcome["message"] if outcome else ""
            if source is None:
                status, selected = "not-selected", False
                reason = f"{distribution} {version} does not ship {path}"
            elif not in_range:
                status, selected = "not-selected", False
                reason = f"{distribution} {version} does not satisfy {spec}"
                if patch.fixed_in:
                    reason += f" (fixed upstream in {patch.fixed_in})"
            else:
                selected = True
                status = STATUS_FROM_OUTCOME[codemod]
                reason = f"{distribution} {version} satisfies {spec}" if spec else "no condition on " + distribution
            cells.append(Cell(patch.id, distribution, version, path, status, selected, reason, codemod, edits, message))
    return cells
