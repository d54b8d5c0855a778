"""check-upstream as a function: index -> downloads (parallel) -> matrix, gates, nightlies -> report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from ..model import Patch, TargetFile
from ..plan.selection import condition_holds
from .binding import Binding, bind_cached
from .deps import BOUND, Requirements, bind_dependencies, read_requirements
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
    targets: Sequence[TargetFile] | None = None  # files bound even where no patch changes them (default: declared_targets)
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
    requirements: Requirements = field(default_factory=Requirements)  # what each vLLM release allows

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
            "requirements": self.requirements.to_json(),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
        }


    def binding_releases(self) -> list[str]:
        return sorted({v for b in self.bindings for v in b.vllm_releases}, key=Version)

    def runs_json(self) -> dict:
        """Per vLLM release bound: the last run-matrix result, or null (never run)."""
        return {v: (self.runs[v].to_json() if v in self.runs else None) for v in self.binding_releases()}


def fact_distributions(patches: Sequence[Patch]) -> list[str]:
    return sorted({f.distribution for f in all_facts(patches)})


def declared_targets(patches: Sequence[Patch]) -> list[TargetFile]:
    """The files the patches rewrite, and every file patches/targets.py declares: a file whose
    patch was removed is still speculators' code, imported by `import speculators`, and is bound
    as it is (pristine) on the releases the patch set is meant for."""
    found = {p.target for p in patches}
    try:
        from ..patches import targets as declared  # type: ignore[import-not-found]  # mapped by pyproject
    except ImportError:
        declared = None
    found |= {v for v in vars(declared).values() if isinstance(v, TargetFile)} if declared else set()
    return sorted(found, key=lambda t: (t.distribution, t.path))


def run_check(patches: Sequence[Patch], options: CheckOptions) -> CheckReport:
    report = CheckReport()
    cache = options.cache or default_cache()
    say = options.progress
    started = time.perf_counter()
    targets = sorted({p.target.distribution for p in patches})
    fact_dists = fact_distributions(patches)
    bound = [d for d in BOUND if options.bind and d not in targets]
    try:
        say(f"asking the package index for the releases of {', '.join(sorted({*targets, *fact_dists, *bound}))}")
        index = options.index or load_index([*targets, *fact_dists, *bound], pre=options.pre, workers=options.workers)
        lacking = [d for d in bound if d not in index.versions]
        if lacking:  # an index answer made for fewer distributions (tests, several checks in a row)
            index = Index({**index.versions, **load_index(lacking, pre=options.pre).versions}, index.pre)
    except IndexUnreachable as error:
        report.exit_code = EXIT_UNREACHABLE
        report.message = str(error)
        return report
    report.index = index.versions
    report.timings["index"] = time.perf_counter() - started

    # What to read: the patched distribution's releases per patch window, the facts' from `since`.
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

    facts = all_facts(patches)
    started = time.perf_counter()
    if options.bind and fact_releases.get("vllm"):
        say(f"reading what {len(fact_releases['vllm'])} vLLM releases require of {' and '.join(bound)}")
        wheels = {v: index.source_wheel("vllm", v) for v in fact_releases["vllm"]}
        choices = {d: within(index.releases(d), None, options.only.get(d)) for d in bound}
        try:
            report.requirements = read_requirements(
                cache, {v: w for v, w in wheels.items() if w}, choices, options.workers
            )
        except IndexUnreachable as error:
            report.exit_code, report.message = EXIT_UNREACHABLE, str(error)
            return report
        report.problems.extend(report.requirements.problems)
    report.timings["requirements"] = time.perf_counter() - started
    started = time.perf_counter()
    bound_files = declared_targets(patches) if options.targets is None else list(options.targets)
    patched: dict[str, list[Variant]] = {}  # vLLM release -> the patched files apply writes there
    for dist, version in sorted(needed, key=lambda dv: (dv[0], Version(dv[1]))) if options.bind else ():
        with ReleaseFiles(cache, dist, version) as files:
            try:
                found = variants(
                    patches, dist, version, files, fact_releases.get("vllm", []), cache / ".transforms",
                    report.requirements.allowed, bound_files,
                )
            except (DownloadFailed, OSError, SyntaxError, UnicodeDecodeError) as error:
                report.problems.append(f"{dist} {version}: could not be read: {error}")
                continue
            except IndexUnreachable as error:
                report.exit_code, report.message = EXIT_UNREACHABLE, str(error)
                return report
        for vllm, files_there in found.items():
            patched.setdefault(vllm, []).extend(files_there)
    report.timings["patched"] = time.perf_counter() - started
    started = time.perf_counter()
    say(f"reading {len(jobs)} releases ({options.workers} at a time; cache {cache})")

    def work(job: tuple[str, str, str]):
        dist, version, wheel = job
        files = ReleaseFiles(cache, wheel, version)
        try:
            if dist in targets and (dist, version) in needed:
                def in_window(p, d=dist, v=version):
                    return v in window(p, target_releases[d], options.since.get(d))

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
        futures = [(job, pool.submit(work, job)) for job in jobs]
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
                if dist in fact_dists and (dist, version) not in needed:
                    report.reads.setdefault(dist, {})[version] = ReleaseRead(dist, version, wheel, error=str(error))
                continue
            if downloaded:
                report.downloads.append(f"{wheel}=={version}")
                say(f"  read {wheel} {version} (downloaded)")
            if isinstance(result, ReleaseRead):
                report.reads.setdefault(dist, {})[version] = result
                report.bindings.extend(result.bindings)
            else:
                report.cells.extend(result)
    report.timings["releases"] = time.perf_counter() - started
    started = time.perf_counter()
    if patched and not unreachable:
        try:
            more, downloaded, problems = bind_dependencies(patched, cache, options.workers, say)
        except IndexUnreachable as error:
            unreachable.append(str(error))
        else:
            report.bindings.extend(more)
            report.downloads.extend(downloaded)
            report.problems.extend(problems)
    report.timings["dependencies"] = time.perf_counter() - started
    if unreachable:
        report.exit_code = EXIT_UNREACHABLE
        report.message = unreachable[0]
        return report

    started = time.perf_counter()
    for patch in patches:
        for edit in patch.edits:
            dist = edit.fact.distribution if edit.fact else (fact_dists[0] if fact_dists else "vllm")
            check = check_gate(patch, edit, report.reads.get(dist, {}), fact_releases.get(dist, []))
            report.gates.append(check)
            report.problems.extend(check.problems)

    if options.nightlies:
        others = {}
        for dist in targets:
            firsts = [r for r in target_releases[dist] if any(
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
    report.timings["compare"] = time.perf_counter() - started

    drift = [c for c in report.cells if c.drift]
    for cell in drift:
        report.problems.append(
            f"drift: {cell.patch_id} on {cell.distribution} {cell.version}: {cell.message or 'anchor missing'}"
        )
    report.bindings.sort(key=lambda b: (b.release.split()[0] != "vllm", b.release.split()[0],
                                        Version(b.release.split()[1]), b.file))  # fmt: skip
    unbound = [b for b in report.bindings if b.problems]
    for binding in unbound:
        spec = ", ".join(f"{k} {v}" for k, v in sorted(binding.versions.items()) if k != "vllm")
        if binding.allowed_by:
            spec += f", allowed by vllm {_span(binding.allowed_by)}"
        for problem in binding.problems:
            report.problems.append(f"binding ({spec}; {', '.join(_short(p) for p in binding.patches) or 'no patch'}): {problem}")
    report.runs = load_runs(options.runs)
    if drift or unbound:
        report.exit_code = EXIT_DRIFT
    elif report.problems:
        report.exit_code = EXIT_WRONG_GATE
    wrong = sum(1 for g in report.gates if not g.ok)
    report.message = (
        f"{len(report.cells)} matrix cells ({len(drift)} drift), {len(report.gates)} gates ({wrong} wrong), "
        f"{len(report.bindings)} patched files bound on {len(report.binding_releases())} vLLM releases "
        f"and the {len({b.release for b in report.bindings if b.allowed_by})} transformers/torch releases they allow "
        f"({len({v for b in unbound for v in b.vllm_releases})} with calls that do not bind), "
        f"{sum(len(r) for r in report.reads.values())} upstream releases read, {len(report.nightlies)} nightlies"
    )
    return report


def _short(patch_id: str) -> str:
    return patch_id.split("-", 1)[0]


def _span(versions: Sequence[str]) -> str:
    """Every release named: those allowing a transformers release need not be consecutive (5.24.0:
    0.11.0, then 0.19.1 to 0.30.0)."""
    return ", ".join(versions)
