"""End to end on the real vLLM 0.32.0 (CPU build, torch 2.13.0, transformers 5.19.0: the recipe
in patcher/demo/releases.json), pinned: the newest release patcher is tested on in CI.

Lean on purpose (CI has 2 cores): one generate batch with every patch, and each leave-one-out a
patch declares on this release (Patch.leave_one_out: v13-v16 today), each asserting its own
declared symptom.
The 0.16 module (tests/test_e2e_vllm.py) covers the rest; bench/releases.py runs every release.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import patcher
from tests.support.declared import leave_one_outs, run_id
from tests.support.e2e import (
    assert_every_selected_patch_applies,
    extract,
    leave_out,
    pristine,
    rolled_back_overlay,
    summary,
)
from workbench.envs import demo_env

pytestmark = pytest.mark.vllm

VLLM = "0.32.0"
NEEDED = [(p, run) for p, run in leave_one_outs(VLLM) if run.symptom is not None]


@pytest.fixture(scope="module")
def demo_python() -> Path:

    return demo_env(VLLM)


# model: tests/conftest.py (the 0.16 environment makes it; every release reads the same weights)


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    with rolled_back_overlay(tmp_path_factory.mktemp("e2e032"), demo_python) as python:
        yield python


def test_every_patch_it_needs_is_selected_and_one_batch_is_correct(target: Path, model: Path):
    _code, doc, _err = patcher("status", "--python", str(target), "--json")
    versions = doc["targets"][0]["versions"]
    assert versions["vllm"].startswith(VLLM) and versions["transformers"] == "5.19.0", versions
    assert versions["torch"].startswith("2.13.0"), versions
    assert_every_selected_patch_applies(target)
    report = extract(target, model, "1", "0.32 all patches")
    assert report["error"] is None, summary(report)
    assert report["calls"] and all(p["status"] == "ok" for c in report["calls"] for p in c["prompts"]), summary(report)
    assert report["max_rel_diff"] <= report["tolerance"]
    # the CPU build runs V1 (Model Runner V2 needs Triton): v27 leaves it to V1's own batch
    assert report["model_runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner", report["model_runner"]


def test_the_run_check_passes_on_the_patched_environment(target: Path):
    """`patcher verify --run` (issue: the run check passes on the patched 0.16 and 0.32 environments):
    the same tiny model, made inside the target by its own transformers 5.19, through speculators and
    vLLM 0.32, against transformers."""
    assert_every_selected_patch_applies(target)
    code, doc, err = patcher("verify", "--run", "--python", str(target), "--json")
    assert code == 0, err[-3000:]
    check = doc["targets"][0]["run_check"]
    assert check["ok"] and check["cannot_run"] is None and check["problems"] == [], check
    assert check["device"] == "cpu" and check["whole_and_in_order"] is True
    assert check["calls"] == 5 and check["prompts"] == check["prompts_ok"] == 97  # 70 in the fifth call
    assert 0 < check["max_rel_diff"] <= check["tolerance"] == 0.25
    print(
        f"\nrun check on 0.32: {check['timings']}, peak {check['peak_rss_mib']} MiB, max rel {check['max_rel_diff']:.3f}"
    )


@pytest.mark.parametrize("patch,run", NEEDED, ids=[run_id(p, r) for p, r in NEEDED])
def test_without_it_the_declared_symptom_shows(target: Path, model: Path, patch, run):
    """Each patch's declared leave-one-out on 0.32.0 (Patch.leave_one_out): the symptom its
    `without_it` names, as the extraction driver reports it."""
    problems, said = leave_out(target, model, patch, run)
    assert not problems, f"{run_id(patch, run)}: {problems}; the run said: {said}"


def test_rollback_restores_the_pristine_files(target: Path):
    code, _doc, err = patcher("rollback", "--python", str(target))
    assert code == 0, err
    assert pristine(target)
