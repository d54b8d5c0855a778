"""A patch is described in one place, its declaration: what is derived from it (the README's
patch table, the tests' per-patch expectations) must agree with it, and a declaration that
leaves something out fails at once with a line saying what to add."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from patcher.model import Edit, Example, Patch
from patcher.patches.targets import GENERATOR, SPECULATORS_0_3
from patcher.patchset.registry import import_patches

ROOT = Path(__file__).resolve().parent.parent
PATCHES = import_patches()


def _script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_readme_patch_table_is_generated_from_the_declarations():
    script = _script("readme_patch_table")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert script.rewritten(text) == text, (
        "README's patch table is out of date: run `python scripts/readme_patch_table.py`"
    )
    assert all(f"| {p.id} |" in script.table() for p in PATCHES)


def test_each_module_is_named_after_its_patch():
    for patch in PATCHES:
        found = [name for name, mod in sys.modules.items() if getattr(mod, "PATCH", None) is patch]
        assert found == [f"patcher.patches.{patch.module_name}"], (patch.id, found)


def test_needs_name_known_patches_declared_before():
    numbers = {p.id: p.number for p in PATCHES}
    for patch in PATCHES:
        for needed in patch.needs:
            assert needed in numbers, f"{patch.id} needs {needed}, which no module declares"


def _declare(**changes) -> Patch:
    fields = {
        "id": "v99-example",
        "title": "t",
        "target": GENERATOR,
        "requires": SPECULATORS_0_3,
        "edits": (Edit(codemod=object, when={"vllm": ">=0.12.0"}),),
        "examples": (Example("a\\n", "b\\n"),),
        "satisfied": (),
        "upstream": "u",
        "without_it": "w",
    }
    fields.update(changes)
    return Patch(**fields)


def test_a_patch_that_says_nothing_of_what_breaks_cannot_go_in_the_readme(monkeypatch):
    import patcher.patchset.registry

    monkeypatch.setattr(patcher.patchset.registry, "import_patches", lambda: (_declare(without_it=""),))
    with pytest.raises(SystemExit, match="v99-example declares neither without_it= nor readme="):
        _script("readme_patch_table").table()


def test_optional_fields_default_and_bad_ones_fail_with_one_clear_line():
    patch = _declare()
    assert (patch.readme_cell, patch.since_cell, patch.on_fixed_in) == ("w", "0.12.0", "")
    with pytest.raises(TypeError, match="unexpected keyword argument 'note'"):
        _declare(note="the former name of without_it")  # removed: without_it= is the only name
    for changes, message in (
        ({"on_fixed_in": "fine"}, "on_fixed_in='fine'; one of"),
        ({"on_fixed_in": "anchor-missing"}, "on_fixed_in= needs fixed_in="),
        ({"needs": ("v99-example",)}, "needs itself"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("?", r"\?")):
            _declare(**changes)
