"""check-upstream as a function: index -> downloads (parallel) -> matrix, gates, nightlies -> report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from ..model import Patch
from ..selection import condition_holds
from .binding import Binding, bind_cached
from .gates import GateCheck, ReleaseRead, all_facts, check_gate, read_release
from .index import Index, load_index, within
from .matrix import Cell, release_cells, window
from .nightly import DEFAULT_NIGHTLIES, NightlyCheck, check_nightly
from .patched import Variant, variants
from .runs import RunResult, load_runs
from .sources import ReleaseFiles, default_cache
from .wheels import DownloadFailed, IndexUnreachable

SCHEMA_VERSION = 1

EXIT_OK = 0
EXIT_WRONG_GATE = 1  # a gate disagrees with upstream, an edit declares no fact, a release unreadable
EXIT_USAGE = 2
EXIT_DRIFT = 3  # a codemod's anchor is missing on a release its patch is selected for, or a
# patched file's call into vLLM no longer binds there (a missing name or module, an unknown
# keyword, a new required argument)
EXIT_UNREACHABLE = 4  # the package index cannot be reached

# Where the fact scan starts by default: the vLLM speculators 0.3.0 was released against, and the
# transformers line vLLM 0.11.0 resolved to (4.57); transformers facts concern its 5.x releases.
DEFAULT_SINCE = {"vllm": "0.11.0", "transformers": "4.57.0"}


@dataclass
class CheckOptions:
    since: Mapping[str, str] = field(default_factory=dict)  # distribution -> first release to read
    only: Mapping[str, Sequence[str]] = field(default_factory=dict)  # distribution -> the releases to read
    pre: bool = False
    nightlies: Sequence[str] = DEFAULT_NIGHTLIES
    workers: int = 4
    cache: Path | None = None
    runs: Path | None = None  # the release matrix's results (default $PATCHER_CACHE/releases)
    index: Index | None = None  # the index's answer, when the caller has it (several checks in a row)
    bind: bool = True  # bind the patched files (off: gates and matrix alone, e.g. for one patch on its own)
    progress: Callable[[str], None] = lambda message: None


@dataclass
class CheckReport:
    exit_code: int = EXIT_OK
    message: str = ""
    cells: list[Cell] = field(default_factory=list)
    gates: list[GateCheck] = field(default_factory=list)
    nightlies: list[NightlyCheck] = field(default_factory=list)
    reads: dict[str, dict[str, ReleaseRead]] = field(default_factory=dict)  # distribution -> version -> read
    index: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    downloads: list[str] = field(default_factory=list)
    bindings: list[Binding] = field(default_factory=list)
    runs: dict[str, RunResult] = field(default_factory=dict)  # vLLM release -> last run-matrix result

    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "command": "check-upstream",
            "exit_code": self.exit_code,
            "message": self.message,
            "index": self.index,
            "matrix": [c.to_json() for c in self.cells],
            "gates": [g.to_json() for g in self.gates],
            "releases_read": {
                dist: {v: {"wheel": r.wheel, "downloaded": r.downloaded, "error": r.error} for v, r in reads.items()}
                for dist, reads in self.reads.items()
            },
            "nightlies": [n.to_json() for n in self.nightlies],
            "problems": self.problems,
            "downloads": self.downloads,
            "bindings": [b.to_json() for b in self.bindings],
            "runs": self.runs_json(),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
        }


    def binding_releases(self) -> list[str]:
        return sorted({b.versions["vllm"] for b in self.bindings}, key=Version)

    def runs_json(self) -> dict:
        """Per vLLM release bound: the last run-matrix result, or null (never run)."""
        return {v: (self.runs[v].to_json() if v in self.runs else None) for v in self.binding_releases()}


def fact_distributions(patches: Sequence[Patch]) -> list[str]:
    return sorted({f.distribution for f in all_facts(patches)})


def run_check(patches: Sequence[Patch], options: CheckOptions) -> CheckReport:
    """The whole check: ask the index, choose the releases to read, bind the patched files, read
    the releases (parallel), compare gates and nightlies with what was read, conclude."""
    report = CheckReport()
    cache = options.cache or default_cache()
    started = time.perf_counter()
    targets = sorted({p.target.distribution for p in patches})
    fact_dists = fact_distributions(patches)
    try:
        options.progress(f"asking the package index for the releases of {', '.join(targets + fact_dists)}")
        index = options.index or load_index([*targets, *fact_dists], pre=options.pre, workers=options.workers)
    except IndexUnreachable as error:
        report.exit_code = EXIT_UNREACHABLE
        report.message = str(error)
        return report
    report.index = index.versions
    report.timings["index"] = time.perf_counter() - started
    reading = _choose_releases(patches, options, index, targets, fact_dists, report)
    started = time.perf_counter()
    patched = _patched_files(patches, options, reading, cache, report) if options.bind else {}
    if report.exit_code == EXIT_UNREACHABLE:
        return report
    report.timings["patched"] = time.perf_counter() - started
    started = time.perf_counter()
    unreachable = _read_releases(patches, options, reading, patched, cache, report)
    report.timings["releases"] = time.perf_counter() - started
    if unreachable:
        report.exit_code = EXIT_UNREACHABLE
        report.message = unreachable[0]
        return report
    started = time.perf_counter()
    _compare(patches, options, reading, cache, report)
    report.timings["compare"] = time.perf_counter() - started
    _conclude(options, report)
    return report


@dataclass
class _Reading:
    """What a check reads: the patched distributions' releases (per patch window) and the facts'
    (from `since`), as download jobs (distribution, version, wheel distribution)."""

    targets: list[str]
    fact_dists: list[str]
    target_releases: dict[str, list[str]]
    fact_releases: dict[str, list[str]]
    needed: set[tuple[str, str]]
    jobs: list[tuple[str, str, str]]


def _choose_releases(
    patches: Sequence[Patch], options: CheckOptions, index: Index, targets: list[str], fact_dists: list[str],
    report: CheckReport,
) -> _Reading:  # fmt: skip
    """The releases to read; a release --only names that the index does not serve is a problem."""
    target_releases = {
        d: within(index.releases(d), None, options.only.get(d)) for d in targets
    }
    needed: set[tuple[str, str]] = set()
    for patch in patches:
        dist = patch.target.distribution
        needed.update((dist, v) for v in window(patch, target_releases[dist], options.since.get(dist)))
    fact_releases = {
        d: within(index.releases(d), options.since.get(d, DEFAULT_SINCE.get(d)), options.only.get(d))
        for d in fact_dists
    }
    for dist, wanted in options.only.items():
        served = set(index.releases(dist))
        for version in wanted:
            if version not in served:
                report.problems.append(f"{dist} {version} is not served by the package index")
    jobs: list[tuple[str, str, str]] = []  # (distribution, version, wheel distribution)
    for dist, version in sorted(needed, key=lambda dv: (dv[0], Version(dv[1]))):
        jobs.append((dist, version, dist))
    for dist, versions in fact_releases.items():
        for version in versions:
            wheel = index.source_wheel(dist, version)
            if wheel is not None:
                jobs.append((dist, version, wheel))
    return _Reading(targets, fact_dists, target_releases, fact_releases, needed, jobs)


def _patched_files(
    patches: Sequence[Patch], options: CheckOptions, reading: _Reading, cache: Path, report: CheckReport
) -> dict[str, list[Variant]]:
    """vLLM release -> the patched files apply writes there. An unreachable index sets the
    report's exit code and message (the check stops there)."""
    patched: dict[str, list[Variant]] = {}
    for dist, version in sorted(reading.needed, key=lambda dv: (dv[0], Version(dv[1]))):
        with ReleaseFiles(cache, dist, version) as files:
            try:
                found = variants(
                    patches, dist, version, files, reading.fact_releases.get("vllm", []), cache / ".transforms"
                )
            except (DownloadFailed, OSError, SyntaxError, UnicodeDecodeError) as error:
                report.problems.append(f"{dist} {version}: could not be read: {error}")
                continue
            except IndexUnreachable as error:
                report.exit_code, report.message = EXIT_UNREACHABLE, str(error)
                return patched
        for vllm, files_there in found.items():
            patched.setdefault(vllm, []).extend(files_there)
    return patched


