"""The remote command parses in every common login shell (issue 38): ssh hands it to the login
user's shell, and a `python -c` program spread over lines made tcsh answer "Unmatched '''." (read as
"did not answer as a Python 3.9+ interpreter"). The command is one line of plain words in single
quotes. Real login users with each shell, a real sshd."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import patcher
from workbench.sshd import ensure_user, spec, why_no_sshd

pytestmark = pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")

SHELLS = ["sh", "bash", "tcsh"]


def login_user_with(shell: str) -> str:
    path = shutil.which(shell)
    if path is None:
        pytest.skip(f"no {shell} here (apt-get install {shell}; .ci/bootstrap does it as root)")
    name = f"patcher-{shell}"
    ensure_user(name)
    subprocess.run(["usermod", "-s", path, name], check=True, capture_output=True)
    return name


@pytest.mark.parametrize("shell", SHELLS)
def test_status_through_each_login_shell(tmp_path: Path, client, servers, shared_env: Path, shell: str):
    user = login_user_with(shell)
    server = servers(users=(user,))
    code, doc, err = patcher(
        "status", "--host", spec(server, user), "--python", str(shared_env), *client.args(), "--json", cwd=tmp_path
    )
    assert code == 0, err
    assert doc is not None and doc["targets"][0]["versions"] == {"speculators": "0.3.0", "vllm": "0.16.0"}, err
