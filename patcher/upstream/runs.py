"""The release matrix's last result per vLLM release, shown beside check-upstream's verdict.

check-upstream sees only what the sources say; what a release does when it runs (the KV cache
layout resolved at start-up, the CPU block size, silently wrong rows) is seen only by running
it: the release matrix (bench/releases.py in patcher's repository) builds each release's
environment, applies and runs the run check there, and records one row per release. Two places
are read:

- the user's own runs, one file per run:

    $PATCHER_CACHE/releases/<anything>.json      (default ~/.cache/patcher/releases)
    {"schema_version": 1, "vllm": "0.32.0", "ok": true, "finished": "2026-11-30T22:04:00Z",
     "summary": "one line: what passed or the first failure", "patcher": "commit or version"}

  and bench/releases.py's own rows (`<release>[-speculators-<V>][-without-vN]-<key>.json`:
  "release", "apply", "extract", "rollback_identical", "finished", ...) put there;
- the release matrix's record as patcher ships it (RECORD_INDEX, package data): per release, the
  run record_index made of the repository's rows when this patcher was built (scripts/generate.py
  writes it, and its --check fails while it is not the rows' own). Made there, not here, because
  whether a row is stale is told by hashing the patch modules' syntax trees (row_key), whose
  ast.dump differs between Python releases: an installed patcher on another Python could not tell.

A bench row is ok when apply exited 0 (verified), the extraction was ok with every row whole and
in order and had a call of more prompts than the generator's scheduler runs at once (or, for a
release without a CPU build, whose row is apply and verification only, was not run), and rollback
was byte-identical; finished is the row's own (else the file's time). A row is marked stale when
it no longer speaks for the patches here (row_is_current): today's declarations select other
patches or edits on its versions, or what the ones it selected run, or its release's recipe,
changed since it ran (a gate moved alone does not make it stale), or its extraction had no call
past the scheduler's max_num_seqs (the driver's calls before the fifth). The newest `finished` per
release wins; a file that reads as neither is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunResult:
    vllm: str
    ok: bool
    finished: str  # ISO 8601, UTC
    summary: str = ""
    patcher: str = ""
    file: str = ""
    stale: bool = False  # made with another patch set than the one here

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "finished": self.finished,
            "summary": self.summary,
            "patcher": self.patcher,
            "file": self.file,
            "stale": self.stale,
        }


# A Patch's keywords that describe it and never change what a run does: editing them (a clearer
# without_it, a new leave-one-out declared, an example added) leaves every recorded row current.
DESCRIPTIVE_KEYWORDS = frozenset(
    {
        "title",
        "upstream",
        "without_it",
        "since",
        "fixed_in",
        "on_fixed_in",
        "leave_one_out",
        "examples",
        "satisfied",
        "near_misses",
    }
)
# An Edit's keyword in words only (`fact` stays: check-upstream reads it)
EDIT_DESCRIPTIVE_KEYWORDS = frozenset({"answers"})
# The gates: where a patch (requires=) or one of its edits (when=) is selected. A row's key leaves
# them out, because row_is_current asks today's declarations what they select on the row's own
# versions: a gate widened to another release line, or narrowed past the row's versions, changes
# nothing the row ran, and one that changes what it selects makes the row stale there. A patch
# withdrawn (selected nowhere) likewise: the rows that selected it are stale, no other.
GATE_KEYWORDS = frozenset({"requires", "when", "withdrawn"})
DEFAULT_SPECULATORS = "0.3.0"  # a row without a "speculators" field ran this one


def _names_used(node) -> set[str]:
    import ast

    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _names_defined(node) -> set[str]:
    """The module-level names a top-level statement binds, where it only binds names (an
    assignment, a class, a function); empty for anything else (kept whatever it binds)."""
    import ast

    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    if targets and all(isinstance(t, ast.Name) for t in targets):
        return {t.id for t in targets if isinstance(t, ast.Name)}
    return set()


def _edit_name(call) -> str:
    """The codemod class an Edit(...) call names (its first argument or codemod=)."""
    import ast

    value = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "codemod"), None)
    return value.id if isinstance(value, ast.Name) else ""


def patch_code(path: Path, edits: Sequence[str] | None = None, roots: Sequence[str] | None = None) -> str:
    """A patch module's code as a row ran it, without its layout, its descriptions or its gates:
    the syntax tree, less docstrings, the declaration's descriptive keywords and the `requires=`
    and `when=` of its Patch(...) and Edit(...) calls, so that reformatting a module (ruff format,
    comments), rewording it or moving a gate does not make a row stale, and any change to what it
    does does. With `edits` (the names of the edits selected on a row's versions) the other
    Edit(...) entries go too. Then every module-level assignment, class and function that nothing
    left uses (from the declaration, `X = Patch(...)`, on, or from the names `roots` when given: what
    another patch module imports of it) goes: a constant only a gate or an example read, a codemod of an
    edit not selected. The dump's format can differ between Python versions: a key made by
    another interpreter misses (the row runs again), never matches wrongly."""
    import ast

    from .facts import parse  # under the lock check-upstream's threads share (CPython 3.11's AST race)

    tree = parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Patch":
            node.keywords = [k for k in node.keywords if k.arg not in DESCRIPTIVE_KEYWORDS | GATE_KEYWORDS]
            for k in node.keywords:
                if k.arg == "edits" and edits is not None and isinstance(k.value, (ast.Tuple, ast.List)):
                    k.value.elts = [
                        e
                        for e in k.value.elts
                        if not (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "Edit")
                        or _edit_name(e) in edits
                    ]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Edit":
            node.keywords = [k for k in node.keywords if k.arg not in EDIT_DESCRIPTIVE_KEYWORDS | GATE_KEYWORDS]
    if not isinstance(tree, ast.Module):
        return ast.dump(tree)
    # the model's names it imports (LeaveOneOut, Symptom: descriptions) show where they are used
    body = [n for n in tree.body if not (isinstance(n, ast.ImportFrom) and n.module == "patcher.model")]
    if roots is not None:  # a shared helpers' module: the engine's contract in it is not keyed
        body = [n for n in body if not (_names_defined(n) and _names_defined(n) <= ENGINE_NAMES)]
    # what a run starts from: the declaration (whatever its name), or the names asked for; a module
    # with neither keeps all its code
    rooted = [
        bool(_names_defined(n) & set(roots))
        if roots is not None
        else isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _names_used(n.value.func) == {"Patch"}
        for n in body
    ]
    while any(rooted):  # what nothing left uses goes, until nothing more does
        used = [_names_used(n) for n in body]
        kept = [
            (n, root)
            for i, (n, root) in enumerate(zip(body, rooted))
            if root
            or not (defined := _names_defined(n))
            or any(defined & names for j, names in enumerate(used) if j != i)
        ]
        if len(kept) == len(body):
            break
        body, rooted = [n for n, _ in kept], [root for _, root in kept]
    # and the names imported from the patches' own modules that nothing left uses (a release
    # line's constant only `requires=` named, from .targets)
    used_anywhere = set().union(*(_names_used(n) for n in body))
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.level:
            node.names = [a for a in node.names if (a.asname or a.name) in used_anywhere] or node.names[:0]
    tree.body = [n for n in body if not (isinstance(n, ast.ImportFrom) and n.level and not n.names)]
    return ast.dump(tree)


@functools.lru_cache(maxsize=1024)
def _module_key(
    path: str, mtime_ns: int, size: int, edits: tuple[str, ...] | None, roots: tuple[str, ...] | None
) -> str:
    """patch_code's digest, once per version of a file and selection (a table of rows asks often)."""
    return hashlib.sha256(patch_code(Path(path), edits, roots).encode()).hexdigest()


def _code_key(path: Path, edits: Sequence[str] | None = None, roots: Sequence[str] | None = None) -> str:
    stat = path.stat()
    return _module_key(
        str(path),
        stat.st_mtime_ns,
        stat.st_size,
        tuple(edits) if edits is not None else None,
        tuple(roots) if roots is not None else None,
    )


# Modules outside patches/ whose definitions a patch imports and runs or writes: the helpers
# several patches share (patcher/codemod.py's edit helpers, patcher/device_memory.py's and
# patcher/shared_states.py's written sources). A row is keyed by the definitions it imports from
# them (and what those use), so an edit to a shared helper makes the rows that ran it stale. Not
# keyed: the engine's contract (PatchCodemod's counting and "anchor not found"), the matchers
# (patcher.shapes) and the declarations (patcher.model).
WRITTEN_HELPERS = ("patcher.shared_states", "patcher.device_memory", "patcher.codemod")
ENGINE_NAMES = frozenset({"PatchCodemod", "SkipFile"})


def _sibling_imports(path: Path) -> dict[str, tuple[str, ...]]:
    """The patch modules a patch module imports names from (`from .v9_device_memory import X`),
    and the WRITTEN_HELPERS it imports from, with those names: their code runs in the patch's
    codemods too, or is what they write."""
    import ast

    from .facts import parse

    out: dict[str, tuple[str, ...]] = {}
    tree = parse(path.read_text(encoding="utf-8"))
    for node in tree.body if isinstance(tree, ast.Module) else []:
        if not (isinstance(node, ast.ImportFrom) and node.module):
            continue
        if (node.level == 1 and node.module[:1] == "v") or (node.level == 0 and node.module in WRITTEN_HELPERS):
            names = {a.name for a in node.names} - (ENGINE_NAMES if node.level == 0 else set())
            if names:
                out[node.module] = tuple(sorted({*out.get(node.module, ()), *names}))
    return out


def _imported_module_path(folder: Path, module: str) -> Path:
    """Where a name of _sibling_imports lives: a patch module beside the patch, or a helper."""
    if "." not in module:
        return folder / f"{module}.py"
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin)


