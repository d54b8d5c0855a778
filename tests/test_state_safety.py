"""Nothing outside patcher's own files, ever: a state record edited by whoever can write the
environment, symlinks planted among patcher's own entries, and a --retry-file that names a
file patcher did not write. Each attack is made with real files in a real environment, with a
sentinel planted where the attack points; the sentinel must survive, byte for byte, and its
contents must never come back in any output."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from patcher.fleet.inventory import RETRY_HEADER
from patcher.patchset.registry import load_patches
from patcher.plan.planning import condition_names, target_files
from patcher.transport.local import LocalTransport
from tests.support.cli import patcher_env
from tests.support.files import GENERATOR, PRISTINE_GENERATOR
from workbench.envs import light_env, site_file
from workbench.sshd import SshClient, free_port, why_no_sshd

PATCHES = load_patches()
TARGETS = sorted({p.target.path for p in PATCHES})
SECRET = "SECRET-5b0c1d-never-shown"
COMMANDS = (
    ("status",),
    ("plan", "--diff"),
    ("rollback",),
    ("apply", "--no-verify"),
    ("forget",),
    ("forget", "--all"),
)


def run(*args: str, cwd: Path | None = None, env: dict | None = None) -> tuple[int, str, str]:
    """patcher ARGS without the user's ssh agent or cache (patcher_env's clean_ssh); `env` adds."""
    proc = subprocess.run(
        [sys.executable, "-m", "patcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=patcher_env(env, clean_ssh=True),
    )
    return proc.returncode, proc.stdout, proc.stderr


def message(stdout: str) -> str:
    return json.loads(stdout)["targets"][0]["message"]


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def state_dir(python: Path) -> Path:
    return python.parent.parent / "share" / "patcher"


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under `folder` (links by their target, files by their bytes)."""
    out: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file():
            out[key] = path.read_bytes()
        else:
            out[key] = "dir"
    return out


@pytest.fixture
def env(tmp_path: Path) -> Path:
    return light_env(tmp_path)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the environment, holding a sentinel a hostile record points at."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "important.py").write_text(f"# {SECRET}\nKEEP = True\n")
    return folder


# ------------------------------------------------------------------ 1. a hostile state record


def _absolute_sha(state: dict, python: Path, outside: Path) -> None:
    state["files"][GENERATOR]["original_sha256"] = str(outside / "important")


def _relative_sha(state: dict, python: Path, outside: Path) -> None:
    backups = state_dir(python) / "backups"
    state["files"][GENERATOR]["original_sha256"] = os.path.relpath(outside / "important", backups)


def _pending_sha(state: dict, python: Path, outside: Path) -> None:
    state["files"][GENERATOR]["pending"] = {"sha256": "../../../" + str(outside), "patches": []}


def _path_outside(state: dict, python: Path, outside: Path) -> None:
    site = site_file(python, "")
    state["files"][os.path.relpath(outside / "important.py", site)] = dict(state["files"][GENERATOR])


def _absolute_path(state: dict, python: Path, outside: Path) -> None:
    state["files"][str(outside / "important.py")] = dict(state["files"][GENERATOR])


def _undeclared_path(state: dict, python: Path, outside: Path) -> None:
    # inside site-packages, but no patch rewrites it
    state["files"]["speculators/__init__.py"] = dict(state["files"][GENERATOR])


