"""Released speculators files for tests: download a wheel once, keep only the files patcher rewrites.

The cache lives in $PATCHER_TEST_CACHE, or ~/.cache/patcher/test-releases:
    <cache>/wheels/<wheel file>
    <cache>/<distribution>-<version>/<path inside site-packages>
Once the extracted files are there, nothing is downloaded again. The pip side lives in
patcher/upstream/wheels.py (check-upstream uses it at run time).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from patcher.upstream.wheels import DownloadFailed, download_wheel, extract

__all__ = ["INDEX_AS_OF", "DownloadFailed", "cache_dir", "download_wheel", "release_files"]

# The package index as these tests were last brought up to date with it: each distribution's
# newest release then. Checks against the index read no newer one, so a release published later
# (transformers 5.25.0 brought modeling_attn_mask_utils back) cannot turn the suite red; saying
# so is `patcher check-upstream`'s job. Raise these when the patches are brought up to date.
INDEX_AS_OF = {
    "speculators": "0.9.0",
    "vllm": "0.34.0",
    "transformers": "5.25.0",
    "torch": "2.15.0",
    "hs-connectors": "0.9.0",
}


def cache_dir() -> Path:
    configured = os.environ.get("PATCHER_TEST_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "patcher" / "test-releases"


def release_files(distribution: str, version: str, paths: Iterable[str], cache: Path | None = None) -> dict[str, Path]:
    """Map each path inside the wheel (e.g. speculators/data_generation/x.py) to a cached copy."""
    root = cache if cache is not None else cache_dir()
    release = root / f"{distribution}-{version}"
    wanted = {path: release / path for path in paths}
    missing = [path for path, file in wanted.items() if not file.is_file()]
    if missing:
        extract(download_wheel(distribution, version, root / "wheels"), missing, release)
    return wanted