def _patches_folder() -> Path | None:
    """The patch modules' folder, wherever patcher.patches is (patches/ in a checkout)."""
    import importlib.util

    spec = importlib.util.find_spec("patcher.patches")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def row_key(release: str, selected: Sequence[str], versions: dict[str, str]) -> str | None:
    """bench/releases.py's key for a row of `release` that selected these patches (short ids) on
    these versions (row_versions): what the row ran, and nothing of where it is selected. Per
    selected patch: its module's code less descriptions and gates, with only the edits selected on
    `versions` (patch_code), the code of the patch modules it imports from, the names of those
    edits, its target, needs and attribute calls; then the speculators release and that release's
    recipe (what its environment is built from). A patch the row did not select is not in it, nor
    is any `requires=` or `when=`: row_is_current checks that today's gates select the same patches
    on the row's versions. None where no recipe answers the release or a selected patch has no
    module."""
    from patcher.demo.recipes import RecipeError, recipe_for
    from patcher.patchset.registry import load_patches
    from patcher.plan.selection import select_patches

    folder = _patches_folder()
    if folder is None:
        return None
    patches = load_patches()
    declared = {p.short_id: p for p in patches}
    chosen = select_patches(patches, versions)
    digest = hashlib.sha256()
    for short in sorted(selected, key=lambda s: int(s.lstrip("v"))):
        patch = declared.get(short)
        if patch is None:
            return None
        edits = [e.name for e in chosen[patch.id].edits]
        path = folder / f"{patch.module_name}.py"
        code = _code_key(path, edits)
        for module, names in sorted(_sibling_imports(path).items()):
            code += f"\0{module}:" + _code_key(_imported_module_path(folder, module), None, names)
        spec = dataclasses.asdict(patch.spec())
        for gate in GATE_KEYWORDS:
            spec.pop(gate, None)
        spec["edits"] = edits
        planning = json.dumps(spec, sort_keys=True, default=list)
        digest.update(path.name.encode() + b"\0" + code.encode() + b"\0" + planning.encode() + b"\0")
    digest.update(b"\0speculators\0" + str(versions.get("speculators", DEFAULT_SPECULATORS)).encode())
    try:
        digest.update(b"\0recipe\0" + recipe_for(release).row_fingerprint().encode())
    except RecipeError:
        return None
    return digest.hexdigest()[:12]


