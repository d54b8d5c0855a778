"""Run the selected patches' codemods over one file's source: parse once, generate once."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Literal, Sequence

from .model import Edit, Patch

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


_shared: dict | None = None  # see shared_transforms()
_shared_lock = threading.Lock()


@contextmanager
def shared_transforms() -> Iterator[None]:
    """Within this block, identical transforms (same source, filename, patches and edits) run
    once and their result is shared: a fleet of hosts with the same files costs one libcst pass.
    Thread-safe. The key holds the patch and edit objects themselves, so it is exact."""
    global _shared
    with _shared_lock:
        outer, _shared = _shared, ({} if _shared is None else _shared)
    try:
        yield
    finally:
        with _shared_lock:
            _shared = outer


def transform_source(
    source: str,
    steps: Sequence[tuple[Patch, Iterable[Edit]]],
    filename: str = "<source>",
) -> FileTransform:
    """Apply each (patch, its selected edits) in order (once per block of shared_transforms()).

    A patch whose edit cannot find its anchor contributes nothing (never a partial edit):
    the tree is rolled back to what it was before that patch, and later patches still run.
    """
    if _shared is None:
        return _transform(source, steps, filename)
    steps = [(patch, tuple(edits)) for patch, edits in steps]
    key = (source, filename, tuple((id(patch), tuple(map(id, edits))) for patch, edits in steps))
    with _shared_lock:  # one transform at a time: under the GIL they would not run faster anyway
        cache = _shared if _shared is not None else {}
        hit = cache.get(key)
        if hit is None:
            hit = (steps, _transform(source, steps, filename))  # the key's objects stay alive with it
            cache[key] = hit
        return hit[1]


def _transform(
    source: str,
    steps: Sequence[tuple[Patch, Iterable[Edit]]],
    filename: str,
) -> FileTransform:
    import libcst as cst
    from libcst.codemod import CodemodContext, SkipFile

    tree = cst.parse_module(source)
    outcomes: list[PatchOutcome] = []
    for patch, edits in steps:
        before_patch = tree
        edit_states: dict[str, str] = {}
        missing = ""
        for edit in edits:
            codemod = edit.codemod(CodemodContext(filename=filename))
            try:
                tree = codemod.transform_module(tree)
            except SkipFile as skip:
                edit_states[edit.name] = "anchor-missing"
                missing = f"{filename}: {edit.name}: {skip}"
                break
            edit_states[edit.name] = "applied" if codemod.rewrites else "satisfied"
        if missing:
            tree = before_patch
            outcomes.append(PatchOutcome(patch.id, "anchor-missing", missing, edit_states))
        elif any(state == "applied" for state in edit_states.values()):
            outcomes.append(PatchOutcome(patch.id, "applied", "", edit_states))
        else:
            outcomes.append(PatchOutcome(patch.id, "already-satisfied", "", edit_states))
    return FileTransform(source, tree.code, outcomes)
