"""The release matrix's short form for speculators 0.4.0.1 (docs/speculators-releases.md), on the
vLLM 0.16.0 CPU environment the suite builds anyway: pristine 0.4.0.1 cannot start on a host
without a GPU (v23's symptom); `patcher apply` alone (verification included) makes it extract the
right hidden states, whole and in the caller's order, in calls of any size (33 prompts, 70: more
than the 32 requests its scheduler runs at once), with nothing of a call left for the next (in
the scheduler or the worker); without v22 a call of eleven prompts comes back out of order,
silently; without v25 a call of more than 32 prompts fails, in the driver and in `patcher verify
--run`; rollback restores the original bytes.

Five vLLM starts and one run check (the 0.3.0 module makes about ten): each prompt of the
driver's five calls checked against transformers, as in tests/test_e2e_vllm.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.support.cli import patcher
from tests.support.declared import leave_one_outs, report_shows
from tests.support.e2e import assert_all_correct, error_of, extract, prompts, rolled_back_overlay, summary
from workbench.envs import site_file

pytestmark = pytest.mark.vllm

SPECULATORS = "0.4.0.1"
GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"
WORKER = "speculators/data_generation/custom_worker.py"


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    with rolled_back_overlay(tmp_path_factory.mktemp("e2e-04"), demo_python, SPECULATORS) as python:
        yield python


def hashes(python: Path) -> dict[str, str]:
    return {rel: hashlib.sha256(site_file(python, rel).read_bytes()).hexdigest() for rel in (GENERATOR, WORKER)}


def test_pristine_0_4_0_1_cannot_start_without_a_gpu(target: Path, model: Path):
    report = extract(target, model, "1", "0.4.0.1 pristine")
    error = error_of(report)
    # the index's torch is a CUDA build: speculators' mem_get_info asks CUDA on this GPU-less host
    assert error["phase"] == "init" and error["type"] == "RuntimeError", error
    assert "Found no NVIDIA driver" in error["message"], error


def test_apply_alone_makes_it_extract_right_whole_and_in_order(target: Path, model: Path):
    pristine = hashes(target)
    code, doc, err = patcher("apply", "--python", str(target), "--json")
    assert code == 0, err
    entry = doc["targets"][0]
    assert entry["message"].endswith("verified"), entry["message"]
    applied = {p["id"].split("-", 1)[0] for p in entry["patches"] if p["state"] == "applied"}
    assert applied == {"v8", "v22", "v23", "v24", "v25", "v26", "v27", "v29"}, entry["patches"]
    # the driver's five calls, then call 5's first 33 prompts (one past max_num_seqs), then call 1
    # again: in one generator, nothing a call leaves behind may reach the next
    report = extract(target, model, "1,2,3,4,5,5:33,1", "0.4.0.1 patched")
    assert_all_correct(report)
    assert report["max_num_seqs"] == 32  # speculators' MAX_NUM_SEQS: what the scheduler runs at once
    assert report["prompts_per_call"] == [7, 5, 11, 4, 70, 33, 7], report["prompts_per_call"]
    assert len(prompts(report, 3)) == 11  # the call over the step budget, and over ten prompts
    assert report["prompts_checked"] == 137 == report["prompts_ok"]
    # after every call nothing of it stays, in the scheduler or the worker (v25 and v29; the driver
    # fails a call that leaves any)
    assert report["worker_requests_after_call"] == [0] * 7 == report["scheduler_requests_after_call"]
    code, _, err = patcher("rollback", "--python", str(target), "--json")
    assert code == 0 and hashes(target) == pristine, err


def test_without_v22_eleven_prompts_come_back_out_of_order(target: Path, model: Path):
    code, _, err = patcher("apply", "--python", str(target), "--skip", "v22", "--json")
    assert code == 0, err
    report = extract(target, model, "3", "0.4.0.1 without v22")
    assert report["error"] is None, summary(report)
    statuses = [p["status"] for p in prompts(report, 3)]
    # sorted('req_2_0', ..., 'req_2_10'): 0, 1, 10, 2, ..., 9: position 2 holds prompt 10's states
    assert statuses[:2] == ["ok", "ok"] and "ok" not in statuses[2:], statuses
    assert not any(p["input_ids_ok"] for p in prompts(report, 3)[2:])


def test_without_v25_a_call_of_more_than_32_prompts_fails(target: Path, model: Path):
    code, _, err = patcher("rollback", "--python", str(target), "--json")
    assert code == 0, err
    code, _, err = patcher("apply", "--python", str(target), "--skip", "v25", "--json")
    assert code == 0, err  # verification binds every call: only running it shows the failure
    # v25's declared leave-one-out on this release (the release matrix records it as a row too)
    (run,) = [r for p, r in leave_one_outs("0.16.0", speculators=SPECULATORS) if p.short_id == "v25"]
    report = extract(target, model, run.calls, "0.4.0.1 without v25")
    problems = report_shows(run.symptom, report)
    assert not problems, (problems, summary(report))
    assert report["prompts_per_call"] == [70] and report["max_num_seqs"] == 32
    assert report["error"]["message"].startswith("Request req_0_32 not found in captured states. Available: ")


def test_verify_run_fails_on_a_target_without_v25(target: Path, model: Path):
    # the state the previous test left: every patch but v25, applied and verified
    code, doc, err = patcher("status", "--python", str(target), "--json")
    assert code == 0, err
    states = {p["id"].split("-", 1)[0]: p["state"] for p in doc["targets"][0]["patches"]}
    assert states["v25"] == "pending" and states["v22"] == "applied", states
    code, doc, err = patcher("verify", "--run", "--model", str(model), "--python", str(target), "--json", timeout=900)
    assert code == 1, err[-3000:]
    report = doc["targets"][0]
    check = report["run_check"]
    assert check["ok"] is False and check["whole_and_in_order"] is False, check
    (problem,) = check["problems"]
    assert problem.startswith(
        "generate() call 5 failed: RuntimeError: Request req_4_32 not found in captured states."
    ), problem
    assert "the patch that releases prefilled requests is not applied" in problem, problem
    assert "run check FAILED on cpu with " in report["message"], report["message"]
    assert ": generate() call 5 failed: RuntimeError: Request req_4_32 not found" in report["message"]
    code, _, err = patcher("rollback", "--python", str(target), "--json")
    assert code == 0, err
