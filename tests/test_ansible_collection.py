"""patcher as an Ansible collection (remote/ansible/): built with `ansible-galaxy collection build`,
installed with `ansible-galaxy collection install`, and run by `ansible-playbook` (the pinned
ansible-core of the test extra) against real targets, each with its own light target environment:

- every connection plugin ansible-core ships that runs POSIX commands (local, ssh, paramiko_ssh;
  the ssh ones against real loopback sshd hosts), each with and without become (sudo) and with
  pipelining on and off, in one inventory: check mode writes nothing, the first apply is
  `changed`, the second `ok`, rollback restores the original bytes;
- two ssh hosts: the same, and a hand-edited file fails with the conflict message;
- the documentation renders with `ansible-doc`.
"""

from __future__ import annotations

import ast
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from patcher.frontends.ansible_task import COMMANDS, OPTIONS
from patcher.patchset.registry import load_patches
from tests.support.files import GENERATOR
from tests.test_hostile_answers import answers_changed
from workbench.ansible_test_sanity import SHORT_FORM, run_sanity
from workbench.envs import light_env, site_file
from workbench.release_files import cache_dir
from workbench.sshd import SshClient, SshServer, why_no_sshd

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TARGETS = sorted({p.target.path for p in load_patches()})
SYSTEM_PYTHON = Path("/usr/bin/python3")

pytestmark = pytest.mark.skipif(
    not (BIN / "ansible-playbook").exists(), reason="ansible-core (test extra) is not installed"
)
needs_sshd = pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


@pytest.fixture(scope="module")
def collections(tmp_path_factory) -> Path:
    """The collection, built from remote/ansible and installed: the ANSIBLE_COLLECTIONS_PATH."""
    work = tmp_path_factory.mktemp("collection")
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
    installed = work / "collections"
    done = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "install", str(tarball), "-p", str(installed)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return installed


def ansible_env(work: Path, collections: Path, client: SshClient | None = None) -> dict[str, str]:
    """ansible-playbook's environment: the installed collection, a private ssh client
    configuration (nothing under ~/.ssh), JSON results on one line each."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"},
        "ANSIBLE_COLLECTIONS_PATH": str(collections),
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
    if client is not None:
        env["ANSIBLE_SSH_ARGS"] = f"-F {client.config} -o ControlMaster=auto -o ControlPersist=60s"
        env["ANSIBLE_PARAMIKO_LOOK_FOR_KEYS"] = "False"
    return env


def play(
    work: Path, inventory: Path, env: dict, command: str, *flags: str, forks: int = 8
) -> tuple[int, dict[str, dict], str]:
    """One ansible-playbook run of the collection's task (README's patch.yml, verification left
    out: a light target has vLLM's metadata only); each host's task result, and the output."""
    book = work / f"{command}.yml"
    book.write_text(
        "- hosts: gpus\n  gather_facts: false\n  tasks:\n"
        "    - name: speculators patches on vLLM\n"
        f"      patcher.fleet.patch:\n        command: {command}\n        verify: false\n"
        "      register: patched\n"
    )
    done = subprocess.run(
        [str(BIN / "ansible-playbook"), "-v", "-i", str(inventory), "-f", str(forks), *flags, str(book)],
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


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> dict[str, bytes]:
    """The target files as `patcher apply` writes them on a light environment."""
    work = tmp_path_factory.mktemp("reference")
    reference = light_env(work)
    subprocess.run(
        [sys.executable, "-m", "patcher.cli", "apply", "--no-verify", "-q", "--python", str(reference)],
        check=True,
        env={**os.environ, "PATCHER_CACHE": str(work / "cache")},
    )
    return files(reference)


def env_owned_by(user: str, template: Path) -> Path:
    """A copy of the light environment `template` on the system Python, in /tmp, owned by `user`
    (who must be able to reach and run it: the tests' own Python and folders are root's)."""
    root = Path(tempfile.mkdtemp(prefix="patcher-ansible-env-", dir="/tmp"))
    os.chmod(root, 0o755)
    env = root / "env"
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(env)], check=True)
    site = next((env / "lib").glob("python3.*/site-packages"))
    shutil.rmtree(site)
    shutil.copytree(next((template.parent.parent / "lib").glob("python3.*/site-packages")), site, symlinks=True)
    account = pwd.getpwnam(user)
    for path in [env, *env.rglob("*")]:
        os.chown(path, account.pw_uid, account.pw_gid, follow_symlinks=False)
    return env / "bin" / "python"


def owner_of_state(python: Path) -> str:
    """Who wrote the environment's state record (<sys.prefix>/share/patcher/state.json, a new file
    of the agent's, so owned by the user the agent ran as)."""
    state = python.parent.parent / "share" / "patcher" / "state.json"
    return pwd.getpwuid(state.stat().st_uid).pw_name


