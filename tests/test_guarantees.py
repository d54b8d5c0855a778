"""Nothing lost, ever: concurrency, damaged backups, pip, bytecode, hostile paths, permissions,
and random sequences of operations, each with real processes and real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher, sha, states
from tests.support.files import GENERATOR, PRISTINE_GENERATOR
from workbench.envs import PYTHON_FOR_TARGETS, light_env, site_file
from workbench.release_files import cache_dir, download_wheel

PATCHES = load_patches()
TARGETS = sorted({p.target.path for p in PATCHES})


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def state_dir(python: Path) -> Path:
    return python.parent.parent / "share" / "patcher"


@pytest.fixture
def env(tmp_path: Path) -> Path:
    return light_env(tmp_path)


def test_two_runs_at_once_never_interleave(env: Path):
    pristine = files(env)
    slow = subprocess.Popen(
        [sys.executable, "-m", "patcher.cli", "apply", "--python", str(env), "--no-verify"],
        env={**os.environ, "PATCHER_FAULT": json.dumps({"at": "intent-recorded", "action": "pause", "seconds": 20})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    state = state_dir(env) / "state.json"
    deadline = time.monotonic() + 60
    while not (state.exists() and "pending" in state.read_text()):
        assert time.monotonic() < deadline and slow.poll() is None, slow.communicate()
        time.sleep(0.05)
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", "--lock-timeout", "0.5", "--json")
    assert code == 5, err
    assert "another patcher run holds" in doc["targets"][0]["message"]
    assert files(env) == pristine  # the first run is still paused before writing any file
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", "--lock-timeout", "60", "--json")
    assert slow.wait(timeout=60) == 0, slow.communicate()
    assert code == 0, err
    assert doc["targets"][0]["message"].startswith("nothing to do")
    assert files(env) != pristine


@pytest.mark.parametrize("damage", ["missing", "corrupted"])
def test_damaged_backup_is_refused_and_nothing_written(env: Path, damage: str):
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    patched = files(env)
    backup = state_dir(env) / "backups" / f"{PRISTINE_GENERATOR}.py"
    if damage == "missing":
        backup.unlink()
    else:
        backup.write_bytes(backup.read_bytes().replace(b"import", b"imp0rt", 1))
    code, doc, err = patcher("rollback", "--python", str(env), "--json")
    assert code == 3, err
    assert "pristine backup" in doc["targets"][0]["message"] and "force-reinstall" in doc["targets"][0]["message"]
    assert files(env) == patched


def test_pip_force_reinstall_and_uninstall(tmp_path: Path):
    env = tmp_path / "pipenv"
    subprocess.run([PYTHON_FOR_TARGETS, "-m", "venv", str(env)], check=True)
    python = env / "bin" / "python"
    wheel = download_wheel("speculators", "0.3.0", cache_dir() / "wheels")
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check"]
    subprocess.run([*pip, str(wheel)], check=True)
    from workbench.envs import fabricate_dist

    fabricate_dist(env, "vllm", "0.16.0")
    pristine = files(python)
    assert patcher("apply", "--python", str(python), "--no-verify")[0] == 0
    patched = files(python)
    subprocess.run([*pip, "--force-reinstall", str(wheel)], check=True)
    assert files(python) == pristine
    code, doc, _ = patcher("status", "--python", str(python), "--json")
    assert code == 0 and states(doc)["v3-signatures"] == "pending"
    assert patcher("apply", "--python", str(python), "--no-verify")[0] == 0
    assert files(python) == patched
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "speculators"], check=True)
    package = site_file(python, "speculators")
    assert not package.exists() or not list(package.rglob("*")), list(package.rglob("*"))


@pytest.mark.parametrize("mode", ["checked-hash", "unchecked-hash", "timestamp"])
def test_no_stale_bytecode_after_apply_or_rollback(env: Path, mode: str):
    target = site_file(env, GENERATOR)

    def compiled() -> list[Path]:
        return sorted((target.parent / "__pycache__").glob(target.stem + ".*.pyc"))

    subprocess.run([str(env), "-m", "compileall", "-q", "--invalidation-mode", mode, str(target)], check=True)
    assert compiled()
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    assert compiled() == []
    subprocess.run([str(env), "-m", "compileall", "-q", "--invalidation-mode", mode, str(target)], check=True)
    assert patcher("rollback", "--python", str(env))[0] == 0
    assert compiled() == []


def test_state_record_path_leaving_site_packages_is_refused(env: Path, tmp_path: Path):
    outside = tmp_path / "precious.py"
    outside.write_text("keep me\n")
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    record = state_dir(env) / "state.json"
    state = json.loads(record.read_text())
    entry = dict(state["files"][GENERATOR])
    state["files"]["../../../../../../" + str(outside).lstrip("/")] = entry
    record.write_text(json.dumps(state))
    code, doc, err = patcher("forget", "--python", str(env), "--all", "--json")
    assert code == 3, err
    assert "none of the files patcher's patches rewrite" in doc["targets"][0]["message"]
    assert outside.read_text() == "keep me\n"


def test_symlink_pointing_outside_is_refused(env: Path, tmp_path: Path):
    outside = tmp_path / "elsewhere.py"
    target = site_file(env, GENERATOR)
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    code, doc, err = patcher("apply", "--python", str(env), "--no-verify", "--json")
    assert code == 3, err
    assert "leaves" in doc["targets"][0]["message"]
    assert sha(outside) == PRISTINE_GENERATOR


def test_mode_and_ownership_are_kept(env: Path):
    target = site_file(env, GENERATOR)
    os.chown(target, 1234, 2345)
    target.chmod(0o640)
    assert patcher("apply", "--python", str(env), "--no-verify")[0] == 0
    assert sha(target) != PRISTINE_GENERATOR
    st_ = target.stat()
    assert (st_.st_uid, st_.st_gid, st_.st_mode & 0o7777) == (1234, 2345, 0o640)
    assert patcher("rollback", "--python", str(env))[0] == 0
    st_ = target.stat()
    assert sha(target) == PRISTINE_GENERATOR
    assert (st_.st_uid, st_.st_gid, st_.st_mode & 0o7777) == (1234, 2345, 0o640)


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's override capabilities to play a user without write access")
def test_user_without_write_access_gets_a_clear_error(env: Path):
    venv = env.parent.parent
    subprocess.run(["chown", "-R", "65534:65534", str(venv)], check=True)
    before = files(env)
    drop = "-dac_override,-fowner,-dac_read_search"
    proc = subprocess.run(
        [
            "setpriv",
            "--bounding-set",
            drop,
            "--inh-caps",
            drop,
            sys.executable,
            "-m",
            "patcher.cli",
            "apply",
            "--python",
            str(env),
            "--no-verify",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr
    assert "run as a user who can write" in proc.stderr
    # one line says it, once (no "failed: error: ..." doubling)
    assert len([line for line in proc.stderr.splitlines() if "run as a user who can write" in line]) == 1, proc.stderr
    assert "error: " not in proc.stderr.replace("failed: ", ""), proc.stderr
    assert "Traceback" not in proc.stderr
    assert files(env) == before


# ------------------------------------------------------------------ random sequences

OPERATIONS = st.one_of(
    st.tuples(st.just("apply"), st.sampled_from(["", "--only", "--skip"]), st.sampled_from(PATCHES)),
    st.tuples(st.just("rollback"), st.sampled_from(["", "--only"]), st.sampled_from(PATCHES)),
    st.tuples(st.just("reinstall"), st.just(""), st.just(None)),
    st.tuples(st.just("hand-edit"), st.just(""), st.just(None)),
)


def expected_bytes(original: dict[str, bytes], record: dict) -> dict[str, set[bytes]]:
    """What each file may be, given the record: its original, or the original with exactly the
    recorded patches (and edits) applied in canonical order."""
    from patcher.transform.transforms import transform_source

    by_id = {p.id: p for p in PATCHES}
    allowed = {rel: {data} for rel, data in original.items()}
    for rel, entry in record.get("files", {}).items():
        for recorded in (entry, entry.get("pending") or {}):
            ids = recorded.get("patches") or []
            if not ids:
                continue
            steps = [(by_id[i], [e for e in by_id[i].edits if e.name in recorded["edits"].get(i, [])]) for i in ids]
            allowed[rel].add(transform_source(original[rel].decode(), steps).result.encode())
    return allowed


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPERATIONS, min_size=2, max_size=5))
def test_random_sequences_keep_the_promise(tmp_path_factory, ops):
    python = light_env(tmp_path_factory.mktemp("prop"))
    original = files(python)
    edited: set[str] = set()
    for op, flag, patch in ops:
        if op == "reinstall":
            for rel, data in original.items():
                site_file(python, rel).write_bytes(data)
            edited.clear()
            continue
        if op == "hand-edit":
            target = site_file(python, GENERATOR)
            target.write_bytes(target.read_bytes() + b"# hand edit\n")
            edited.add(GENERATOR)
            continue
        args = [op, "--python", str(python), "--json"] + (["--no-verify"] if op == "apply" else [])
        if flag:
            args += [flag, patch.short_id]
        code, doc, err = patcher(*args)
        assert code in ((3,) if edited else (0,)), (ops, op, err)
        assert "Traceback" not in err
        record = (
            json.loads((state_dir(python) / "state.json").read_text())
            if (state_dir(python) / "state.json").exists()
            else {}
        )
        allowed = expected_bytes(original, record)
        for rel, data in files(python).items():
            if rel not in edited:
                assert data in allowed[rel], (ops, op, rel)
        # status tells the truth: it agrees with the bytes on disk
        code, doc, err = patcher("status", "--python", str(python), "--json")
        assert code == (3 if edited else 0), err
        if not edited:
            applied_files = {p["file"] for p in doc["targets"][0]["patches"] if p["state"] == "applied"}
            for rel, data in files(python).items():
                assert (data != original[rel]) == (rel in applied_files), (ops, rel)
    if edited:  # recover the way the message says: reinstall
        for rel, data in original.items():
            site_file(python, rel).write_bytes(data)
    code, _, err = patcher("rollback", "--python", str(python))
    assert code == 0, err
    assert files(python) == original
