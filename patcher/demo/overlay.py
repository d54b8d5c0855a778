"""A target environment of its own on top of the demo environment.

A venv (no pip) whose .pth file points at the demo environment's site-packages, so it sees the
real vLLM, torch and transformers, with its own copy of speculators installed in front of them.
Patching it never touches the shared, cached environment: the demo and the tests each patch a
throwaway copy of exactly what a user's environment holds.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def make_overlay(base_python: Path, dest: Path, speculators: str = "speculators==0.3.0") -> Path:
    """Create the overlay at `dest` (replacing any) and return its python.

    `speculators` is what pip installs there: a requirement or a wheel file.
    """
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run([str(base_python), "-m", "venv", "--without-pip", str(dest)], check=True)
    base_site = _purelib(base_python)
    site = Path(_purelib(dest / "bin" / "python"))
    (site / "_patcher_demo_base.pth").write_text(base_site + "\n")
    subprocess.run(
        [
            str(base_python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--disable-pip-version-check",
            "--target",
            str(site),
            speculators,
        ],
        check=True,
        capture_output=True,
    )
    return dest / "bin" / "python"


def _purelib(python: Path) -> str:
    return subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
