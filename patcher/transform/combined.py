"""Every selected edit of a file in one libcst traversal instead of one traversal per edit.

A traversal rebuilds every node of the module, and that, not matching, is what a codemod pass
costs (about 50 ms for the generator file). Run together, the codemods see each node in patch
order, each leave_ method receiving what the codemods before it returned, which is what running
them one after another gives for codemods that, like ours, rewrite the `updated` node they are
handed. tests/test_real_sources.py checks that for every subset of the patches on the real files.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import libcst as cst

from ..codemod import PatchCodemod, SkipFile
from ..model import Edit, Patch
from .outcomes import Outcome, PatchOutcome


class _Diverged(Exception):
    """A codemod returned a node of another type: later codemods would not see it as theirs."""


def _overrides(codemod: PatchCodemod, name: str):
    method = getattr(type(codemod), name, None)
    if method is None or method is getattr(cst.CSTTransformer, name, None):
        return None
    return getattr(codemod, name)


@functools.cache
def _has_field_hooks(codemod_type: type) -> bool:
    """Whether the codemod defines visit_<Node>_<field> or leave_<Node>_<field> methods."""
    for klass in codemod_type.__mro__:
        if klass is cst.CSTTransformer:
            return False
        for name in vars(klass):
            prefix, _, rest = name.partition("_")
            node_name, _, field_name = rest.partition("_")
            if prefix in ("visit", "leave") and field_name and isinstance(getattr(cst, node_name, None), type):
                return True
    return False


class _Together(cst.CSTTransformer):
    def __init__(self, codemods: Sequence[PatchCodemod]) -> None:
        super().__init__()
        self.codemods = codemods
        self.visits: dict[type, list] = {}
        self.leaves: dict[type, list] = {}
        # Where codemod i's visit_ returned False: it sees nothing below that node.
        self.stopped_at: list[cst.CSTNode | None] = [None] * len(codemods)
        self.stopped = 0

    def _methods(self, table: dict[type, list], prefix: str, node_type: type) -> list:
        found = table.get(node_type)
        if found is None:
            name = prefix + node_type.__name__
            found = [(i, m) for i, c in enumerate(self.codemods) if (m := _overrides(c, name)) is not None]
            table[node_type] = found
        return found

    def on_visit(self, node: cst.CSTNode) -> bool:
        for i, visit in self._methods(self.visits, "visit_", type(node)):
            if self.stopped_at[i] is None and visit(node) is False:
                self.stopped_at[i] = node
                self.stopped += 1
        return self.stopped < len(self.codemods)

    # None of the codemods has visit_<Node>_<field> hooks (apply_together checks): skipping
    # libcst's lookup of them for every field of every node saves a fifth of the traversal.
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        result = updated
        for i, leave in self._methods(self.leaves, "leave_", type(original)):
            if self.stopped_at[i] is not None and self.stopped_at[i] is not original:
                continue
            result = leave(original, result)
            if type(result) is not type(original):
                raise _Diverged
        if self.stopped:
            for i, node in enumerate(self.stopped_at):
                if node is original:
                    self.stopped_at[i] = None
                    self.stopped -= 1
        return result


def apply_together(
    tree: cst.Module, steps: Sequence[tuple[Patch, tuple[Edit, ...]]], filename: str
) -> tuple[cst.Module, list] | None:
    """(new tree, outcomes) with every edit run in one traversal, or None where that cannot
    stand for running them one by one: an anchor is missing, or a codemod changed a node's type."""

    codemods = [edit.codemod(filename) for _, edits in steps for edit in edits]
    if any(_has_field_hooks(type(c)) for c in codemods):
        return None
    try:
        updated = tree.visit(_Together(codemods))
        for codemod in codemods:
            codemod.check_anchor()
    except (SkipFile, _Diverged):
        return None
    outcomes = []
    done = iter(codemods)
    for patch, edits in steps:
        states = {edit.name: ("applied" if next(done).rewrites else "satisfied") for edit in edits}
        outcome: Outcome = "applied" if "applied" in states.values() else "already-satisfied"
        outcomes.append(PatchOutcome(patch.id, outcome, "", states))
    assert isinstance(updated, cst.Module)
    return updated, outcomes
