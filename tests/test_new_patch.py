"""Adding a patch touches one file plus generated outputs. In a copy of the repository, the example
module of docs/writing-a-patch.md is written to patches/ and nothing else is edited: the generated
artefacts are out of date until `python scripts/generate.py`, which changes only generated files;
the per-patch tests (examples, real sources, the engine) run it; the release matrix's rows, where
it is not selected, stay current; and the leave-one-out check asks for the run it declares."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "writing-a-patch.md"
MODULE = "patches/v98_cache_memory_fraction.py"
MARK = f"<!-- the example patch: tests/test_new_patch.py writes this block to {MODULE} -->"


def example_module() -> str:
    """The module the docs page shows, exactly."""
    after = PAGE.read_text(encoding="utf-8").split(MARK, 1)[1]
    assert after.startswith("\n```python\n"), "the example's code block must follow its marker"
    return after.split("```python\n", 1)[1].split("\n```\n", 1)[0] + "\n"


def copy_of_the_repository(root: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        source = ROOT / rel
        if source.is_file() and not source.is_symlink():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / rel)
    # An editable install maps patcher.patches and patcher.remote to this checkout's folders; in the
    # copy they are found first on the copy's own patcher/ (as an installed wheel lays them out).
    (root / "patcher" / "patches").symlink_to("../patches")
    (root / "patcher" / "remote").symlink_to("../remote")
    return root


def hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts
    }


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return copy_of_the_repository(tmp_path_factory.mktemp("new-patch") / "repo")


def run(tree: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("PATCHER_UPDATE_GOLDEN", None)
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_new_patch_module_is_all_a_patch_author_writes(tree: Path):
    probe = run(
        tree,
        "-c",
        "import patcher.patches, patcher.upstream.row_keys as r; print(patcher.patches.__file__, r.__file__)",
    )
    assert all(path.startswith(str(tree)) for path in probe.stdout.split()), probe.stdout + probe.stderr
    assert run(tree, "scripts/generate.py", "--check", "--no-golden").returncode == 0
    before = hashes(tree)

    (tree / MODULE).write_text(example_module(), encoding="utf-8")
    stale = run(tree, "scripts/generate.py", "--check", "--no-golden")
    assert stale.returncode == 1 and "docs/reference/patches.md" in stale.stderr, stale.stderr
    assert "run python scripts/generate.py" in stale.stderr

    done = run(tree, "scripts/generate.py")
    assert done.returncode == 0, done.stdout + done.stderr
    after = hashes(tree)
    changed = {rel for rel in after if before.get(rel) != after[rel]} | (set(before) - set(after))
    # docs/patches.md's "Which patches a run needs" lists the runs the module declares
    generated = {MODULE, "docs/reference/patches.md"} | {
        r for r in changed if r.startswith("tests/golden/") or r == "docs/patches.md"
    }
    assert changed == generated, f"files changed beyond the module and generated outputs: {changed - generated}"
    assert (
        "tests/golden/list.json" in changed
        and "v98-cache-memory-fraction" in (tree / "docs/reference/patches.md").read_text()
    )
    assert run(tree, "scripts/generate.py", "--check").returncode == 0

    # The per-patch tests pick it up: each parametrized over the declarations, none edited. All of
    # them are collected for it; the examples, its files' subsets and the engine's run are run.
    listed = run(tree, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-k", "v98", "tests")
    for test in (
        "test_before_becomes_after",
        "test_each_patch_applies_to_its_release_and_compiles",
        "test_subset_applies_and_compiles",
        "test_subsets_are_idempotent",
        "test_each_patch_alone_applies_once_and_rolls_back_byte_identical",
    ):
        assert f"::{test}[" in listed.stdout, (test, listed.stdout[-1500:])
    picked = run(
        tree, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "v98 and not idempotent",
        "tests/test_patch_examples.py", "tests/test_real_sources.py", "tests/test_engine.py",
    )  # fmt: skip
    passed = re.search(r"(\d+) passed", picked.stdout)
    assert picked.returncode == 0 and passed and int(passed.group(1)) >= 10, picked.stdout[-3000:]

    # What does not name it stays as it was: every recorded release row keeps its state (v98 is
    # selected on none), the declarations and generated pages agree.
    same = run(
        tree, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "tests/test_declarations.py", "tests/test_generated.py",
        "tests/test_release_record.py::test_the_rows_of_the_releases_the_suite_runs_speak_for_todays_patches",
        "tests/test_release_record.py::test_every_row_run_with_other_patches_says_so",
    )  # fmt: skip
    assert same.returncode == 0, same.stdout[-3000:]

    # Its declared evidence is asked for: a leave-one-out on 0.34.5 needs that release's recorded row.
    evidence = run(tree, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_leave_one_out.py", "-k", "v98")
    assert evidence.returncode == 1, evidence.stdout[-2000:]
    assert (
        "no recorded row 0.34.5-without-v98: python bench/releases.py --release 0.34.5 --speculators 0.3.0 "
        "--tensor-parallel 1 --leave-out v98" in evidence.stdout
    )
