"""No interpreter patcher starts imports from the current, script or temp folder.

A local user who can write /tmp, the folder patcher is started from, or a login home plants
`json.py`, `__future__.py`, `pydantic.py` and `speculators/` and `patcher/` packages there; each records that
it ran. The agent (locally and over a real sshd), its verification and a bundle must run none of
them, and still answer as usual.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.cli import patcher_env
from workbench.sshd import ensure_user, spec, why_no_sshd

PLANTED = ("json", "__future__", "pydantic", "speculators", "patcher")
# The console script, as users start patcher: `python -m patcher` would itself put the current
# folder first on the controller's sys.path (Python's rule for -m, not patcher's).
PATCHER = str(Path(sys.executable).parent / "patcher")


def plant(folder: Path, marks: Path) -> None:
    """The four planted modules in `folder`; each one that runs leaves a file in `marks`."""
    for name in PLANTED:
        code = f"open({str(marks / f'{folder.name}-{name}')!r}, 'w').close()\n"
        if name in ("speculators", "patcher"):  # packages (the agent's modules are named patcher.remote.agent.*)
            (folder / name).mkdir()
            (folder / name / "__init__.py").write_text(code)
        else:
            (folder / f"{name}.py").write_text(code)


@pytest.fixture
def planted():
    """make(name) -> a folder holding the planted modules; ran() lists those that ran. The
    folders are under /tmp and open to everyone: a test's login user plants there too."""
    root = Path(tempfile.mkdtemp(prefix="patcher-planted-", dir="/tmp"))
    os.chmod(root, 0o755)
    marks = root / "marks"
    marks.mkdir()
    os.chmod(marks, 0o777)

    def make(name: str) -> Path:
        folder = root / name
        folder.mkdir()
        os.chmod(folder, 0o777)
        plant(folder, marks)
        for path in folder.rglob("*"):
            os.chmod(path, 0o777 if path.is_dir() else 0o666)
        return folder

    make.ran = lambda: sorted(p.name for p in marks.iterdir())  # type: ignore[attr-defined]
    yield make
    shutil.rmtree(root, ignore_errors=True)


def run(*args: str, cwd: Path, tmpdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PATCHER, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=patcher_env({"TMPDIR": str(tmpdir)}, clean_ssh=True),
        timeout=600,
    )


def test_the_local_agent_imports_nothing_from_the_folder_patcher_starts_in(planted, host_env, tmp_path):
    python = host_env()
    cwd = planted("cwd")
    status = run("status", "--python", str(python), cwd=cwd, tmpdir=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "pending" in status.stdout + status.stderr
    assert planted.ran() == []


def test_verification_imports_nothing_from_the_temp_folder(planted, host_env, tmp_path):
    python = host_env()
    tmp = planted("tmp")
    # verification runs in a fresh interpreter of the target (a light one: it finds problems)
    for command in ("verify", "apply"):
        done = run(command, "--python", str(python), cwd=tmp_path, tmpdir=tmp)
        assert done.returncode in (0, 1), done.stderr
        assert "verif" in done.stdout + done.stderr
    assert planted.ran() == []


@pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")
def test_over_ssh_the_login_home_is_never_imported_from(planted, client, servers, shared_env):
    home = planted("home")
    user = ensure_user("patcher-home").pw_name
    subprocess.run(["usermod", "-d", str(home), user], check=True, capture_output=True)
    server = servers(users=(user,))
    target = ["--host", spec(server, user), "--python", str(shared_env), *client.args()]
    cwd, tmp = planted("cwd"), planted("tmp")
    status = run("status", *target, cwd=cwd, tmpdir=tmp)
    assert status.returncode == 0, status.stderr
    verify = run("verify", *target, cwd=cwd, tmpdir=tmp)
    assert verify.returncode in (0, 1), verify.stderr
    assert planted.ran() == []


@functools.lru_cache(maxsize=1)
def built_bundle(folder: str) -> Path:
    out = Path(folder) / "patcher-bundle.py"
    done = subprocess.run([PATCHER, "bundle", "-o", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return out


def test_a_bundle_imports_nothing_from_its_own_folder(planted, host_env, tmp_path_factory):
    bundle = built_bundle(str(tmp_path_factory.mktemp("planted-bundle")))
    beside, cwd, tmp = planted("beside"), planted("cwd"), planted("tmp")
    copy = beside / bundle.name
    shutil.copy2(bundle, copy)
    python = host_env()
    env = {k: v for k, v in patcher_env({"TMPDIR": str(tmp)}).items() if not k.startswith("PYTHON")}
    for command in ("status", "apply"):
        done = subprocess.run(
            [str(python), str(copy), command], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
        )
        assert done.returncode in (0, 1), done.stderr
        assert "Traceback" not in done.stderr, done.stderr
    assert planted.ran() == []