TAMPERS = {
    "original_sha256-absolute": _absolute_sha,
    "original_sha256-relative": _relative_sha,
    "pending-sha256-path": _pending_sha,
    "path-leaving-site-packages": _path_outside,
    "absolute-path": _absolute_path,
    "undeclared-path-in-site-packages": _undeclared_path,
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_hostile_record_is_refused_by_every_command_and_nothing_outside_is_touched(
    env: Path, outside: Path, tamper: str
):
    code, out, err = run("apply", "--python", str(env), "--no-verify")
    assert code == 0, err
    record = state_dir(env) / "state.json"
    state = json.loads(record.read_text())
    TAMPERS[tamper](state, env, outside)
    record.write_text(json.dumps(state))
    # pip replaced the file since (what made `forget` act on the entry): its bytes are
    # neither the recorded original nor the patched ones
    target = site_file(env, GENERATOR)
    target.write_bytes(target.read_bytes() + b"# reinstalled from another build\n")
    before = snapshot(outside)
    declared_init = site_file(env, "speculators/__init__.py").read_bytes()
    package = files(env)
    for command in COMMANDS:
        code, out, err = run(*command, "--python", str(env), "--json")
        # what was touched first (today's failure is what it does), then what it says
        assert snapshot(outside) == before, command
        assert SECRET not in out + err, command
        assert files(env) == package, command
        assert site_file(env, "speculators/__init__.py").read_bytes() == declared_init
        assert json.loads(record.read_text()) == state, command  # the record itself is left for the user
        assert code == 3, (command, err)
        assert "state record" in message(out) and "patcher forget" not in message(out), (command, message(out))


def test_the_agent_never_returns_a_file_outside_the_declared_set(env: Path, outside: Path):
    """What status reads comes back to the controller: under --sudo that would disclose files
    the login user cannot read. Asked directly, the agent answers nothing of the sentinel."""
    assert run("apply", "--python", str(env), "--no-verify")[0] == 0
    record = state_dir(env) / "state.json"
    state = json.loads(record.read_text())
    _absolute_sha(state, env, outside)
    record.write_text(json.dumps(state))
    with LocalTransport(str(env)) as transport:
        facts = transport.call(
            {
                "op": "facts",
                "names": condition_names(PATCHES),
                "files": target_files(p.spec() for p in PATCHES),
                "declared": target_files(p.spec() for p in PATCHES),
            }
        )
    assert SECRET not in json.dumps(facts)
    assert "state record" in facts["state_error"]


def test_forget_drops_entries_of_replaced_files_and_their_backups(env: Path):
    """The ordinary forget still works with the checks in place: after a reinstall of another
    build, forget drops the record and the backup (found from the validated sha256)."""
    assert run("apply", "--python", str(env), "--no-verify")[0] == 0
    backups = state_dir(env) / "backups"
    assert (backups / f"{PRISTINE_GENERATOR}.py").exists()
    # the files apply recorded (v13-v18's files are not patched in a light environment)
    recorded = sorted(json.loads((state_dir(env) / "state.json").read_text())["files"])
    assert recorded and set(recorded) <= set(TARGETS)
    for rel in TARGETS:
        target = site_file(env, rel)
        target.write_bytes(target.read_bytes() + b"# another build\n")
    code, out, err = run("forget", "--python", str(env), "--json")
    assert code == 0, err
    assert sorted(f["path"] for f in json.loads(out)["targets"][0]["files"]) == recorded
    assert list(backups.iterdir()) == []


# ------------------------------------------------------------------ 2. symlinks among patcher's entries


def test_backups_symlinked_elsewhere_is_refused_and_nothing_written_or_deleted_there(env: Path, outside: Path):
    (outside / ".patcher-left.tmp").write_text("not a temporary of patcher's\n")
    (outside / f"{PRISTINE_GENERATOR}.py").write_bytes(site_file(env, GENERATOR).read_bytes())
    before = snapshot(outside)
    state_dir(env).mkdir(parents=True)
    (state_dir(env) / "backups").symlink_to(outside, target_is_directory=True)
    pristine = files(env)
    code, out, err = run("apply", "--python", str(env), "--no-verify", "--json")
    assert snapshot(outside) == before
    assert files(env) == pristine
    assert code == 3, err
    assert "symbolic link" in message(out) and str(state_dir(env) / "backups") in message(out)


def test_backups_made_a_symlink_after_apply_rollback_and_forget_refuse(env: Path, outside: Path, tmp_path: Path):
    assert run("apply", "--python", str(env), "--no-verify")[0] == 0
    patched = files(env)
    backups = state_dir(env) / "backups"
    moved = tmp_path / "moved-backups"
    backups.rename(moved)
    for entry in moved.iterdir():
        shutil.copy(entry, outside / entry.name)
    backups.symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    for command in (("status",), ("rollback",), ("forget", "--all")):
        code, out, err = run(*command, "--python", str(env), "--json")
        assert snapshot(outside) == before, command
        assert files(env) == patched, command
        assert code == 3, (command, err)
        assert "symbolic link" in message(out), command


def test_a_backup_file_that_is_a_symlink_is_refused(env: Path, outside: Path):
    assert run("apply", "--python", str(env), "--no-verify")[0] == 0
    patched = files(env)
    backup = state_dir(env) / "backups" / f"{PRISTINE_GENERATOR}.py"
    decoy = outside / "pristine-copy.py"
    decoy.write_bytes(backup.read_bytes())
    backup.unlink()
    backup.symlink_to(decoy)
    before = snapshot(outside)
    for command in (("status",), ("rollback",), ("forget", "--all")):
        code, out, err = run(*command, "--python", str(env), "--json")
        assert snapshot(outside) == before and files(env) == patched, command
        assert code == 3, (command, err)
        assert "symbolic link" in message(out), command


def test_dangling_lock_symlink_is_refused_and_its_target_not_created(env: Path, tmp_path: Path):
    state_dir(env).mkdir(parents=True)
    victim = tmp_path / "created-by-the-lock"
    (state_dir(env) / "lock").symlink_to(victim)
    pristine = files(env)
    for command in (("apply", "--no-verify"), ("forget", "--all")):
        code, out, err = run(*command, "--python", str(env), "--json")
        assert not victim.exists(), command
        assert files(env) == pristine
        assert code == 3, (command, err)
        assert "symbolic link" in message(out) and "lock" in message(out), command


def test_state_record_symlink_is_refused(env: Path, outside: Path):
    assert run("apply", "--python", str(env), "--no-verify")[0] == 0
    patched = files(env)
    record = state_dir(env) / "state.json"
    elsewhere = outside / "state.json"
    elsewhere.write_bytes(record.read_bytes())
    record.unlink()
    record.symlink_to(elsewhere)
    before = snapshot(outside)
    for command in (("status",), ("rollback",), ("apply", "--no-verify"), ("forget", "--all")):
        code, out, err = run(*command, "--python", str(env), "--json")
        assert snapshot(outside) == before and files(env) == patched, command
        assert code == 3, (command, err)
        assert "symbolic link" in message(out), command


def test_state_folder_symlink_is_refused(env: Path, outside: Path):
    (env.parent.parent / "share").mkdir()
    state_dir(env).symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    pristine = files(env)
    for command in (("status",), ("apply", "--no-verify"), ("forget", "--all")):
        code, out, err = run(*command, "--python", str(env), "--json")
        assert snapshot(outside) == before and files(env) == pristine, command
        assert code == 3, (command, err)
        assert "symbolic link" in message(out) and str(state_dir(env)) in message(out), command


def test_symlinked_temporaries_in_the_state_folder_are_refused(env: Path, outside: Path):
    assert run("apply", "--python", str(env), "--no-verify")[0] == 0
    (state_dir(env) / "backups" / ".patcher-planted.tmp").symlink_to(outside / "important.py")
    before = snapshot(outside)
    code, out, err = run("rollback", "--python", str(env), "--json")
    assert snapshot(outside) == before
    assert code == 3, err
    assert "symbolic link" in message(out)


def test_a_symlinked_prefix_and_share_folder_keep_working(tmp_path: Path):
    """sys.prefix reached through a symlink (conda, /usr/local) and a `share` folder that is a
    link: only patcher's own entries must be real."""
    real = tmp_path / "real"
    python = light_env(real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    shared = tmp_path / "shared-share"
    shared.mkdir()
    (real / "env" / "share").symlink_to(shared, target_is_directory=True)
    via_link = link / "env" / "bin" / "python"
    pristine = files(python)
    code, out, err = run("apply", "--python", str(via_link), "--no-verify", "--json")
    assert code == 0, err
    assert files(python) != pristine
    assert (shared / "patcher" / "state.json").is_file() and not (shared / "patcher").is_symlink()
    code, out, err = run("status", "--python", str(via_link), "--json")
    assert code == 0, err
    assert {p["state"] for p in json.loads(out)["targets"][0]["patches"]} <= {"applied", "not-selected"}
    code, out, err = run("rollback", "--python", str(via_link), "--json")
    assert code == 0, err
    assert files(python) == pristine


# ------------------------------------------------------------------ as root, on a user's environment


@pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")
def test_root_through_sudo_on_a_users_environment_deletes_and_reads_nothing_outside(
    tmp_path: Path, client, servers, shared_env, sudoer
):
    """The attack as it was seen: a login user owns the environment and edits its record, then
    runs patcher through `sudo` (root) over ssh. A root-only file is the sentinel."""
    env_root = shared_env.parent.parent
    owner = pwd.getpwnam(sudoer)
    subprocess.run(["chown", "-R", f"{owner.pw_uid}:{owner.pw_gid}", str(env_root)], check=True)
    server = servers(users=(sudoer,))
    via = ["--host", f"{sudoer}@{server.address}:{server.port}", "--python", str(shared_env), *client.args()]
    code, out, err = run("apply", "--no-verify", *via, "--json", cwd=tmp_path)  # as the user
    assert code == 0, err
    vault = Path(tempfile.mkdtemp(prefix="patcher-root-only-", dir="/tmp"))
    try:
        os.chmod(vault, 0o700)
        secret = vault / "important.py"
        secret.write_text(f"# {SECRET}\n")
        secret.chmod(0o600)
        record = state_dir(shared_env) / "state.json"
        state = json.loads(record.read_text())
        state["files"][GENERATOR]["original_sha256"] = str(vault / "important")
        record.write_text(json.dumps(state))  # what the owner of the environment may do
        os.chown(record, owner.pw_uid, owner.pw_gid)
        target = site_file(shared_env, GENERATOR)
        target.write_bytes(target.read_bytes() + b"# reinstalled from another build\n")
        for command in COMMANDS:
            code, out, err = run(*command, "--sudo", *via, "--json", cwd=tmp_path)
            assert secret.exists() and secret.read_text() == f"# {SECRET}\n", command
            assert SECRET not in out + err, command
            assert code == 3, (command, err)
            assert "state record" in message(out), (command, message(out))
    finally:
        shutil.rmtree(vault, ignore_errors=True)


# ------------------------------------------------------------------ 3. --retry-file


@pytest.fixture
def unreachable(tmp_path: Path):
    """A host on loopback where nothing listens (its port was free a moment ago), and the
    private ssh configuration to try it with: every run against it fails, so a retry file is due."""
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        pytest.skip("the OpenSSH client (ssh, ssh-keygen) is missing")
    client = SshClient(tmp_path / "client")
    host = f"root@127.0.0.1:{free_port('127.0.0.1')}"
    return host, client.args()


def test_retry_file_is_written_new_or_over_a_retry_file_only(tmp_path: Path, unreachable):
    host, ssh = unreachable
    code, _out, err = run("status", "--host", host, *ssh, "--retry-file", "failed.retry", cwd=tmp_path)
    assert code == 4, err
    retry = tmp_path / "failed.retry"
    first = retry.read_text()
    assert first.startswith(RETRY_HEADER) and host.split("@")[1].split(":")[0] in first
    code, _out, err = run("status", "--host", host, *ssh, "--retry-file", "failed.retry", cwd=tmp_path)
    assert code == 4, err  # patcher's own retry file: rewritten
    assert retry.read_text().startswith(RETRY_HEADER)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".failed")] == []  # no temporary left


