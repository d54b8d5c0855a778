"""Remote hosts and fleets, over real OpenSSH servers on loopback addresses (127.0.0.x) started
by these tests, with the real ssh client and a client configuration of their own (never ~/.ssh).
Each "host" is its own sshd with its own host key and its own light target environment.

Faults are made with real processes: nothing listening, a server that never answers, a wrong
key, a regenerated host key, a missing interpreter, the connection killed while the agent is
in an apply, a login user who cannot write the environment, sudo with and without rights.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher
from workbench.envs import site_file
from workbench.sshd import SshClient, SshServer, ensure_user, free_port, next_address, spec, why_no_sshd

pytestmark = pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")

TARGETS = sorted({p.target.path for p in load_patches()})
# Every command here runs without SSH_AUTH_SOCK: never the user's own agent.
patcher = functools.partial(patcher, clean_ssh=True)


def own_cache(tmp_path: Path) -> dict:
    """The test's own PATCHER_CACHE, where a failed fleet run's retry file is written by default."""
    return {"PATCHER_CACHE": str(tmp_path / "cache")}


def retry_file(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "patcher.retry"


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def by_host(doc: dict) -> dict[str, dict]:
    return {t["target"]: t for t in doc["targets"]}


def comparable(target: dict) -> dict:
    """A target's JSON entry without what names the machine (paths, labels)."""
    return {
        "status": target["status"],
        "exit_code": target["exit_code"],
        "message": target["message"],
        "versions": target["versions"],
        "patches": [(p["id"], p["state"], p["reason"]) for p in target["patches"]],
        "files": [(f["path"], f["action"], f.get("patches")) for f in target["files"]],
    }


# ---------------------------------------------------------------- the ordinary path


def test_one_host_behaves_exactly_as_local(tmp_path: Path, client, servers, host_env):
    server = servers()
    remote, local = host_env(), host_env()
    pristine = files(remote)
    target = ["--host", spec(server), "--python", str(remote), *client.args()]
    for command in (["apply", "--no-verify"], ["status"], ["plan"], ["rollback"], ["status"]):
        code_r, doc_r, err_r = patcher(*command, *target, "--json", cwd=tmp_path)
        code_l, doc_l, err_l = patcher(*command, "--python", str(local), "--json", cwd=tmp_path)
        assert code_r == code_l, (command, err_r, err_l)
        entry_r, entry_l = doc_r["targets"][0], doc_l["targets"][0]
        assert entry_r["target"] == spec(server)
        assert entry_r["host"] == spec(server) and entry_r["started"] is True
        assert entry_r["python"] == str(remote)
        assert comparable(entry_r) == comparable(entry_l), command
        assert files(remote) == files(local), command
        if command[0] == "apply":
            assert entry_r["status"] == "changed"
            assert files(remote) != pristine
    assert files(remote) == pristine  # rolled back to the byte
    assert not (tmp_path / "patcher.retry").exists()


def test_a_host_on_an_uncovered_release_fails_the_rollout_and_is_retried(tmp_path: Path, client, servers):
    """Exit 7 (a speculators release no patch set covers) is a failed host like any other: not
    counted ok, named in the retry file, and the fleet's exit code is the worst host's."""
    from workbench.envs import light_env

    up = [servers() for _ in range(2)]
    envs = [light_env(tmp_path / "covered"), light_env(tmp_path / "uncovered", speculators="0.2.0")]
    inventory = tmp_path / "hosts"
    inventory.write_text("".join(f"{spec(s)} ansible_python_interpreter={e}\n" for s, e in zip(up, envs)))
    code, doc, err = patcher(
        "apply", "--no-verify", "-i", str(inventory), *client.args(), "--json", cwd=tmp_path, env=own_cache(tmp_path)
    )
    assert code == 7 == doc["exit_code"], err
    hosts = by_host(doc)
    assert hosts[spec(up[0])]["status"] == "changed"
    bad = hosts[spec(up[1])]
    assert bad["status"] == "failed" and bad["exit_code"] == 7
    assert bad["message"].startswith("speculators 0.2.0 is not a release patcher covers"), bad["message"]
    retry = [line.split()[0] for line in retry_file(tmp_path).read_text().splitlines() if line and line[0] != "#"]
    assert retry == [spec(up[1])]


