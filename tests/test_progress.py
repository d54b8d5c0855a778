"""A long step is never silent: while apply's write-and-verify request is in flight (here held
for 2.5 s by the agent's own pause fault, after it wrote the first file), a pipe gets a line
every PATCHER_PROGRESS_EVERY seconds and a terminal a spinner with the elapsed time (rich), and
--json's stdout stays the document alone. The suite's own environment builds show the same
lines on pytest's output although pytest captures the fixture's (workbench/progress.py)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from tests.support.cli import patcher_argv, patcher_env
from tests.support.files import GENERATOR
from workbench.envs import light_env

HELD = json.dumps({"at": f"file-written:{GENERATOR}", "action": "pause", "seconds": 2.5})
ROOT = Path(__file__).resolve().parent.parent


def held_apply(python: Path, *extra: str) -> list[str]:
    return patcher_argv("apply", "--no-verify", "--python", str(python), *extra)


def test_a_long_step_in_a_pipe_gets_a_line_every_so_often_and_stdout_stays_json(tmp_path: Path):
    python = light_env(tmp_path)
    env = patcher_env({"PATCHER_FAULT": HELD, "PATCHER_PROGRESS_EVERY": "1"})
    done = subprocess.run(held_apply(python, "--json"), capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["exit_code"] == 0  # stdout: the document, nothing else
    lines = done.stderr.splitlines()
    step = lines.index(f"{python}: writing 2 file(s)")
    assert lines[step + 1 : step + 3] == ["  ... 1 s so far", "  ... 2 s so far"], done.stderr
    assert "  ... 3 s so far" not in lines  # the step ended at 2.5 s: nothing more after it


def test_quiet_shows_no_time(tmp_path: Path):
    python = light_env(tmp_path)
    env = patcher_env({"PATCHER_FAULT": HELD, "PATCHER_PROGRESS_EVERY": "1"})
    done = subprocess.run(held_apply(python, "--quiet"), capture_output=True, text=True, env=env, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_long_step_on_a_terminal_gets_a_spinner_with_the_elapsed_time(tmp_path: Path):
    python = light_env(tmp_path)
    primary, secondary = pty.openpty()
    env = patcher_env({"PATCHER_FAULT": HELD, "TERM": "xterm", "COLUMNS": "100"})
    proc = subprocess.Popen(held_apply(python, "--json"), stdout=subprocess.PIPE, stderr=secondary, env=env, text=True)
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=120)
    os.close(primary)
    screen = b"".join(chunks).decode()
    assert proc.returncode == 0, screen
    assert json.loads(out)["exit_code"] == 0
    assert "\x1b[?25l" in screen  # the spinner hides the cursor ...
    assert "0:00:02" in screen  # ... counts the held step's seconds ...
    shown = screen.index("\x1b[?25h")  # ... and gives the cursor back before the report
    assert shown < screen.index("2 file(s) written, not verified")
    assert "so far" not in screen  # the pipe's lines are for pipes


def test_a_fixtures_progress_reaches_pytests_output_through_its_capture(tmp_path: Path):
    """A captured test (no -s) whose fixture reports progress the way tests/support/envs.py's
    demo_env does: its lines, with the time of the silent step, are in pytest's own output."""
    (tmp_path / "conftest.py").write_text(
        "from workbench.progress import keep_config\n\ndef pytest_configure(config):\n    keep_config(config)\n"
    )
    (tmp_path / "test_build.py").write_text(
        "import time\n"
        "from workbench.progress import shown\n\n"
        "def test_build():\n"
        "    print('captured, never shown')\n"
        "    with shown('vLLM 9.9 environment') as progress:\n"
        "        progress('    install the requirements ...')\n"
        "        time.sleep(2.5)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATCHER_PROGRESS_EVERY": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_build.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    first = lines.index("[vLLM 9.9 environment] install the requirements ...")
    assert lines[first + 1 : first + 3] == [
        "[vLLM 9.9 environment] ... 1 s so far",
        "[vLLM 9.9 environment] ... 2 s so far",
    ]
    assert "captured, never shown" not in done.stdout
