"""check-upstream as a function: index -> downloads (parallel) -> matrix, gates, nightlies -> report."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from ..model import ConnectorDrift, Patch, ReleaseLine, TargetFile
from ..patchset.registry import declared_drift
from ..plan.selection import condition_holds
from . import connectors
from .binding import Binding, bind_cached
from .connectors import ConnectorFile, ModuleVerdict
from .deps import BOUND, Requirements, bind_dependencies, read_requirements
from .gates import GateCheck, ReleaseRead, all_facts, check_gate, read_release
from .index import Index, load_index, within
from .matrix import Cell, release_cells, window
from .nightly import DEFAULT_NIGHTLIES, NightlyCheck, check_nightly
from .patched import Variant, variants
from .release_rows import RunResult, load_runs
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
# what patcher's commands exit with on a target outside every patched release line (patcher.core.errors)
EXIT_UNSUPPORTED = 7
EXIT_CONNECTOR = 5  # the speculators 0.5+ path: an hs-connectors module meets a problem on a vLLM release
# that CONNECTOR_DRIFT does not declare there (upstream's drift, not a patch's)

# Where the fact scan starts by default: the vLLM speculators 0.3.0 was released against, and the
# transformers line vLLM 0.11.0 resolved to (4.57); transformers facts concern its 5.x releases.
DEFAULT_SINCE = {"vllm": "0.11.0", "transformers": "4.57.0"}


@dataclass
class CheckOptions:
    since: Mapping[str, str] = field(default_factory=dict)  # distribution -> first release to read
    only: Mapping[str, Sequence[str]] = field(default_factory=dict)  # distribution -> the releases to read
    until: Mapping[str, str] = field(default_factory=dict)  # distribution -> its newest release to read
    pre: bool = False
    nightlies: Sequence[str] = DEFAULT_NIGHTLIES
    workers: int = 4
    cache: Path | None = None
    runs: Path | None = None  # the release matrix's results (default $PATCHER_CACHE/releases and the record)
    index: Index | None = None  # the index's answer, when the caller has it (several checks in a row)
    bind: bool = True  # bind the patched files (off: gates and matrix alone, e.g. for one patch on its own)
    targets: Sequence[TargetFile] | None = (
        None  # files bound even where no patch changes them (default: declared_targets)
    )
    # what the 0.5+ path's connector modules are known to meet (default: patches/connector_drift.py's CONNECTOR_DRIFT)
    connector_drift: Sequence[ConnectorDrift] | None = None
    # the release lines of the sets checked (default: every set's in use)
    lines: Sequence[ReleaseLine] | None = None
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
    # releases of a fact distribution no patched release line runs on (vLLM 0.34.0): distribution ->
    # version -> why. Not read, not drift: patcher refuses such a target (exit 7) and says so.
    not_covered: dict[str, dict[str, str]] = field(default_factory=dict)
    # the speculators 0.5+ path: hs-connectors' modules bound per vLLM release (connectors.py)
    connector_bindings: list[Binding] = field(default_factory=list)
    connector_releases: list[str] = field(default_factory=list)  # the hs-connectors releases read
    path_vllm: dict[str, bool] = field(default_factory=dict)  # vLLM release -> has extract_hidden_states
    connectors: list[ModuleVerdict] = field(default_factory=list)

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
            "not_covered": [
                {"distribution": d, "version": v, "status": "refused", "exit_code": EXIT_UNSUPPORTED, "why": why}
                for d, releases in self.not_covered.items()
                for v, why in releases.items()
            ],
            "connectors": self.connectors_json(),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
        }

    def binding_releases(self) -> list[str]:
        return sorted({v for b in self.bindings for v in b.vllm_releases}, key=Version)

    def connectors_json(self) -> dict:
        with_path, without = connectors.path_summary(self.path_vllm)
        return {
            "distribution": connectors.DISTRIBUTION,
            "releases": self.connector_releases,
            "vllm_with_path": with_path,
            "vllm_without_path": without,
            "modules": [v.to_json() for v in self.connectors],
            "bindings": [b.to_json() for b in self.connector_bindings],
        }

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


def names_vllm(patches: Sequence[Patch]) -> bool:
    """Whether the patches' gates or facts name vLLM: only then are their files bound against vLLM
    releases, the 0.5+ path's connectors read and vLLM nightly version strings selected on (a set
    for another library has its matrix and its gates)."""
    return any("vllm" in p.conditions() for p in patches) or "vllm" in fact_distributions(patches)


def run_check(patches: Sequence[Patch], options: CheckOptions) -> CheckReport:
    """Read the index, the releases each patch and fact needs, bind the patched files there, then
    compare: matrix cells, gates, nightlies. An unreachable index ends the check with exit 4 and
    what was gathered until then."""
    if patches and not names_vllm(patches):  # no patch at all: the connectors alone are checked
        options = dataclasses.replace(options, bind=False, nightlies=())
    check = _Check(patches, options)
    try:
        check.run()
    except _Unreachable as stop:
        check.report.exit_code, check.report.message = EXIT_UNREACHABLE, stop.message
    return check.report


class _Unreachable(Exception):
    """The package index could not be reached at a step that cannot go on without it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


