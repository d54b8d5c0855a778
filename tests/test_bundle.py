"""`patcher bundle`: one standard-library file that patches, reports and rolls back on a host
with no controller. Run here with light target environments' own Pythons (3.11 and 3.9)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.frontends.bundle import PROGRAM_MARK, program_of, reseal
from patcher.patchset.registry import load_patches
from tests.support.cli import patcher
from tests.support.files import GENERATOR
from workbench.envs import demo_env, light_env, site_file
from workbench.pythons import find_python, python_or_skip

TARGETS = sorted({p.target.path for p in load_patches()})
GENERATOR_PATH = "speculators/data_generation/vllm_hidden_states_generator.py"  # patched on vLLM 0.16


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def run_bundle(bundle: Path, python: Path, *args: str) -> tuple[int, dict | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        [str(python), str(bundle), *args], capture_output=True, text=True, env=env, cwd="/", timeout=600
    )
    doc = json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else None
    return proc.returncode, doc, proc.stderr


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "patcher-bundle.py"
    code, _, err = patcher("bundle", "-o", str(out))
    assert code == 0, err
    assert "wrote" in err
    return out


def test_the_bundle_is_standard_library_only(bundle: Path):
    source = bundle.read_text()
    assert source.startswith("#!/usr/bin/env python3\n")
    loader = [line.strip() for line in source.split(PROGRAM_MARK)[0].splitlines()]  # one indented statement
    lines = [*loader, *program_of(source).splitlines()]
    imports = {line.split()[1].split(".")[0] for line in lines if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "argparse", "base64", "hashlib", "json", "re", "sys", "zlib"}
    assert os.access(bundle, os.X_OK)


def test_apply_writes_what_patcher_writes_and_patcher_agrees(bundle: Path, tmp_path: Path):
    target, reference = light_env(tmp_path / "a"), light_env(tmp_path / "b")
    pristine = files(target)
    code, doc, err = run_bundle(bundle, target, "status", "--json")
    assert code == 0, err
    assert doc["targets"][0]["versions"] == {"speculators": "0.3.0", "vllm": "0.16.0"}
    assert {p["state"] for p in doc["targets"][0]["patches"]} <= {"pending", "not-selected"}
    assert run_bundle(bundle, target, "plan")[0] == 6
    code, doc, err = run_bundle(bundle, target, "apply", "--no-verify", "--json")
    assert code == 0, err
    assert doc["targets"][0]["status"] == "changed"
    assert patcher("apply", "--no-verify", "--python", str(reference))[0] == 0
    assert files(target) == files(reference) != pristine  # the very bytes patcher writes

    # patcher reads the bundle's record as its own: every patch applied, nothing to do
    _, mine, _ = patcher("status", "--python", str(target), "--json")
    _, theirs, _ = patcher("status", "--python", str(reference), "--json")
    assert [(p["id"], p["state"]) for p in mine["targets"][0]["patches"]] == [
        (p["id"], p["state"]) for p in theirs["targets"][0]["patches"]
    ]
    assert mine["targets"][0]["message"] == "nothing to do"
    code, doc, err = run_bundle(bundle, target, "apply", "--no-verify", "--json")
    assert code == 0 and doc["targets"][0]["message"] == "nothing to do", err

    code, doc, err = run_bundle(bundle, target, "rollback", "--json")
    assert code == 0, err
    assert files(target) == pristine
    state = json.loads((target.parent.parent / "share" / "patcher" / "state.json").read_text())
    assert state["files"] == {}
    # and patcher can roll back what the bundle applied
    assert run_bundle(bundle, target, "apply", "--no-verify")[0] == 0
    assert patcher("rollback", "--python", str(target))[0] == 0
    assert files(target) == pristine


def test_rollback_force_restores_an_original_pips_record_does_not_vouch_for(bundle: Path, tmp_path: Path):
    """As `patcher rollback --force`: a kept original that is not pip's bytes (planted where the
    state folder's checks pass) is refused without --force, restored with it."""
    from tests.support.state import PLANTED, plant_original

    target = light_env(tmp_path)
    pristine = files(target)
    assert run_bundle(bundle, target, "apply", "--no-verify")[0] == 0
    plant_original(target, as_nobody=False)
    patched = files(target)
    code, doc, err = run_bundle(bundle, target, "rollback", "--json")
    assert code == 3, err
    text = doc["targets"][0]["message"]
    assert "pip's RECORD gives" in text and "run this bundle with `rollback --force`" in text, text
    assert files(target) == patched
    code, _, err = run_bundle(bundle, target, "status", "--force")
    assert code == 2 and "--force goes with rollback only" in err, err
    code, doc, err = run_bundle(bundle, target, "rollback", "--force", "--json")
    assert code == 0, err
    assert site_file(target, GENERATOR).read_bytes() == PLANTED
    assert {k: v for k, v in files(target).items() if k != GENERATOR} == {
        k: v for k, v in pristine.items() if k != GENERATOR
    }


