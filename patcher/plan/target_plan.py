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

# The largest target file patcher reads and transforms: its target files are a few dozen KiB, and
# the codemods' cost grows faster than the file (a 2 MB file once took a minute and 4 GB). The
# agent refuses a larger one before reading it (remote/agent/writes.py: the same variable and
# default, which the controller sends it as `file_limit`); planning refuses one here too, whatever
# the target says.
TARGET_FILE_LIMIT_VARIABLE = "PATCHER_TARGET_FILE_LIMIT_MIB"
DEFAULT_TARGET_FILE_LIMIT_MIB = 0.25


def target_file_limit_bytes() -> int:
    import math
    import os

    try:
        mib = float(os.environ.get(TARGET_FILE_LIMIT_VARIABLE, DEFAULT_TARGET_FILE_LIMIT_MIB))
    except ValueError:
        mib = DEFAULT_TARGET_FILE_LIMIT_MIB
    if not (math.isfinite(mib) and 0 < mib < 2**20):
        mib = DEFAULT_TARGET_FILE_LIMIT_MIB
    return int(mib * 2**20)


def within_limit(facts: PlanningFacts, limit: int) -> PlanningFacts:
    """`facts`, with a file whose text (or pristine backup's) is over `limit` bytes refused as the
    agent refuses it: one line naming the file and the limit, planning touches nothing there."""
    files = dict(facts["files"])
    for rel, info in facts["files"].items():
        size = max(len((info.get("content") or "").encode("utf-8")), len((info.get("original") or "").encode("utf-8")))
        if size > limit:
            files[rel] = {
                "exists": True,
                "refused": f"{info.get('root', '?')}/{rel} is {size} bytes, over the {limit / 2**20:g} MiB a target "
                "file may have (patcher's are a few dozen KiB): it is not the package's file; put the package's "
                "own file back (pip install --force-reinstall the package), or set "
                f"{TARGET_FILE_LIMIT_VARIABLE} to a larger number of MiB",
            }
            if "root" in info:
                files[rel]["root"] = info["root"]
    return {**facts, "files": files}


def spec_of(patch: Patch) -> PatchSpec:
    """Kept for patcher/frontends/bundle.py, which another branch reworks: elsewhere patch.spec()."""
    return patch.spec()


def specs_of(patches: Sequence[Patch]) -> list[PatchSpec]:
    """Kept for patcher/frontends/bundle.py (as spec_of): elsewhere [p.spec() for p in patches]."""
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
    facts = within_limit(facts, target_file_limit_bytes())
    d = draft(
        facts, [p.spec() for p in patches], condition_holds, mode, only, skip, force, [x.as_json() for x in lines]
    )
    by_id = {p.id: p for p in patches}
    return finish(d, {r.path: run_transform(r, by_id) for r in d.requests})
