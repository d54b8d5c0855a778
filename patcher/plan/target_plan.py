"""Planning for patcher: the shared core (patcher/core/planning.py) with packaging's PEP 440
and the codemods. The core says which files need which codemods; they run here and the core
turns their results into the plan (per file, the bytes to write or the original to restore
and the hash the file must have first; per patch, its state and why)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from ..core import planning as core
from ..core.planning import (  # noqa: F401  (the plan's types, for the rest of patcher)
    Conflict,
    Draft,
    FileChange,
    PatchSpec,
    PatchState,
    TargetPlan,
    TransformRequest,
    TransformResult,
    after_write,
    draft,
    finish,
)
from ..model import Patch, ReleaseLine
from .selection import condition_holds

if TYPE_CHECKING:
    from ..core.protocol import PlanningFacts, TargetFile

Mode = Literal["apply", "rollback"]


def spec_of(patch: Patch) -> PatchSpec:
    """The data planning needs of a declaration."""
    return patch.spec()


def specs_of(patches: Sequence[Patch]) -> list[PatchSpec]:
    return [spec_of(p) for p in patches]


# Detected in every target whether a patch's condition names them or not: their versions are in
# every report (`versions`), and patches may gate on them (transformers 5 breaks speculators itself).
# hs_connectors: the KV connector speculators 0.8+ extracts through (`status` names it).
ALWAYS_DETECTED = ("vllm", "speculators", "transformers", "torch", "hs_connectors")


def detected_names(patches: Sequence[Patch]) -> list[str]:
    """The import names the agent is asked about: every condition's, and ALWAYS_DETECTED."""
    names = condition_names(patches)
    return names + [n for n in ALWAYS_DETECTED if n not in names]


def condition_names(patches: Sequence[Patch]) -> list[str]:
    return core.condition_names(patches)


def target_files(patches: Sequence[Patch]) -> list[TargetFile]:
    return core.target_files(specs_of(patches))


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
    """The plan for one target: the core's draft, the codemods it asks for, the core's finish.
    `lines`: the release lines the target must fall in (patcher.patchset.registry.release_lines)."""
    d = draft(facts, specs_of(patches), condition_holds, mode, only, skip, force, [x.as_json() for x in lines])
    by_id = {p.id: p for p in patches}
    return finish(d, {r.path: run_transform(r, by_id) for r in d.requests})