def test_several_hosts_json_per_host_retry_file_and_rerun_from_it(tmp_path: Path, client, servers, host_env):
    up = [servers() for _ in range(3)]
    envs = [host_env() for _ in up]
    down_address = next_address()
    down_port = free_port(down_address)  # nothing listens there (yet)
    down_env = host_env()
    inventory = tmp_path / "hosts.ini"
    lines = ["[gpus]"] + [f"{spec(s)} ansible_python_interpreter={e}" for s, e in zip(up, envs)]
    lines += [
        "[late]",
        (
            f"gpu-late ansible_host={down_address} ansible_port={down_port} ansible_user=root "
            f"ansible_python_interpreter={down_env}"
        ),
    ]
    inventory.write_text("\n".join(lines) + "\n")
    pristine = files(down_env)

    code, doc, err = patcher(
        "apply", "--no-verify", "-i", str(inventory), *client.args(), "--json", cwd=tmp_path, env=own_cache(tmp_path)
    )
    assert code == 4, err
    assert doc["exit_code"] == 4
    hosts = by_host(doc)
    assert list(hosts) == [spec(s) for s in up] + ["gpu-late"]
    assert [hosts[spec(s)]["status"] for s in up] == ["changed"] * 3
    assert hosts["gpu-late"]["status"] == "unreachable" and hosts["gpu-late"]["exit_code"] == 4
    assert "connection refused" in hosts["gpu-late"]["message"]
    assert doc["summary"]["changed"] == 3 and doc["summary"]["unreachable"] == 1
    assert all(files(e) != pristine for e in envs) and files(down_env) == pristine
    assert not (tmp_path / "patcher.retry").exists()  # never the current folder
    retry = retry_file(tmp_path).read_text()
    hosts_in_retry = [line for line in retry.splitlines() if line and not line.startswith("#")]
    assert hosts_in_retry == [
        (
            f"gpu-late ansible_host={down_address} ansible_user=root ansible_port={down_port} "
            f"ansible_python_interpreter={down_env}"
        )
    ]
    assert "unreachable 1" in err  # the per-host summary on stderr

    late = SshServer(tmp_path / "sshd-late", down_address, {"root": client.public_key}, port=down_port)
    late.start()
    try:
        code, doc, err = patcher(
            "apply", "--no-verify", "-i", str(retry_file(tmp_path)), *client.args(), "--json", env=own_cache(tmp_path)
        )
        assert code == 0, err
        assert [t["target"] for t in doc["targets"]] == ["gpu-late"]
        assert doc["targets"][0]["status"] == "changed"
        assert files(down_env) == files(envs[0])
        assert not retry_file(tmp_path).exists()  # everything succeeded: the old list is gone
    finally:
        late.remove()


def test_yaml_inventory_with_nested_groups_and_per_host_python(tmp_path: Path, client, servers, host_env):
    first, second = servers(), servers()
    env_first, env_second = host_env(), host_env()
    inventory = tmp_path / "fleet.yml"
    inventory.write_text(
        "all:\n"
        "  vars:\n"
        "    ansible_user: root\n"
        "  children:\n"
        "    gpus:\n"
        "      vars:\n"
        f"        ansible_python_interpreter: {env_first}\n"
        "      hosts:\n"
        f"        one: {{ansible_host: {first.address}, ansible_port: {first.port}}}\n"
        "      children:\n"
        "        special:\n"
        "          hosts:\n"
        f"            two: {{ansible_host: {second.address}, ansible_port: {second.port}}}\n"
        "          vars:\n"
        f"            ansible_python_interpreter: {env_second}\n"
    )
    code, doc, err = patcher(
        "status", "-i", str(inventory), *client.args(), "--python", "/nonexistent", "--json", cwd=tmp_path
    )
    assert code == 0, err
    assert {t["target"]: t["python"] for t in doc["targets"]} == {"one": str(env_first), "two": str(env_second)}
    # --limit by group (a nested one), by name with a wildcard, and by exclusion: only those hosts are contacted
    for pattern, expected in (("special", ["two"]), ("o*", ["one"]), ("gpus,!special", ["one"])):
        code, doc, err = patcher(
            "status", "-i", str(inventory), "--limit", pattern, *client.args(), "--json", cwd=tmp_path
        )
        assert code == 0, err
        assert [t["target"] for t in doc["targets"]] == expected, pattern
    code, doc, err = patcher("status", "-i", str(inventory), "--limit", "gpu", *client.args(), cwd=tmp_path)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: --limit: 'gpu' matches no host or group; groups: gpus, special; check the name"
    )
    code, _, err = patcher("status", "--limit", "gpus", cwd=tmp_path)
    assert code == 2 and "--limit only apply to remote hosts" in err


