"""Targets the engine must handle beyond the common case: older and too-old interpreters and
read-only site-packages."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import patcher, sha, states
from tests.support.files import GENERATOR, PRISTINE_GENERATOR
from workbench.envs import light_env, site_file

PYENV = Path.home() / ".pyenv" / "versions"


def interpreter(minor: str) -> str:
    found = shutil.which(f"python{minor}") if not (PYENV.exists()) else None
    candidates = sorted(PYENV.glob(f"{minor}.*/bin/python{minor}")) if PYENV.exists() else []
    path = str(candidates[-1]) if candidates else found
    if not path:
        pytest.fail(f"python{minor} is not installed; .ci/bootstrap expects it on this machine kind")
    return path


def test_target_on_python_3_9(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("workbench.envs.PYTHON_FOR_TARGETS", interpreter("3.9"))
    python = light_env(tmp_path)
    version = subprocess.run(
        [str(python), "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True, check=True
    ).stdout
    assert version.strip() == "(3, 9)"
    code, doc, err = patcher("apply", "--python", str(python), "--no-verify", "--json")
    assert code == 0, err
    assert states(doc)["v3-signatures"] == "applied"
    assert patcher("rollback", "--python", str(python))[0] == 0
    assert sha(site_file(python, GENERATOR)) == PRISTINE_GENERATOR


def test_target_python_too_old_is_named(tmp_path: Path):
    code, _, err = patcher("status", "--python", interpreter("3.8"))
    assert code == 2
    assert "patcher needs 3.9 or newer" in err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a read-only bind mount")
def test_read_only_site_packages_changes_nothing(tmp_path: Path):
    python = light_env(tmp_path)
    package = site_file(python, "speculators")
    if subprocess.run(["mount", "--bind", "-o", "ro", str(package), str(package)]).returncode != 0:
        pytest.fail("mount --bind -o ro failed; this machine kind allows it as root")
    try:
        code, doc, err = patcher("apply", "--python", str(python), "--no-verify", "--json")
    finally:
        subprocess.run(["umount", str(package)], check=True)
    assert code == 1, err
    assert "not writable" in doc["targets"][0]["message"]
    assert sha(site_file(python, GENERATOR)) == PRISTINE_GENERATOR
    state = python.parent.parent / "share" / "patcher" / "state.json"
    assert not state.exists() or '"files": {}' in state.read_text()
