"""What a target prints cannot exhaust the controller: output is read in chunks, only answers are
kept whole, and an answer over the limit is one line naming the limit and how to raise it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.cli import patcher, patcher_argv, patcher_env

LINE = 500 * 10**6  # bytes on one line, printed before the target's Python starts


def noisy_python(tmp_path: Path, python: Path, where: str) -> Path:
    """A --python that prints LINE bytes without a newline on stdout or stderr, then runs python."""
    wrapper = tmp_path / f"noisy-{where}"
    redirect = " >&2" if where == "stderr" else ""
    wrapper.write_text(f"#!/bin/sh\nhead -c {LINE} /dev/zero | tr '\\0' x{redirect}\necho\nexec {python} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def peak_rss_mib(*args: str) -> tuple[int, int]:
    """(exit code, the controller's peak resident memory in MiB)."""
    proc = subprocess.Popen(
        patcher_argv(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=patcher_env()
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss // 1024


def test_a_huge_line_before_python_starts_costs_the_controller_one_chunk(tmp_path: Path, host_env):
    python = host_env()
    for where in ("stdout", "stderr"):
        code, peak = peak_rss_mib("status", "--python", str(noisy_python(tmp_path, python, where)))
        assert code == 0
        assert peak < 200, f"{where}: the controller peaked at {peak} MiB for a {LINE // 10**6} MB line"


def test_an_answer_over_the_limit_is_one_line_with_the_way_to_raise_it(host_env):
    python = host_env()
    code, _, err = patcher("status", "--python", str(python), env={"PATCHER_ANSWER_LIMIT_MIB": "0.0625"})
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "the agent's answer is over 0.0625 MiB (the limit)" in last and "PATCHER_ANSWER_LIMIT_MIB" in last, err
