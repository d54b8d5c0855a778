"""Tensor parallel 2 on vLLM's CPU build (0.16.0, the demo environment): the multi-rank path that
GPU fleets run (the capture on rank 0 only, the single reply of `unique_reply_rank`, the shared
buffer written by rank 0 while rank 1 captures nothing, 0.4's per-request order) on every commit.

vLLM's CPU build runs each rank as a process of its own (gloo, started with spawn), with the
threads of each rank bound to a share of the CPUs this process may use (extract.py's
`cpu_thread_binding`; vLLM's own "auto" binding asks for a NUMA node a rank). What only GPUs show
(NCCL, CUDA IPC, custom all-reduce, the fork fix of v24) is in docs/gpu.md's records.

One vLLM start a speculators line: every call of the driver checked against transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from patcher.run_check.extract import cpu_thread_binding
from tests.support.cli import patcher
from tests.support.e2e import assert_all_correct, extract, prompts, rolled_back_overlay

pytestmark = pytest.mark.vllm

RANKS = 2


@pytest.fixture(scope="module", params=["0.3.0", "0.4.0.1"])
def target(request, tmp_path_factory, demo_python: Path):
    folder = tmp_path_factory.mktemp(f"tp-{request.param}")
    with rolled_back_overlay(folder, demo_python, request.param) as python:
        code, doc, err = patcher("apply", "--python", str(python), "--json")
        assert code == 0, err
        assert doc["targets"][0]["message"].endswith("verified"), doc["targets"][0]["message"]
        yield python, request.param


def test_every_call_matches_at_tensor_parallel_2(target: tuple[Path, str], model: Path):
    python, speculators = target
    report = extract(python, model, "all", f"speculators {speculators} at TP {RANKS}", tensor_parallel=RANKS)
    assert_all_correct(report)
    assert report["tensor_parallel_size"] == RANKS
    assert report["cpu_thread_binding"] == cpu_thread_binding(RANKS, sorted(os.sched_getaffinity(0)))
    # the shared buffer carried every call's states (rank 0 wrote them; rank 1 has none to give)
    assert report["transfer"] == {"path": "shared memory", "calls": report["planned_calls"]}, report["transfer"]
    assert len(prompts(report, 3)) == 11  # the call over the step budget: prompts continued over steps


@pytest.mark.parametrize(
    ("ranks", "cpus", "binding"),
    [
        (2, [0, 1], "0|1"),
        (2, [0, 1, 2, 3, 4], "0,1|2,3"),
        (4, [2, 3, 6, 7], "2|3|6|7"),
        (8, [0, 1], "0|1|0|1|0|1|0|1"),  # more ranks than CPUs: they take turns
    ],
)
def test_cpu_thread_binding_gives_each_rank_its_share(ranks: int, cpus: list[int], binding: str):
    assert cpu_thread_binding(ranks, cpus) == binding
