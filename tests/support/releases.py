"""Released speculators files for tests: download a wheel once, keep only the files patcher rewrites.

The cache lives in $PATCHER_TEST_CACHE, or ~/.cache/patcher/test-releases:
    <cache>/wheels/<wheel file>
    <cache>/<distribution>-<version>/<path inside site-packages>
Once the extracted files are there, nothing is downloaded again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterable

DOWNLOAD_TIMEOUT = 300  # seconds


class DownloadFailed(RuntimeError):
    """pip could not fetch the wheel (offline, index unreachable, no such release)."""


def cache_dir() -> Path:
    configured = os.environ.get("PATCHER_TEST_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "patcher" / "test-releases"


def _wheel_prefix(distribution: str, version: str) -> str:
    # Wheel file names use the normalised project name with "_" (PEP 427 / PEP 503).
    return f"{re.sub(r'[-_.]+', '_', distribution).lower()}-{version}-"


def _find_wheel(directory: Path, distribution: str, version: str) -> Path | None:
    prefix = _wheel_prefix(distribution, version)
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def download_wheel(distribution: str, version: str, directory: Path) -> Path:
    """The wheel of `distribution==version` in `directory`, fetched with pip if not there yet."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(directory, distribution, version)
    if wheel is not None:
        return wheel
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "-d", str(directory), f"{distribution}=={version}",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DownloadFailed(f"{' '.join(command)}: {error}") from error
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise DownloadFailed(f"{' '.join(command)} exited {done.returncode}:\n{tail}")
    wheel = _find_wheel(directory, distribution, version)
    if wheel is None:
        raise DownloadFailed(f"pip reported success but no {_wheel_prefix(distribution, version)}*.whl in {directory}")
    return wheel


def release_files(
    distribution: str, version: str, paths: Iterable[str], cache: Path | None = None
) -> dict[str, Path]:
    """Map each path inside the wheel (e.g. speculators/data_generation/x.py) to a cached copy."""
    root = cache if cache is not None else cache_dir()
    release = root / f"{distribution}-{version}"
    wanted = {path: release / path for path in paths}
    missing = {path: file for path, file in wanted.items() if not file.is_file()}
    if not missing:
        return wanted
    wheel = download_wheel(distribution, version, root / "wheels")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for path, file in missing.items():
            if path not in names:
                raise FileNotFoundError(f"{wheel.name} has no {path}")
            file.parent.mkdir(parents=True, exist_ok=True)
            partial = file.with_name(f".{file.name}.{os.getpid()}.part")
            partial.write_bytes(archive.read(path))
            os.replace(partial, file)  # atomic: a concurrent run never reads half a file
    return wanted