def row_versions(row: dict) -> dict[str, str]:
    """The versions a row's target had: detected by its apply, or (rows carried over from a table)
    its release, torch and transformers, with its speculators (0.3.0, the matrix's first, where
    the row names none)."""
    detected = row.get("versions_detected")
    if detected:
        return {k: str(v) for k, v in detected.items()}
    versions = {"speculators": str(row.get("speculators") or DEFAULT_SPECULATORS), "vllm": str(row["release"])}
    for name in ("torch", "transformers"):
        if row.get(name) and row[name] != "?":
            versions[name] = str(row[name])
    return versions


def expected_selection(row: dict) -> list[str]:
    """The patches (short ids, in order) today's declarations select on a row's versions, less the
    one it left out and those that need it: what a row run now would apply."""
    from patcher.patchset.registry import load_patches
    from patcher.plan.selection import select_patches

    patches = load_patches()
    chosen = select_patches(patches, row_versions(row))
    kept = [p for p in patches if chosen[p.id].selected and p.short_id != row.get("left_out")]
    while True:  # a patch whose needs are left out goes too (v11 without v10)
        ids = {p.id for p in kept}
        fewer = [p for p in kept if all(n in ids for n in p.needs)]
        if len(fewer) == len(kept):
            return [p.short_id for p in kept]
        kept = fewer


