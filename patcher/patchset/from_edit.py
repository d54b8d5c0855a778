"""`patcher new NAME --from-edit DIST`: a hand edit already made in an environment, as a patch
module. The edited files are those whose bytes differ from the distribution's RECORD (pip's own
sha256 of each installed file); the pristine text is the release's wheel's. Each run of changed
statements, in the class or function it sits in, becomes one `StatementRun` edit: it rewrites
exactly the release's own code, and refuses any other (anchor not found)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from ..codemod import StatementRun, statement_code

# Runs in the target interpreter (standard library only, Python 3.9+): the distribution's .py files
# whose bytes differ from RECORD, with their text.
CHANGED_FILES = r"""
import base64, hashlib, json, sys
from importlib import metadata
try:
    dist = metadata.distribution(sys.argv[1])
except metadata.PackageNotFoundError:
    print(json.dumps({"missing": True}))
    raise SystemExit(0)
changed = []
for file in dist.files or []:
    if file.hash is None or not str(file).endswith(".py"):
        continue
    try:
        data = file.locate().read_bytes()
    except OSError:
        continue
    digest = base64.urlsafe_b64encode(hashlib.new(file.hash.mode, data).digest()).rstrip(b"=").decode()
    if digest != file.hash.value:
        changed.append({"path": str(file), "text": data.decode("utf-8")})
print(json.dumps({"name": dist.metadata["Name"], "version": dist.version, "changed": changed}))
"""


class FromEditError(ValueError):
    """The edit cannot be captured: the message says why and what to do (exit 2)."""


@dataclass
class EditedFile:
    distribution: str  # as installed ("Flask")
    version: str
    path: str  # relative to site-packages
    edited: str


@dataclass
class Hunk:
    scope: tuple[str, ...]
    before: list[cst.BaseStatement]
    after: list[cst.BaseStatement]


def edited_files(python: str, distribution: str) -> list[EditedFile]:
    proc = subprocess.run(
        [python, "-c", CHANGED_FILES, distribution], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise FromEditError(f"{python} could not read {distribution}'s RECORD: {proc.stderr.strip()[-300:]}")
    found = json.loads(proc.stdout)
    if found.get("missing"):
        raise FromEditError(f"{distribution} is not installed in {python}; name the environment with --python PATH")
    return [EditedFile(found["name"], found["version"], f["path"], f["text"]) for f in found["changed"]]


def pristine_text(edited: EditedFile, wheel_of: Callable[[str, str], Path]) -> str:
    """The file as the release's wheel has it; `wheel_of(distribution, version)` gives the wheel."""
    import zipfile

    wheel = wheel_of(edited.distribution, edited.version)
    with zipfile.ZipFile(wheel) as archive:
        try:
            return archive.read(edited.path).decode("utf-8")
        except KeyError:
            raise FromEditError(f"{edited.path} is not in the {edited.distribution} {edited.version} wheel") from None


def _container(statement: cst.CSTNode) -> str:
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and isinstance(statement.body, cst.IndentedBlock):
        return statement.name.value
    return ""


def _header(statement: cst.FunctionDef | cst.ClassDef) -> str:
    return statement_code(statement.with_changes(body=cst.IndentedBlock(body=[cst.SimpleStatementLine([cst.Pass()])])))


def hunks(
    before: Sequence[cst.BaseStatement], after: Sequence[cst.BaseStatement], scope: tuple[str, ...] = ()
) -> list[Hunk]:
    """The runs of statements that differ, each in the innermost class or function both texts
    share; a run only added or only removed takes the statement before it (or after it) along,
    as its anchor."""
    import difflib

    old = [statement_code(s) for s in before]
    new = [statement_code(s) for s in after]
    found: list[Hunk] = []
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        a, b = before[i1:i2], after[j1:j2]
        if len(a) == 1 and len(b) == 1 and _container(a[0]) and _container(a[0]) == _container(b[0]):
            first, second = a[0], b[0]
            assert isinstance(first, (cst.FunctionDef, cst.ClassDef)) and isinstance(
                second, (cst.FunctionDef, cst.ClassDef)
            )
            if _header(first) == _header(second):
                assert isinstance(first.body, cst.IndentedBlock) and isinstance(second.body, cst.IndentedBlock)
                found += hunks(first.body.body, second.body.body, (*scope, _container(first)))
                continue
        if not a or not b:
            if i1 > 0:
                i1, j1 = i1 - 1, j1 - 1
            elif i2 < len(before):
                i2, j2 = i2 + 1, j2 + 1
            else:
                raise FromEditError(
                    "the edit replaces a whole block; capture a smaller edit or write the patch by hand"
                )
        found.append(Hunk(scope, list(before[i1:i2]), list(after[j1:j2])))
    return found


