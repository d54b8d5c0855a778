"""The release matrix's recorded rows: the last result per vLLM release, shown beside check-upstream's verdict.

check-upstream sees only what the sources say; what a release does when it runs (the KV cache
layout resolved at start-up, the CPU block size, silently wrong rows) is seen only by running
it: the release matrix (bench/releases.py in patcher's repository) builds each release's
environment, applies and runs the run check there, and records one row per release. Two places
are read:

- the user's own runs, one file per run:

    $PATCHER_CACHE/releases/<anything>.json      (default ~/.cache/patcher/releases)
    {"schema_version": 1, "vllm": "0.32.0", "ok": true, "finished": "2026-11-30T22:04:00Z",
     "summary": "one line: what passed or the first failure", "patcher": "commit or version"}

  and bench/releases.py's own rows (`<release>[-speculators-<V>][-without-vN]-<key>.json`:
  "release", "apply", "extract", "rollback_identical", "finished", ...) put there;
- the release matrix's record as patcher ships it (RECORD_INDEX, package data): per release, the
  run record_index made of the repository's rows when this patcher was built (scripts/generate.py
  writes it, and its --check fails while it is not the rows' own). Made there, not here, because
  whether a row is stale is told by hashing the patch modules' syntax trees (row_keys.py: row_key), whose
  ast.dump differs between Python releases: an installed patcher on another Python could not tell.

A bench row is ok when apply exited 0 (verified), the extraction was ok with every row whole and
in order and had a call of more prompts than the generator's scheduler runs at once (or, for a
release without a CPU build, whose row is apply and verification only, was not run), and rollback
was byte-identical; finished is the row's own (else the file's time). A row is marked stale when
it no longer speaks for the patches here (row_is_current): today's declarations select other
patches or edits on its versions, or what the ones it selected run, or its release's recipe,
changed since it ran (a gate moved alone does not make it stale), or its extraction had no call
past the scheduler's max_num_seqs (the driver's calls before the fifth). The newest `finished` per
release wins; a file that reads as neither is skipped.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .row_keys import DEFAULT_SPECULATORS, row_key


@dataclass(frozen=True)
class RunResult:
    vllm: str
    ok: bool
    finished: str  # ISO 8601, UTC
    summary: str = ""
    patcher: str = ""
    file: str = ""
    stale: bool = False  # made with another patch set than the one here

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "finished": self.finished,
            "summary": self.summary,
            "patcher": self.patcher,
            "file": self.file,
            "stale": self.stale,
        }


def row_versions(row: dict) -> dict[str, str]:
    """The versions a row's target had: detected by its apply, or (rows carried over from a table)
    its release, torch and transformers, with its speculators (0.3.0, the matrix's first, where
    the row names none)."""
    detected = row.get("versions_detected")
    if detected:
        return {k: str(v) for k, v in detected.items()}
    versions = {"speculators": str(row.get("speculators") or DEFAULT_SPECULATORS), "vllm": str(row["release"])}
    for name in ("torch", "transformers"):
        if row.get(name) and row[name] != "?":
            versions[name] = str(row[name])
    return versions


def expected_selection(row: dict) -> list[str]:
    """The patches (short ids, in order) today's declarations select on a row's versions, less the
    one it left out and those that need it: what a row run now would apply."""
    from patcher.patchset.registry import load_patches
    from patcher.plan.selection import select_patches

    patches = load_patches()
    chosen = select_patches(patches, row_versions(row))
    kept = [p for p in patches if chosen[p.id].selected and p.short_id != row.get("left_out")]
    while True:  # a patch whose needs are left out goes too (v11 without v10)
        ids = {p.id for p in kept}
        fewer = [p for p in kept if all(n in ids for n in p.needs)]
        if len(fewer) == len(kept):
            return [p.short_id for p in kept]
        kept = fewer


def row_patches_current(row: dict, key: str | None = None) -> bool | None:
    """Whether a recorded row ran today's patches: today's declarations select what it selected on
    its versions, and what those patches run there (row_key) and its recipe are the ones it ran
    with (`key`: the row's own, else its patch_set_hash). None where that cannot be told here."""
    selected = list(row.get("selected") or [])
    current = row_key(str(row["release"]), selected, row_versions(row))
    if current is None:
        return None
    return current == (key or row.get("patch_set_hash")) and expected_selection(row) == selected


def row_filled_the_scheduler(row: dict) -> bool:
    """Whether a row's extraction, where one finished, had a generate() call of more prompts than
    the generator's scheduler runs at once (its max_num_seqs, as the driver reports it): speculators
    0.4 failed past 32 prompts a call while every row with the driver's first four calls (11 prompts
    at most) passed. A row whose extraction did not finish (an error, none run) and a leave-one-out
    row (evidence whatever it shows) are not held to it."""
    extract = row.get("extract") or {}
    if row.get("left_out") or "ok" not in extract:
        return True
    most = extract.get("max_num_seqs")
    calls = extract.get("prompts_per_call") or []
    return isinstance(most, int) and any(isinstance(n, int) and n > most for n in calls)


def row_is_current(row: dict, key: str | None = None) -> bool | None:
    """Whether a recorded row speaks for today's patches and today's check: it ran today's patches
    (row_patches_current) and its extraction filled the scheduler (row_filled_the_scheduler). None
    where that cannot be told here."""
    patches = row_patches_current(row, key)
    if patches is None:
        return None
    return patches and row_filled_the_scheduler(row)


def bench_row_passed(data: dict) -> bool:
    """Whether a release's row of bench/releases.py passed: apply exited 0 (written and verified), the
    extraction matched with every row whole and in order, with a call of more prompts than the
    scheduler runs at once (row_filled_the_scheduler), and rollback was byte-identical. A release
    without a CPU build (its recipe says so: 0.33.0) runs no extraction; apply and rollback are its row."""
    from patcher.demo.recipes import RecipeError, recipe_for

    extract = data.get("extract") or {}
    try:
        extracted = recipe_for(str(data.get("release"))).cpu_build
    except RecipeError:
        extracted = True  # no recipe says otherwise: the extraction is required
    matched = bool(extract.get("ok")) and bool(extract.get("rows_whole_in_order")) and row_filled_the_scheduler(data)
    return (
        str(data.get("apply", "")).startswith("exit 0")
        and (matched or not extracted)
        and bool(data.get("rollback_identical"))
    )


def _from_bench_row(data: dict, file: Path) -> RunResult:
    extract = data.get("extract") or {}
    apply = str(data.get("apply", ""))
    ok = bench_row_passed(data)
    problem = extract.get("error") or extract.get("skipped")
    summary = apply + (f"; run: {problem}" if problem else "")
    if extract.get("max_rel_diff") is not None:
        summary += f"; largest relative error {extract['max_rel_diff']:.3f}"
    finished = str(data.get("finished") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(file.stat().st_mtime)))
    match = re.search(r"-([0-9a-f]{12})\.json$", file.name)
    stale = bool(match) and row_is_current(data, match.group(1) if match else None) is False
    return RunResult(str(data["release"]), ok, finished, summary, "", str(file), stale)


