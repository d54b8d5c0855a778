"""Every patch's own examples, run automatically (Fixit-style): before -> after, after is a
fixed point, "already satisfied" sources are left alone, unrelated code is reported, and code that
looks like the anchor but is not it (a patch's near_misses) is reported and left alone."""

import pytest

from patcher.patchset.registry import load_patches
from patcher.transform.transforms import transform_source

PATCHES = load_patches()
EXAMPLES = [
    pytest.param(patch, example, id=f"{patch.id}-{i}") for patch in PATCHES for i, example in enumerate(patch.examples)
]
SATISFIED = [
    pytest.param(patch, source, id=f"{patch.id}-{i}") for patch in PATCHES for i, source in enumerate(patch.satisfied)
]


def run(patch, source):
    return transform_source(source, [(patch, patch.edits)])


@pytest.mark.parametrize("patch,example", EXAMPLES)
def test_before_becomes_after(patch, example):
    result = run(patch, example.before)
    assert result.outcome(patch.id).outcome == "applied", result.outcomes
    assert result.result == example.after


@pytest.mark.parametrize("patch,example", EXAMPLES)
def test_after_is_a_fixed_point(patch, example):
    result = run(patch, example.after)
    assert result.outcome(patch.id).outcome == "already-satisfied", result.outcomes
    assert result.result == example.after


@pytest.mark.parametrize("patch,source", SATISFIED)
def test_already_satisfied_is_left_alone(patch, source):
    result = run(patch, source)
    assert result.outcome(patch.id).outcome == "already-satisfied", result.outcomes
    assert result.result == source


@pytest.mark.parametrize("patch", PATCHES, ids=[p.id for p in PATCHES])
def test_unrelated_source_reports_anchor_missing(patch):
    source = "def unrelated():\n    return 1\n"
    result = run(patch, source)
    outcome = result.outcome(patch.id)
    assert outcome.outcome == "anchor-missing"
    assert "anchor not found: expected" in outcome.message
    assert result.result == source  # never a partial edit


NEAR_MISSES = [
    pytest.param(patch, source, id=f"{patch.id}-{i}") for patch in PATCHES for i, source in enumerate(patch.near_misses)
]


@pytest.mark.parametrize("patch,source", NEAR_MISSES)
def test_a_near_miss_is_left_alone(patch, source):
    # code that looks like the anchor but is not the shape the patch was written for
    result = run(patch, source)
    outcome = result.outcome(patch.id)
    assert outcome.outcome == "anchor-missing", (outcome.outcome, outcome.message)
    assert "anchor not found: expected" in outcome.message
    assert result.result == source


@pytest.mark.parametrize("patch", PATCHES, ids=[p.id for p in PATCHES])
def test_every_patch_declares_a_near_miss(patch):
    assert patch.near_misses, f"{patch.id}: declare near_misses= (code like its anchor that it must leave alone)"


def test_sources_are_read_dedented():
    # written indented in triple quotes, as the declarations do (LibCST's assertCodemod reads its fixtures so)
    from patcher.model import Example

    example = Example(
        before="""
            def f():
                return 1
        """,
        after="def f():\n    return 2\n",
    )
    assert example.before == "def f():\n    return 1\n" and example.after == "def f():\n    return 2\n"
    assert Example(before=example.before, after=example.after) == example  # read again: the same text
