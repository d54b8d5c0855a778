"""Row keys: what a recorded row of the release matrix ran, as one digest (row_key), so that a row
made with other patches, other selected edits or another recipe than today's is told apart.

Per selected patch, its module's syntax tree less layout, descriptions and gates (patch_code), the
definitions it imports from the helpers several patches share (WRITTEN_HELPERS, by module name,
less the engine's contract ENGINE_NAMES), its target, needs and attribute calls; then the
speculators release and the release's recipe. Hashed from syntax trees, whose ast.dump differs
between Python releases, so a key is made where the rows are (bench/releases.py, scripts/generate.py),
not by an installed patcher on another Python. Reading the rows and telling whether one is
current: release_rows.py.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

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