@needs_sshd
def test_every_connection_with_and_without_become_and_pipelining(
    collections, patched, tmp_path: Path, client: SshClient, servers, sudoer
):
    """One inventory, one host per (connection, become, pipelining): local, ssh and paramiko_ssh
    (both against a real loopback sshd), become through sudo or not, pipelining on (the request
    on the command's stdin) or off (the request in a temporary file on the host), and README's
    playbooks on all of them at once."""
    sshd = servers(users=("root", sudoer))
    remote_tmp = Path(tempfile.mkdtemp(prefix="patcher-ansible-tmp-", dir="/tmp"))
    os.chmod(remote_tmp, 0o1777)  # each login user's own remote_tmp below (become hosts log in as the sudoer)
    hosts: dict[str, Path] = {}
    owned: list[Path] = []  # environments made outside tmp_path, removed at the end
    lines = []
    for connection in ("local", "ssh", "paramiko_ssh"):
        for become in (False, True):
            for pipelining in (True, False):
                name = f"{connection}-{'become' if become else 'plain'}-{'pipelined' if pipelining else 'unpipelined'}"
                python = light_env(tmp_path / name)
                variables = {
                    "ansible_connection": connection,
                    "ansible_pipelining": str(pipelining).lower(),
                    "ansible_remote_tmp": str(remote_tmp / name),
                }
                if connection == "local":
                    if become:
                        # root becomes an unprivileged user: the agent writes as that user, in
                        # that user's environment (and the unpipelined request file must be
                        # made readable for it: Ansible's own _fixup_perms2)
                        python = env_owned_by(sudoer, python)
                        owned.append(python.parent.parent.parent)
                        variables.update(ansible_become="true", ansible_become_user=sudoer)
                else:
                    variables.update(ansible_host=sshd.address, ansible_port=str(sshd.port))
                    variables["ansible_private_key_file"] = str(client.key)
                    # a sudoer logs in and becomes root (the default become_user), or root logs in
                    variables["ansible_user"] = sudoer if become else "root"
                    if become:
                        variables["ansible_become"] = "true"
                variables["ansible_python_interpreter"] = str(python)
                hosts[name] = python
                lines.append(name + " " + " ".join(f"{k}={v}" for k, v in variables.items()) + "\n")
    inventory = tmp_path / "hosts.ini"
    inventory.write_text("[gpus]\n" + "".join(lines))
    env = ansible_env(tmp_path, collections, client)
    pristine = {name: files(python) for name, python in hosts.items()}
    run = lambda *args: play(tmp_path, inventory, env, *args, forks=len(hosts))  # noqa: E731

    try:
        code, results, output = run("apply", "--check", "--diff")
        assert code == 0, output
        assert {h: r["status"] for h, r in results.items()} == dict.fromkeys(hosts, "changed"), output
        assert all(r["patcher"]["exit_code"] == 6 for r in results.values()), output
        assert {name: files(python) for name, python in hosts.items()} == pristine  # check mode wrote nothing

        code, results, output = run("apply", "-vvv")
        assert code == 0, output
        assert {h: r["status"] for h, r in results.items()} == dict.fromkeys(hosts, "changed"), output
        # pipelining off, and paramiko_ssh (which cannot pipe): each request (facts, then apply) was
        # a file put on the host; pipelining on: none was
        uploads = [line for line in output.splitlines() if " PUT " in line and "patcher-request-" in line]
        by_file = [name for name in hosts if name.endswith("-unpipelined") or name.startswith("paramiko_ssh")]
        assert len(uploads) == 2 * len(by_file), uploads
        for name in by_file:
            if not name.startswith("local-become"):  # that one's folder is in the system's tmp (Ansible's rule)
                assert sum(f"{remote_tmp / name}/" in line for line in uploads) == 2, (name, uploads)
        for name, python in hosts.items():
            assert files(python) == patched, name
            assert results[name]["patcher"]["versions"] == {"speculators": "0.3.0", "vllm": "0.16.0"}, name
            # who the agent ran as: the become user where become is on, else the login user (root)
            wanted = sudoer if name.startswith("local-become") else "root"
            assert owner_of_state(python) == wanted, name

        code, results, output = run("apply")
        assert code == 0, output
        assert {h: r["status"] for h, r in results.items()} == dict.fromkeys(hosts, "ok"), output

        code, results, output = run("rollback", "--check")
        assert code == 0, output
        assert {h: r["status"] for h, r in results.items()} == dict.fromkeys(hosts, "changed"), output
        assert all(files(python) == patched for python in hosts.values())

        code, results, output = run("rollback")
        assert code == 0, output
        assert {h: r["status"] for h, r in results.items()} == dict.fromkeys(hosts, "changed"), output
        assert {name: files(python) for name, python in hosts.items()} == pristine  # the original bytes
        # nothing left in the remote temporary folders (the unpipelined requests are removed)
        assert not [p for p in remote_tmp.rglob("*") if p.is_file()], list(remote_tmp.rglob("*"))
    finally:
        shutil.rmtree(remote_tmp, ignore_errors=True)
        for folder in owned:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, collections):
    work = tmp_path_factory.mktemp("ansible")
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
    yield work, inventory, envs, ansible_env(work, collections, client)
    for server in servers:
        server.remove()


