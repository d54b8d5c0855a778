"""The release matrix's short form for speculators 0.4.0.1 (docs/speculators-releases.md), on the
vLLM 0.16.0 CPU environment the suite builds anyway: pristine 0.4.0.1 cannot start on a host
without a GPU (v23's symptom); `patcher apply` alone (verification included) makes it extract the
right hidden states, whole and in the caller's order; without v22 a call of eleven prompts comes
back out of order, silently; rollback restores the original bytes.

Three vLLM starts (the 0.3.0 module makes about ten): each prompt of the driver's four calls checked
against transformers, as in tests/test_e2e_vllm.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.support.cli import patcher
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
    assert applied == {"v8", "v22", "v23", "v24", "v26"}, entry["patches"]
    report = extract(target, model, "all", "0.4.0.1 patched")
    assert_all_correct(report)
    assert len(prompts(report, 3)) == 11  # the call over the step budget, and over ten prompts
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
