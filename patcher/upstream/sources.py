"""The files of one released wheel that check-upstream reads, extracted once and cached.

    <cache>/<wheel distribution>-<version>/<path inside the wheel>
    <cache>/<wheel distribution>-<version>/.absent.json   paths the wheel does not have

A file asked for that is neither cached nor known to be absent makes the wheel come (pip
download, into a temporary folder next to the cache); it stays open while the release is being
read, and is deleted on close(): only the files actually read are kept. A warm cache answers
without pip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import zipfile
from pathlib import Path

from .wheels import SOURCE_WHEEL_TAGS, download_wheel, write_atomic


def default_cache() -> Path:
    configured = os.environ.get("PATCHER_UPSTREAM_CACHE")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("PATCHER_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "patcher") / "upstream"


class ReleaseFiles:
    """Read-through access to the files of `wheel_distribution==version` (one thread at a time)."""

    def __init__(self, cache: Path, wheel_distribution: str, version: str, tags=SOURCE_WHEEL_TAGS) -> None:
        self.wheel_distribution = wheel_distribution
        self.version = version
        self.root = cache / f"{wheel_distribution}-{version}"
        self.tags = tags
        self._absent_file = self.root / ".absent.json"
        self._absent: set[str] | None = None
        self._archive: zipfile.ZipFile | None = None
        self._names: set[str] = set()
        self._download_dir: Path | None = None
        self.downloaded = False  # whether this run fetched the wheel
        self.wheel_name = ""
        self._lock = threading.Lock()

    @property
    def label(self) -> str:
        return f"{self.wheel_distribution} {self.version}"

    def _load_absent(self) -> set[str]:
        if self._absent is None:
            try:
                self._absent = set(json.loads(self._absent_file.read_text()))
            except (OSError, ValueError):
                self._absent = set()
        return self._absent

    def read(self, path: str) -> str | None:
        """The text of `path` inside the wheel, or None if the release has no such file."""
        data = self.read_bytes(path)
        return None if data is None else data.decode("utf-8")

    def read_bytes(self, path: str) -> bytes | None:
        file = self.root / path
        with self._lock:
            try:
                return file.read_bytes()
            except FileNotFoundError:
                pass
            absent = self._load_absent()
            if path in absent:
                return None
            archive = self._open()
            if path not in self._names:
                absent.add(path)
                write_atomic(self._absent_file, json.dumps(sorted(absent), indent=0).encode())
                return None
            data = archive.read(path)
            write_atomic(file, data)
            return data

    def exists(self, path: str) -> bool:
        return self.read_bytes(path) is not None

    def _open(self) -> zipfile.ZipFile:
        if self._archive is None:
            self._download_dir = self.root.parent / f".download-{self.root.name}-{os.getpid()}-{threading.get_ident()}"
            wheel = download_wheel(
                self.wheel_distribution, self.version, self._download_dir, tags=self.tags, quiet_cache=True
            )
            self.downloaded = True
            self.wheel_name = wheel.name
            self._archive = zipfile.ZipFile(wheel)
            self._names = set(self._archive.namelist())
        return self._archive

    def close(self) -> None:
        """Drop the wheel (the files read are kept)."""
        with self._lock:
            if self._archive is not None:
                self._archive.close()
                self._archive = None
            if self._download_dir is not None:
                shutil.rmtree(self._download_dir, ignore_errors=True)
                self._download_dir = None

    def __enter__(self) -> ReleaseFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def digest(self) -> str:
        """sha256 over the cached files (names and bytes): a cheap baseline for timings."""
        h = hashlib.sha256()
        if self.root.is_dir():
            for file in sorted(p for p in self.root.rglob("*") if p.is_file()):
                h.update(str(file.relative_to(self.root)).encode())
                h.update(file.read_bytes())
        return h.hexdigest()
