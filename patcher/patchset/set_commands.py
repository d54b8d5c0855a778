"""`patcher test-patches` and `patcher new`: a team's own patch set, written and checked as patcher's
own patches are (docs/writing-a-patch-set.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

EXIT_USAGE = 2
EXIT_FAILED = 1


def _error(message: str, code: int = EXIT_USAGE) -> None:
    click.echo(click.style("error: ", fg="red", bold=True) + message, err=True)
    sys.exit(code)


def _set_package(where: str) -> str:
    """A folder of patch modules, or the name of an installed set: its package."""
    from .sets import PatchSetError, import_folder, installed_sets

    for patch_set in installed_sets():
        if patch_set.name == where:
            return patch_set.package
    if not Path(where).exists():
        known = ", ".join(s.name for s in installed_sets())
        _error(f"{where}: neither a folder nor an installed patch set (installed: {known})")
    try:
        return import_folder(Path(where)).package
    except PatchSetError as exc:
        _error(str(exc).replace("--patches ", "", 1))
    raise AssertionError  # _error exits


@click.command("test-patches")
@click.argument("where", metavar="DIR|SET")
@click.option("--verbose", "-v", is_flag=True, help="list every check, not only the failed ones")
def test_patches(where: str, verbose: bool) -> None:
    """Check every patch of a set from its own declaration: each example's before becomes its
    after, the after is a fixed point, sources declared satisfied are left alone, unrelated code
    and each near miss read "anchor not found" with their bytes kept.

    DIR is a folder of patch modules (as --patches takes); SET the name of an installed set.
    Exit codes: 0 every check holds, 1 a check fails, 2 the set cannot be loaded.
    """
    from .checks import check_patch
    from .registry import set_patches

    package = _set_package(where)
    try:
        patches = set_patches(package, indexed=False)
    except Exception as exc:  # the set's own code: any error it raises is the answer  # noqa: BLE001
        _error(f"{where}: its patch modules do not load: {type(exc).__name__}: {exc}")
    if not patches:
        _error(f"{where}: no patch module (vN_slug.py) declares a PATCH")
    failed = 0
    for patch in patches:
        results = list(check_patch(patch))
        bad = [r for r in results if not r.ok]
        failed += len(bad)
        mark = click.style("ok  ", fg="green") if not bad else click.style("FAIL", fg="red", bold=True)
        click.echo(f"{mark} {patch.id}: {len(results) - len(bad)} of {len(results)} checks hold")
        for result in results if verbose else bad:
            state = "ok" if result.ok else result.problem
            click.echo(f"     {result.check}: {state}")
    if failed:
        click.echo(f"{failed} check(s) failed", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(f"every check of {len(patches)} patch(es) holds")


SLUG = r"[a-z0-9]+(?:-[a-z0-9]+)*"

INIT = '"""Patch set {name}: patch modules vN_slug.py, their targets (targets.py); see `patcher test-patches`."""\n'

TARGETS = '''"""The files this set rewrites (one TargetFile each) and the releases its patches serve."""

from patcher.model import TargetFile
'''

SKELETON = '''"""{patch_id}: WHAT IT DOES, in one line.

The drift: which release of which library changed what (a link to its issue or commit), and the
symptom without this patch. Upstream fix: the release of {distribution} that no longer needs it.
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Patch

from .targets import {constant}

OLD_CALL = m.Call(func=m.Name("old_function"))


class {codemod}(PatchCodemod):
    """`old_function(...)` -> `new_function(...)`: rewrite only the unpatched shape, and recognise
    the patched one (applying the patch to its own output changes nothing)."""

    ANCHOR = "a call old_function(...)"  # what "anchor not found" says the file lacks

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if m.matches(updated, OLD_CALL):
            self.rewrote()
            return updated.with_changes(func=cst.Name("new_function"))
        if m.matches(updated, m.Call(func=m.Name("new_function"))):
            self.found_patched()
        return updated  # neither shape: the engine reports "anchor not found" and writes nothing


