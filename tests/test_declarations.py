"""A patch is described in one place, its declaration: what is derived from it (the generated
patch reference, the tests' per-patch expectations) must agree with it, and a declaration that
leaves something out fails at once with a line saying what to add."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from patcher.model import Edit, Example, LeaveOneOut, Patch, Symptom
from patcher.patches.targets import GENERATOR, SPECULATORS_0_3
from patcher.patchset.registry import import_patches

ROOT = Path(__file__).resolve().parent.parent
PATCHES = import_patches()


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


def test_optional_fields_default_and_bad_ones_fail_with_one_clear_line():
    patch = _declare()
    assert (patch.since_cell, patch.on_fixed_in, patch.next_release, patch.leave_one_out) == ("0.12.0", "", "0.4.0", ())
    for removed in ("note", "readme"):  # former names of without_it, or the same fact said twice
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{removed}'"):
            _declare(**{removed: "w"})
    for changes, message in (
        ({"on_fixed_in": "fine"}, "on_fixed_in='fine'; one of"),
        (
            {"on_fixed_in": "anchor-missing", "requires": {"speculators": ">=0.3.0"}},
            "on_fixed_in= needs an upper bound",
        ),
        ({"needs": ("v99-example",)}, "needs itself"),
        ({"leave_one_out": (LeaveOneOut("0.16.0", None, also_skip=("v6-prefix",)),)}, "also_skip='v6-prefix'"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("?", r"\?")):
            _declare(**changes)


def test_leave_one_out_declarations_refuse_what_no_test_could_check():
    for make, message in (
        (lambda: Symptom("start"), "symptom phase 'start': one of"),
        (lambda: Symptom("rows", "RuntimeError"), "a 'rows' symptom has no error"),
        (lambda: Symptom("init"), "names a part of its message"),
        (lambda: LeaveOneOut("0.16", None), "a vLLM release"),
        (lambda: LeaveOneOut("0.16.0", None, device="tpu"), "device 'tpu'"),
        (lambda: LeaveOneOut("0.16.0", None, tensor_parallel=0), "tensor_parallel=0"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            make()


def test_a_patch_module_reads_alone():
    """No patch module imports from another: helpers several patches share live in patcher/codemod.py
    (and the sources they write in patcher/device_memory.py, patcher/shared_states.py), constants
    and symptoms in patches/targets.py; row keys hash what a patch imports from those
    (patcher.upstream.row_keys.row_key)."""
    import ast

    for path in sorted((ROOT / "patches").glob("v*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        siblings = [
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level and node.module not in (None, "targets")
        ]
        assert not siblings, f"{path.name} imports from {siblings}: move what it shares to patcher/codemod.py"