def row_patches_current(row: dict, key: str | None = None) -> bool | None:
    """Whether a recorded row ran today's patches: today's declarations select what it selected on
    its versions, and what those patches run there (row_key) and its recipe are the ones it ran
    with (`key`: the row's own, else its patch_set_hash). None where that cannot be told here."""
    selected = list(row.get("selected") or [])
    current = row_key(str(row["release"]), selected, row_versions(row))
    if current is None:
        return None
    return current == (key or row.get("patch_set_hash")) and expected_selection(row) == selected


def row_filled_the_scheduler(row: dict) -> bool:
    """Whether a row's extraction, where one finished, had a generate() call of more prompts than
    the generator's scheduler runs at once (its max_num_seqs, as the driver reports it): speculators
    0.4 failed past 32 prompts a call while every row with the driver's first four calls (11 prompts
    at most) passed. A row whose extraction did not finish (an error, none run) and a leave-one-out
    row (evidence whatever it shows) are not held to it."""
    extract = row.get("extract") or {}
    if row.get("left_out") or "ok" not in extract:
        return True
    most = extract.get("max_num_seqs")
    calls = extract.get("prompts_per_call") or []
    return isinstance(most, int) and any(isinstance(n, int) and n > most for n in calls)


def row_is_current(row: dict, key: str | None = None) -> bool | None:
    """Whether a recorded row speaks for today's patches and today's check: it ran today's patches
    (row_patches_current) and its extraction filled the scheduler (row_filled_the_scheduler). None
    where that cannot be told here."""
    patches = row_patches_current(row, key)
    if patches is None:
        return None
    return patches and row_filled_the_scheduler(row)


def bench_row_passed(data: dict) -> bool:
    """Whether a release's row of bench/releases.py passed: apply exited 0 (written and verified), the
    extraction matched with every row whole and in order, with a call of more prompts than the
    scheduler runs at once (row_filled_the_scheduler), and rollback was byte-identical. A release
    without a CPU build (its recipe says so: 0.33.0) runs no extraction; apply and rollback are its row."""
    from patcher.demo.recipes import RecipeError, recipe_for

    extract = data.get("extract") or {}
    try:
        extracted = recipe_for(str(data.get("release"))).cpu_build
    except RecipeError:
        extracted = True  # no recipe says otherwise: the extraction is required
    matched = bool(extract.get("ok")) and bool(extract.get("rows_whole_in_order")) and row_filled_the_scheduler(data)
    return (
        str(data.get("apply", "")).startswith("exit 0")
        and (matched or not extracted)
        and bool(data.get("rollback_identical"))
    )


