"""End to end on the real vLLM 0.32.0 (CPU build, torch 2.13.0, transformers 5.19.0: the recipe
in patcher/demo/releases.json), pinned: the newest release patcher is tested on in CI.

Lean on purpose (CI has 2 cores): one generate batch with every patch, and the leave-one-out of
each patch this release needs that 0.16 does not (v13-v16), each asserting its own symptom.
The 0.16 module (tests/test_e2e_vllm.py) covers the rest; bench/releases.py runs every release.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import patcher
from tests.support.e2e import error_of, extract, patch_as, pristine, summary
from tests.support.envs import overlay_env

pytestmark = pytest.mark.vllm

VLLM = "0.32.0"


@pytest.fixture(scope="module")
def demo_python() -> Path:
    from patcher.demo.environment import build_demo_env

    return build_demo_env(progress=lambda message: None, vllm=VLLM)


@pytest.fixture(scope="module")
def model() -> Path:
    # made once with the 0.16 environment (the same weights every release reads)
    from patcher.demo.environment import build_demo_env
    from patcher.demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model(build_demo_env(progress=lambda message: None), progress=lambda message: None)


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    python = overlay_env(tmp_path_factory.mktemp("e2e032"), demo_python)
    try:
        yield python
    finally:
        patcher("rollback", "--python", str(python))


def test_every_patch_it_needs_is_selected_and_one_batch_is_correct(target: Path, model: Path):
    _code, doc, _err = patcher("status", "--python", str(target), "--json")
    versions = doc["targets"][0]["versions"]
    assert versions["vllm"].startswith(VLLM) and versions["transformers"] == "5.19.0", versions
    assert versions["torch"].startswith("2.13.0"), versions
    states = patch_as(target)
    assert states.pop("v12") == "not-selected"  # vLLM 0.33's module move
    assert states.pop("v17") == "not-selected"  # transformers 5.24's removal
    assert all(state == "applied" for state in states.values()), states
    report = extract(target, model, "1", "0.32 all patches")
    assert report["error"] is None, summary(report)
    assert report["calls"] and all(p["status"] == "ok" for c in report["calls"] for p in c["prompts"]), summary(report)
    assert report["max_rel_diff"] <= report["tolerance"]


def test_the_run_check_passes_on_the_patched_environment(target: Path):
    """`patcher verify --run` (issue: the run check passes on the patched 0.16 and 0.32 environments):
    the same tiny model, made inside the target by its own transformers 5.19, through speculators and
    vLLM 0.32, against transformers."""
    states = patch_as(target)
    assert states["v19"] == "applied", states  # vLLM 0.32 defaults to Model Runner V2 where Triton is
    code, doc, err = patcher("verify", "--run", "--python", str(target), "--json")
    assert code == 0, err[-3000:]
    check = doc["targets"][0]["run_check"]
    assert check["ok"] and check["cannot_run"] is None and check["problems"] == [], check
    assert check["device"] == "cpu" and check["whole_and_in_order"] is True
    assert check["calls"] == 4 and check["prompts"] == check["prompts_ok"] >= 25
    assert 0 < check["max_rel_diff"] <= check["tolerance"] == 0.25
    print(
        f"\nrun check on 0.32: {check['timings']}, peak {check['peak_rss_mib']} MiB, max rel {check['max_rel_diff']:.3f}"
    )


def test_without_v13_request_refuses_eos_token_id(target: Path, model: Path):
    patch_as(target, "v13")
    error = error_of(extract(target, model, "1", "0.32 without v13"))
    assert error["type"] == "TypeError" and error["phase"] == "generate 1", error
    assert "unexpected keyword argument 'eos_token_id'" in error["message"]


def test_without_v14_kv_cache_layout_unresolved(target: Path, model: Path):
    patch_as(target, "v14")
    error = error_of(extract(target, model, "1", "0.32 without v14"))
    assert error["type"] == "ValueError" and error["phase"] == "init", error
    assert "KV cache layout has not been resolved yet" in error["message"]


def test_without_v15_no_common_block_size(target: Path, model: Path):
    patch_as(target, "v15")
    error = error_of(extract(target, model, "1", "0.32 without v15"))
    assert error["phase"] == "init", error
    assert "No common block size for 16" in error["message"] + error.get("traceback", ""), error


def test_without_v16_speculators_does_not_import(target: Path, model: Path):
    patch_as(target, "v16")
    error = error_of(extract(target, model, "1", "0.32 without v16"))
    assert error["type"] == "PydanticUndefinedAnnotation" and error["phase"] == "import", error
    assert "name 'torch' is not defined" in error["message"]


def test_rollback_restores_the_pristine_files(target: Path):
    code, _doc, err = patcher("rollback", "--python", str(target))
    assert code == 0, err
    assert pristine(target)
