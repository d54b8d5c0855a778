"""Fixtures shared by test modules (helpers that are not fixtures live in tests/support/, and those
bench/ uses too in workbench/)."""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from workbench.envs import demo_env, light_env
from workbench.progress import keep_config
from workbench.sshd import SshClient, SshServer, ensure_user, next_address


def pytest_configure(config: pytest.Config) -> None:
    keep_config(config)  # the long fixtures' progress goes to pytest's terminal (workbench/progress.py)


@pytest.fixture
def client(tmp_path: Path) -> SshClient:
    """An ssh client configuration of the test's own (never ~/.ssh)."""
    return SshClient(tmp_path / "client")


@pytest.fixture
def servers(tmp_path: Path, client: SshClient):
    """make(users=..., public_key=..., address=...) starts a real sshd on loopback; all are
    stopped at the end of the test."""
    started: list[SshServer] = []

    def make(users=("root",), public_key: str | None = None, address: str | None = None) -> SshServer:
        keys = {user: public_key or client.public_key for user in users}
        server = SshServer(tmp_path / f"sshd{len(started)}", address or next_address(), keys)
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.remove()


@pytest.fixture
def host_env(tmp_path: Path):
    """make() gives a new light target environment (its python) for one more host."""
    count = itertools.count()

    def make() -> Path:
        return light_env(tmp_path / f"host{next(count)}")

    return make


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def shared_env(tmp_path: Path, host_env):
    """A root-owned target environment that other users can run but not write: built on the
    system Python (the test's own Python lives under /root, which other users cannot enter)."""
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"no {SYSTEM_PYTHON} for a target environment other users can run")
    template = host_env()
    root = Path(tempfile.mkdtemp(prefix="patcher-shared-", dir="/tmp"))
    os.chmod(root, 0o755)
    env = root / "env"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next((env / "lib").glob("python3.*/site-packages"))
    source = next((template.parent.parent / "lib").glob("python3.*/site-packages"))
    shutil.rmtree(site)
    shutil.copytree(source, site, symlinks=True)
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if not stat.S_ISLNK(mode):
            os.chmod(path, (mode & ~0o022) | (0o755 if stat.S_ISDIR(mode) or mode & 0o100 else 0o644))
    yield env / "bin" / "python"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sudoer():
    if not shutil.which("sudo"):
        pytest.skip("sudo is not installed (apt-get install sudo): --sudo cannot be tried")
    if not Path("/etc/sudoers.d").is_dir():
        pytest.skip("no /etc/sudoers.d to grant the test user passwordless sudo")
    ensure_user("patcher-sudo")
    rule = Path(f"/etc/sudoers.d/patcher-test-{os.getpid()}")
    rule.write_text("patcher-sudo ALL=(root) NOPASSWD: ALL\n")
    rule.chmod(0o440)
    try:
        check = subprocess.run(["sudo", "-n", "-u", "patcher-sudo", "sudo", "-n", "true"], capture_output=True)
        if check.returncode != 0:
            pytest.skip(f"sudo does not honour /etc/sudoers.d here: {check.stderr.decode().strip()}")
        yield "patcher-sudo"
    finally:
        rule.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def demo_python() -> Path:
    """The demo environment's python (vLLM 0.16.0, CPU build; workbench.envs.demo_env): built
    once, cached. A module on another release defines its own."""
    return demo_env()


@pytest.fixture(scope="module")
def model() -> Path:
    """The tiny random Llama checkpoint, made once with the 0.16 environment: every release reads
    the same weights."""
    from patcher.demo.model_cache import ensure_tiny_model

    return ensure_tiny_model(demo_env(), progress=lambda message: None)