PATCH = Patch(
    id="{patch_id}",
    title="WHAT IT DOES, in one line",
    target={constant},
    # the releases of {distribution} it is written for (narrow it: a release past them is told, not patched)
    requires={{"{distribution}": ">={version}"}},
    edits=(
        Edit(
            {codemod},
            when={{}},  # the releases of the other libraries that need it, e.g. {{"werkzeug": ">=3.0.0"}}
            answers="the upstream fact it answers, in words",
        ),
    ),
    examples=(
        Example(
            before="""
                value = old_function(1)
            """,
            after="""
                value = new_function(1)
            """,
        ),
    ),
    satisfied=("value = new_function(1)\\n",),
    near_misses=(
        # code that looks like the anchor but must be left alone
        """
            value = module.old_function(1)
        """,
    ),
    upstream="the upstream change it answers (a link)",
    without_it="without it: the symptom, e.g. `ImportError: ...` at `import {module}`",
)
'''


@click.command("new")
@click.argument("name", metavar="NAME")
@click.option("--target", "target", metavar="DIST:PATH", help="the file it rewrites, e.g. flask:flask/app.py")
@click.option(
    "--from-edit",
    "from_edit",
    metavar="DIST",
    help="write the patch from a hand edit already made to DIST's files in --python's environment "
    "(the files whose bytes differ from pip's RECORD; the pristine text from the release's wheel)",
)
@click.option("--python", "python", metavar="PATH", help="the environment holding the hand edit (with --from-edit)")
@click.option(
    "--into",
    "into",
    default=".",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="the set's folder (made if missing)",
)
def new_patch(name: str, target: str | None, from_edit: str | None, python: str | None, into: Path) -> None:
    """Write a patch module, vN_NAME.py, into a set's folder (its next number), with its target in
    the folder's targets.py. With --target: a skeleton that passes `patcher test-patches` as
    written; edit its codemod, example and gates from there. With --from-edit DIST --python PATH:
    the hand edit made there, one patch per edited file, gated on the installed release, anchored on
    the release's own statements. NAME: lowercase words joined by '-'.
    """
    import re

    slug = name.replace("_", "-")
    if not re.fullmatch(SLUG, slug):
        _error(f"{name!r}: name the patch in lowercase letters and digits joined by '-', e.g. url-quote")
    if bool(target) == bool(from_edit):
        _error("give either --target DIST:PATH (a skeleton) or --from-edit DIST --python PATH (a hand edit)")
    if from_edit:
        if not python:
            _error("--from-edit needs --python PATH, the environment where the edit was made")
        _new_from_edit(slug, from_edit, str(python), into)
        return
    assert target is not None
    distribution, sep, path = target.partition(":")
    if not sep or not distribution or not _inside_site(path):
        _error(f"--target {target!r}: expected DIST:PATH, a .py file inside site-packages, e.g. flask:flask/app.py")
    module, patch_id, constant = _place(into, slug, distribution, path)
    skeleton = SKELETON.format(
        patch_id=patch_id,
        codemod="".join(part.capitalize() for part in slug.split("-")),
        constant=constant,
        distribution=distribution,
        module=path.removesuffix(".py").replace("/", ".").removesuffix(".__init__"),
        version="0",
    )
    _write(module, skeleton)
    click.echo(f"wrote {module} ({patch_id}, target {distribution}:{path})")
    click.echo(f"next: edit it, then `patcher test-patches {into}` and `patcher --patches {into} status --python PATH`")


def _inside_site(path: str) -> bool:
    return path.endswith(".py") and not path.startswith("/") and ".." not in path.split("/")


def _place(into: Path, slug: str, distribution: str, path: str) -> tuple[Path, str, str]:
    """The new module's path and id (the folder's next number), and the targets.py constant naming
    its file (added when missing; the folder made a package)."""
    import re

    taken = [int(m.group(1)) for p in into.glob("v*.py") if (m := re.match(r"v([0-9]+)_", p.name))]
    patch_id = f"v{max(taken, default=0) + 1}-{slug}"
    constant = re.sub(r"[^A-Za-z0-9]+", "_", Path(path).stem).upper().strip("_") or "TARGET"
    if constant[0].isdigit():
        constant = f"FILE_{constant}"
    try:
        into.mkdir(parents=True, exist_ok=True)
        if not (into / "__init__.py").exists():
            (into / "__init__.py").write_text(INIT.format(name=into.resolve().name.replace("_", "-")), encoding="utf-8")
        targets = into / "targets.py"
        text = targets.read_text(encoding="utf-8") if targets.exists() else TARGETS
        line = f'{constant} = TargetFile("{distribution}", "{path}")\n'
        if line not in text:
            if re.search(rf"^{constant} = ", text, re.MULTILINE):
                _error(f"{targets}: {constant} names another file already; add this one by hand")
            text = text.rstrip("\n") + "\n" + ("\n" if "TargetFile(" not in text else "") + line
            targets.write_text(text, encoding="utf-8")
    except OSError as exc:
        _error(f"cannot write into {into}: {exc.strerror}")
    return into / f"{patch_id.replace('-', '_')}.py", patch_id, constant


def _write(module: Path, text: str) -> None:
    try:
        with open(module, "x", encoding="utf-8") as handle:
            handle.write(text)
    except FileExistsError:
        _error(f"{module} exists already; choose another NAME")
    except OSError as exc:
        _error(f"cannot write {module}: {exc.strerror}")


def _new_from_edit(slug: str, distribution: str, python: str, into: Path) -> None:
    from ..codemod import SkipFile
    from ..upstream.wheels import find_or_download
    from .from_edit import FromEditError, edited_files, patch_module, pristine_text

    try:
        edits = edited_files(python, distribution)
    except (FromEditError, OSError, subprocess.SubprocessError) as exc:
        _error(str(exc))
    if not edits:
        _error(f"no file of {distribution} in {python} differs from its RECORD: edit the installed file first")
    condition = distribution.lower().replace("-", "_")
    for edited in edits:
        own = slug if len(edits) == 1 else f"{slug}-{Path(edited.path).stem.replace('_', '-').lower()}"
        try:
            pristine = pristine_text(edited, lambda name, version: find_or_download(name, version, lambda _: None))
            module, patch_id, constant = _place(into, own, condition, edited.path)
            text = patch_module(patch_id, constant, condition, edited, pristine)
        except (FromEditError, SkipFile) as exc:
            _error(f"{edited.path}: {exc}" if isinstance(exc, SkipFile) else str(exc))
        except Exception as exc:  # the wheel could not be had (DownloadFailed, IndexUnreachable)  # noqa: BLE001
            _error(f"cannot get {edited.distribution} {edited.version}'s wheel for the pristine {edited.path}: {exc}")
        _write(module, text)
        click.echo(f"wrote {module} ({patch_id}: {edited.path} of {edited.distribution} {edited.version})")
    click.echo(
        f"next: `patcher test-patches {into}`; then, for patcher to own the edit, reinstall the release "
        f"(`{python} -m pip install --force-reinstall --no-deps {edits[0].distribution}=={edits[0].version}`) "
        f"and `patcher --patches {into} apply --python {python}` writes the same bytes"
    )
