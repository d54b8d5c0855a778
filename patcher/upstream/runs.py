"""The release matrix's last result per vLLM release, shown beside check-upstream's verdict.

check-upstream sees only what the sources say; what a release does when it runs (the KV cache
layout resolved at start-up, the CPU block size, silently wrong rows) is seen only by running
it: the release matrix (bench/releases.py) builds each release's environment, applies and runs
the run check there, and writes one file per run:

    $PATCHER_CACHE/releases/<anything>.json      (default ~/.cache/patcher/releases)
    {"schema_version": 1, "vllm": "0.32.0", "ok": true, "finished": "2026-11-30T22:04:00Z",
     "summary": "one line: what passed or the first failure", "patcher": "commit or version"}

bench/releases.py's own rows (`<release>-<patch-set hash>.json`: "release", "apply", "extract",
"rollback_identical", "finished", ...) are read too, from that folder and, in a checkout, from the
matrix's record in the repository (bench/results/releases): ok when apply exited 0 (verified), the
extraction was ok with every row whole and in order (or, for a release without a CPU build, whose
row is apply and verification only, was not run), and rollback was byte-identical; finished is the row's
own (else the file's time). A row whose hash is not that of the patches and the release's recipe
here is marked stale (it ran other ones). The newest `finished` per release wins; a file that reads
as neither is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path


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


def patch_code(path: Path) -> str:
    """A patch module's code without its layout: the syntax tree, so that reformatting a module
    (ruff format, comments) does not make every row stale, and any change to what it does does.
    The dump's format can differ between Python versions: a key made by another interpreter
    misses (the row runs again), never matches wrongly."""
    import ast

    from .facts import parse  # under the lock check-upstream's threads share (CPython 3.11's AST race)

    return ast.dump(parse(path.read_text(encoding="utf-8")))


DEFAULT_SPECULATORS = "0.3.0"  # a row without a "speculators" field ran this one


def patch_set_hash(release: str, speculators: str = DEFAULT_SPECULATORS) -> str | None:
    """bench/releases.py's key for `release`'s row: every patch module's code and that release's recipe
    (what its environment is built from: another line's recipe does not make the row stale), and the
    speculators release on top (named only when not 0.3.0: the earlier rows keep their keys), or
    None where this installation has no recipes file."""
    from patcher.demo.recipes import RecipeError, recipe_for

    root = Path(__file__).resolve().parent.parent.parent
    patches = root / "patches"
    if not (root / "patcher" / "demo" / "releases.json").is_file() or not patches.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(patches.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + patch_code(path).encode())
    try:
        digest.update(b"\0recipe\0" + recipe_for(release).row_fingerprint().encode())
    except RecipeError:
        return None
    if speculators != DEFAULT_SPECULATORS:
        digest.update(b"\0speculators\0" + speculators.encode())
    return digest.hexdigest()[:12]


def bench_row_passed(data: dict) -> bool:
    """Whether a release's row of bench/releases.py passed: apply exited 0 (written and verified), the
    extraction matched with every row whole and in order, and rollback was byte-identical. A release
    without a CPU build (its recipe says so: 0.33.0) runs no extraction; apply and rollback are its row."""
    from patcher.demo.recipes import RecipeError, recipe_for

    extract = data.get("extract") or {}
    try:
        extracted = recipe_for(str(data.get("release"))).cpu_build
    except RecipeError:
        extracted = True  # no recipe says otherwise: the extraction is required
    matched = bool(extract.get("ok")) and bool(extract.get("rows_whole_in_order"))
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
    current = patch_set_hash(str(data["release"]), str(data.get("speculators", DEFAULT_SPECULATORS)))
    stale = bool(match and current and match.group(1) != current)
    return RunResult(str(data["release"]), ok, finished, summary, "", str(file), stale)


def default_folder() -> Path:
    base = os.environ.get("PATCHER_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "patcher") / "releases"


def recorded_folder() -> Path:
    """The release matrix's record in a checkout (absent from an installed wheel)."""
    return Path(__file__).resolve().parent.parent.parent / "bench" / "results" / "releases"


def load_runs(folder: Path | None = None) -> dict[str, RunResult]:
    out: dict[str, RunResult] = {}
    files: list[Path] = []
    for where in [folder] if folder else [default_folder(), recorded_folder()]:
        try:
            files += sorted(where.glob("*.json"))
        except OSError:
            continue
    for file in files:
        try:
            data = json.loads(file.read_text())
            if data.get("left_out"):
                continue  # a leave-one-out row proves a patch's need, not the release's state
            if data.get("speculators", DEFAULT_SPECULATORS) != DEFAULT_SPECULATORS:
                continue  # check-upstream's runs column is speculators 0.3.0's (its patch set's)
            if "release" in data and "vllm" not in data:
                result = _from_bench_row(data, file)
            else:
                result = RunResult(
                    str(data["vllm"]),
                    bool(data["ok"]),
                    str(data["finished"]),
                    str(data.get("summary", "")),
                    str(data.get("patcher", "")),
                    str(file),
                )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if result.vllm not in out or result.finished > out[result.vllm].finished:
            out[result.vllm] = result
    return out