@pytest.mark.parametrize("kind", ["inventory", "other-file", "folder", "link"])
def test_retry_file_refuses_what_patcher_did_not_write(tmp_path: Path, unreachable, kind: str):
    host, ssh = unreachable
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        f"[gpus]\n{host.split('@')[1].split(':')[0]} ansible_port={host.rsplit(':', 1)[1]} ansible_user=root\n"
    )
    victim = {
        "inventory": inventory,
        "other-file": tmp_path / "notes.txt",
        "folder": tmp_path / "folder",
        "link": tmp_path / "link",
    }[kind]
    if kind == "other-file":
        victim.write_text("my notes\n")
    elif kind == "folder":
        victim.mkdir()
    elif kind == "link":
        victim.symlink_to(inventory)
    before = snapshot(tmp_path)
    code, _out, err = run("apply", "-i", str(inventory), *ssh, "--retry-file", str(victim), cwd=tmp_path)
    assert snapshot(tmp_path) == before  # nothing written: not the file, not a temporary
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.strip()]
    assert len(errors) == 1 and "--retry-file" in errors[0] and "--no-retry-file" in errors[0], err
    assert "connection refused" not in err  # refused before any host was tried


def test_a_failed_host_run_writes_its_retry_file_in_the_cache_never_in_the_current_folder(tmp_path: Path, unreachable):
    """No --retry-file: the list goes to $PATCHER_CACHE/patcher.retry (the cache folder made as
    the cache's are, 0755), the current folder (here a git checkout) is left as it was, and the
    last line says where the list is and how to use it."""
    host, ssh = unreachable
    checkout = tmp_path / "checkout"
    (checkout / ".git").mkdir(parents=True)
    cache = tmp_path / "cache"
    code, _out, err = run("status", "--host", host, *ssh, cwd=checkout, env={"PATCHER_CACHE": str(cache)})
    assert code == 4, err
    assert [p.name for p in checkout.iterdir()] == [".git"]
    retry = cache / "patcher.retry"
    assert retry.read_text().startswith(RETRY_HEADER + str(retry))
    assert os.stat(cache).st_mode & 0o777 == 0o755
    assert err.splitlines()[-1] == (
        f"1 host(s) did not succeed; listed in {retry}: `patcher status -i {retry}` "
        "with this run's other options retries just them"
    )