def _read_releases(
    patches: Sequence[Patch], options: CheckOptions, reading: _Reading, patched: dict[str, list[Variant]],
    cache: Path, report: CheckReport,
) -> list[str]:  # fmt: skip
    """Download and read every release, `options.workers` at a time: matrix cells for the patched
    distributions, fact verdicts and bindings for the others. The index's errors, if any."""
    options.progress(f"reading {len(reading.jobs)} releases ({options.workers} at a time; cache {cache})")
    facts = all_facts(patches)
    targets, needed = reading.targets, reading.needed

    def work(job: tuple[str, str, str]):
        dist, version, wheel = job
        files = ReleaseFiles(cache, wheel, version)
        try:
            if dist in targets and (dist, version) in needed:
                def in_window(p, d=dist, v=version):
                    return v in window(p, reading.target_releases[d], options.since.get(d))
                return job, release_cells(patches, dist, version, files, in_window), files.downloaded
            dist_facts = [f for f in facts if f.distribution == dist]
            read = read_release(files, dist, dist_facts, package=dist.replace("-", "_"))
            if dist == "vllm":
                read.bindings = bind_cached(files, version, patched.get(version, []))
            return job, read, files.downloaded
        finally:
            files.close()

    unreachable: list[str] = []
    with ThreadPoolExecutor(max_workers=max(1, options.workers)) as pool:
        futures = [(job, pool.submit(work, job)) for job in reading.jobs]
        for job, future in futures:
            dist, version, wheel = job
            try:
                _, result, downloaded = future.result()
            except IndexUnreachable as error:
                unreachable.append(str(error))
                continue
            except (DownloadFailed, OSError, SyntaxError, UnicodeDecodeError) as error:
                message = f"{wheel} {version}: could not be read: {error}"
                report.problems.append(message)
                if dist in reading.fact_dists and (dist, version) not in needed:
                    report.reads.setdefault(dist, {})[version] = ReleaseRead(dist, version, wheel, error=str(error))
                continue
            if downloaded:
                report.downloads.append(f"{wheel}=={version}")
                options.progress(f"  read {wheel} {version} (downloaded)")
            if isinstance(result, ReleaseRead):
                report.reads.setdefault(dist, {})[version] = result
                report.bindings.extend(result.bindings)
            else:
                report.cells.extend(result)
    return unreachable