def default_folder() -> Path:
    base = os.environ.get("PATCHER_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "patcher") / "releases"


# The release matrix's record as patcher ships it (package data, written by scripts/generate.py)
RECORD_INDEX = Path(__file__).with_name("release_record.json")


def _read_run(data: dict, file: Path) -> RunResult | None:
    """The run one file says, or None for a row check-upstream does not show: a leave-one-out row
    proves a patch's need, not the release's state, and the runs column is speculators 0.3.0's
    (its patch set's)."""
    if data.get("left_out") or data.get("speculators", DEFAULT_SPECULATORS) != DEFAULT_SPECULATORS:
        return None
    if "release" in data and "vllm" not in data:
        return _from_bench_row(data, file)
    return RunResult(
        str(data["vllm"]),
        bool(data["ok"]),
        str(data["finished"]),
        str(data.get("summary", "")),
        str(data.get("patcher", "")),
        str(file),
    )


def _newest(runs: list[RunResult]) -> dict[str, RunResult]:
    out: dict[str, RunResult] = {}
    for result in runs:
        if result.vllm not in out or result.finished > out[result.vllm].finished:
            out[result.vllm] = result
    return out


def read_folder(folder: Path) -> dict[str, RunResult]:
    """The newest run per release among a folder's files (one that reads as no run is skipped)."""
    runs = []
    try:
        files = sorted(folder.glob("*.json"))
    except OSError:
        return {}
    for file in files:
        try:
            result = _read_run(json.loads(file.read_text()), file)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if result is not None:
            runs.append(result)
    return _newest(runs)


def record_index(folder: Path, shown_as: str) -> str:
    """RECORD_INDEX's text for the rows in `folder` (the repository's record, named `shown_as` in
    each run's "file"): per release, its newest run as read_folder reads it, stale told here."""
    runs = read_folder(folder)
    entries = [
        {"vllm": v, **runs[v].to_json(), "file": f"{shown_as}/{Path(runs[v].file).name}"}
        for v in sorted(runs, key=_version_key)
    ]
    return json.dumps({"schema_version": 1, "runs": entries}, indent=1) + "\n"


def _version_key(text: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(text), text)
    except InvalidVersion:
        return (1, text, text)


def shipped_runs() -> dict[str, RunResult]:
    """The runs RECORD_INDEX holds ({} where it cannot be read)."""
    try:
        entries = json.loads(RECORD_INDEX.read_text(encoding="utf-8"))["runs"]
        return _newest(
            [
                RunResult(
                    str(e["vllm"]),
                    bool(e["ok"]),
                    str(e["finished"]),
                    str(e.get("summary", "")),
                    str(e.get("patcher", "")),
                    str(e.get("file", "")),
                    bool(e.get("stale")),
                )
                for e in entries
            ]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def load_runs(folder: Path | None = None) -> dict[str, RunResult]:
    """The newest run per release: of `folder` alone when given, else of the user's own runs
    (default_folder) and the record patcher ships (shipped_runs)."""
    if folder:
        return read_folder(folder)
    return _newest([*shipped_runs().values(), *read_folder(default_folder()).values()])