def _from_bench_row(data: dict, file: Path) -> RunResult:
    extract = data.get("extract") or {}
    apply = str(data.get("apply", ""))
    ok = bench_row_passed(data)
    problem = extract.get("error") or extract.get("skipped")
    summary = apply + (f"; run: {problem}" if problem else "")
    if extract.get("max_rel_diff") is not None:
        summary += f"; largest relative error {extract['max_rel_diff']:.3f}"
    finished = str(data.get("finished") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(file.stat().st_mtime)))
    match = re.search(r"-([0-9a-f]{12})\.json$", file.name)
    stale = bool(match) and row_is_current(data, match.group(1) if match else None) is False
    return RunResult(str(data["release"]), ok, finished, summary, "", str(file), stale)


def default_folder() -> Path:
    base = os.environ.get("PATCHER_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "patcher") / "releases"


# The release matrix's record as patcher ships it (package data, written by scripts/generate.py)
RECORD_INDEX = Path(__file__).with_name("release_record.json")


def _read_run(data: dict, file: Path) -> RunResult | None:
    """The run one file says, or None for a row check-upstream does not show: a leave-one-out row
    proves a patch's need, not the release's state, and the runs column is speculators 0.3.0's
    (its patch set's)."""
    if data.get("left_out") or data.get("speculators", DEFAULT_SPECULATORS) != DEFAULT_SPECULATORS:
        return None
    if "release" in data and "vllm" not in data:
        return _from_bench_row(data, file)
    return RunResult(
        str(data["vllm"]),
        bool(data["ok"]),
        str(data["finished"]),
        str(data.get("summary", "")),
        str(data.get("patcher", "")),
        str(file),
    )


def _newest(runs: list[RunResult]) -> dict[str, RunResult]:
    out: dict[str, RunResult] = {}
    for result in runs:
        if result.vllm not in out or result.finished > out[result.vllm].finished:
            out[result.vllm] = result
    return out


def read_folder(folder: Path) -> dict[str, RunResult]:
    """The newest run per release among a folder's files (one that reads as no run is skipped)."""
    runs = []
    try:
        files = sorted(folder.glob("*.json"))
    except OSError:
        return {}
    for file in files:
        try:
            result = _read_run(json.loads(file.read_text()), file)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if result is not None:
            runs.append(result)
    return _newest(runs)


def record_index(folder: Path, shown_as: str) -> str:
    """RECORD_INDEX's text for the rows in `folder` (the repository's record, named `shown_as` in
    each run's "file"): per release, its newest run as read_folder reads it, stale told here."""
    runs = read_folder(folder)
    entries = [
        {"vllm": v, **runs[v].to_json(), "file": f"{shown_as}/{Path(runs[v].file).name}"}
        for v in sorted(runs, key=_version_key)
    ]
    return json.dumps({"schema_version": 1, "runs": entries}, indent=1) + "\n"


def _version_key(text: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(text), text)
    except InvalidVersion:
        return (1, text, text)


def shipped_runs() -> dict[str, RunResult]:
    """The runs RECORD_INDEX holds ({} where it cannot be read)."""
    try:
        entries = json.loads(RECORD_INDEX.read_text(encoding="utf-8"))["runs"]
        return _newest(
            [
                RunResult(
                    str(e["vllm"]),
                    bool(e["ok"]),
                    str(e["finished"]),
                    str(e.get("summary", "")),
                    str(e.get("patcher", "")),
                    str(e.get("file", "")),
                    bool(e.get("stale")),
                )
                for e in entries
            ]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def load_runs(folder: Path | None = None) -> dict[str, RunResult]:
    """The newest run per release: of `folder` alone when given, else of the user's own runs
    (default_folder) and the record patcher ships (shipped_runs)."""
    if folder:
        return read_folder(folder)
    return _newest([*shipped_runs().values(), *read_folder(default_folder()).values()])
