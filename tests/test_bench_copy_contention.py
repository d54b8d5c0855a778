"""bench/copy_contention.py's short form: BUFFER_SOURCE's copy-out and the earlier way, each alone
and beside a busy-waiting thread, in the demo environment's torch; the record it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_short_form_times_both_ways_alone_and_busy(tmp_path: Path, demo_python: Path):
    out = tmp_path / "copy-contention.json"
    command = [sys.executable, str(ROOT / "bench" / "copy_contention.py"), "--python", str(demo_python)]
    done = subprocess.run(
        [*command, "--hidden", "256", "--prompts", "4", "--rounds", "2", "--threads", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    assert record["config"] == {"hidden": 256, "prompts": 4, "rounds": 2, "threads": 2}
    medians = record["seconds_a_call"]
    assert set(medians) == {"current-idle", "current-busy", "lookup-each-idle", "lookup-each-busy"}
    assert all(value > 0 for value in medians.values()), medians
    for load in ("idle", "busy"):
        ratio = medians[f"lookup-each-{load}"] / medians[f"current-{load}"]
        assert abs(record["ratios"][f"lookup-each/current ({load})"] - ratio) < 0.01 * ratio, record
    assert f"written: {out}" in done.stdout


def test_an_interpreter_without_torch_is_one_line_and_exit_1(tmp_path: Path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "copy_contention.py"),
            "--python",
            sys.executable,
            "--out",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: the timed run exited 1:") and "torch" in done.stderr, done.stderr
    assert not (tmp_path / "r.json").exists()