def _embedded(bundle: Path, name: str) -> dict:
    """A blob the bundle carries (DATA or MODULES), decoded as the bundle decodes it."""
    import base64
    import zlib

    source = program_of(bundle.read_text())
    start = source.index(f'\n{name} = """') + len(f'\n{name} = """')
    return zlib.decompress(base64.b64decode(source[start : source.index('"""', start)]))


def test_every_error_kind_exits_alike_through_patcher_and_a_bundle(bundle: Path):
    from patcher.core.errors import ERROR_KINDS
    from patcher.frontends.bundle import BUNDLE_SHARED_MODULES
    from patcher.remote.agent.bootstrap import read_texts
    from patcher.report import TargetReport
    from patcher.target_run import _fail

    modules = json.loads(_embedded(bundle, "MODULES"))
    # patcher's own agent, planning, errors and versions, not copies
    assert modules == read_texts(BUNDLE_SHARED_MODULES)
    assert modules["patcher.plan.planning"][1] == Path("patcher/plan/planning.py").read_text()
    ns: dict = {}
    exec(compile(modules["patcher.core.errors"][1], "<bundle-errors>", "exec"), ns)  # noqa: S102 - the bundle's text
    for kind in [*ERROR_KINDS, "a-kind-nobody-knows"]:
        report = _fail(TargetReport("t"), kind, "m")
        assert (report.status, report.exit_code) == ns["outcome"](kind), kind
    assert ns["outcome"]("stale-plan") == ("failed", 3)  # 1 in bundles before the shared table


def test_patcher_and_the_bundle_plan_alike(bundle: Path, tmp_path: Path):
    """Drift: the same states, reasons, files and exit codes through both, step by step."""
    from workbench.envs import fabricate_dist

    mine, theirs = light_env(tmp_path / "a"), light_env(tmp_path / "b")

    def same(command: str, *extra: str) -> None:
        code, doc, err = patcher(command, "--python", str(mine), *extra, "--json")
        bundle_code, bundle_doc, bundle_err = run_bundle(bundle, theirs, command, *extra, "--json")
        assert code == bundle_code, (command, err, bundle_err)
        a, b = doc["targets"][0], bundle_doc["targets"][0]
        assert a["patches"] == b["patches"], command
        assert [(f["path"], f["action"], f["patches"]) for f in a["files"]] == [
            (f["path"], f["action"], f["patches"]) for f in b["files"]
        ], command
        assert (a["status"], a["exit_code"]) == (b["status"], b["exit_code"]), command

    for step in (("status",), ("plan",), ("apply", "--no-verify"), ("plan",), ("apply", "--no-verify")):
        same(*step)
    assert files(mine) == files(theirs)
    for python in (mine, theirs):  # vLLM downgraded under both: patches go stale
        fabricate_dist(python.parent.parent, "vllm", "0.11.0")
    for step in (("status",), ("plan",), ("apply", "--no-verify"), ("status",), ("rollback",), ("status",)):
        same(*step)
    assert files(mine) == files(theirs)


