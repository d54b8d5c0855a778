"""Fixtures shared by test modules (helpers that are not fixtures live in tests/support/)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.support.envs import light_env
from tests.support.sshd import SshClient, SshServer, next_address


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
