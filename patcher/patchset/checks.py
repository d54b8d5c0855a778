"""What `patcher test-patches` checks of every patch of a set, from its own declaration (the suite
checks patcher's own patches the same way, tests/test_patch_examples.py): each example's before
becomes its after, the after is a fixed point, the sources declared satisfied are left alone,
unrelated code and each near miss read "anchor not found" with their bytes kept, and the patch
declares a near miss at all. Whether it applies on real releases is check-upstream's part."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass

from ..model import Patch

UNRELATED = "def unrelated():\n    return 1\n"


@dataclass(frozen=True)
class CheckResult:
    patch_id: str
    check: str  # "example 1", "satisfied 2", "near miss 1", ...
    problem: str  # "" when it holds

    @property
    def ok(self) -> bool:
        return not self.problem


def check_patch(patch: Patch) -> Iterator[CheckResult]:
    from ..transform.transforms import transform_source

    def run(source: str):
        result = transform_source(source, [(patch, patch.edits)])
        return result, result.outcome(patch.id)

    for number, example in enumerate(patch.examples, 1):
        result, outcome = run(example.before)
        problem = ""
        if outcome.outcome != "applied":
            problem = f"before reads {outcome.outcome}, not applied ({outcome.message})"
        elif result.result != example.after:
            problem = "before does not become after:\n" + _diff(example.after, result.result)
        yield CheckResult(patch.id, f"example {number}", problem)
        result, outcome = run(example.after)
        problem = ""
        if outcome.outcome != "already-satisfied" or result.result != example.after:
            problem = f"after is not a fixed point: it reads {outcome.outcome}" + (
                ", and changes:\n" + _diff(example.after, result.result) if result.changed else ""
            )
        yield CheckResult(patch.id, f"example {number} again", problem)
    for number, source in enumerate(patch.satisfied, 1):
        result, outcome = run(source)
        problem = ""
        if outcome.outcome != "already-satisfied" or result.changed:
            problem = f"reads {outcome.outcome}, not already-satisfied" + (" and changes it" if result.changed else "")
        yield CheckResult(patch.id, f"satisfied {number}", problem)
    for name, source in [
        ("unrelated code", UNRELATED),
        *((f"near miss {n}", s) for n, s in enumerate(patch.near_misses, 1)),
    ]:
        result, outcome = run(source)
        problem = ""
        if outcome.outcome != "anchor-missing" or "anchor not found: expected" not in outcome.message:
            problem = f"reads {outcome.outcome}, not anchor-missing ({outcome.message or 'no message'})"
        elif result.changed:
            problem = "anchor missing, but the source changed (a partial edit)"
        yield CheckResult(patch.id, name, problem)
    if not patch.near_misses:
        yield CheckResult(
            patch.id, "near misses", "declares none: give near_misses= (code like its anchor it must leave alone)"
        )


def _diff(expected: str, got: str) -> str:
    lines = difflib.unified_diff(expected.splitlines(True), got.splitlines(True), "expected after", "result")
    return "".join(lines).rstrip("\n")