def test_an_agent_error_exits_alike_through_patcher_and_a_bundle(bundle: Path, tmp_path: Path):
    """A real one (the agent's `locked`, another run holding the lock): the same status, exit code
    and message through both."""
    import fcntl

    mine, theirs = light_env(tmp_path / "a"), light_env(tmp_path / "b")
    got = []
    for python, command in ((mine, None), (theirs, bundle)):
        state = python.parent.parent / "share" / "patcher"
        state.mkdir(parents=True)
        with open(state / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            args = ("apply", "--no-verify", "--lock-timeout", "0.2", "--json")
            code, doc, _err = (
                patcher(*args, "--python", str(python)) if command is None else run_bundle(bundle, python, *args)
            )
        target = doc["targets"][0]
        got.append((code, target["status"], target["exit_code"], target["message"].replace(str(state), "STATE")))
    assert got[0] == got[1] and got[0][:3] == (5, "failed", 5), got


def test_a_file_it_does_not_know_is_refused(bundle: Path, tmp_path: Path):
    target = light_env(tmp_path)
    generator = site_file(target, GENERATOR)
    generator.write_bytes(generator.read_bytes() + b"\n# changed by hand\n")
    before = files(target)
    code, doc, err = run_bundle(bundle, target, "apply", "--no-verify", "--json")
    assert code == 3, err
    message = doc["targets"][0]["message"]
    assert "which this bundle does not know" in message and "changed by hand" in message
    assert files(target) == before


def test_a_hostile_record_or_a_symlinked_backups_folder_is_refused(bundle: Path, tmp_path: Path):
    """The bundle's agent takes the same declared files as patcher's: a record digest made a
    path, and backups/ made a link, are refused; what they point at is left as it was."""
    target = light_env(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    sentinel = outside / "important.py"
    sentinel.write_text("# SECRET-bundle\n")
    assert run_bundle(bundle, target, "apply", "--no-verify")[0] == 0
    patched = files(target)
    record = target.parent.parent / "share" / "patcher" / "state.json"
    valid = record.read_text()
    state = json.loads(valid)
    state["files"][GENERATOR]["original_sha256"] = str(outside / "important")
    record.write_text(json.dumps(state))
    for command in ("status", "rollback", "apply"):
        code, doc, err = run_bundle(bundle, target, command, "--no-verify", "--json")
        assert sentinel.read_text() == "# SECRET-bundle\n" and files(target) == patched, command
        assert "SECRET" not in json.dumps(doc) + err, command
        assert code == 3 and "state record" in doc["targets"][0]["message"], (command, err)
    record.write_text(valid)
    backups = record.parent / "backups"
    for entry in backups.iterdir():
        shutil.copy(entry, outside / entry.name)
    shutil.rmtree(backups)
    backups.symlink_to(outside, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    for command in ("status", "rollback"):
        code, doc, err = run_bundle(bundle, target, command, "--no-verify", "--json")
        assert {p.name: p.read_bytes() for p in outside.iterdir()} == before and files(target) == patched, command
        assert code == 3 and "symbolic link" in doc["targets"][0]["message"], (command, err)


def test_other_releases_and_wrong_interpreters(bundle: Path, tmp_path: Path):
    # speculators 0.4.0.1: the bundle carries the 0.4 files and their patched bytes, as patcher writes them
    newer, reference = (
        light_env(tmp_path / "new", speculators="0.4.0.1"),
        light_env(tmp_path / "ref", speculators="0.4.0.1"),
    )
    code, doc, err = run_bundle(bundle, newer, "apply", "--no-verify", "--json")
    assert code == 0, err
    assert doc["targets"][0]["status"] == "changed"
    assert patcher("apply", "--no-verify", "--python", str(reference))[0] == 0
    assert files(newer) == files(reference)
    old = light_env(tmp_path / "old", speculators="0.2.0")  # a release no line covers: refused (test_coverage.py)
    assert run_bundle(bundle, old, "apply", "--no-verify", "--json")[0] == 7
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    code, doc, err = run_bundle(bundle, bare / "bin" / "python", "status", "--json")
    assert code == 2
    assert "speculators is not installed" in doc["targets"][0]["message"]


def test_runs_on_python_3_9(bundle: Path, tmp_path: Path, monkeypatch):
    found = python_or_skip("3.9")
    monkeypatch.setattr("workbench.envs.PYTHON_FOR_TARGETS", found)
    target = light_env(tmp_path)
    pristine = files(target)
    code, doc, err = run_bundle(bundle, target, "apply", "--no-verify", "--json")
    assert code == 0, err
    assert doc["targets"][0]["python"].endswith("python") and files(target) != pristine
    assert run_bundle(bundle, target, "rollback")[0] == 0
    assert files(target) == pristine


def test_interpreters_are_found_by_running_them(tmp_path: Path):
    """A python3.9 on PATH that cannot run (a pyenv shim for a version pyenv does not select)
    is passed over for one that runs; when none runs, the test is skipped saying why."""
    shims = tmp_path / "shims"
    shims.mkdir()
    shim = shims / "python3.9"
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.9: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    nowhere = {"pyenv_root": str(tmp_path / "no-pyenv"), "system": ()}
    with pytest.raises(pytest.skip.Exception) as skipped:
        python_or_skip("3.9", search_path=str(shims), **nowhere)
    assert str(skipped.value) == (f"no python3.9 runs here: {shim}: exit 127 (pyenv: python3.9: command not found)")
    real = python_or_skip("3.9")  # one that runs, wherever it is (pyenv's installs included)
    works = tmp_path / "bin"
    works.mkdir()
    (works / "python3.9").symlink_to(real)
    found, _ = find_python("3.9", search_path=f"{shims}{os.pathsep}{works}", **nowhere)
    assert found == str(works / "python3.9")


def test_a_vllm_version_outside_what_it_carries_is_refused(tmp_path: Path, bundle: Path):
    """Selections the bundle holds no bytes for are refused, not guessed (here: a bundle whose
    data lost a selection, as if made before a patch's new edit existed)."""
    source = program_of(bundle.read_text())
    start = source.index('DATA = """') + len('DATA = """')
    end = source.index('"""', start)
    import base64
    import zlib

    data = json.loads(zlib.decompress(base64.b64decode(source[start:end])))
    data["variants"] = {key: v for key, v in data["variants"].items() if "v1-block-hasher" not in key}
    raw = json.dumps(data).encode()
    blob = base64.b64encode(zlib.compress(raw)).decode()
    trimmed = tmp_path / "trimmed.py"
    program = with_digest(source[:start] + blob + source[end:], "DATA", hashlib.sha256(raw).hexdigest())
    trimmed.write_text(reseal(bundle.read_text(), program))
    target = light_env(tmp_path)
    pristine = files(target)
    code, doc, err = run_bundle(trimmed, target, "apply", "--no-verify", "--json")
    assert code == 2, err
    assert (
        "holds no patched bytes for what these versions select (speculators 0.3.0, vllm 0.16.0)"
        in (doc["targets"][0]["message"])
    )
    assert files(target) == pristine


@pytest.mark.vllm
def test_apply_verifies_against_the_real_vllm(bundle: Path, tmp_path: Path):
    from workbench.envs import overlay_env

    target = overlay_env(tmp_path, demo_env())
    pristine = files(target)
    code, doc, err = run_bundle(bundle, target, "apply", "--json")
    assert code == 0, err
    assert doc["targets"][0]["message"].endswith(", verified")
    assert run_bundle(bundle, target, "rollback")[0] == 0
    assert files(target) == pristine


def with_digest(source: str, name: str, digest: str) -> str:
    """The bundle's text with the sha256 it keeps for blob `name` replaced (an edit made on purpose)."""
    found = re.search(r"^DIGESTS = (\{.*?\})", source, re.MULTILINE)
    assert found is not None
    digests = json.loads(found.group(1))
    return source.replace(found.group(0), f"DIGESTS = {json.dumps({**digests, name: digest}, sort_keys=True)}", 1)


def _blob_text(source: str, name: str) -> tuple[int, int]:
    start = source.index(f'\n{name} = """') + len(f'\n{name} = """\n')
    return start, source.index('"""', start)


@pytest.mark.parametrize("name", ["DATA", "MODULES"])
@pytest.mark.parametrize("trailer", ["kept", "made to match"])
def test_a_damaged_bundle_is_one_line_and_exit_2(bundle: Path, tmp_path: Path, name: str, trailer: str):
    """One base64 character changed in a blob: the file no longer matches its last line's sha256,
    and where that was made to match too, the blob no longer matches its own."""
    target = light_env(tmp_path / "t")
    pristine = files(target)
    source = program_of(bundle.read_text())
    start, _ = _blob_text(source, name)
    middle = start + 150  # well inside the blob
    flipped = "A" if source[middle] != "A" else "B"
    damaged = tmp_path / "damaged.py"
    text = reseal(bundle.read_text(), source[:middle] + flipped + source[middle + 1 :])
    if trailer == "kept":
        text = text[: text.rindex(" ") + 1] + bundle.read_text()[text.rindex(" ") + 1 :]
    damaged.write_text(text)
    for command in ("status", "apply"):
        code, _, err = run_bundle(damaged, target, command, "--no-verify" if command == "apply" else "--quiet")
        assert code == 2, err
        assert err.strip().splitlines() == [err.strip()] and "this bundle is damaged" in err, err
        assert ("blob does not" in err) == (trailer == "made to match"), err
    assert files(target) == pristine


def test_a_patched_file_swapped_under_its_key_is_refused(bundle: Path, tmp_path: Path):
    """Another blob's (valid) text kept under a patched file's sha256: found before any write."""
    import base64
    import zlib

    target = light_env(tmp_path / "t")
    pristine = files(target)
    source = program_of(bundle.read_text())
    data = json.loads(_embedded(bundle, "DATA"))
    first, second = sorted(data["blobs"])[:2]
    data["blobs"][first] = data["blobs"][second]
    encoded = base64.b64encode(zlib.compress(json.dumps(data, sort_keys=True).encode())).decode()
    start, end = _blob_text(source, "DATA")
    wrapped = "\n".join(encoded[i : i + 100] for i in range(0, len(encoded), 100))
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    digests = re.search(r"^DIGESTS = (\{.*?\})", source, re.MULTILINE)
    assert digests is not None
    old_digest = json.loads(digests.group(1))["DATA"]
    swapped = tmp_path / "swapped.py"
    program = (source[:start] + wrapped + "\n" + source[end:]).replace(old_digest, digest)
    swapped.write_text(reseal(bundle.read_text(), program))
    code, _, err = run_bundle(swapped, target, "apply", "--no-verify")
    assert code == 2, err
    assert f"the patched file {first[:12]} does not match its sha256" in err
    assert files(target) == pristine


@pytest.mark.skipif(os.geteuid() != 0, reason="root applying to another user's environment needs root")
def test_root_on_a_user_owned_environment_leaves_state_the_owner_can_roll_back(bundle: Path, shared_env: Path):
    from workbench.sshd import ensure_user

    owner = ensure_user("patcher-plain")
    prefix = shared_env.parent.parent
    for path in [prefix, *prefix.rglob("*")]:
        os.chown(path, owner.pw_uid, owner.pw_gid, follow_symlinks=False)
    pristine = files(shared_env)
    code, _, err = patcher("apply", "--no-verify", "--python", str(shared_env))
    assert code == 0, err
    made = [prefix / "share", prefix / "share" / "patcher", *(prefix / "share" / "patcher").rglob("*")]
    assert {(p.name, p.lstat().st_uid) for p in made} == {(p.name, owner.pw_uid) for p in made}
    copy = prefix.parent / bundle.name
    shutil.copy2(bundle, copy)
    os.chmod(prefix.parent, 0o755)

    def as_owner() -> None:
        os.setgid(owner.pw_gid)
        os.setuid(owner.pw_uid)

    done = subprocess.run(
        [str(shared_env), str(copy), "rollback"],
        capture_output=True, text=True, cwd="/", preexec_fn=as_owner, timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert files(shared_env) == pristine


def test_a_bundle_cut_short_is_one_line_and_exit_2(bundle: Path, tmp_path: Path):
    """A copy that stopped early (scp interrupted, a full disk) proves nothing: the bundle checks that
    it is whole (its last line, the sha256 of the rest) before it does anything. Cut inside its
    opening statement it does not compile; cut anywhere after, it says so in one line, exit 2."""
    target = light_env(tmp_path / "t")
    pristine = files(target)
    raw = bundle.read_bytes()
    newlines = [i + 1 for i, byte in enumerate(raw) if byte == ord("\n")]
    cuts = {
        "its last line": newlines[-2],
        "its last two lines": newlines[-3],
        "mid-line near the end": len(raw) - 100,
        "in the middle": len(raw) // 2,
        "at a line in the middle": newlines[len(newlines) // 2],
    }
    for where, at in cuts.items():
        cut = tmp_path / "cut.py"
        cut.write_bytes(raw[:at])
        code, _, err = run_bundle(cut, target, "apply", "--no-verify")
        assert code == 2, (where, err)
        assert err.strip().splitlines() == [err.strip()] and "this bundle is incomplete" in err, (where, err)
        assert files(target) == pristine, where
    opening = raw.index(b"\nfinally:\n    ...") + len(b"\nfinally:\n    ...")  # its first statement's end
    cut = tmp_path / "cut.py"
    cut.write_bytes(raw[:opening])
    code, _, err = run_bundle(cut, target, "apply", "--no-verify")
    assert code == 2 and "this bundle is incomplete" in err, err
    for at in (newlines[1], newlines[3], opening - 20, opening - 5, opening - 2, opening - 1):  # inside it
        cut = tmp_path / "cut.py"
        cut.write_bytes(raw[:at])
        code, _, err = run_bundle(cut, target, "apply", "--no-verify")
        assert code == 1 and re.search(r"^(Syntax|Indentation)Error: ", err, re.MULTILINE), (at, err)
        assert files(target) == pristine


def test_a_lock_timeout_that_is_not_a_finite_bounded_number_is_a_usage_error(bundle: Path, tmp_path: Path):
    """The bundle's --lock-timeout follows patcher's rule (patcher/core/errors.py time_limit_problem)."""
    target = light_env(tmp_path / "t")
    pristine = files(target)
    for value in ("inf", "nan", "-1", "1e300"):
        code, _, err = run_bundle(bundle, target, "apply", "--no-verify", "--lock-timeout", value)
        assert code == 2, (value, err)
        assert f"argument --lock-timeout: {value!r} is not a number of seconds from 0 to" in err, err
    assert files(target) == pristine
    assert run_bundle(bundle, target, "status", "--lock-timeout", "0")[0] == 0


def test_a_fifo_or_a_byte_that_is_not_utf8_is_refused_naming_the_file(bundle: Path, tmp_path: Path):
    """As patcher refuses them (tests/test_target_files.py): exit 3, the file named, nothing written."""
    from tests.support.files import WORKER

    target = light_env(tmp_path / "t")
    worker = site_file(target, WORKER)
    worker.unlink()
    os.mkfifo(worker)
    generator = site_file(target, GENERATOR)
    generator.write_bytes(b"\xfe" + generator.read_bytes())
    before = generator.read_bytes()
    code, doc, err = run_bundle(bundle, target, "apply", "--no-verify", "--json")
    assert code == 3, err
    assert doc is not None
    problems = doc["targets"][0]["problems"]
    assert f"{generator} is not UTF-8 text (byte 0xfe at offset 0)" in " ".join(problems), problems
    assert f"{worker} is not a regular file (a fifo)" in " ".join(problems), problems
    assert generator.read_bytes() == before