@needs_sshd
def test_playbook_check_apply_again_rollback_and_a_conflict(fleet, patched):
    work, inventory, envs, env = fleet
    pristine = [files(e) for e in envs]

    code, results, output = play(work, inventory, env, "apply", "--check", "--diff")
    assert code == 0, output
    assert [results[h]["status"] for h in ("gpu0", "gpu1")] == ["changed", "changed"], output
    assert results["gpu0"]["patcher"]["exit_code"] == 6 and "would change" in results["gpu0"]["msg"]
    assert "+++ " in output and "@@" in output  # --diff: the plan's unified diffs
    assert [files(e) for e in envs] == pristine  # check mode wrote nothing

    code, results, output = play(work, inventory, env, "apply")
    assert code == 0, output
    assert {h: r["status"] for h, r in results.items()} == {"gpu0": "changed", "gpu1": "changed"}, output
    entry = results["gpu0"]["patcher"]
    assert entry["status"] == "changed" and entry["versions"] == {"speculators": "0.3.0", "vllm": "0.16.0"}
    assert all(files(e) == patched for e in envs)
    assert "changed=1" in output

    code, results, output = play(work, inventory, env, "apply")
    assert code == 0, output
    assert {h: r["status"] for h, r in results.items()} == {"gpu0": "ok", "gpu1": "ok"}, output
    assert "changed=0" in output

    code, results, output = play(work, inventory, env, "rollback", "--check")
    assert code == 0 and results["gpu0"]["status"] == "changed", output
    assert all(files(e) == patched for e in envs)

    code, results, output = play(work, inventory, env, "rollback")
    assert code == 0, output
    assert {h: r["status"] for h, r in results.items()} == {"gpu0": "changed", "gpu1": "changed"}, output
    assert [files(e) for e in envs] == pristine  # the original bytes, to the byte

    code, results, output = play(work, inventory, env, "apply")
    assert code == 0, output
    edited = site_file(envs[1], TARGETS[0])
    edited.write_bytes(edited.read_bytes() + b"\n# edited by hand\n")
    code, results, output = play(work, inventory, env, "rollback")
    assert code != 0, output
    assert results["gpu0"]["status"] == "changed"
    bad = results["gpu1"]
    assert bad["status"] == "fatal"  # failed: the callback prints it as fatal
    assert bad["patcher"]["exit_code"] == 3
    assert f"{TARGETS[0]} was changed by hand since patcher last wrote it" in bad["msg"], bad["msg"]
    # the task's option, where patcher's own message names its command line's
    assert bad["msg"] == bad["patcher"]["message"].replace("rerun with --force", "rerun with force: true")
    assert "rerun with force: true to adopt" in bad["msg"], bad["msg"]
    assert edited.read_bytes().endswith(b"# edited by hand\n")  # left as it is


