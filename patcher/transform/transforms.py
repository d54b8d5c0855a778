"""Run the selected patches' codemods over one file's source: parse once, generate once."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from ..model import Edit, Patch
from .outcomes import FileTransform, Outcome, PatchOutcome  # noqa: F401  (the results' types, here for callers)

_shared: dict | None = None  # see shared_transforms()
_persist: Path | None = None
_shared_lock = threading.Lock()


@contextmanager
def shared_transforms(persist: Path | None = None) -> Iterator[None]:
    """Within this block, identical transforms (same source, filename, patches and edits) run
    once and their result is shared: a fleet of hosts with the same files costs one libcst pass.
    Thread-safe. The key holds the patch and edit objects themselves, so it is exact.

    With `persist` (a folder), results are also kept on disk across runs, keyed by the source's
    sha256, the patches and edits, and a fingerprint of every line of code that can change a
    result (the patches' package, this module, the codemod base, the model, libcst's version):
    a rollout to the next batch of hosts does not run the codemods again."""
    global _shared, _persist
    with _shared_lock:
        outer = (_shared, _persist)
        _shared = {} if _shared is None else _shared
        _persist = persist if persist is not None else _persist
    try:
        yield
    finally:
        with _shared_lock:
            _shared, _persist = outer


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
    # The lock guards the table only: the first caller of a key runs its transform outside it,
    # later callers of that key wait for that one result, and other keys run meanwhile. (Under
    # one lock, a host with a huge file held every other host of the fleet for its whole parse.)
    with _shared_lock:
        cache = _shared if _shared is not None else {}
        found: _Shared | None = cache.get(key)
        first = found is None
        entry = found if found is not None else _Shared(steps, persist=_persist)
        cache[key] = entry  # the key's objects stay alive with it
    if first:
        entry.run(source, steps, filename)
    return entry.wait()


class _Shared:
    """One transform's result, computed once by its first caller and waited for by the others."""

    def __init__(self, steps, persist: Path | None) -> None:
        self.steps, self.persist = steps, persist
        self.done = threading.Event()
        self.result: FileTransform | None = None
        self.error: BaseException | None = None

    def run(self, source: str, steps, filename: str) -> None:
        try:
            result = _load_persisted(source, steps, filename, self.persist) if self.persist is not None else None
            if result is None:
                result = _transform(source, steps, filename)
                if self.persist is not None:
                    _save_persisted(source, steps, filename, result, self.persist)
            self.result = result
        except BaseException as exc:  # noqa: BLE001 - the waiters get it too, as this caller does (wait())
            self.error = exc
        finally:
            self.done.set()

    def wait(self) -> FileTransform:
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def code_fingerprint() -> str:
    """sha256 of every line of code that can change a transform's result: the patch sets in use,
    the transform engine, the source patches write (shared_states.py), and libcst's installed
    version."""
    from ..patchset.sets import active_sets

    return _code_fingerprint(tuple((s.name, s.folder) for s in active_sets()))


@lru_cache(maxsize=4)
def _code_fingerprint(sets: tuple[tuple[str, Path], ...]) -> str:
    import hashlib

    digest = hashlib.sha256()
    top = Path(__file__).parent.parent  # patcher/
    engine = (
        "transform/transforms.py",
        "transform/combined.py",
        "codemod.py",
        "shapes.py",
        "model.py",
        "transform/outcomes.py",
        "shared_states.py",
    )
    for name, folder in sets:
        digest.update(name.encode() + b"\0")
        for path in sorted(folder.rglob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for path in (top / name for name in engine):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(_libcst_release().encode())
    return digest.hexdigest()


def _libcst_release() -> str:
    """libcst's dist-info folder name (name and version), found without importing libcst or
    importlib.metadata: a cached transform is there to save those imports."""
    import importlib.util

    spec = importlib.util.find_spec("libcst")
    if spec is None or not spec.submodule_search_locations:
        return "libcst missing"
    site = Path(next(iter(spec.submodule_search_locations))).parent
    found = sorted(path.name for path in site.glob("libcst-*.dist-info"))
    return found[-1] if found else "libcst without metadata"


def _persist_path(source: str, steps, filename: str, persist: Path) -> Path:
    import hashlib
    import json

    key = json.dumps(
        [
            hashlib.sha256(source.encode("utf-8")).hexdigest(),
            filename,
            [[patch.id, [e.name for e in edits]] for patch, edits in steps],
            code_fingerprint(),
        ]
    )
    return persist / (hashlib.sha256(key.encode("utf-8")).hexdigest() + ".json")


def _load_persisted(source: str, steps, filename: str, persist: Path) -> FileTransform | None:
    import json

    from ..cache import trusted

    path = _persist_path(source, steps, filename, persist)
    if not trusted(path):
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        outcomes = [PatchOutcome(o["patch_id"], o["outcome"], o["message"], o["edits"]) for o in data["outcomes"]]
        return FileTransform(source, data["result"], outcomes)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save_persisted(source: str, steps, filename: str, result: FileTransform, persist: Path) -> None:
    import json

    from ..cache import write_cache_file

    data = {"result": result.result, "outcomes": [vars(o) for o in result.outcomes]}
    write_cache_file(_persist_path(source, steps, filename, persist), json.dumps(data).encode("utf-8"))


def apply_patch(tree, patch: Patch, edits: Iterable[Edit], filename: str):
    """One patch's edits on a parsed module: (new tree, outcome). All or nothing."""
    from ..codemod import SkipFile

    before_patch = tree
    edit_states: dict[str, str] = {}
    for edit in edits:
        codemod = edit.codemod(filename)
        try:
            tree = codemod.transform_module(tree)
        except SkipFile as skip:
            edit_states[edit.name] = "anchor-missing"
            message = f"{filename}: {edit.name}: {skip}"
            return before_patch, PatchOutcome(patch.id, "anchor-missing", message, edit_states)
        edit_states[edit.name] = "applied" if codemod.rewrites else "satisfied"
    if any(state == "applied" for state in edit_states.values()):
        return tree, PatchOutcome(patch.id, "applied", "", edit_states)
    return tree, PatchOutcome(patch.id, "already-satisfied", "", edit_states)


def _transform(
    source: str,
    steps: Sequence[tuple[Patch, Iterable[Edit]]],
    filename: str,
) -> FileTransform:
    import libcst as cst

    from .combined import apply_together

    fixed = [(patch, tuple(edits)) for patch, edits in steps]
    tree = cst.parse_module(source)
    # One traversal for every edit; when some anchor is missing (a patch must then drop out
    # whole, and later patches see the tree without it) the patches run one after another.
    together = apply_together(tree, fixed, filename)
    if together is not None:
        tree, outcomes_together = together
        return FileTransform(source, tree.code, outcomes_together)
    outcomes: list[PatchOutcome] = []
    for patch, edits in fixed:
        tree, outcome = apply_patch(tree, patch, edits, filename)
        outcomes.append(outcome)
    return FileTransform(source, tree.code, outcomes)
