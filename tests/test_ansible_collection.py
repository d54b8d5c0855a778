"""patcher as an Ansible collection (remote/ansible/): built with `ansible-galaxy collection build`,
installed with `ansible-galaxy collection install`, and run by `ansible-playbook` (the pinned
ansible-core of the test extra) against real loopback sshd hosts, each with its own light target
environment: check mode writes nothing, the first apply is `changed`, the second `ok`, rollback
restores the bytes, a hand-edited file fails with the conflict message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.envs import light_env, site_file
from tests.support.sshd import SshClient, SshServer, why_no_sshd

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TARGETS = sorted({p.target.path for p in load_patches()})

pytestmark = [
    pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or ""),
    pytest.mark.skipif(not (BIN / "ansible-playbook").exists(), reason="ansible-core (test extra) is not installed"),
]


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("ansible")
    built = work / "built"
    done = subprocess.run(
        [
            str(BIN / "ansible-galaxy"),
            "collection",
            "build",
            str(ROOT / "remote" / "ansible"),
            "--output-path",
            str(built),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    (tarball,) = built.glob("patcher-fleet-*.tar.gz")
    collections = work / "collections"
    done = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "install", str(tarball), "-p", str(collections)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    client = SshClient(work / "client")
    servers = [
        SshServer(work / f"sshd{i}", f"127.0.0.{200 + i}", {"root": client.public_key}).start() for i in range(2)
    ]
    envs = [light_env(work / f"host{i}") for i in range(2)]
    inventory = work / "hosts.ini"
    inventory.write_text(
        "[gpus]\n"
        + "".join(
            f"gpu{i} ansible_host={s.address} ansible_port={s.port} ansible_user=root ansible_python_interpreter={e}\n"
            for i, (s, e) in enumerate(zip(servers, envs))
        )
    )
    env = {
        **{k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"},
        "ANSIBLE_COLLECTIONS_PATH": str(collections),
        "ANSIBLE_SSH_ARGS": f"-F {client.config} -o ControlMaster=auto -o ControlPersist=60s",
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(work / "cp"),
        "ANSIBLE_HOST_KEY_CHECKING": "False",
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_LOCAL_TEMP": str(work / "tmp"),
        "ANSIBLE_HOME": str(work / "home"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
        "ANSIBLE_CALLBACK_FORMAT_PRETTY": "False",
        "PATCHER_CACHE": str(work / "cache"),
    }
    yield work, inventory, envs, env
    for server in servers:
        server.remove()


def play(fleet, command: str, *flags: str) -> tuple[int, dict[str, dict], str]:
    """One ansible-playbook run of the collection's task; each host's task result, and the output."""
    work, inventory, _, env = fleet
    book = work / f"{command}.yml"
    book.write_text(
        "- hosts: gpus\n  gather_facts: false\n  tasks:\n"
        f"    - patcher.fleet.patch:\n        command: {command}\n        verify: false\n"
    )
    done = subprocess.run(
        [str(BIN / "ansible-playbook"), "-v", "-i", str(inventory), "-f", "8", *flags, str(book)],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=600,
    )
    results = {}
    for line in done.stdout.splitlines():
        for status in ("ok", "changed", "fatal"):
            prefix = f"{status}: ["
            if line.startswith(prefix) and " => {" in line:  # `fatal: [h]: FAILED! => {...}`
                host, _, rest = line[len(prefix) :].partition("]")
                results[host] = {"status": status, **json.loads(rest.split("=> ", 1)[1])}
    return done.returncode, results, done.stdout + done.stderr


def test_playbook_check_apply_again_rollback_and_a_conflict(fleet, tmp_path: Path):
    _, _, envs, _ = fleet
    pristine = [files(e) for e in envs]
    reference = light_env(tmp_path / "reference")
    subprocess.run(
        [sys.executable, "-m", "patcher.cli", "apply", "--no-verify", "-q", "--python", str(reference)],
        check=True,
        env={**os.environ, "PATCHER_CACHE": str(tmp_path / "cache")},
    )
    patched = files(reference)

    code, results, output = play(fleet, "apply", "--check", "--diff")
    assert code == 0, output
    assert [results[h]["status"] for h in ("gpu0", "gpu1")] == ["changed", "changed"], output
    assert results["gpu0"]["patcher"]["exit_code"] == 6 and "would change" in results["gpu0"]["msg"]
    assert "+++ " in output and "@@" in output  # --diff: the plan's unified diffs
    assert [files(e) for e in envs] == pristine  # check mode wrote nothing

    code, results, output = play(fleet, "apply")
    assert code == 0, output
    assert {h: r["status"] for h, r in results.items()} == {"gpu0": "changed", "gpu1": "changed"}, output
    entry = results["gpu0"]["patcher"]
    assert entry["status"] == "changed" and entry["versions"] == {"speculators": "0.3.0", "vllm": "0.16.0"}
    assert all(files(e) == patched for e in envs)
    assert "changed=1" in output

    code, results, output = play(fleet, "apply")
    assert code == 0, output
    assert {h: r["status"] for h, r in results.items()} == {"gpu0": "ok", "gpu1": "ok"}, output
    assert "changed=0" in output

    code, results, output = play(fleet, "rollback", "--check")
    assert code == 0 and results["gpu0"]["status"] == "changed", output
    assert all(files(e) == patched for e in envs)

    code, results, output = play(fleet, "rollback")
    assert code == 0, output
    assert {h: r["status"] for h, r in results.items()} == {"gpu0": "changed", "gpu1": "changed"}, output
    assert [files(e) for e in envs] == pristine  # the original bytes, to the byte

    code, results, output = play(fleet, "apply")
    assert code == 0, output
    edited = site_file(envs[1], TARGETS[0])
    edited.write_bytes(edited.read_bytes() + b"\n# edited by hand\n")
    code, results, output = play(fleet, "rollback")
    assert code != 0, output
    assert results["gpu0"]["status"] == "changed"
    bad = results["gpu1"]
    assert bad["status"] == "fatal"  # failed: the callback prints it as fatal
    assert bad["patcher"]["exit_code"] == 3 and bad["msg"] == bad["patcher"]["message"]
    assert f"{TARGETS[0]} was changed by hand since patcher last wrote it" in bad["msg"], bad["msg"]
    assert edited.read_bytes().endswith(b"# edited by hand\n")  # left as it is


def test_a_host_on_an_uncovered_release_is_failed_with_the_reason(fleet):
    """Exit 7 is Ansible's `failed` (only 0, and 6 in check mode, are ok), with patcher's one line."""
    from tests.support.envs import reinstall_speculators

    _, _, envs, _ = fleet
    reinstall_speculators(envs[1], "0.2.0")  # a release no patch set covers
    try:
        code, results, output = play(fleet, "status")
        assert code != 0, output
        assert results["gpu0"]["status"] == "ok"
        bad = results["gpu1"]
        assert bad["status"] == "fatal" and bad["patcher"]["exit_code"] == 7, output
        assert bad["msg"] == bad["patcher"]["message"]
        assert bad["msg"].startswith("speculators 0.2.0 is not a release patcher covers"), bad["msg"]
    finally:
        reinstall_speculators(envs[1], "0.3.0")