def test_bad_inputs_fail_the_host_with_what_to_do(collections, tmp_path: Path):
    """Each host of one play gets one bad input (local connection: no sshd needed); each fails
    with a one-line message saying what to do, and the play exits 2 (Ansible's failed hosts)."""
    good = light_env(tmp_path / "good")
    odd = light_env(tmp_path / "odd")
    answers_changed(odd, "[o]")  # a .pth there makes each of the agent's answers a list
    hosts = {
        "windows-shell": f"ansible_shell_type=powershell ansible_python_interpreter={good}",
        "no-python-pipelined": "ansible_python_interpreter=/nonexistent/bin/python3",
        "no-python-unpipelined": "ansible_python_interpreter=/nonexistent/bin/python3 ansible_pipelining=false",
        "not-python": "ansible_python_interpreter=/bin/true",
        "bad-command": f"ansible_python_interpreter={good} patcher_command=upgrade",
        "unknown-patch": f"ansible_python_interpreter={good} patcher_only=v999",
        "no-target": f"ansible_python_interpreter={sys.executable}",
        "lock-forever": f"ansible_python_interpreter={good} patcher_lock_timeout=inf",
        "odd-answers": f"ansible_python_interpreter={odd}",
    }
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[gpus]\n" + "".join(f"{name} ansible_connection=local {variables}\n" for name, variables in hosts.items())
    )
    book = tmp_path / "bad.yml"
    book.write_text(
        "- hosts: gpus\n  gather_facts: false\n  tasks:\n"
        "    - patcher.fleet.patch:\n"
        "        command: \"{{ patcher_command | default('status') }}\"\n"
        '        only: "{{ [patcher_only] if patcher_only is defined else omit }}"\n'
        '        lock_timeout: "{{ patcher_lock_timeout | default(10) }}"\n'
    )
    done = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), "-f", str(len(hosts)), str(book)],
        capture_output=True,
        text=True,
        env=ansible_env(tmp_path, collections),
        cwd=tmp_path,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    messages = {}
    for line in done.stdout.splitlines():
        if line.startswith("fatal: ["):
            host, _, rest = line[len("fatal: [") :].partition("]")
            messages[host] = json.loads(rest.split("=> ", 1)[1])["msg"]
    assert set(messages) == set(hosts), output
    assert "needs a POSIX shell on the host; this host's is powershell" in messages["windows-shell"]
    for name in ("no-python-pipelined", "no-python-unpipelined"):
        assert messages[name] == (
            f"no python at /nonexistent/bin/python3 on {name}; set python: (or ansible_python_interpreter)"
        ), messages[name]
    assert messages["not-python"].startswith("/bin/true did not answer as a Python 3.9+ interpreter on not-python")
    assert messages["bad-command"] == "command='upgrade': one of status, apply, rollback"
    assert "v999" in messages["unknown-patch"] and "see `patcher list`" in messages["unknown-patch"]
    assert messages["no-target"] == (
        f"speculators is not installed in {sys.executable}; name the environment's interpreter with python: "
        "(or ansible_python_interpreter)"
    ), messages["no-target"]
    forever = messages["lock-forever"]
    assert forever == "lock_timeout: 'inf' is not a number of seconds from 0 to 604800 (7 days)", forever
    assert messages["odd-answers"].startswith(
        "odd-answers: the target answered something that is not patcher's protocol (to the facts request: answer "
        f"is a list, not an object); something in {odd} (a .pth file"
    ), messages["odd-answers"]
    assert all("\n" not in m for m in messages.values()), messages