def test_retry_file_goes_where_asked_and_nowhere_with_no_retry_file(tmp_path: Path, unreachable):
    host, ssh = unreachable
    cache, elsewhere = tmp_path / "cache", tmp_path / "lists"
    elsewhere.mkdir()
    env = {"PATCHER_CACHE": str(cache)}
    wanted = elsewhere / "gpus.retry"
    code, _out, err = run("apply", "--host", host, *ssh, "--retry-file", str(wanted), cwd=tmp_path, env=env)
    assert code == 4, err
    assert wanted.read_text().startswith(RETRY_HEADER)
    assert err.splitlines()[-1].startswith(
        f"1 host(s) did not succeed; listed in {wanted}: `patcher apply -i {wanted}`"
    )
    assert not (cache / "patcher.retry").exists()
    before = snapshot(tmp_path)
    code, _out, err = run("apply", "--host", host, *ssh, "--no-retry-file", cwd=tmp_path, env=env)
    assert code == 4, err
    assert snapshot(tmp_path) == before and "retry" not in err


def test_an_untrusted_cache_gets_no_retry_file_and_says_so(tmp_path: Path, unreachable):
    host, ssh = unreachable
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o777)  # writable by others: patcher must not write what it later reads as an inventory
    code, _out, err = run("status", "--host", host, *ssh, cwd=tmp_path, env={"PATCHER_CACHE": str(cache)})
    assert code == 4, err
    assert list(cache.iterdir()) == []
    assert f"warning: not using the cache {cache}: {cache} is writable by group and others" in err
    assert err.splitlines()[-1] == (
        "no retry file written: the cache is not used (the warning above says why); name one with --retry-file"
    )


