"""Find a Python of a given version by running it, not by its name on PATH.

A name on PATH proves nothing: a pyenv shim for a version pyenv does not select exits 127
("pyenv: python3.9: command not found"). Each candidate is asked for its version; the first
that answers with the one wanted is used, else the reasons each candidate gave.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_ASK = "import sys; print('%d.%d' % sys.version_info[:2])"


SYSTEM_FOLDERS = ("/usr/local/bin", "/usr/bin")


def candidates(
    version: str, search_path: str | None = None, pyenv_root: str | None = None, system=SYSTEM_FOLDERS
) -> list[Path]:
    """`python<version>` in every PATH folder (in order), then pyenv's own installs (newest
    first: they are not on PATH, only its shims are), then the system's usual places."""
    name = f"python{version}"
    search_path = os.environ.get("PATH", "") if search_path is None else search_path
    found = [Path(folder) / name for folder in search_path.split(os.pathsep) if folder]
    root = Path(pyenv_root or os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    installs = sorted(
        (root / "versions").glob(f"{version}.*/bin/{name}"),
        key=lambda p: [int(x) if x.isdigit() else -1 for x in p.parent.parent.name.split(".")],
        reverse=True,
    )
    found += installs + [Path(folder) / name for folder in system]
    unique, seen = [], set()
    for path in found:
        if path not in seen and path.is_file() and os.access(path, os.X_OK):
            seen.add(path)
            unique.append(path)
    return unique


def find_python(
    version: str, search_path: str | None = None, pyenv_root: str | None = None, system=SYSTEM_FOLDERS
) -> tuple[str | None, str]:
    """(the first interpreter that runs and is `version`, "") or (None, why none was usable)."""
    reasons = []
    for path in candidates(version, search_path, pyenv_root, system):
        try:
            proc = subprocess.run(
                [str(path), "-c", _ASK], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            reasons.append(f"{path}: {exc}")
            continue
        said = proc.stdout.strip()
        if proc.returncode == 0 and said == version:
            return str(path), ""
        if proc.returncode == 0:
            reasons.append(f"{path}: is Python {said}")
        else:
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            reasons.append(f"{path}: exit {proc.returncode}" + (f" ({last})" if last else ""))
    return None, f"no python{version} runs here: " + ("; ".join(reasons) or "none found on PATH or in pyenv")


def python_or_skip(version: str, **where) -> str:
    """find_python's interpreter, or skip the test saying why none runs."""
    import pytest

    found, why_not = find_python(version, **where)
    if found is None:
        pytest.skip(why_not)
    return found
