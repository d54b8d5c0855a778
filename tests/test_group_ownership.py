"""Owners kept (issue 38): an environment owned by one user and shared with a group (group-writable,
setgid folders) is written only by its owner or root. A second member of the group who runs
`patcher apply` is refused with one line before anything is written (a file it replaced would
become its own, and a state folder it created would be trusted by no other user's run), and the
owner applies and rolls back as before. Root with umask 000 creates share/ 0755, never 0777.
Real users, a real group, a real sshd logging them in."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher, patcher_argv, patcher_env
from workbench.envs import site_file
from workbench.sshd import ensure_user, spec, why_no_sshd

TARGETS = sorted({p.target.path for p in load_patches()})
GROUP = "patcher-mlgrp"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="other users, a group and file owners need root")


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def owners(python: Path) -> set[str]:
    import pwd

    return {pwd.getpwuid(site_file(python, rel).stat().st_uid).pw_name for rel in TARGETS}


def group_member(name: str) -> None:
    ensure_user(name)
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True, capture_output=True)
    subprocess.run(["usermod", "-a", "-G", GROUP, name], check=True, capture_output=True)


def shared_with_the_group(python: Path, owner: str) -> Path:
    """The environment handed to `owner`:GROUP, group-writable, its folders setgid (pip's files
    stay the group's whoever of it installs them)."""
    import pwd

    prefix = python.parent.parent
    uid, gid = pwd.getpwnam(owner).pw_uid, grp.getgrnam(GROUP).gr_gid
    for path in [prefix, *prefix.rglob("*")]:
        os.chown(path, uid, gid, follow_symlinks=False)
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            os.chmod(path, (mode & 0o7777) | 0o2070)
        elif stat.S_ISREG(mode):
            os.chmod(path, (mode & 0o7777) | 0o060)
    return prefix


@pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")
def test_a_group_member_is_refused_before_writing_and_the_owner_keeps_every_command(
    tmp_path: Path, client, servers, shared_env: Path
):
    owner, member = "patcher-owner", "patcher-member"
    for user in (owner, member):
        group_member(user)
    prefix = shared_with_the_group(shared_env, owner)
    server = servers(users=(owner, member))
    pristine = files(shared_env)

    def run(user: str, *args: str) -> tuple[int, dict, str]:
        code, doc, err = patcher(
            *args, "--host", spec(server, user), "--python", str(shared_env), *client.args(), "--json", cwd=tmp_path
        )
        assert doc is not None, err
        return code, doc["targets"][0], err

    code, target, err = run(member, "apply", "--no-verify")
    assert code == 1, err
    assert target["message"].startswith(
        f"{prefix}/share would be created in {prefix}, which is {owner}'s, and written by {member} it would "
        f"become {member}'s"
    ), target["message"]
    assert f"nothing was written: run patcher as {owner}, or as root" in target["message"]
    assert not (prefix / "share").exists()
    assert files(shared_env) == pristine and owners(shared_env) == {owner}

    code, target, err = run(owner, "apply", "--no-verify")
    assert code == 0, err
    assert owners(shared_env) == {owner}
    patched = files(shared_env)
    code, target, err = run(member, "status")  # reading needs no write: the member still can
    assert code == 0, err
    code, target, err = run(member, "rollback")
    assert code == 1, err
    assert files(shared_env) == patched and owners(shared_env) == {owner}
    code, target, err = run(owner, "rollback")
    assert code == 0, err
    assert files(shared_env) == pristine and owners(shared_env) == {owner}
    code, target, err = run(owner, "status")
    assert code == 0, err


def test_root_with_umask_000_creates_share_0755(shared_env: Path):
    """The state folder handed to the environment's owner: no third user may write share/ (replace
    share/patcher, plant files there), whatever root's umask."""
    owner = ensure_user("patcher-plain")
    prefix = shared_env.parent.parent
    for path in [prefix, *prefix.rglob("*")]:
        os.chown(path, owner.pw_uid, owner.pw_gid, follow_symlinks=False)
    done = subprocess.run(
        patcher_argv("apply", "--no-verify", "--python", str(shared_env)),
        capture_output=True, text=True, env=patcher_env(), timeout=300, preexec_fn=lambda: os.umask(0),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    made = [prefix / "share", prefix / "share" / "patcher", prefix / "share" / "patcher" / "backups"]
    assert {p.name: p.stat().st_mode & 0o7777 for p in made} == {p.name: 0o755 for p in made}
    assert {p.stat().st_uid for p in made} == {owner.pw_uid}