_Job = tuple[str, str, str]  # (distribution, version, wheel distribution)


class _Check:
    """One check-upstream run: the steps of run_check, sharing what each step learnt."""

    def __init__(self, patches: Sequence[Patch], options: CheckOptions) -> None:
        self.patches = patches
        self.options = options
        self.report = CheckReport()
        self.cache = options.cache or default_cache()
        self.say = options.progress
        self.targets = sorted({p.target.distribution for p in patches})
        self.fact_dists = fact_distributions(patches)
        self.bound = [d for d in BOUND if options.bind and d not in self.targets]
        self.facts = all_facts(patches)
        self.target_releases: dict[str, list[str]] = {}
        self.fact_releases: dict[str, list[str]] = {}
        self.needed: set[tuple[str, str]] = set()
        self.patched: dict[str, list[Variant]] = {}  # vLLM release -> the patched files apply writes there
        from ..patchset.registry import release_lines

        lines = release_lines() if options.lines is None else options.lines
        self.lines = [x.as_json() for x in lines]
        self.connector_files: list[ConnectorFile] = []  # every hs-connectors release's modules importing vLLM

    @contextmanager
    def _timed(self, step: str) -> Iterator[None]:
        """Record the step's duration when it completes (a step cut short by _Unreachable records none)."""
        started = time.perf_counter()
        yield
        self.report.timings[step] = time.perf_counter() - started

    def run(self) -> None:
        with self._timed("index"):
            index = self._ask_index()
        jobs = self._plan_reads(index)
        with self._timed("requirements"):
            self._read_requirements(index)
        with self._timed("patched"):
            self._patch_files()
        with self._timed("connectors"):
            self._read_connectors(index)
        with self._timed("releases"):
            unreachable = self._read_releases(jobs)
        with self._timed("dependencies"):
            if self.patched and not unreachable:
                self._bind_dependencies(unreachable)
        if unreachable:
            raise _Unreachable(unreachable[0])
        with self._timed("compare"):
            self._check_gates()
            if self.options.nightlies:
                self._check_nightlies()
        self._conclude()

    def _ask_index(self) -> Index:
        options = self.options
        bound = [*self.bound, *(["vllm", connectors.DISTRIBUTION] if options.bind else [])]
        wanted = [*self.targets, *self.fact_dists, *bound]
        try:
            self.say(f"asking the package index for the releases of {', '.join(sorted(set(wanted)))}")
            index = options.index or load_index(wanted, pre=options.pre, workers=options.workers)
            lacking = [d for d in bound if d not in index.versions]
            if lacking:  # an index answer made for fewer distributions (tests, several checks in a row)
                index = Index({**index.versions, **load_index(lacking, pre=options.pre).versions}, index.pre)
        except IndexUnreachable as error:
            raise _Unreachable(str(error)) from None
        if options.until:
            index = index.until(options.until)
        self.report.index = index.versions
        return index

    def _plan_reads(self, index: Index) -> list[_Job]:
        """What to read: the patched distribution's releases per patch window, the facts' from `since`."""
        options = self.options
        self.target_releases = {d: within(index.releases(d), None, options.only.get(d)) for d in self.targets}
        for patch in self.patches:
            dist = patch.target.distribution
            self.needed.update((dist, v) for v in window(patch, self.target_releases[dist], options.since.get(dist)))
        # the connectors of the 0.5+ path are bound on vLLM's sources, with or without facts about vLLM
        read = [*self.fact_dists, *(["vllm"] if options.bind and "vllm" not in self.fact_dists else [])]
        self.fact_releases = {
            d: within(index.releases(d), options.since.get(d, DEFAULT_SINCE.get(d)), options.only.get(d)) for d in read
        }
        # a release no patched line runs on is refused by patcher before any patch is selected:
        # its facts and bindings would speak of patches no target there gets (v10, v19 on vLLM 0.34)
        for dist, versions in self.fact_releases.items():
            refused = {v: why for v in versions if (why := self.refusal(dist, v))}
            if refused:
                self.report.not_covered[dist] = refused
                self.fact_releases[dist] = [v for v in versions if v not in refused]
        for dist, wanted in options.only.items():
            served = set(index.releases(dist))
            for version in wanted:
                if version not in served:
                    self.report.problems.append(f"{dist} {version} is not served by the package index")
        jobs: list[_Job] = [(dist, version, dist) for dist, version in self._needed_in_order()]
        for dist, versions in self.fact_releases.items():
            for version in versions:
                wheel = index.source_wheel(dist, version)
                if wheel is not None:
                    jobs.append((dist, version, wheel))
        return jobs

    def refusal(self, dist: str, version: str) -> str:
        """Why every patched release line refuses `version` of `dist` (one line), or '' where one runs on it."""
        from ..plan.planning import unmet_requirement

        grouped: dict[tuple[str, str, str], list[str]] = {}
        for line in self.lines:
            if not line["patched"]:
                continue
            failed, why, _ = unmet_requirement(line, dist, version, condition_holds)
            if not failed:
                return ""
            grouped.setdefault((line["distribution"], failed, why), []).extend(line["releases"])
        return "; ".join(
            f"{name} {', '.join(releases)} run{'s' if len(releases) == 1 else ''} on {dist} {failed} only"
            + (f": {why}" if why else "")
            for (name, failed, why), releases in grouped.items()
        )

    def _needed_in_order(self) -> list[tuple[str, str]]:
        return sorted(self.needed, key=lambda dv: (dv[0], Version(dv[1])))

    def _read_requirements(self, index: Index) -> None:
        """What each vLLM release read requires of the bound distributions (transformers, torch)."""
        options, vllm_releases = self.options, self.fact_releases.get("vllm")
        if not (options.bind and vllm_releases):
            return
        self.say(f"reading what {len(vllm_releases)} vLLM releases require of {' and '.join(self.bound)}")
        wheels = {v: index.source_wheel("vllm", v) for v in vllm_releases}
        choices = {d: within(index.releases(d), None, options.only.get(d)) for d in self.bound}
        try:
            self.report.requirements = read_requirements(
                self.cache, {v: w for v, w in wheels.items() if w}, choices, options.workers
            )
        except IndexUnreachable as error:
            raise _Unreachable(str(error)) from None
        self.report.problems.extend(self.report.requirements.problems)

    def _patch_files(self) -> None:
        """The files apply writes on each vLLM release, from every patched release read."""
        if not self.options.bind:
            return
        bound_files = declared_targets(self.patches) if self.options.targets is None else list(self.options.targets)
        from ..plan.planning import line_allows

        lines = self.lines
        for dist, version in self._needed_in_order():
            # only the vLLM releases the release line of `version` runs on (speculators 0.4: 0.12+)
            vllms = [
                v
                for v in self.fact_releases.get("vllm", [])
                if line_allows(lines, dist, version, {"vllm": v}, condition_holds)
            ]
            with ReleaseFiles(self.cache, dist, version) as files:
                try:
                    found = variants(
                        self.patches,
                        dist,
                        version,
                        files,
                        vllms,
                        self.cache / ".transforms",
                        self.report.requirements.allowed,
                        bound_files,
                    )
                except (DownloadFailed, OSError, SyntaxError, UnicodeDecodeError) as error:
                    self.report.problems.append(f"{dist} {version}: could not be read: {error}")
                    continue
                except IndexUnreachable as error:
                    raise _Unreachable(str(error)) from None
            for vllm, files_there in found.items():
                self.patched.setdefault(vllm, []).extend(files_there)

    def _read_connectors(self, index: Index) -> None:
        """The modules importing vLLM of every hs-connectors release (the 0.5+ path's KV connectors)."""
        if not (self.options.bind and self.fact_releases.get("vllm")):
            return
        dist, options = connectors.DISTRIBUTION, self.options
        releases = within(index.releases(dist), options.since.get(dist), options.only.get(dist))
        self.report.connector_releases = releases
        for version in releases:
            with ReleaseFiles(self.cache, dist, version) as files:
                try:
                    self.connector_files += connectors.read_connector(files)
                except IndexUnreachable as error:
                    raise _Unreachable(str(error)) from None
                except (DownloadFailed, OSError, SyntaxError, UnicodeDecodeError) as error:
                    self.report.problems.append(f"{dist} {version}: could not be read: {error}")
                    continue
                if files.downloaded:
                    self.report.downloads.append(f"{dist}=={version}")

    def _read_one(self, job: _Job) -> tuple[_Job, list[Cell] | ReleaseRead, bool]:
        """One release: its matrix cells (a patched release) or its facts and bindings (vLLM, transformers...)."""
        dist, version, wheel = job
        files = ReleaseFiles(self.cache, wheel, version)
        try:
            if dist in self.targets and (dist, version) in self.needed:

                def in_window(p, d=dist, v=version):
                    return v in window(p, self.target_releases[d], self.options.since.get(d))

                return job, release_cells(self.patches, dist, version, files, in_window), files.downloaded
            dist_facts = [f for f in self.facts if f.distribution == dist]
            read = read_release(files, dist, dist_facts, package=dist.replace("-", "_"))
            if dist == "vllm":
                read.bindings = bind_cached(files, version, self.patched.get(version, []))
                if self.connector_files:
                    read.path_runs = files.exists(connectors.PATH_MODULE)
                    if read.path_runs:
                        read.connectors = bind_cached(files, version, self.connector_files)
                        for binding in read.connectors:
                            binding.versions["vllm"] = version
            return job, read, files.downloaded
        finally:
            files.close()

    def _read_releases(self, jobs: list[_Job]) -> list[str]:
        """Read every job, `workers` at a time; returns the index-unreachable errors met."""
        report, options = self.report, self.options
        self.say(f"reading {len(jobs)} releases ({options.workers} at a time; cache {self.cache})")
        unreachable: list[str] = []
        with ThreadPoolExecutor(max_workers=max(1, options.workers)) as pool:
            futures = [(job, pool.submit(self._read_one, job)) for job in jobs]
            for job, future in futures:
                dist, version, wheel = job
                try:
                    _, result, downloaded = future.result()
                except IndexUnreachable as error:
                    unreachable.append(str(error))
                    continue
                except (DownloadFailed, OSError, SyntaxError, UnicodeDecodeError) as error:
                    report.problems.append(f"{wheel} {version}: could not be read: {error}")
                    if dist in self.fact_dists and (dist, version) not in self.needed:
                        report.reads.setdefault(dist, {})[version] = ReleaseRead(dist, version, wheel, error=str(error))
                    continue
                self._record_read(job, result, downloaded)
        return unreachable

    def _record_read(self, job: _Job, result: list[Cell] | ReleaseRead, downloaded: bool) -> None:
        dist, version, wheel = job
        if downloaded:
            self.report.downloads.append(f"{wheel}=={version}")
            self.say(f"  read {wheel} {version} (downloaded)")
        if isinstance(result, ReleaseRead):
            self.report.reads.setdefault(dist, {})[version] = result
            self.report.bindings.extend(result.bindings)
            self.report.connector_bindings.extend(result.connectors)
            if result.path_runs is not None:
                self.report.path_vllm[version] = result.path_runs
        else:
            self.report.cells.extend(result)

    def _bind_dependencies(self, unreachable: list[str]) -> None:
        """Bind the patched files against the transformers and torch releases each vLLM release allows."""
        try:
            more, downloaded, problems = bind_dependencies(self.patched, self.cache, self.options.workers, self.say)
        except IndexUnreachable as error:
            unreachable.append(str(error))
        else:
            self.report.bindings.extend(more)
            self.report.downloads.extend(downloaded)
            self.report.problems.extend(problems)

    def _check_gates(self) -> None:
        for patch in self.patches:
            for edit in patch.edits:
                dist = edit.fact.distribution if edit.fact else (self.fact_dists[0] if self.fact_dists else "vllm")
                check = check_gate(patch, edit, self.report.reads.get(dist, {}), self.fact_releases.get(dist, []))
                self.report.gates.append(check)
                self.report.problems.extend(check.problems)

    def _check_nightlies(self) -> None:
        """Select on each nightly's fabricated metadata; `others` pins each patched distribution at
        the first release read that some patch requires."""
        report, patches = self.report, self.patches
        others = {}
        for dist in self.targets:
            firsts = [
                r
                for r in self.target_releases[dist]
                if any(p.target.distribution == dist and condition_holds(p.requires.get(dist, ""), r) for p in patches)
            ]
            if firsts:
                others[dist] = firsts[0]

        def one(nightly: str) -> NightlyCheck:
            refused = self.refusal("vllm", nightly)
            # selection is still shown; its gates are not judged where patcher refuses the target
            checked = check_nightly(
                nightly, patches, others, [] if refused else report.gates, self.cache, sys.executable
            )
            if refused:
                checked.notes.append(f"not covered: refused (exit {EXIT_UNSUPPORTED}): {refused}")
            return checked

        with ThreadPoolExecutor(max_workers=max(1, self.options.workers)) as pool:
            report.nightlies = list(pool.map(one, self.options.nightlies))
        for nightly in report.nightlies:
            report.problems.extend(nightly.problems)

    def _conclude(self) -> None:
        """Drift and unbound calls become problems; the exit code and the one-line message."""
        report = self.report
        drift = [c for c in report.cells if c.drift]
        for cell in drift:
            report.problems.append(
                f"drift: {cell.patch_id} on {cell.distribution} {cell.version}: {cell.message or 'anchor missing'}"
            )
        report.bindings.sort(
            key=lambda b: (b.release.split()[0] != "vllm", b.release.split()[0], Version(b.release.split()[1]), b.file)
        )
        unbound = [b for b in report.bindings if b.problems]
        for binding in unbound:
            report.problems.extend(_binding_problems(binding))
        report.runs = load_runs(self.options.runs)
        declared = self.options.connector_drift
        with_path, _ = connectors.path_summary(report.path_vllm)
        report.connectors = connectors.verdicts(
            report.connector_bindings, with_path, declared_drift() if declared is None else declared
        )
        for verdict in report.connectors:
            report.problems.extend(connectors.verdict_problems(verdict))
        if drift or unbound:
            report.exit_code = EXIT_DRIFT
        elif any(v.unexpected for v in report.connectors):
            report.exit_code = EXIT_CONNECTOR
        elif report.problems:
            report.exit_code = EXIT_WRONG_GATE
        report.message = _summary(report, drift, unbound)


