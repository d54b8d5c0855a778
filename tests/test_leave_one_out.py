"""Every leave-one-out a patch declares (Patch.leave_one_out) has its evidence: on 0.16.0 and 0.32.0
the end-to-end tests run it (speculators 0.3.0); on any other CPU release, or with another speculators
release on top, the release matrix's recorded row (bench/results/releases/<release>[-speculators-<V>]-without-vN-*.json)
must show the declared symptom; on CUDA the GPU
run's record (bench/gpu/results/). And every recorded leave-one-out row is one a patch declares."""

from __future__ import annotations

import json

import pytest

from tests.support.declared import (
    END_TO_END,
    ROOT,
    bench_row_shows,
    by_record,
    gpu_records,
    left_out,
    patches,
    record_shows,
    run_id,
)
from workbench import release_matrix as matrix

DECLARED = [(p, run) for p in patches() for run in p.leave_one_out]
RECORDED_ON_CPU = [(p, run) for p, run in DECLARED if by_record(run)]
ON_CUDA = [(p, run) for p, run in DECLARED if run.device == "cuda"]


def test_every_patch_declares_where_its_need_is_shown():
    missing = [p.id for p in patches() if not p.leave_one_out]
    assert not missing, f"declare leave_one_out=(LeaveOneOut(...),) in: {', '.join(missing)}"


@pytest.mark.parametrize(
    "patch,run",
    RECORDED_ON_CPU,
    ids=[f"{r.vllm}-{r.speculators}-tp{r.tensor_parallel}-{run_id(p, r)}" for p, r in RECORDED_ON_CPU],
)
def test_a_recorded_row_shows_the_declared_symptom(patch, run):
    assert not run.also_skip, f"{patch.id}: bench/releases.py leaves out one patch; run it on {' or '.join(END_TO_END)}"
    name = matrix.row_name(
        {
            "release": run.vllm,
            "speculators": run.speculators,
            "tensor_parallel": run.tensor_parallel,
            "left_out": patch.short_id,
        }
    )
    rows = [r for r in matrix.recorded_rows(left_out=True) if matrix.row_name(r) == name]
    assert rows, (
        f"no recorded row {name}: python bench/releases.py --release {run.vllm} --speculators {run.speculators} "
        f"--tensor-parallel {run.tensor_parallel} --leave-out {patch.short_id}"
    )
    (row,) = rows
    assert row["rollback_identical"], row
    if run.symptom is None:
        assert matrix.row_passed({k: v for k, v in row.items() if k != "left_out"}), row["apply"]
        return
    problems = bench_row_shows(run.symptom, row)
    assert not problems, (name, problems)


@pytest.mark.parametrize("patch,run", ON_CUDA, ids=[f"{r.vllm}-{run_id(p, r)}" for p, r in ON_CUDA])
def test_a_gpu_record_shows_the_declared_symptom(patch, run):
    records = gpu_records(patch, run)
    assert records, f"no bench/gpu/results/{run.vllm}-*/e2e-{run_id(patch, run)}.json: bench/gpu/gpu_run.py --leave-out"
    assert run.symptom is not None, "a GPU run's passing leave-one-out is not recorded as such"
    verdicts = {str(path.relative_to(ROOT)): record_shows(run.symptom, path) for path in records}
    assert any(not problems for problems in verdicts.values()), verdicts


def test_every_recorded_leave_one_out_row_is_declared():
    declared = {(run.vllm, run.speculators, run.tensor_parallel, left_out(p, run)) for p, run in DECLARED}
    for row in matrix.recorded_rows(left_out=True):
        speculators, ranks = matrix.speculators_of(row), matrix.tensor_parallel_of(row)
        assert (row["release"], speculators, ranks, (row["left_out"],)) in declared, (
            f"{matrix.row_name(row)} is recorded but no patch declares "
            f"LeaveOneOut({row['release']!r}, ..., speculators={speculators!r}, tensor_parallel={ranks}) "
            f"for {row['left_out']}"
        )


def test_the_driver_reports_what_the_symptoms_are_matched_against():
    # the fields tests/support/declared.py reads of a driver's error, from a recorded report
    report = json.loads(next((ROOT / "bench" / "gpu" / "results").glob("*/e2e-without-v19.json")).read_text())
    assert {"type", "phase", "message", "where", "traceback"} <= set(report["error"])
