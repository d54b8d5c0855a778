"""The tests' per-patch expectations, derived from the declarations (patcher.model.Patch) alone:
which versions select a patch, which runs show it is needed (Patch.leave_one_out) and whether a
run's report, a recorded row of the release matrix or a GPU run's record shows the declared
symptom. A new patch module is picked up by every test that uses these, with no other edit."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from packaging.version import Version

from patcher.core.versions import lower_bounds
from patcher.model import LeaveOneOut, Patch, Symptom
from patcher.patchset.registry import load_patches
from patcher.plan.selection import condition_holds, select_patches

ROOT = Path(__file__).resolve().parent.parent.parent
# The CPU-build releases the end-to-end tests build and run every leave-one-out on; a run declared
# on any other release is checked against its recorded row (bench/results/releases/).
END_TO_END = {"0.16.0": "tests/test_e2e_vllm.py", "0.32.0": "tests/test_e2e_vllm_032.py"}
GPU_RESULTS = ROOT / "bench" / "gpu" / "results"
# What a light environment (workbench/envs.py) has when a patch's conditions say nothing else.
BASELINE = {"speculators": "0.3.0", "vllm": "0.16.0"}


def patches() -> tuple[Patch, ...]:
    return load_patches()


def selected_ids(versions: Mapping[str, str | None], among: tuple[Patch, ...] | None = None) -> set[str]:
    """Short ids of the patches a fresh target with these versions selects."""
    chosen = select_patches(among or patches(), versions)
    return {sel.patch.short_id for sel in chosen.values() if sel.selected}


def _lowest(specs: list[str]) -> str | None:
    """The lowest version every spec allows, among the bounds they name (>=X, ==X, >X is not used)."""
    bounds = [bound for spec in specs for bound in lower_bounds(spec)]
    for bound in sorted(set(bounds), key=Version):
        if all(condition_holds(spec, bound) for spec in specs):
            return bound
    return None


def selected_on(patch: Patch) -> dict[str, str]:
    """Versions on which `patch` is selected: the baseline where it already is, else, for each
    distribution its conditions (or one edit's with the patch's own) name, the lowest bound they
    allow (v12: vLLM 0.33.0; v16: transformers 5.4.0; v18: torch 2.0)."""
    from patcher.plan.planning import select_one

    def lowest_allowed(conditions: Mapping[str, list[str]]) -> dict[str, str]:
        versions = dict(BASELINE)
        for name, specs in conditions.items():
            if not all(condition_holds(spec, versions.get(name)) for spec in specs):
                lowest = _lowest(specs)
                if lowest is not None:
                    versions[name] = lowest
        return versions

    def with_edit(edit) -> dict[str, list[str]]:
        conditions = {name: [spec] for name, spec in patch.requires.items()}
        for name, spec in edit.when.items():
            conditions.setdefault(name, []).append(spec)
        return conditions

    for versions in (
        dict(BASELINE),
        lowest_allowed(patch.conditions()),
        *(lowest_allowed(with_edit(edit)) for edit in patch.edits),
    ):
        if select_one(patch.spec(), versions, condition_holds).selected:
            return versions
    raise AssertionError(f"{patch.id}: no versions its conditions name select it ({patch.conditions()})")


def leave_one_outs(
    vllm: str, device: str = "cpu", speculators: str = "0.3.0", tensor_parallel: int = 1
) -> list[tuple[Patch, LeaveOneOut]]:
    """The runs declared on this vLLM release and device, with this speculators release on top
    (0.3.0: the end-to-end tests' environment), at this many ranks."""
    return [
        (p, run)
        for p in patches()
        for run in p.leave_one_out
        if run.vllm == vllm
        and run.device == device
        and run.speculators == speculators
        and run.tensor_parallel == tensor_parallel
    ]


def by_record(run: LeaveOneOut) -> bool:
    """Whether a CPU run is shown by the release matrix's recorded row, not by the end-to-end tests
    (which run 0.16.0 and 0.32.0 with speculators 0.3.0 at TP 1)."""
    return run.device == "cpu" and (
        run.vllm not in END_TO_END or run.speculators != BASELINE["speculators"] or run.tensor_parallel != 1
    )


def left_out(patch: Patch, run: LeaveOneOut) -> tuple[str, ...]:
    """The short ids a leave-one-out run skips: the patch and what it declares with it."""
    return (patch.short_id, *run.also_skip)


def run_id(patch: Patch, run: LeaveOneOut) -> str:
    return "without-" + "+".join(left_out(patch, run))


def not_needed_on(vllm: str) -> list[str]:
    """Short ids whose declared run on this (CPU) release passes without them."""
    return [p.short_id for p, run in leave_one_outs(vllm) if run.symptom is None]


# ---------------------------------------------------------------------- does a record show it


def error_shows(symptom: Symptom, error: Mapping | None) -> list[str]:
    """What the extraction driver's error record (patcher/run_check/extract.py) lacks of the symptom
    ([] when it shows it)."""
    if error is None:
        return [f"no error; expected {describe(symptom)}"]
    problems = []
    if symptom.error and error.get("type") != symptom.error:
        problems.append(f"error type {error.get('type')!r}, expected {symptom.error!r}")
    if error.get("phase") != symptom.phase:
        problems.append(f"phase {error.get('phase')!r}, expected {symptom.phase!r}")
    text = f"{error.get('message', '')}\n{error.get('traceback', '')}"
    problems += [f"message lacks {part!r}" for part in symptom.messages if part not in text]
    if symptom.where and symptom.where not in f"{error.get('where', '')}\n{error.get('traceback', '')}":
        problems.append(f"raised at {error.get('where')!r}, expected {symptom.where!r}")
    return problems


def report_shows(symptom: Symptom, report: Mapping) -> list[str]:
    """The same for the driver's whole report: a 'rows' symptom is a run that returned with some
    prompt's rows short or wrong."""
    if symptom.phase != "rows":
        return error_shows(symptom, report.get("error"))
    if report.get("error") is not None:
        return [f"an error instead of wrong rows: {report['error'].get('type')}: {report['error'].get('message')}"]
    statuses = [p["status"] for c in report.get("calls", []) for p in c["prompts"]]
    if report.get("ok") or all(s == "ok" for s in statuses):
        return ["every prompt came back whole and right"]
    return []


def apply_refusal_shows(symptom: Symptom, code: int, status: str, message: str) -> list[str]:
    """A 'verify' symptom: apply's verification refused (exit 1, every file restored)."""
    problems = (
        [] if code == 1 and status == "rolled-back" else [f"apply exit {code}, {status}; expected 1, rolled-back"]
    )
    if symptom.error and f"{symptom.error}:" not in message:
        problems.append(f"no {symptom.error} in {message!r}")
    return problems + [f"message lacks {part!r}" for part in symptom.messages if part not in message]


def bench_row_shows(symptom: Symptom, row: Mapping) -> list[str]:
    """Whether a recorded row of bench/releases.py shows the symptom."""
    if symptom.phase == "verify":
        code, _, status = str(row.get("apply", "")).removeprefix("exit ").partition(", ")
        status = status.split(":", 1)[0]
        return apply_refusal_shows(symptom, int(code) if code.isdigit() else -1, status, row.get("apply_message", ""))
    extract = row.get("extract") or {}
    if symptom.phase == "rows":
        if extract.get("error") or extract.get("ok") or extract.get("rows_whole_in_order", True):
            return [f"the run did not return wrong rows: {extract}"]
        return []
    error = str(extract.get("error", ""))  # "ValueError in init: KV cache layout ..."
    if not error:
        return [f"the run raised nothing: {extract}"]
    kind, _, phase = error.split(": ", 1)[0].partition(" in ")
    problems = []
    if (symptom.error and kind != symptom.error) or phase != symptom.phase:
        problems.append(f"{error[:120]!r}: expected {symptom.error or 'an error'} in {symptom.phase}")
    text = "\n".join([error, *extract.get("log_tail", []), *extract.get("vllm_log", [])])
    return problems + [f"the run's record lacks {part!r}" for part in symptom.messages if part not in text]


def record_shows(symptom: Symptom, path: Path) -> list[str]:
    """A GPU run's record: the driver's JSON report (structured), or a log (each message in it)."""
    if not path.is_file():
        return [f"no record {path.relative_to(ROOT)}"]
    if path.suffix == ".json":
        return report_shows(symptom, json.loads(path.read_text(encoding="utf-8")))
    text = path.read_text(encoding="utf-8", errors="replace")
    return [f"{path.name} lacks {part!r}" for part in symptom.messages if part not in text]


def gpu_records(patch: Patch, run: LeaveOneOut) -> list[Path]:
    if run.record:
        return [ROOT / run.record]
    return sorted(GPU_RESULTS.glob(f"{run.vllm}-*/e2e-{run_id(patch, run)}.json"))


def describe(symptom: Symptom) -> str:
    if symptom.phase == "rows":
        return "rows short or wrong, no error"
    what = symptom.error or "an error"
    return f"{what} in {symptom.phase}" + (f" saying {' ... '.join(symptom.messages)}" if symptom.messages else "")