def _binding_problems(binding: Binding) -> list[str]:
    spec = ", ".join(f"{k} {v}" for k, v in sorted(binding.versions.items()) if k != "vllm")
    if binding.allowed_by:
        spec += f", allowed by vllm {_span(binding.allowed_by)}"
    patches = ", ".join(_short(p) for p in binding.patches) or "no patch"
    return [f"binding ({spec}; {patches}): {problem}" for problem in binding.problems]


def _summary(report: CheckReport, drift: list[Cell], unbound: list[Binding]) -> str:
    wrong = sum(1 for g in report.gates if not g.ok)
    bound = (
        f"{len(report.bindings)} patched files bound on {len(report.binding_releases())} vLLM releases "
        f"and the {len({b.release for b in report.bindings if b.allowed_by})} transformers/torch releases they allow "
        f"({len({v for b in unbound for v in b.vllm_releases})} with calls that do not bind), "
    )
    return (
        f"{len(report.cells)} matrix cells ({len(drift)} drift), {len(report.gates)} gates ({wrong} wrong), "
        f"{bound if report.bindings else ''}"
        f"{_connector_summary(report)}"
        f"{sum(len(r) for r in report.reads.values())} upstream releases read, {len(report.nightlies)} nightlies"
        + "".join(
            f", {len(versions)} {dist} release(s) not covered (refused, exit {EXIT_UNSUPPORTED}: not drift)"
            for dist, versions in report.not_covered.items()
        )
    )


def _connector_summary(report: CheckReport) -> str:
    """e.g. '5 hs-connectors modules of 4 releases bound on 26 vLLM releases (0 not as declared), '."""
    if not report.connectors:
        return ""
    with_path, _ = connectors.path_summary(report.path_vllm)
    off = sum(1 for v in report.connectors if v.status not in ("binds", "as declared"))
    return (
        f"{len(report.connectors)} {connectors.DISTRIBUTION} modules of {len(report.connector_releases)} releases "
        f"bound on {len(with_path)} vLLM releases ({off} not as declared), "
    )


def _short(patch_id: str) -> str:
    return patch_id.split("-", 1)[0]


def _span(versions: Sequence[str]) -> str:
    """Every release named: those allowing a transformers release need not be consecutive (5.24.0:
    0.11.0, then 0.19.1 to 0.30.0)."""
    return ", ".join(versions)
