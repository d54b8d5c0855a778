"""End to end on the real vLLM 0.16.0 (CPU build): patched speculators 0.3.0 extracts the right
hidden states, each needed patch is shown needed by its own symptom, and rollback brings the
original failure back.

The demo environment and the tiny model are built once per machine and reused (patcher.demo);
every run patches a throwaway overlay target on top of it (its own pristine speculators 0.3.0),
through the real CLI: `patcher rollback`, then `patcher apply --skip vN --no-verify` (verification
is tested in test_verify_vllm.py), then the extraction driver (patcher/run_check/extract.py) in the
target's interpreter. One vLLM process at a time; about ten vLLM starts in all.

Which patches are left out, and what each run must show, is declared by the patches themselves
(Patch.leave_one_out on release 0.16.0, read through tests/support/declared.py): the symptom
their `without_it` describes, as the driver reports it (exception type, phase, message, where it
was raised, or per-prompt rows). A new patch's run is picked up with no edit here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import patcher
from tests.support.declared import leave_one_outs, not_needed_on, run_id
from tests.support.e2e import (
    TIMINGS,
    assert_all_correct,
    assert_every_selected_patch_applies,
    error_of,
    extract,
    leave_out,
    patch_as,
    pristine,
    rolled_back_overlay,
    summary,
)

pytestmark = pytest.mark.vllm

RELEASE = "0.16.0"  # the demo environment's (patcher/demo/releases.json)
NEEDED = [(p, run) for p, run in leave_one_outs(RELEASE) if run.symptom is not None]
NOT_NEEDED = not_needed_on(RELEASE)

FIGURES: dict[str, str] = {}


# --- the pieces -------------------------------------------------------------------------------


# demo_python and model: tests/conftest.py


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    with rolled_back_overlay(tmp_path_factory.mktemp("e2e"), demo_python) as python:
        yield python


# --- the tests, in order -----------------------------------------------------------------------


def test_pristine_0_3_0_fails_at_scheduler_config(target: Path, model: Path):
    assert pristine(target)
    report = extract(target, model, "1", "pristine")
    error = error_of(report)
    assert error["type"] == "ValidationError" and error["phase"] == "init", error
    assert "SchedulerConfig" in error["message"] and "is_encoder_decoder" in error["message"]
    assert "Field required" in error["message"]
    FIGURES["pristine"] = "fails, as it must: " + summary(report)


def test_all_patches_extract_correct_hidden_states(target: Path, model: Path):
    assert_every_selected_patch_applies(target)
    report = extract(target, model, "all", "all patches")
    assert_all_correct(report)
    # The batches are the ones the issue asks for.
    assert len(report["calls"]) == 5 and report["prompts_per_call"][2] > 10
    assert report["tokens_per_call"][2] > 8192  # more than one step's token budget
    assert report["prompts_per_call"][4] > 2 * report["max_num_seqs"] == 64  # three rounds of requests
    assert 0 in report["layer_ids"] and 3 in report["layer_ids"]  # non-final and final layers
    FIGURES["all patches"] = (
        f"{report['prompts_checked']} prompts in {len(report['calls'])} calls, layers {report['layer_ids']}, "
        f"max abs diff {report['max_abs_diff']:.3f} at scale {report['scale']:.1f}, "
        f"max per-row relative diff {report['max_rel_diff']:.3f} (tolerance {report['tolerance']})"
    )


@pytest.mark.skipif(not NOT_NEEDED, reason=f"no patch declares a run on {RELEASE} that passes without it")
def test_the_patches_this_run_does_not_need_can_all_go(target: Path, model: Path):
    # each declares LeaveOneOut(RELEASE, None): v4 (the CPU platform forces async scheduling off
    # anyway), v8 (DeepSeek-V2 family only), v20 (multimodal wrappers and, before vLLM 0.18,
    # DeepSeek-V2-family models: tests/test_e2e_moe_cpu.py), v1 (with v6 turning prefix caching off, the block pool
    # never hashes a block; its symptom needs v6 out too, below): one run without all of them
    patch_as(target, *NOT_NEEDED)
    report = extract(target, model, "all", "without " + ", ".join(NOT_NEEDED))
    assert_all_correct(report)


@pytest.mark.parametrize("patch,run", NEEDED, ids=[run_id(p, r) for p, r in NEEDED])
def test_without_it_the_declared_symptom_shows(target: Path, model: Path, patch, run):
    """Each patch's declared leave-one-out on this release (Patch.leave_one_out): the symptom its
    `without_it` names, as the extraction driver reports it (type, phase, message, where raised)
    or, for a silent one, rows that come back short or wrong."""
    problems, said = leave_out(target, model, patch, run)
    assert not problems, f"{run_id(patch, run)}: {problems}; the run said: {said}"
    FIGURES[run_id(patch, run)] = "its declared symptom, as it must: " + said


def test_rollback_brings_the_original_failure_back(target: Path, model: Path):
    code, _doc, err = patcher("rollback", "--python", str(target), "--json")
    assert code == 0, err
    assert pristine(target)
    report = extract(target, model, "1", "after rollback")
    error = error_of(report)
    assert error["type"] == "ValidationError" and error["phase"] == "init", error
    said = "fails, as it must: " + summary(report)
    assert said == FIGURES.get("pristine", said)  # the same failure as before any patch


def test_report(capsys):
    """Not a check: the figures and timings of this run, for the docs and the log. The failures
    in it are the ones the tests above required, one line each (tests/support/e2e.py summary)."""
    with capsys.disabled():
        print("\nend-to-end on vLLM 0.16.0 (CPU), every check above passed:")
        for label, text in FIGURES.items():
            print(f"  {label}: {text}")
        for label, seconds in TIMINGS.items():
            print(f"  {label}: {seconds:.0f}s")
        print(f"  extraction runs: {len(TIMINGS)}, {sum(TIMINGS.values()):.0f}s in all")