def test_check_mode_writes_nothing_in_the_target(collections, tmp_path: Path):
    """Ansible's check mode (apply or rollback) plans and reports: no file, no folder, not even
    patcher's lock is created or changed (it once made share/, share/patcher/ and lock)."""
    python = light_env(tmp_path / "host")
    prefix = python.parent.parent
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(f"[gpus]\nhost ansible_connection=local ansible_python_interpreter={python}\n")
    env = ansible_env(tmp_path, collections)

    def tree() -> dict[str, tuple[int, int, bytes]]:
        return {
            str(path.relative_to(prefix)): (path.stat().st_mode, path.stat().st_mtime_ns, path.read_bytes())
            for path in prefix.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts
        } | {
            str(path.relative_to(prefix)): (path.stat().st_mode, 0, b"") for path in prefix.rglob("*") if path.is_dir()
        }

    before = tree()
    code, results, output = play(tmp_path, inventory, env, "apply", "--check")
    assert code == 0 and results["host"]["status"] == "changed", output
    assert results["host"]["patcher"]["exit_code"] == 6, output
    assert not (prefix / "share").exists(), sorted(p.name for p in (prefix / "share").rglob("*"))
    assert tree() == before
    code, results, output = play(tmp_path, inventory, env, "apply")
    assert code == 0 and results["host"]["status"] == "changed", output
    before = tree()
    code, results, output = play(tmp_path, inventory, env, "rollback", "--check")
    assert code == 0 and results["host"]["status"] == "changed", output
    assert tree() == before