def edit_classes(found: Sequence[Hunk]) -> list[type[StatementRun]]:
    classes = []
    for number, hunk in enumerate(found, 1):
        where = ".".join(hunk.scope) or "the module"
        first = next(line for line in statement_code(hunk.before[0]).splitlines() if line.strip()).strip()
        attributes = {
            "SCOPE": hunk.scope,
            "BEFORE": "".join(statement_code(s) for s in hunk.before),
            "AFTER": "".join(statement_code(s) for s in hunk.after),
            "ANCHOR": f"the release's statements from `{first[:60]}` in {where}",
        }
        classes.append(type(f"HandEdit{number}", (StatementRun,), attributes))
    return classes


def rewrite(source: str, classes: Sequence[type[StatementRun]]) -> str:
    tree = cst.parse_module(source)
    for cls in classes:
        tree = cls().transform_module(tree)
    return tree.code


def pruned(body: Sequence[cst.BaseStatement], found: Sequence[Hunk], scope: tuple[str, ...] = ()) -> list:
    """The statements of the hunks at this level and the classes and functions that hold hunks
    below it (their bodies pruned the same way): the example's before."""
    kept = []
    for statement in body:
        name = _container(statement)
        if any(h.scope == scope and any(statement is s for s in h.before) for h in found):
            kept.append(statement)
        elif name and any(h.scope[: len(scope) + 1] == (*scope, name) for h in found):
            assert isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and isinstance(
                statement.body, cst.IndentedBlock
            )
            inner = pruned(statement.body.body, found, (*scope, name))
            if inner:
                kept.append(statement.with_changes(body=statement.body.with_changes(body=inner)))
    return kept


def literal(text: str) -> str:
    """Source text as a Python string literal, triple-quoted where that reads back the same."""
    if '"""' not in text and "\\" not in text and not text.endswith('"'):
        return '"""\\\n' + text + '"""'
    return repr(text)


MODULE = '''"""{patch_id}: a hand edit of {path} in {distribution} {version}, captured by `patcher new --from-edit`.

Say here what it does and why (the drift it answers, a link). Its gate is the release it was made
on: widen `requires` to the releases it is written for once `patcher test-patches` and
check-upstream agree.
"""

from patcher.codemod import StatementRun
from patcher.model import Edit, Example, Patch

from .targets import {constant}
{classes}

BEFORE = {before}

AFTER = {after}

PATCH = Patch(
    id="{patch_id}",
    title="the hand edit of {path} ({count} run(s) of statements)",
    target={constant},
    requires={{"{condition_name}": "=={version}"}},
    edits=({edits}),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    # the same statements somewhere else are left alone
    near_misses=({near_miss},),
    upstream="the upstream change it answers (a link)",
    without_it="without it: the symptom the hand edit fixed",
)
'''

CLASS = """

class {name}(StatementRun):
    ANCHOR = {anchor}
    SCOPE = {scope}
    BEFORE = {before}
    AFTER = {after}
"""


def patch_module(patch_id: str, constant: str, condition_name: str, edited: EditedFile, pristine: str) -> str:
    """The patch module's source, checked: its edits turn the pristine file into the edited one."""
    tree = cst.parse_module(pristine)
    found = hunks(tree.body, cst.parse_module(edited.edited).body)
    if not found:
        raise FromEditError(f"{edited.path} differs from its RECORD, but not in its statements (whitespace only?)")
    classes = edit_classes(found)
    if rewrite(pristine, classes) != edited.edited:
        raise FromEditError(
            f"{edited.path}: the edit is not a rewrite of whole statements patcher can anchor; "
            "write the patch by hand (`patcher new NAME --target ...`)"
        )
    example = cst.Module(body=pruned(tree.body, found)).code
    near_miss = "class Elsewhere:\n" + "".join(
        f"    {line}" if line.strip() else line for line in example.splitlines(True)
    )
    text = "".join(
        CLASS.format(
            name=cls.__name__,
            anchor=repr(cls.ANCHOR),
            scope=repr(cls.SCOPE),
            before=literal(cls.BEFORE),
            after=literal(cls.AFTER),
        )
        for cls in classes
    )
    return MODULE.format(
        patch_id=patch_id,
        path=edited.path,
        distribution=edited.distribution,
        version=edited.version,
        constant=constant,
        classes=text,
        before=literal(example),
        after=literal(rewrite(example, classes)),
        count=len(classes),
        condition_name=condition_name,
        edits=", ".join(f"Edit({cls.__name__})" for cls in classes) + ("," if len(classes) == 1 else ""),
        near_miss=literal(near_miss),
    )
