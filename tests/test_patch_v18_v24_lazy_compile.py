"""v18 on the real demo environment (torch 2.10, a CUDA build, on a machine without a GPU): after
the patch, `import speculators` never asks torch for the CUDA device count; before it, and after
rollback, it does, through speculators/models/eagle3/core.py's @torch.compile.

That call, torch._C._cuda_getDeviceCount(), is what initialises CUDA in the parent process on a
GPU host without setting torch.cuda.is_initialized(), so that vLLM forks workers that then die
("Cannot re-initialize CUDA in forked subprocess"; seen on an H200, bench/gpu/results/). The call
happens the same way without a GPU, so it is counted here: a wrapper installed before the import,
in the target's own interpreter, records each call and the stack it came from.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import patcher, sha, states
from tests.support.e2e import rolled_back_overlay
from workbench.envs import site_file

pytestmark = pytest.mark.vllm

CORE = "speculators/models/eagle3/core.py"
PRISTINE_CORE = "adec1633736c5c3f9d9cef895e48576ebbed6e43ca74e4d7e0af77388f876dd6"

PROBE = r"""
import json, sys, traceback
import torch

stacks = []
count_devices = torch._C._cuda_getDeviceCount

def counting():
    stacks.append("".join(traceback.format_stack()))
    return count_devices()

torch._C._cuda_getDeviceCount = counting
import speculators
from speculators.models.eagle3.core import Eagle3DraftModel

print(json.dumps({
    "calls": len(stacks),
    "through_eagle3_core": sum("speculators/models/eagle3/core.py" in s for s in stacks),
    "benchmarking_imported": "torch._inductor.runtime.benchmarking" in sys.modules,
    "forward": Eagle3DraftModel.forward.__qualname__,
}))
"""


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    with rolled_back_overlay(tmp_path_factory.mktemp("lazy-compile"), demo_python) as python:
        yield python


def probe(python: Path) -> dict:
    proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_unpatched_import_asks_cuda_through_torch_compile(target: Path):
    assert sha(site_file(target, CORE)) == PRISTINE_CORE
    seen = probe(target)
    assert seen["calls"] >= 1 and seen["through_eagle3_core"] >= 1, seen
    assert seen["benchmarking_imported"], seen


def test_after_v18_importing_speculators_never_asks_cuda(target: Path):
    code, doc, err = patcher("apply", "--python", str(target), "--only", "v18", "--no-verify", "--json")
    assert code == 0, err
    assert states(doc)["v18-lazy-compile"] == "applied", states(doc)
    assert doc["targets"][0]["versions"]["torch"].startswith("2.10"), doc["targets"][0]["versions"]
    seen = probe(target)
    assert seen["calls"] == 0, seen
    assert not seen["benchmarking_imported"], seen
    assert seen["forward"] == "Eagle3DraftModel.forward", seen  # functools.wraps keeps the method's name


def test_rollback_brings_the_call_back(target: Path):
    code, _, err = patcher("rollback", "--python", str(target), "--only", "v18")
    assert code == 0, err
    assert sha(site_file(target, CORE)) == PRISTINE_CORE
    assert probe(target)["calls"] >= 1


@pytest.fixture(scope="module")
def target_0_4(tmp_path_factory, demo_python: Path):
    with rolled_back_overlay(tmp_path_factory.mktemp("lazy-compile-04"), demo_python, "0.4.0.1") as python:
        yield python


def test_speculators_0_4_asks_cuda_at_import_and_v24_stops_it(target_0_4: Path):
    # 0.4.0's conditional_torch_compile asks torch.cuda.is_available() at class definition
    pristine = sha(site_file(target_0_4, CORE))
    seen = probe(target_0_4)
    assert seen["calls"] >= 1 and seen["through_eagle3_core"] >= 1, seen
    code, doc, err = patcher("apply", "--python", str(target_0_4), "--only", "v24", "--no-verify", "--json")
    assert code == 0, err
    assert states(doc)["v24-lazy-conditional-compile"] == "applied", states(doc)
    seen = probe(target_0_4)
    assert seen["calls"] == 0, seen
    assert seen["forward"] == "Eagle3DraftModel.forward", seen
    code, _, err = patcher("rollback", "--python", str(target_0_4), "--only", "v24")
    assert code == 0 and sha(site_file(target_0_4, CORE)) == pristine, err
