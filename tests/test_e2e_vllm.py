"""End to end on the real vLLM 0.16.0 (CPU build): patched speculators 0.3.0 extracts the right
hidden states, each needed patch is shown needed by its own symptom, and rollback brings the
original failure back.

The demo environment and the tiny model are built once per machine and reused (patcher.demo);
every run patches a throwaway overlay target on top of it (its own pristine speculators 0.3.0),
through the real CLI: `patcher rollback`, then `patcher apply --skip vN --no-verify` (verification
is tested in test_verify_vllm.py), then the extraction driver (patcher/demo/extract.py) in the
target's interpreter. One vLLM process at a time; about ten vLLM starts in all.

What each leave-one-out asserts is the symptom api-drift.md and the patches' notes describe,
as the driver reports it (exception type, message, where it was raised, or per-prompt rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import patcher
from tests.support.e2e import (
    TIMINGS,
    assert_all_correct,
    error_of,
    extract,
    patch_as,
    pristine,
    prompts,
    report_of,
    summary,
)
from tests.support.envs import overlay_env

pytestmark = pytest.mark.vllm

FIGURES: dict[str, str] = {}


# --- the pieces -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_python() -> Path:
    from patcher.demo.environment import build_demo_env

    return build_demo_env(progress=lambda message: None)


@pytest.fixture(scope="module")
def model(demo_python: Path) -> Path:
    from patcher.demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model(demo_python, progress=lambda message: None)


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    python = overlay_env(tmp_path_factory.mktemp("e2e"), demo_python)
    try:
        yield python
    finally:  # whatever happened, the target's speculators files end as pip installed them
        patcher("rollback", "--python", str(python), "--json")


# --- the tests, in order -----------------------------------------------------------------------


def test_pristine_0_3_0_fails_at_scheduler_config(target: Path, model: Path):
    assert pristine(target)
    report = extract(target, model, "1", "pristine")
    error = error_of(report)
    assert error["type"] == "ValidationError" and error["phase"] == "init", error
    assert "SchedulerConfig" in error["message"] and "is_encoder_decoder" in error["message"]
    assert "Field required" in error["message"]
    FIGURES["pristine"] = summary(report)


def test_all_patches_extract_correct_hidden_states(target: Path, model: Path):
    states = patch_as(target)
    # Every patch selected on vLLM 0.16 is applied; v12-v15 and v19 answer later vLLM releases,
    # v16-v17 transformers 5 (this environment has 4.57.6).
    for later in ("v12", "v13", "v14", "v15", "v16", "v17", "v19"):
        assert states.pop(later) == "not-selected", states
    assert all(state == "applied" for state in states.values()), states
    report = extract(target, model, "all", "all patches")
    assert_all_correct(report)
    # The batches are the ones the issue asks for.
    assert len(report["calls"]) == 4 and report["prompts_per_call"][2] > 10
    assert report["tokens_per_call"][2] > 8192  # more than one step's token budget
    assert 0 in report["layer_ids"] and 3 in report["layer_ids"]  # non-final and final layers
    FIGURES["all patches"] = (
        f"{report['prompts_checked']} prompts in {len(report['calls'])} calls, layers {report['layer_ids']}, "
        f"max abs diff {report['max_abs_diff']:.3f} at scale {report['scale']:.1f}, "
        f"max per-row relative diff {report['max_rel_diff']:.3f} (tolerance {report['tolerance']})"
    )


def test_v4_v8_v20_and_v1_are_not_needed_for_this_run(target: Path, model: Path):
    # v4: the CPU platform forces async_scheduling off anyway, and it never removed the
    # sample_tokens() contract (v5). v8: DeepSeek-V2 family only; v20: multimodal wrappers and, before
    # vLLM 0.18, DeepSeek-V2-family models (tests/test_e2e_moe_cpu.py). v1: with v6 turning prefix
    # caching off, the block pool never hashes a block (its symptom needs v6 out too, below).
    patch_as(target, "v1", "v4", "v8", "v20")
    report = extract(target, model, "all", "without v1, v4, v8, v20")
    assert_all_correct(report)


def test_without_v1_and_v6_the_block_pool_asserts(target: Path, model: Path):
    patch_as(target, "v1", "v6")
    error = error_of(extract(target, model, "1", "without v1+v6"))
    assert error["type"] == "AssertionError" and error["phase"] == "generate 1", error
    assert error["where"] == "block_pool.py:cache_full_blocks", error


def test_without_v2_tensor_truthiness(target: Path, model: Path):
    patch_as(target, "v2")
    error = error_of(extract(target, model, "1", "without v2"))
    assert error["type"] == "RuntimeError" and error["phase"] == "generate 1", error
    assert "Boolean value of Tensor with more than one value is ambiguous" in error["message"]


def test_without_v3_scheduler_config_validation_error(target: Path, model: Path):
    patch_as(target, "v3")
    error = error_of(extract(target, model, "1", "without v3"))
    assert error["type"] == "ValidationError" and error["phase"] == "init", error
    assert "is_encoder_decoder" in error["message"] and "Field required" in error["message"]


def test_without_v5_sample_tokens_state_error(target: Path, model: Path):
    patch_as(target, "v5")
    error = error_of(extract(target, model, "1,2", "without v5"))
    # call 1 fits in one step: the second execute_model() is the first of call 2
    assert error["type"] == "RuntimeError" and error["phase"] == "generate 2", error
    assert "sample_tokens() must be called after execute_model() returns None" in error["message"]


def test_without_v6_shared_prefixes_come_back_short(target: Path, model: Path):
    # Prefix caching on: call 1's prompt 3 (64 tokens) shares the 44-token chat template with
    # prompt 1, so two full KV blocks (32 tokens) come from the cache and only 32 rows are
    # computed. Without v10/v11 that is silent (the offsets hand later prompts wrong rows);
    # with them, the worker's row count per request turns it into an error naming it.
    patch_as(target, "v6")
    error = error_of(extract(target, model, "1,2", "without v6"))
    assert error["type"] == "RuntimeError" and error["phase"] == "generate 1", error
    assert "request req_0_3: captured 32 rows of hidden states, expected 64" in error["message"]
    FIGURES["without v6"] = summary(report_of(error))


def test_without_v7_worker_get_input_embeddings(target: Path, model: Path):
    patch_as(target, "v7")
    error = error_of(extract(target, model, "1", "without v7"))
    assert error["type"] == "RuntimeError" and error["phase"] == "init", error
    assert "has no attribute 'get_input_embeddings'" in error["message"]


def test_without_v9_no_cuda_driver(target: Path, model: Path):
    patch_as(target, "v9")
    error = error_of(extract(target, model, "1", "without v9"))
    assert error["type"] == "RuntimeError" and error["phase"] == "init", error
    assert "Found no NVIDIA driver" in error["message"]
    assert error["where"].endswith(":mem_get_info") or "mem_get_info" in error["traceback"], error


@pytest.mark.parametrize("skip", ["v11", "v10"])
def test_without_multistep_prefill_the_split_prompt_is_cut(target: Path, model: Path, skip: str):
    states = patch_as(target, skip)
    if skip == "v10":  # v11 needs v10: the engine leaves it out too
        assert states["v11"] != "applied", states
    report = extract(target, model, "3", f"without {skip}")
    assert report["error"] is None and not report["ok"], summary(report)
    long_batch = prompts(report, 3)
    total = sum(p["prompt_tokens"] for p in long_batch)
    assert len(long_batch) == 11 and total > 8192
    # the last prompt is the one vLLM's second step finishes: it comes back cut ...
    assert long_batch[-1]["rows"][0] < long_batch[-1]["prompt_tokens"], long_batch[-1]
    # ... and the one split across the steps gets rows of its neighbours
    assert any(p["status"] == "wrong" for p in long_batch[:-1]), long_batch
    FIGURES[f"without {skip}"] = summary(report)


def test_rollback_brings_the_original_failure_back(target: Path, model: Path):
    code, _doc, err = patcher("rollback", "--python", str(target), "--json")
    assert code == 0, err
    assert pristine(target)
    report = extract(target, model, "1", "after rollback")
    error = error_of(report)
    assert error["type"] == "ValidationError" and error["phase"] == "init", error
    assert summary(report) == FIGURES.get("pristine", summary(report))


def test_report(capsys):
    """Not a check: the figures and timings of this run, for the README and the log."""
    with capsys.disabled():
        print("\nend-to-end on vLLM 0.16.0 (CPU):")
        for label, text in FIGURES.items():
            print(f"  {label}: {text}")
        for label, seconds in TIMINGS.items():
            print(f"  {label}: {seconds:.0f}s")
        print(f"  extraction runs: {len(TIMINGS)}, {sum(TIMINGS.values()):.0f}s in all")
