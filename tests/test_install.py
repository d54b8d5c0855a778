"""The user's install route (README: `pip install .`, `pipx install .`, `uv tool install .`): the
checkout built into a wheel by pip, installed with its dependencies from the package index into
a fresh venv, then run as a user runs it, from a folder outside the checkout. A file the package
data leaves out fails here (the wheel once lacked patcher/demo/releases.json: `patcher demo`
ended in FileNotFoundError), not on a user's machine.

The checkout's files are copied first (not .git, .venv, build/ or shared/): setuptools builds in
the source folder, and a stale build/ there would put files into the wheel that the tree no
longer has. About 15 s: a build with pip's isolation (setuptools from the index) and an install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from patcher.patchset.registry import load_patches

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "shared", "site", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
)


def run(*argv: str | Path, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_a_wheel_of_the_checkout_installs_and_runs_in_a_fresh_venv(tmp_path: Path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_OUT, symlinks=True)
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", source, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("patcher-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (
        "patcher/demo/releases.json",
        "patcher/demo/requirements.txt",
        "patcher/remote/agent/session.py",
        "patcher/remote/run_check_driver.py",
        "patcher/core/versions.py",
    ):
        assert data in names, data
    # patcher's own patch set is found as any installed set is: by its entry point
    (points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "[patcher.patch_sets]\nspeculators = patcher.patches\n" in zipfile.ZipFile(wheel).read(points).decode()

    venv = tmp_path / "venv"
    assert run(sys.executable, "-m", "venv", venv, cwd=tmp_path).returncode == 0
    installed = run(venv / "bin" / "python", "-m", "pip", "install", "-q", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]

    home = tmp_path / "home"  # the user's folder: outside the checkout, with a cache of its own
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PATCHER_CACHE=str(home / "cache"), COLUMNS="80")
    patcher = venv / "bin" / "patcher"

    version = run(patcher, "--version", cwd=home, env=env)
    assert (version.returncode, version.stdout) == (0, "patcher, version 0.1.0\n"), version.stderr
    listed = run(patcher, "list", cwd=home, env=env)
    assert listed.returncode == 0, listed.stderr
    assert [line for line in listed.stderr.splitlines() if not line.startswith(" ")] == [p.id for p in load_patches()]
    # the demo as far as its recipe: read from releases.json in the installed package, which says
    # that vLLM 0.33.0's recipe installs the CUDA wheel, so there is no CPU build to run (exit 2)
    demo = run(patcher, "demo", "--vllm", "0.33.0", cwd=home, env=env)
    assert demo.returncode == 2, demo.stderr
    assert "Traceback" not in demo.stderr
    assert demo.stderr.splitlines()[-1].startswith(
        "Error: vLLM 0.33.0 has no CPU build: its recipe installs the vllm (CUDA) wheel"
    ), demo.stderr
    # the agent ships too: a run on the venv's own python reads it and says what is missing there
    status = run(patcher, "status", "--python", venv / "bin" / "python", cwd=home, env=env)
    assert status.returncode == 2, status.stderr
    assert "speculators is not installed in" in status.stderr.splitlines()[-1], status.stderr
    assert not (home / "patcher.retry").exists() and sorted(p.name for p in home.iterdir()) in ([], ["cache"])
