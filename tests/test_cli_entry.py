"""The console script's fast answers (--version, --help) are click's answers, without click."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from patcher.cli.entry import render_help
from patcher.cli.help_text import HELP

SCRIPT = Path(sys.executable).parent / "patcher"
ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], columns: int, *, entry: bool = True) -> subprocess.CompletedProcess:
    module = "patcher.cli.entry" if entry else "patcher.cli.patcher_command"
    code = f"import sys; sys.argv[0] = 'patcher'; from {module} import main; main()"
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *args], capture_output=True, text=True, env=env
    )


def imported(importtime: str, module: str) -> bool:
    return any(line.rsplit("|", 1)[-1].strip() == module for line in importtime.splitlines())


def test_kept_help_is_what_click_renders_now():
    assert HELP == render_help(), (
        "the CLI changed: regenerate patcher/cli/help_text.py with `python scripts/generate.py`"
    )


def test_help_text_file_is_what_the_generator_writes():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import generate
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    path = ROOT / "patcher" / "cli" / "help_text.py"
    assert path.read_text(encoding="utf-8") == generate.help_text(), "run `python scripts/generate.py`"


def test_python_dash_m_runs_the_cli():
    for module in ("patcher", "patcher.cli.entry", "patcher.cli"):
        done = subprocess.run([sys.executable, "-m", module, "list", "--json"], capture_output=True, text=True)
        assert done.returncode == 0 and '"v1-block-hasher"' in done.stdout, (module, done.stderr)
        version = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True)
        assert version.stdout.startswith("patcher, version "), (module, version.stderr)
    before = (ROOT / "patcher" / "cli" / "help_text.py").stat().st_mtime_ns
    subprocess.run([sys.executable, "-m", "patcher.cli.entry", "--help"], capture_output=True, check=True)
    assert (ROOT / "patcher" / "cli" / "help_text.py").stat().st_mtime_ns == before, (
        "running the CLI wrote help_text.py"
    )


def test_help_and_version_match_click_and_do_not_import_it():
    for args in (["--help"], ["-h"], ["--version"]):
        fast, slow = run(args, 120), run(args, 120, entry=False)
        assert fast.returncode == slow.returncode == 0
        assert fast.stdout == slow.stdout, args
        assert not imported(fast.stderr, "click"), f"{args}: click was imported"
        assert imported(slow.stderr, "click")  # the check above can see an import of click


def test_narrow_screen_goes_to_click():
    fast, slow = run(["--help"], 60), run(["--help"], 60, entry=False)
    assert fast.stdout == slow.stdout
    assert imported(fast.stderr, "click")


def test_everything_else_goes_to_the_cli():
    done = run(["list", "--json"], 120)
    assert done.returncode == 0 and '"v1-block-hasher"' in done.stdout


def test_installed_script_is_the_entry():
    assert SCRIPT.exists(), "the package is installed with its console script"
    assert "patcher.cli.entry" in SCRIPT.read_text()


def test_the_help_names_every_exit_code():
    from patcher.core.errors import EXIT_MEANINGS

    summary = " ".join(HELP.split("Exit codes:", 1)[1].split("Options:", 1)[0].split())
    missing = [code for code, _ in EXIT_MEANINGS if f" {code} " not in f" {summary}"]
    assert not missing, f"patcher --help's exit-code summary lacks {missing} (patcher/cli/patcher_command.py main)"