def test_retry_file_temporary_is_never_written_through_a_planted_link(tmp_path: Path, unreachable):
    host, ssh = unreachable
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in (".patcher.retry.tmp", ".patcher.retry.new"):
        (tmp_path / name).symlink_to(victim)
    code, _out, err = run("status", "--host", host, *ssh, cwd=tmp_path, env={"PATCHER_CACHE": str(tmp_path)})
    assert code == 4, err
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "patcher.retry").read_text().startswith(RETRY_HEADER)


def test_retry_file_that_is_the_limited_inventory_is_not_cut_down(tmp_path: Path, unreachable):
    # A trailing comma: Ansible splits a pattern on commas when it has one, else on colons.
    host, ssh = unreachable
    env = {"PATCHER_CACHE": str(tmp_path / "cache")}
    code, _, err = run("status", "--host", host, "--host", "root@127.0.0.1:1", *ssh, cwd=tmp_path, env=env)
    assert code == 4, err
    retry = tmp_path / "cache" / "patcher.retry"
    listed = retry.read_text()
    code, _out, err = run("status", "-i", str(retry), "--limit", "root@127.0.0.1:1,", *ssh, cwd=tmp_path, env=env)
    assert retry.read_text() == listed
    assert code == 2 and "--limit" in err and "--no-retry-file" in err, err


