"""The plan for one target on the controller: planning's draft (patcher/plan/planning.py), the
codemods it asks for run here with libcst, planning's finish."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from ..model import Patch, ReleaseLine
from .planning import PatchSpec, TargetPlan, TransformRequest, TransformResult, draft, finish
from .selection import condition_holds

if TYPE_CHECKING:
    from ..core.protocol import PlanningFacts

Mode = Literal["apply", "rollback"]


def spec_of(patch: Patch) -> PatchSpec:
    """Kept for patcher/transport/bundle.py, which another branch reworks: elsewhere patch.spec()."""
    return patch.spec()


def specs_of(patches: Sequence[Patch]) -> list[PatchSpec]:
    """Kept for patcher/transport/bundle.py (as spec_of): elsewhere [p.spec() for p in patches]."""
    return [p.spec() for p in patches]


def run_transform(request: TransformRequest, by_id: dict[str, Patch]) -> TransformResult:
    """One request of a draft, through the codemods (libcst is imported only here)."""
    from ..transform.transforms import transform_source

    steps = [(by_id[pid], [e for e in by_id[pid].edits if e.name in names]) for pid, names in request.steps]
    result = transform_source(request.pristine, steps, filename=request.path)
    missing = [(o.patch_id, o.message) for o in result.outcomes if o.outcome == "anchor-missing"]
    return TransformResult(result.result, {o.patch_id: o.outcome for o in result.outcomes}, missing)


def plan_target(
    facts: PlanningFacts,
    patches: Sequence[Patch],
    mode: Mode = "apply",
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
    force: bool = False,
    lines: Sequence[ReleaseLine] = (),
) -> TargetPlan:
    """The plan for one target: planning's draft, the codemods it asks for, planning's finish.
    `lines`: the release lines the target must fall in (patcher.patchset.registry.release_lines)."""
    d = draft(
        facts, [p.spec() for p in patches], condition_holds, mode, only, skip, force, [x.as_json() for x in lines]
    )
    by_id = {p.id: p for p in patches}
    return finish(d, {r.path: run_transform(r, by_id) for r in d.requests})
