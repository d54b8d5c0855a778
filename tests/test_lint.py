"""ruff and mypy, as configured in pyproject.toml, pass over the tree, and zizmor over the GitHub workflows: the README's test command
(and so .ci/run) runs them. Their pinned versions come with the test extra (.ci/bootstrap)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the environment running the tests has both


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / tool), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_COLOR": "1"},
    )


def test_ruff_check_passes():
    done = _run("ruff", "check", "--no-fix", "--output-format", "concise", ".")
    assert done.returncode == 0, f"ruff check failed (fix what it says):\n{done.stdout}{done.stderr}"


def test_ruff_format_changes_nothing():
    done = _run("ruff", "format", "--check", ".")
    assert done.returncode == 0, f"not formatted (run `ruff format .`):\n{done.stdout}{done.stderr}"


def test_mypy_passes():
    # Files, settings and the cache folder (.mypy_cache, reused between runs) come from pyproject.toml.
    done = _run("mypy")
    assert done.returncode == 0, f"mypy failed (fix what it says):\n{done.stdout}{done.stderr}"


def test_zizmor_finds_nothing_in_the_workflows():
    # --offline: no GitHub API calls (CI reaches only the package index); the pedantic persona
    # also reports the informational findings, so nothing is let through quietly.
    done = _run("zizmor", "--offline", "--persona", "pedantic", "--no-progress", ".github/workflows")
    assert done.returncode == 0, (
        f"zizmor found problems in .github/workflows (fix what it says):\n{done.stdout}{done.stderr}"
    )