# ------------------------------------------------------------------ 4. links on the way to a target file

PYC = Path(GENERATOR).stem + ".cpython-311.pyc"


def swap_for_link(folder: Path, to: Path) -> Path:
    """`folder` moved aside (what it held is kept, inside site-packages) and a link put in its
    place: what whoever can write the environment can do at any moment. Returns the moved folder."""
    moved = folder.with_name(folder.name + ".moved")
    folder.rename(moved)
    folder.symlink_to(to, target_is_directory=True)
    return moved


def undo_swap(folder: Path, moved: Path) -> None:
    folder.unlink()
    moved.rename(folder)


def decoy_package(env: Path, where: Path) -> Path:
    """A folder holding copies of speculators' data_generation files, where a link will point."""
    shutil.copytree(site_file(env, GENERATOR).parent, where)
    return where


def paused(env: Path, point: str, release: Path) -> subprocess.Popen:
    from tests.support.cli import patcher_argv, patcher_env

    fault = {"at": point, "action": "pause", "until": str(release), "seconds": 120}
    return subprocess.Popen(
        patcher_argv("apply", "--no-verify", "--python", str(env), "--json"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=patcher_env({"PATCHER_FAULT": json.dumps(fault)}),
    )  # fmt: skip


def wait_for(proc: subprocess.Popen, done, what: str) -> None:
    import time

    deadline = time.monotonic() + 120
    while not done():
        assert proc.poll() is None, (what, proc.communicate())
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("points", ["inside-site-packages", "outside"])
def test_a_folder_on_the_way_to_a_target_that_is_a_link_is_refused_by_every_command(
    env: Path, tmp_path: Path, points: str
):
    """speculators/data_generation made a link before the run, to another folder holding the same
    files: inside site-packages (what the old check on the resolved path let through: the patched
    generator went into the other folder) or outside it."""
    folder = site_file(env, GENERATOR).parent
    where = site_file(env, "elsewhere") if points == "inside-site-packages" else tmp_path / "elsewhere"
    decoy = decoy_package(env, where)
    moved = swap_for_link(folder, decoy)
    before, kept = snapshot(decoy), snapshot(moved)
    for command in COMMANDS:
        code, out, err = run(*command, "--python", str(env), "--json")
        assert snapshot(decoy) == before and snapshot(moved) == kept, command
        if command[0] == "forget":
            continue  # no record yet: nothing to read or forget, through the link or not
        assert code == 3, (command, err)
        text = message(out)
        assert f"refusing {folder}: it is a symbolic link (to {decoy}" in text and "\n" not in text, (command, text)
    undo_swap(folder, moved)
    code, out, err = run("apply", "--python", str(env), "--no-verify", "--json")
    assert code == 0, err


def test_a_folder_swapped_for_a_link_in_the_middle_of_an_apply_is_refused(env: Path, tmp_path: Path):
    """The swap after every check and backup, before the first write (the agent paused there)."""
    folder = site_file(env, GENERATOR).parent
    decoy = decoy_package(env, tmp_path / "elsewhere")
    before = snapshot(decoy)
    pristine = files(env)
    release = tmp_path / "release"
    proc = paused(env, "intent-recorded", release)
    record = state_dir(env) / "state.json"
    wait_for(proc, lambda: record.exists() and "pending" in record.read_text(), "the intent recorded")
    moved = swap_for_link(folder, decoy)
    release.touch()
    out, err = proc.communicate(timeout=120)
    assert snapshot(decoy) == before  # nothing written through the link
    assert proc.returncode == 3, err
    assert f"refusing {folder}: it is a symbolic link (to {decoy}, which leaves" in message(out), message(out)
    undo_swap(folder, moved)
    assert files(env) == pristine  # the real folder: its old bytes
    code, _, err = run("apply", "--python", str(env), "--no-verify")
    assert code == 0, err
    code, _, err = run("rollback", "--python", str(env))
    assert code == 0, err
    assert files(env) == pristine


def bytecode_decoy(tmp_path: Path) -> Path:
    """A folder of someone's bytecode, named as the generator's would be."""
    decoy = tmp_path / "their-pycache"
    decoy.mkdir()
    (decoy / PYC).write_bytes(b"not patcher's to delete")
    (decoy / (Path(GENERATOR).stem + ".cpython-39.opt-1.pyc")).write_bytes(b"nor this")
    return decoy


def test_a_pycache_that_is_a_link_is_refused_before_anything_is_written(env: Path, tmp_path: Path):
    decoy = bytecode_decoy(tmp_path)
    before = snapshot(decoy)
    cache = site_file(env, GENERATOR).parent / "__pycache__"
    cache.symlink_to(decoy, target_is_directory=True)
    pristine = files(env)
    for command in (("apply", "--no-verify"), ("apply", "--no-verify")):
        code, out, err = run(*command, "--python", str(env), "--json")
        assert snapshot(decoy) == before  # no .pyc deleted through the link
        assert files(env) == pristine  # refused before the first write
        assert code == 3, err
        assert f"refusing {cache}: it is a symbolic link (to {decoy}" in message(out), message(out)
    cache.unlink()
    code, _, err = run("apply", "--python", str(env), "--no-verify")
    assert code == 0, err


def test_a_pycache_swapped_for_a_link_after_the_write_is_refused_and_the_next_apply_completes(
    env: Path, tmp_path: Path
):
    decoy = bytecode_decoy(tmp_path)
    before = snapshot(decoy)
    target = site_file(env, GENERATOR)
    pristine = target.read_bytes()
    release = tmp_path / "release"
    proc = paused(env, f"file-written:{GENERATOR}", release)
    wait_for(proc, lambda: target.read_bytes() != pristine, "the generator written")
    cache = target.parent / "__pycache__"
    cache.symlink_to(decoy, target_is_directory=True)
    release.touch()
    out, err = proc.communicate(timeout=120)
    assert snapshot(decoy) == before  # nothing deleted through the link
    assert proc.returncode == 3, err
    text = message(out)
    assert f"refusing {cache}: it is a symbolic link (to {decoy}, which leaves" in text, text
    assert "every file is its old or its new bytes" in text, text
    cache.unlink()
    code, out, err = run("apply", "--python", str(env), "--no-verify", "--json")
    assert code == 0, err
    code, out, err = run("status", "--python", str(env), "--json")
    assert code == 0, err
    assert {p["state"] for p in json.loads(out)["targets"][0]["patches"]} <= {"applied", "not-selected"}
