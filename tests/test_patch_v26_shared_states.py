"""v26 on the real vLLM 0.16.0 (CPU build) with speculators 0.4.0.1: the captured states come back
through the shared host buffer, the same tensors to the last bit as through the RPC queue without
v26, each result owning its storage and valid after later calls and after the generator is gone;
the worker cuts requests exactly as 0.4's _get_captured_states does, also where the steps'
metadata and the captured rows disagree; and no file of the transfer, nor any new shared-memory
segment, is left after a run, after an exception raised in the worker during the transfer, or
after a SIGINT at any moment of it (before the request, while the caller waits, after the reply)
or in the middle of a loop of calls.

The driver (tests/support/shared_states_driver.py, as for v21) runs in a throwaway target with
speculators 0.4.0.1 over the demo environment, patched through the real CLI; one vLLM at a time
(one run for every moment of the SIGINT, one with v26 for two tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.e2e import patch_as, rolled_back_overlay
from tests.support.shared_states import Leftovers, drive, equal_in_target, interrupt_a_loop
from tests.support.shared_states_driver import MOMENTS

pytestmark = pytest.mark.vllm

SPECULATORS = "0.4.0.1"


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    with rolled_back_overlay(tmp_path_factory.mktemp("v26"), demo_python, SPECULATORS) as python:
        yield python


@pytest.fixture(scope="module")
def with_v26(target: Path, model: Path, tmp_path_factory) -> dict:
    """One run with every patch: its report, what it left, its first call's tensors (--dump)."""
    states = patch_as(target)
    assert states["v26"] == "applied", states
    dump = tmp_path_factory.mktemp("with-v26") / "with.pt"
    with Leftovers() as left:
        report = drive(target, model, "run", "--dump", str(dump))
    return {"report": report, "left": left, "dump": dump}


def test_v26_states_own_their_storage_stay_valid_and_leave_nothing(with_v26: dict):
    report, left = with_v26["report"], with_v26["left"]
    assert report["ok"], report
    assert report["transfer"] == {"path": "shared memory", "calls": 3}, report["transfer"]
    assert report["devices"] == ["cpu"]
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)


def test_without_v26_the_rpc_queue_carries_the_same_tensors(target: Path, model: Path, tmp_path: Path, with_v26):
    """The leave-one-out: the old path, and bit for bit the tensors v26 returns (CPU build)."""
    assert with_v26["report"]["ok"], with_v26["report"]
    states = patch_as(target, "v26")
    assert states["v26"] != "applied", states
    report = drive(target, model, "run", "--dump", str(tmp_path / "without.pt"))
    assert report["ok"], report
    assert report["transfer"]["path"] == "RPC queue", report["transfer"]
    compared = equal_in_target(target, with_v26["dump"], tmp_path / "without.pt")
    assert compared["same_count"] and compared["tensors"] == (7 + 11) * 3, compared  # two calls: one step, two steps
    assert compared["bit_equal"], compared


def test_the_worker_cuts_requests_as_0_4_does_whatever_the_metadata_says(target: Path, model: Path):
    # 300 random captures, against 0.4's own _get_captured_states in the same process (no vLLM)
    patch_as(target)
    with Leftovers() as left:
        report = drive(target, model, "cuts")
    assert report["ok"], report
    assert report["transfer"] == {"path": "shared memory", "calls": 300}, report["transfer"]
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)


def test_an_exception_in_the_worker_during_the_transfer_leaves_nothing(target: Path, model: Path):
    # the driver takes a row off one captured layer just before the transfer: v26's write refuses it
    patch_as(target)
    with Leftovers() as left:
        report = drive(target, model, "worker-error")
    assert report["ok"], report
    assert report["error"]["type"] == "RuntimeError", report["error"]
    assert "captured layer 2 has steps of [999] rows, the first layer [1000]" in report["error"]["message"], report
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)


@pytest.fixture(scope="module")
def interrupted(target: Path, model: Path) -> dict:
    """One driver run that interrupts a call at each of MOMENTS in turn (one vLLM start for all)."""
    patch_as(target)
    with Leftovers() as left:
        report = drive(target, model, "sigint")
    return {"report": report, "left": left}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_sigint_during_the_transfer_leaves_nothing(interrupted: dict, moment: str):
    report, left = interrupted["report"], interrupted["left"]
    assert moment in report.get("moments", {}), report
    seen = report["moments"][moment]
    assert seen.get("interrupted"), report
    assert seen["rpc_file"] and not seen["file_left"], seen
    if moment == "during-rpc":  # the worker went on after the caller had removed the name: it made none
        assert seen["late_reply"]["reply"]["unavailable"].startswith("FileNotFoundError"), seen
    if moment == "after-reply":
        assert seen["reply_made_file"], seen  # the worker had sized and mapped the file
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)


def test_ctrl_c_in_a_loop_of_calls_leaves_nothing(target: Path, model: Path):
    patch_as(target)
    run = interrupt_a_loop(target, model)
    assert run["calls"] and run["calls"][-1]["path"] == "shared memory", run["calls"]
    assert run["code"] != 0  # KeyboardInterrupt
    left = run["left"]
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)