def test_serial_batches_and_max_fail_stop_the_rollout(tmp_path: Path, client, servers, host_env):
    hosts = [servers() for _ in range(4)]
    envs = [host_env() for _ in hosts]
    pristine = files(envs[0])
    inventory = tmp_path / "hosts"
    pythons = [envs[0], "/nonexistent/bin/python3", envs[2], envs[3]]  # the second host is broken
    inventory.write_text("".join(f"{spec(s)} ansible_python_interpreter={p}\n" for s, p in zip(hosts, pythons)))

    code, doc, err = patcher(
        "apply",
        "--no-verify",
        "-i",
        str(inventory),
        "--serial",
        "2",
        "--max-fail",
        "0",
        *client.args(),
        "--json",
        cwd=tmp_path,
        env=own_cache(tmp_path),
    )
    assert code == 2, err  # the worst host: no python there (usage)
    statuses = [t["status"] for t in doc["targets"]]
    assert statuses == ["changed", "failed", "skipped", "skipped"]
    assert [t["started"] for t in doc["targets"]] == [True, True, False, False]
    assert "no python at /nonexistent/bin/python3" in doc["targets"][1]["message"]
    assert "rollout stopped" in doc["targets"][2]["message"] and "--max-fail 0%" in doc["targets"][2]["message"]
    assert files(envs[2]) == pristine and files(envs[3]) == pristine  # never touched
    assert doc["summary"]["skipped"] == 2
    retry = [line.split()[0] for line in retry_file(tmp_path).read_text().splitlines() if not line.startswith("#")]
    assert retry == [spec(s) for s in hosts[1:]]
    assert "skipped" in err

    # 1 of 2 failing is 50%: not above --max-fail 50, so every batch runs
    code, doc, err = patcher(
        "apply",
        "--no-verify",
        "-i",
        str(inventory),
        "--serial",
        "2",
        "--max-fail",
        "50",
        "--forks",
        "1",
        *client.args(),
        "--json",
        cwd=tmp_path,
    )
    assert code == 2, err
    assert [t["status"] for t in doc["targets"]] == ["ok", "failed", "changed", "changed"]