def _compare(patches: Sequence[Patch], options: CheckOptions, reading: _Reading, cache: Path,
             report: CheckReport) -> None:  # fmt: skip
    """Each edit's gate against the releases read; each nightly's selection."""
    fact_dists, fact_releases = reading.fact_dists, reading.fact_releases
    for patch in patches:
        for edit in patch.edits:
            dist = edit.fact.distribution if edit.fact else (fact_dists[0] if fact_dists else "vllm")
            check = check_gate(patch, edit, report.reads.get(dist, {}), fact_releases.get(dist, []))
            report.gates.append(check)
            report.problems.extend(check.problems)

    if options.nightlies:
        others = {}
        for dist in reading.targets:
            firsts = [r for r in reading.target_releases[dist] if any(
                p.target.distribution == dist and condition_holds(p.requires.get(dist, ""), r) for p in patches
            )]
            if firsts:
                others[dist] = firsts[0]
        with ThreadPoolExecutor(max_workers=max(1, options.workers)) as pool:
            report.nightlies = list(
                pool.map(
                    lambda n: check_nightly(n, patches, others, report.gates, cache, sys.executable),
                    options.nightlies,
                )
            )
        for nightly in report.nightlies:
            report.problems.extend(nightly.problems)


def _conclude(options: CheckOptions, report: CheckReport) -> None:
    """Drift and calls that do not bind are exit 3, other problems exit 1; the summary line."""
    drift = [c for c in report.cells if c.drift]
    for cell in drift:
        report.problems.append(
            f"drift: {cell.patch_id} on {cell.distribution} {cell.version}: {cell.message or 'anchor missing'}"
        )
    report.bindings.sort(key=lambda b: (Version(b.versions["vllm"]), b.file))
    unbound = [b for b in report.bindings if b.problems]
    for binding in unbound:
        spec = ", ".join(f"{k} {v}" for k, v in sorted(binding.versions.items()) if k != "vllm")
        for problem in binding.problems:
            report.problems.append(f"binding ({spec}; {', '.join(_short(p) for p in binding.patches)}): {problem}")
    report.runs = load_runs(options.runs)
    if drift or unbound:
        report.exit_code = EXIT_DRIFT
    elif report.problems:
        report.exit_code = EXIT_WRONG_GATE
    wrong = sum(1 for g in report.gates if not g.ok)
    report.message = (
        f"{len(report.cells)} matrix cells ({len(drift)} drift), {len(report.gates)} gates ({wrong} wrong), "
        f"{len(report.bindings)} patched files bound on {len(report.binding_releases())} vLLM releases "
        f"({len({b.versions['vllm'] for b in unbound})} with calls that do not bind), "
        f"{sum(len(r) for r in report.reads.values())} upstream releases read, {len(report.nightlies)} nightlies"
    )


def _short(patch_id: str) -> str:
    return patch_id.split("-", 1)[0]
