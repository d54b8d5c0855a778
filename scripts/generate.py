"""Every generated artefact of the repository, from what the code and the records declare, in one
command. After adding or changing a patch, a command, a recorded row or a benchmark's record:

    python scripts/generate.py            # rewrite every artefact that is out of date
    python scripts/generate.py --check    # write nothing; exit 1 naming each one out of date

The artefacts:
    patcher/cli/help_text.py      `patcher --help` as click renders it (the console script answers
                                  --help from it without importing click)
    docs/reference/*.md           the docs' generated pages (scripts/pages.py): the patch reference,
                                  the CLI reference, the exit codes, the release matrix, the GPU
                                  runs, the benchmarks
    patcher/upstream/release_record.json
                                  the release matrix's record as patcher ships it (package data:
                                  check-upstream shows it), made from bench/results/releases/
    README.md                     its generated cells (the exit codes), between their markers
    docs/patches.md               its generated cell ("Which patches a run needs", from the patches'
                                  declared leave-one-outs), between its markers
    tests/golden/*.json           the documented JSON of the main commands, as tests/test_contract.py
                                  records it (PATCHER_UPDATE_GOLDEN=1; it runs the real CLI on light
                                  environments, a few seconds; --no-golden leaves them out)

tests/test_generated.py fails, naming this command, while any of the first three is out of date;
tests/test_contract.py does for the golden files. Exit: 0 done (or, with --check, all current),
1 out of date (--check) or the golden files' run failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import pages  # noqa: E402  (scripts/pages.py, beside this one)

COMMAND = "python scripts/generate.py"


def help_text() -> str:
    from patcher.cli.entry import render_help

    return (
        f'"""`patcher --help`, as click renders it on an 80-column screen (written by `{COMMAND}`)."""\n\n'
        # double-quoted, as `ruff format` writes a string (tests/test_lint.py checks the format)
        f"HELP = {json.dumps(render_help(), ensure_ascii=False)}\n"
    )


def release_record() -> str:
    from patcher.upstream.release_rows import record_index
    from workbench.release_matrix import RECORD  # importable: pages.py puts the checkout on sys.path

    return record_index(RECORD, RECORD.relative_to(ROOT).as_posix())


ARTEFACTS: dict[str, Callable[[], str]] = {
    "patcher/cli/help_text.py": help_text,
    "patcher/upstream/release_record.json": release_record,
    **pages.PAGES,
    "README.md": pages.readme,
    "docs/patches.md": pages.patches_doc,
}


def out_of_date() -> list[str]:
    """The artefacts (paths relative to the repository) whose file differs from what they render now."""
    stale = []
    for rel, render in ARTEFACTS.items():
        path = ROOT / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != render():
            stale.append(rel)
    return stale


def write() -> list[str]:
    written = []
    for rel, render in ARTEFACTS.items():
        path = ROOT / rel
        text = render()
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            written.append(rel)
    return written


def golden(update: bool) -> int:
    """tests/test_contract.py: with `update`, it rewrites tests/golden/; without, it compares."""
    env = {**os.environ, **({"PATCHER_UPDATE_GOLDEN": "1"} if update else {})}
    if not update:
        env.pop("PATCHER_UPDATE_GOLDEN", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_contract.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,  # its exit code is the answer
    )
    if done.returncode:
        print(done.stdout[-3000:], file=sys.stderr)
    return done.returncode


def main(argv: list[str]) -> int:
    unknown = [a for a in argv if a not in ("--check", "--no-golden")]
    if unknown:
        print(f"generate.py: unknown argument {unknown[0]}; usage: {COMMAND} [--check] [--no-golden]", file=sys.stderr)
        return 2
    with_golden = "--no-golden" not in argv
    if "--check" in argv:
        stale = out_of_date()
        if with_golden and golden(update=False):
            stale.append("tests/golden/*.json")
        if stale:
            print(f"out of date: {', '.join(stale)}: run {COMMAND}", file=sys.stderr)
            return 1
        print("every generated artefact is current")
        return 0
    written = write()
    for rel in written:
        print(f"wrote {rel}")
    before = {p.name: p.read_bytes() for p in (ROOT / "tests" / "golden").glob("*.json")}
    if with_golden:
        if golden(update=True):
            print("tests/test_contract.py failed while writing the golden files (above)", file=sys.stderr)
            return 1
        after = {p.name: p.read_bytes() for p in (ROOT / "tests" / "golden").glob("*.json")}
        for name in sorted(n for n in after if before.get(n) != after[n]):
            print(f"wrote tests/golden/{name}")
    if not written:
        print("every generated page and the help text were current")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