def test_hostile_host_strings_and_paths_are_refused_before_any_ssh(tmp_path: Path, client, servers, host_env):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    marker = tmp_path / "ssh-was-run"
    (fake_bin / "ssh").write_text(f"#!/bin/sh\ntouch {marker}\nexit 255\n")
    (fake_bin / "ssh").chmod(0o755)
    hostile = [
        "-oProxyCommand=touch /tmp/pwned",
        "root@-oProxyCommand=x",
        "-root@127.0.0.2",
        "127.0.0.2;touch x",
        "127.0.0.2 -p 22",
        "127.0.0.2\nid",
        "a$(id)",
        "`id`@127.0.0.2",
        "127.0.0.2:99999",
        "127.0.0.2:22:33",
        "[::1",
    ]
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    for host in hostile:
        proc = subprocess.run(
            [sys.executable, "-m", "patcher.cli", "status", "--host", host],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 2, (host, proc.stderr)
        assert "refusing" in proc.stderr or "error" in proc.stderr, host
        assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr
    inventory = tmp_path / "bad.ini"
    inventory.write_text("good.example\nevil ansible_host='x;reboot'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "patcher.cli", "apply", "-i", str(inventory)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2 and "evil" in proc.stderr and "refusing host 'x;reboot'" in proc.stderr
    for option in ("-oProxyCommand=x", "ProxyCommand", "BatchMode=no"):
        proc = subprocess.run(
            [sys.executable, "-m", "patcher.cli", "status", "--host", "h.example", "--ssh-option", option],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 2, (option, proc.stderr)
    assert not marker.exists()

    # A remote interpreter path is one quoted word: the remote shell runs nothing in it.
    server = servers()
    trap = tmp_path / "trap"
    python = f"/nonexistent dir/$(touch {trap})/`touch {trap}`;touch {trap}/python3"
    code, doc, err = patcher(
        "status", "--host", spec(server), "--python", python, *client.args(), "--json", cwd=tmp_path
    )
    assert code == 2, err
    assert "no python at" in doc["targets"][0]["message"]
    assert not trap.exists()


# ---------------------------------------------------------------- faults with real processes


def test_unreachable_hosts_fail_fast_while_the_others_finish(tmp_path: Path, client, servers, host_env):
    good = servers()
    env = host_env()
    closed = next_address()
    silent_address = next_address()
    silent = socket.socket()
    silent.bind((silent_address, 0))
    silent.listen(8)  # accepts TCP, never says a word of SSH
    try:
        started = time.monotonic()
        code, doc, err = patcher(
            "status",
            "--host",
            spec(good),
            "--host",
            f"root@{closed}:{free_port(closed)}",
            "--host",
            f"root@{silent_address}:{silent.getsockname()[1]}",
            "--python",
            str(env),
            "--connect-timeout",
            "2",
            *client.args(),
            "--json",
            cwd=tmp_path,
        )
        elapsed = time.monotonic() - started
    finally:
        silent.close()
    assert code == 4, err
    statuses = [(t["status"], t["exit_code"]) for t in doc["targets"]]
    assert statuses == [("ok", 0), ("unreachable", 4), ("unreachable", 4)]
    assert "connection refused" in doc["targets"][1]["message"]
    assert "timed out" in doc["targets"][2]["message"]
    assert elapsed < 30


def test_refused_authentication(tmp_path: Path, client, servers, host_env):
    stranger = SshClient(tmp_path / "stranger")
    server = servers(public_key=stranger.public_key)  # the server knows another key
    env = host_env()
    code, doc, err = patcher(
        "apply", "--host", spec(server), "--python", str(env), *client.args(), "--json", cwd=tmp_path
    )
    assert code == 4, err
    target = doc["targets"][0]
    assert target["status"] == "unreachable"
    assert target["message"].startswith("authentication refused for root")


def test_changed_host_key_is_refused_and_says_how_to_fix_it(tmp_path: Path, client, servers, host_env):
    server, other = servers(), servers()
    env, other_env = host_env(), host_env()
    args = ["--host", spec(server), "--python", str(env), *client.args()]
    code, doc, err = patcher("status", *args, cwd=tmp_path)
    assert code == 0, err  # accept-new: the first key is recorded
    assert f"[{server.address}]:{server.port}" in client.known_hosts.read_text()
    pristine = files(env)
    server.new_host_key()
    inventory = tmp_path / "two"
    inventory.write_text(
        f"{spec(server)} ansible_python_interpreter={env}\n{spec(other)} ansible_python_interpreter={other_env}\n"
    )
    code, doc, err = patcher(
        "apply", "--no-verify", "-i", str(inventory), *client.args(), "--json", cwd=tmp_path, env=own_cache(tmp_path)
    )
    assert code == 4, err
    changed, fine = doc["targets"]
    assert changed["status"] == "unreachable"
    assert changed["message"] == (
        f"host key changed: check it, then remove the old key with ssh-keygen -R '[{server.address}]:{server.port}'"
    )
    assert fine["status"] == "changed"
    assert files(env) == pristine
    # strict checking asked for by the user wins over patcher's accept-new
    newcomer = servers()
    code, doc, err = patcher(
        "status",
        "--host",
        spec(newcomer),
        "--python",
        str(env),
        *client.args(),
        "--ssh-option",
        "StrictHostKeyChecking=yes",
        "--json",
        cwd=tmp_path,
    )
    assert code == 4 and "host key unknown" in doc["targets"][0]["message"], err


def test_missing_remote_python(tmp_path: Path, client, servers):
    server = servers()
    code, doc, err = patcher(
        "apply", "--host", spec(server), "--python", "/opt/nowhere/bin/python3", *client.args(), "--json", cwd=tmp_path
    )
    assert code == 2, err
    assert doc["targets"][0]["message"].startswith("no python at /opt/nowhere/bin/python3 on 127.0.0.")
    assert "--python" in doc["targets"][0]["message"]


def _holders(path: Path) -> list[int]:
    """Pids of processes with `path` open (the agent waiting for its lock)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == str(path):
                    found.append(int(proc.name))
                    break
        except OSError:
            continue
    return found


def test_connection_dropped_during_apply(tmp_path: Path, client, servers, host_env):
    server = servers()
    env = host_env()
    pristine = files(env)
    lock = env.parent.parent / "share" / "patcher" / "lock"
    release = tmp_path / "release"
    # Paused inside the apply, its intent recorded, connection open.
    fault = {"at": "intent-recorded", "action": "pause", "until": str(release), "seconds": 60}
    state = lock.parent / "state.json"
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "patcher.cli",
                "apply",
                "--no-verify",
                "--host",
                spec(server),
                "--python",
                str(env),
                "--lock-timeout",
                "60",
                *client.args(),
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PATCHER_FAULT": json.dumps(fault)},
        )
        deadline = time.monotonic() + 60
        while not (state.exists() and "pending" in state.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        agents = _holders(lock)
        assert agents, "the agent never reached its lock"
        assert server.drop_connections()  # the connection dies in the middle of the apply
        out, err = proc.communicate(timeout=60)
    finally:
        release.touch()  # the orphaned agent goes on with its transaction
    assert proc.returncode == 4, err
    target = json.loads(out)["targets"][0]
    assert target["status"] == "unreachable"
    assert target["message"].startswith("connection lost")
    assert "outcome of this apply" in target["message"] and "patcher status --host" in target["message"]
    # The orphaned agent may still finish its transaction: wait for it, then every file is
    # either its old or its new bytes, never anything between, and patcher knows which.
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in agents) and time.monotonic() < deadline:
        time.sleep(0.05)
    reference = host_env()
    patcher("apply", "--no-verify", "--python", str(reference), cwd=tmp_path)
    patched = files(reference)
    for rel in TARGETS:
        assert files(env)[rel] in (pristine[rel], patched[rel]), rel
    assert not [p for p in site_file(env, "speculators").rglob(".patcher-*")]
    code, _doc, err = patcher(
        "apply", "--no-verify", "--host", spec(server), "--python", str(env), *client.args(), "--json", cwd=tmp_path
    )
    assert code == 0, err
    assert files(env) == patched
    code, _doc, err = patcher("rollback", "--host", spec(server), "--python", str(env), *client.args(), cwd=tmp_path)
    assert code == 0, err
    assert files(env) == pristine


# ---------------------------------------------------------------- users who are not root


def test_ansible_become_in_the_inventory_is_sudo_for_that_host(tmp_path: Path, client, servers, shared_env, sudoer):
    server = servers(users=(sudoer,))
    pristine = files(shared_env)
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        f"[gpus]\n{spec(server, sudoer)} ansible_python_interpreter={shared_env}\n\n[gpus:vars]\nansible_become=true\n"
    )
    code, doc, err = patcher("apply", "--no-verify", "-i", str(inventory), *client.args(), "--json", cwd=tmp_path)
    assert code == 0, err
    assert doc["targets"][0]["status"] == "changed"
    assert files(shared_env) != pristine
    assert site_file(shared_env, TARGETS[0]).stat().st_uid == 0  # written as root, owner kept
    # the same login without ansible_become cannot write there
    inventory.write_text(f"{spec(server, sudoer)} ansible_python_interpreter={shared_env}\n")
    code, doc, err = patcher("rollback", "-i", str(inventory), *client.args(), "--json", cwd=tmp_path)
    assert code == 1, err
    assert doc["targets"][0]["message"].endswith("try --sudo")
    assert files(shared_env) != pristine


def test_environment_not_writable_for_the_login_user(tmp_path: Path, client, servers, shared_env):
    ensure_user("patcher-plain")
    server = servers(users=("patcher-plain",))
    pristine = files(shared_env)
    code, doc, err = patcher(
        "apply",
        "--no-verify",
        "--host",
        spec(server, "patcher-plain"),
        "--python",
        str(shared_env),
        *client.args(),
        "--json",
        cwd=tmp_path,
    )
    assert code == 1, err
    target = doc["targets"][0]
    assert target["status"] == "failed"
    assert (
        "not writable" in target["message"] or "cannot create" in target["message"] or "Permission" in target["message"]
    )
    assert target["message"].endswith("try --sudo")
    assert files(shared_env) == pristine
    # status needs no write: it works for the same user
    code, doc, err = patcher(
        "status",
        "--host",
        spec(server, "patcher-plain"),
        "--python",
        str(shared_env),
        *client.args(),
        "--json",
        cwd=tmp_path,
    )
    assert code == 0, err
    assert doc["targets"][0]["versions"] == {"speculators": "0.3.0", "vllm": "0.16.0"}


def test_sudo_runs_the_remote_side_as_root_without_prompting(tmp_path: Path, client, servers, shared_env, sudoer):
    ensure_user("patcher-plain")
    server = servers(users=(sudoer, "patcher-plain"))
    pristine = files(shared_env)
    code, doc, err = patcher(
        "apply",
        "--no-verify",
        "--sudo",
        "--host",
        spec(server, sudoer),
        "--python",
        str(shared_env),
        *client.args(),
        "--json",
        cwd=tmp_path,
    )
    assert code == 0, err
    assert doc["targets"][0]["status"] == "changed"
    assert files(shared_env) != pristine
    target = site_file(shared_env, TARGETS[0])
    assert target.stat().st_uid == 0  # owner kept
    # a user without sudo rights: refused at once, never a password prompt
    code, doc, err = patcher(
        "rollback",
        "--sudo",
        "--host",
        spec(server, "patcher-plain"),
        "--python",
        str(shared_env),
        *client.args(),
        "--json",
        cwd=tmp_path,
        timeout=60,
    )
    assert code == 2, err
    assert doc["targets"][0]["message"].startswith("sudo -n refused")
    code, doc, err = patcher(
        "rollback",
        "--sudo",
        "--host",
        spec(server, sudoer),
        "--python",
        str(shared_env),
        *client.args(),
        "--json",
        cwd=tmp_path,
    )
    assert code == 0, err
    assert files(shared_env) == pristine


# ---------------------------------------------------------------- inventories as Ansible reads them


def test_inventory_connection_variables_from_ansible_inventory_and_built_in(tmp_path: Path, client, servers, host_env):
    """group_vars/ beside the inventory, a Jinja reference, a key file only the inventory names, the
    port only in ansible_ssh_extra_args, a local host left out by --limit: both readers reach the
    host the same way; the JSON names the reader and the ignored variables; the retry file keeps
    the resolved variables."""
    other_key = SshClient(tmp_path / "other")  # the server knows only this key; the client config does not name it
    server = servers(public_key=other_key.public_key)
    env = host_env()
    down_address = next_address()
    inventory = tmp_path / "inv" / "hosts.ini"
    (tmp_path / "inv" / "group_vars").mkdir(parents=True)
    (tmp_path / "inv" / "group_vars" / "gpus.yml").write_text(f"ansible_python_interpreter: {env}\nlogin: root\n")
    inventory.write_text(
        "localhost ansible_connection=local\n"
        "[gpus]\n"
        f"gpu1 ansible_host={server.address} ansible_user='{{{{ login }}}}' ansible_ssh_pass=unused "
        f"ansible_ssh_private_key_file={other_key.key} ansible_ssh_extra_args='-o Port={server.port}'\n"
        f"gpu2 ansible_host={down_address} ansible_port={free_port(down_address)} ansible_user=root\n"
    )
    for reader in ([], ["--no-ansible-inventory"]):
        code, doc, err = patcher(
            "status",
            "-i",
            str(inventory),
            "--limit",
            "gpus",
            *reader,
            *client.args(),
            "--connect-timeout",
            "5",
            "--json",
            cwd=tmp_path,
            env=own_cache(tmp_path),
        )
        assert code == 4, err
        assert doc["inventory"]["reader"] == (
            "built-in" if reader else f"ansible-inventory ({Path(sys.executable).parent}/ansible-inventory)"
        )
        gpu1, gpu2 = doc["targets"]
        assert (gpu1["target"], gpu1["status"], gpu1["python"]) == ("gpu1", "ok", str(env)), gpu1["message"]
        assert "inventory variables patcher ignores for this host: ansible_ssh_pass" in gpu1["notes"]
        assert gpu2["status"] == "unreachable"
    retry = [line for line in retry_file(tmp_path).read_text().splitlines() if not line.startswith("#")]
    assert retry == [
        f"gpu2 ansible_host={down_address} ansible_user=root ansible_port={retry[0].split('ansible_port=')[1]}"
    ]
    # without --limit the local host is refused, with the way out
    code, _, err = patcher("status", "-i", str(inventory), *client.args(), cwd=tmp_path)
    assert code == 2 and "ansible_connection=local is not supported" in err and "--limit" in err
    # the key file and ssh args are kept in the retry file too
    from patcher.fleet.inventory import inventory_line, load_hosts

    host = load_hosts([], [str(inventory)], "gpu1").hosts[0]
    assert host.key_file == str(other_key.key) and host.ssh_args == ("-o", f"Port={server.port}")
    line = tmp_path / "one"
    line.write_text(inventory_line(host) + "\n")
    assert load_hosts([], [str(line)]).hosts == [host]
    assert load_hosts([], [str(line)], None, str(Path(sys.executable).parent / "ansible-inventory")).hosts == [host]