def test_a_python_in_the_home_folder_as_on_the_command_line(collections, tmp_path: Path):
    """`python: ~/...` is the (become) user's home, as `--python ~/...` is patcher's (it was taken
    as a folder named `~`)."""
    python = light_env(tmp_path / "home" / "host")
    inventory = tmp_path / "hosts.ini"
    inventory.write_text("[gpus]\nhost ansible_connection=local\n")
    book = tmp_path / "home.yml"
    book.write_text(
        "- hosts: gpus\n  gather_facts: false\n  tasks:\n"
        f"    - patcher.fleet.patch:\n        python: ~/{python.relative_to(tmp_path / 'home')}\n"
    )
    done = subprocess.run(
        [str(BIN / "ansible-playbook"), "-v", "-i", str(inventory), str(book)],
        capture_output=True,
        text=True,
        env={**ansible_env(tmp_path, collections), "HOME": str(tmp_path / "home")},
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"versions": {"speculators": "0.3.0", "vllm": "0.16.0"}' in done.stdout, done.stdout


def test_rollback_with_force_restores_an_original_pips_record_does_not_vouch_for(collections, tmp_path: Path):
    """`force: true` with `command: rollback` is `patcher rollback --force`: a kept original that is
    not pip's bytes is refused without it (the message names the task's options), restored with it."""
    from tests.support.state import PLANTED, plant_original

    python = light_env(tmp_path / "host")
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(f"[gpus]\nhost ansible_connection=local ansible_python_interpreter={python}\n")
    env = ansible_env(tmp_path, collections)
    code, results, output = play(tmp_path, inventory, env, "apply")
    assert code == 0 and results["host"]["status"] == "changed", output
    plant_original(python, as_nobody=False)
    patched = files(python)
    code, results, output = play(tmp_path, inventory, env, "rollback")
    assert code != 0 and results["host"]["status"] == "fatal", output
    assert results["host"]["patcher"]["exit_code"] == 3
    assert "run the task with command: rollback and force: true" in results["host"]["msg"], results["host"]["msg"]
    assert files(python) == patched
    book = tmp_path / "forced.yml"
    book.write_text(
        "- hosts: gpus\n  gather_facts: false\n  tasks:\n    - patcher.fleet.patch: {command: rollback, force: true}\n"
    )
    done = subprocess.run(
        [str(BIN / "ansible-playbook"), "-v", "-i", str(inventory), str(book)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "changed: [host]" in done.stdout, done.stdout
    assert site_file(python, GENERATOR).read_bytes() == PLANTED


def test_delegate_to_and_a_templated_interpreter(collections, patched, tmp_path: Path):
    """`delegate_to: near` patches near's environment over near's connection (local), with near's
    ansible_python_interpreter (a template, rendered as Ansible renders it), never the play host's."""
    python = light_env(tmp_path / "near")
    pristine = files(python)
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[gpus]\nfar ansible_host=127.0.0.254 ansible_port=1 ansible_python_interpreter=/nonexistent/bin/python3\n"
        "[workers]\nnear ansible_connection=local ansible_python_interpreter='{{ envs }}/near/env/bin/python'\n"
        f"[all:vars]\nenvs={tmp_path}\n"
    )
    book = tmp_path / "delegated.yml"
    env = ansible_env(tmp_path, collections)
    for command, wanted in (("apply", patched), ("rollback", pristine)):
        book.write_text(
            "- hosts: gpus\n  gather_facts: false\n  tasks:\n"
            f"    - patcher.fleet.patch: {{command: {command}, verify: false}}\n      delegate_to: near\n"
        )
        done = subprocess.run(
            [str(BIN / "ansible-playbook"), "-v", "-i", str(inventory), str(book)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "changed: [far -> near]" in done.stdout, done.stdout
        assert files(python) == wanted, command
        result = json.loads(done.stdout.split("changed: [far -> near] => ", 1)[1].splitlines()[0])
        assert result["patcher"]["target"] == "far (delegated to near)"
        assert result["patcher"]["python"] == str(python), result["patcher"]["python"]


def test_ansible_doc_renders_and_documents_exactly_the_actions_options(collections):
    """`ansible-doc` renders the module's documentation (text and JSON), and its options are the
    ones the action accepts: a new option cannot go undocumented, nor a documented one unaccepted."""
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(collections), "ANSIBLE_NOCOLOR": "1"}
    text = subprocess.run(
        [
            str(
                BIN / "ansible-doc",
            ),
            "patcher.fleet.patch",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert text.returncode == 0 and not text.stderr.strip(), text.stderr
    for heading in ("OPTIONS", "ATTRIBUTES", "NOTES", "REQUIREMENTS", "EXAMPLES", "RETURN VALUES"):
        assert heading in text.stdout, heading
    assert "This module has a corresponding action plugin" in text.stdout
    done = subprocess.run(
        [str(BIN / "ansible-doc"), "--json", "patcher.fleet.patch"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)["patcher.fleet.patch"]["doc"]
    action = (collections / "ansible_collections" / "patcher" / "fleet" / "plugins" / "action" / "patch.py").read_text()
    accepted = ast.literal_eval(action.split("_VALID_ARGS = frozenset(", 1)[1].split(")\n", 1)[0])
    assert set(doc["options"]) == set(OPTIONS) == set(accepted)
    assert doc["options"]["command"]["choices"] == list(COMMANDS)
    assert doc["attributes"]["check_mode"]["support"] == "full" and doc["attributes"]["diff_mode"]["support"] == "full"


def test_ansible_test_sanity_short_form(tmp_path: Path):
    """`ansible-test sanity` (the pinned ansible-core's) on the collection: the tests of its
    documentation and metadata, and those that need no environment. Its environments are kept in
    patcher's test cache (made once, from the package index); bench/ansible_sanity.py runs all of
    the sanity tests."""
    done = run_sanity(tmp_path, cache_dir() / "ansible-test-home", SHORT_FORM)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    for test in SHORT_FORM:
        assert f'Running sanity test "{test}"' in output, (test, output[-3000:])


def test_patcher_is_imported_once_by_ansible_playbook_before_it_forks_the_hosts_workers(collections, tmp_path: Path):
    """The action plugin imports patcher (and reads the patch set) when ansible-playbook loads it,
    in ansible-playbook's own process, which then forks one worker per host: three hosts, one
    import, in the process whose stderr `-X importtime` reports (the workers' is not shown)."""
    python = light_env(tmp_path / "env")
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[gpus]\n" + "".join(f"h{i} ansible_connection=local ansible_python_interpreter={python}\n" for i in range(3))
    )
    book = tmp_path / "status.yml"
    book.write_text("- hosts: gpus\n  gather_facts: false\n  tasks:\n    - patcher.fleet.patch: {command: status}\n")
    done = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(book)],
        capture_output=True,
        text=True,
        env={**ansible_env(tmp_path, collections), "PYTHONPROFILEIMPORTTIME": "1"},
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0 and "ok=1" in done.stdout, done.stdout + done.stderr[-3000:]
    imports = [line for line in done.stderr.splitlines() if line.endswith("| patcher.frontends.ansible_task")]
    assert len(imports) == 1, imports


@needs_sshd
def test_a_host_on_an_uncovered_release_is_failed_with_the_reason(fleet):
    """Exit 7 is Ansible's `failed` (only 0, and 6 in check mode, are ok), with patcher's one line."""
    from workbench.envs import reinstall_speculators

    work, inventory, envs, env = fleet
    reinstall_speculators(envs[1], "0.2.0")  # a release no patch set covers
    try:
        code, results, output = play(work, inventory, env, "status")
        assert code != 0, output
        assert results["gpu0"]["status"] == "ok"
        bad = results["gpu1"]
        assert bad["status"] == "fatal" and bad["patcher"]["exit_code"] == 7, output
        assert bad["msg"] == bad["patcher"]["message"]
        assert bad["msg"].startswith("speculators 0.2.0 is not a release patcher covers"), bad["msg"]
    finally:
        reinstall_speculators(envs[1], "0.3.0")


def test_a_patch_set_from_a_folder_through_the_collections_task(collections, tmp_path: Path):
    """`patches: [DIR]` is `patcher --patches DIR`: the Flask set applied and rolled back on a
    host's Flask 2.2.2 / Werkzeug 3 environment; a folder others can write fails the host."""
    from tests.support.patch_sets import FILES, copy_of_set, flask_works
    from workbench.envs import flask_env, site_file

    python = flask_env(tmp_path / "host")
    pristine = {rel: site_file(python, rel).read_bytes() for rel in FILES}
    folder = copy_of_set(tmp_path)
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(f"[gpus]\nhost ansible_connection=local ansible_python_interpreter={python}\n")
    env = ansible_env(tmp_path, collections)

    def run(command: str) -> tuple[int, str]:
        book = tmp_path / f"set-{command}.yml"
        book.write_text(
            "- hosts: gpus\n  gather_facts: false\n  tasks:\n"
            f"    - patcher.fleet.patch:\n        command: {command}\n        patches: ['{folder}']\n"
        )
        done = subprocess.run(
            [str(BIN / "ansible-playbook"), "-v", "-i", str(inventory), str(book)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
        )
        return done.returncode, done.stdout + done.stderr

    code, output = run("apply")
    assert code == 0 and "flask-werkzeug3:v1-url-quote" in output, output
    assert flask_works(python).stdout.strip() == "hi"
    code, output = run("rollback")
    assert code == 0, output
    assert {rel: site_file(python, rel).read_bytes() for rel in FILES} == pristine
    folder.chmod(0o777)
    code, output = run("apply")
    assert code != 0 and "patches: " in output and "is writable by others" in output, output
