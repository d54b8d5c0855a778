"""What a target prints cannot exhaust the controller: output is read in chunks, only answers are
kept whole, and an answer over the limit is one line naming the limit and how to raise it."""

from __future__ import annotations

import collections
import os
import queue
import subprocess
import time
from pathlib import Path

from patcher.transport.process import TooLong, TooNoisy, pump_answers
from tests.support.cli import patcher, patcher_argv, patcher_env

LINE = 500 * 10**6  # bytes on one line, printed before the target's Python starts


def noisy_python(tmp_path: Path, python: Path, where: str) -> Path:
    """A --python that prints LINE bytes without a newline on stdout or stderr, then runs python."""
    wrapper = tmp_path / f"noisy-{where}"
    redirect = " >&2" if where == "stderr" else ""
    wrapper.write_text(f"#!/bin/sh\nhead -c {LINE} /dev/zero | tr '\\0' x{redirect}\necho\nexec {python} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def peak_rss_mib(*args: str, env: dict | None = None) -> tuple[int, int]:
    """(exit code, the controller's peak resident memory in MiB)."""
    proc = subprocess.Popen(
        patcher_argv(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=patcher_env(env)
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss // 1024


def test_a_huge_line_before_python_starts_costs_the_controller_one_chunk(tmp_path: Path, host_env):
    """On stderr it is drained and the run goes on; on stdout, where only answers belong, the
    session ends at the noise limit (PATCHER_NOISE_LIMIT_MIB, 1 MiB): exit 2."""
    python = host_env()
    for where, exit_code in (("stdout", 2), ("stderr", 0)):
        code, peak = peak_rss_mib("status", "--python", str(noisy_python(tmp_path, python, where)))
        assert code == exit_code, where
        assert peak < 200, f"{where}: the controller peaked at {peak} MiB for a {LINE // 10**6} MB line"


def test_an_answer_over_the_limit_is_one_line_with_the_way_to_raise_it(host_env):
    python = host_env()
    code, _, err = patcher("status", "--python", str(python), env={"PATCHER_ANSWER_LIMIT_MIB": "0.0625"})
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "the agent's answer is over 0.0625 MiB (the limit)" in last and "PATCHER_ANSWER_LIMIT_MIB" in last, err


def printing_python(tmp_path: Path, python: Path, printer: str) -> Path:
    """A --python that runs `printer` (a shell pipeline writing to stdout), then the real python."""
    wrapper = tmp_path / "printing-python"
    wrapper.write_text(f'#!/bin/sh\n{printer}\nexec {python} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_lines_over_the_noise_limit_are_one_line_naming_the_limit(tmp_path: Path, host_env):
    """Lines that are not answers (a .pth's, a wrapper's, a login's) past PATCHER_NOISE_LIMIT_MIB
    end the session: one line naming the variable, exit 2, not minutes of reading."""
    python = printing_python(tmp_path, host_env(), "yes 'not an answer' | head -n 100000")
    code, _, err = patcher("status", "--python", str(python), env={"PATCHER_NOISE_LIMIT_MIB": "0.25"})
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "printed over 0.25 MiB that is not an answer (the limit; its last line: 'not an answer')" in last, err
    assert "set PATCHER_NOISE_LIMIT_MIB to a larger number of MiB" in last, err


def test_the_deadline_holds_whatever_the_target_prints(tmp_path: Path, host_env):
    """A target printing lines faster than they are read, for longer than the time limit (the
    noise limit raised out of the way): timed out at the limit, memory flat; the lines were once
    all queued and the deadline looked at only when the queue ran dry."""
    python = printing_python(tmp_path, host_env(), "yes | head -n 5000000")
    started = time.monotonic()
    code, peak = peak_rss_mib(
        "apply",
        "--no-verify",
        "--facts-timeout",
        "1",
        "--lock-timeout",
        "0",
        "--python",
        str(python),
        env={"PATCHER_NOISE_LIMIT_MIB": "100000"},
    )
    took = time.monotonic() - started
    # timed out (4), or, where the flood ended early enough on a loaded machine for the agent to
    # answer, done (0): either way within the limit, never after reading every line first
    assert code in (0, 4), code
    assert took < 6, f"took {took:.1f}s for --facts-timeout 1"
    assert peak < 200, f"the controller peaked at {peak} MiB"


def test_the_deadline_holds_against_a_target_that_prints_without_end(tmp_path: Path, host_env):
    """A target whose output never ends and never answers (`exec yes`): with the noise limit out of
    the way, timed out at the limit (exit 4); with the default limit, stopped at 1 MiB (exit 2).
    Either way within seconds, the controller's memory flat."""
    flood = tmp_path / "flooding-python"
    flood.write_text("#!/bin/sh\nexec yes\n")
    flood.chmod(0o755)
    for env, expected in (({"PATCHER_NOISE_LIMIT_MIB": "100000"}, 4), ({}, 2)):
        started = time.monotonic()
        code, peak = peak_rss_mib(
            "apply", "--no-verify", "--facts-timeout", "1", "--lock-timeout", "0", "--python", str(flood), env=env
        )
        took = time.monotonic() - started
        assert code == expected, (env, code)
        assert took < 8, f"{env}: took {took:.1f}s for --facts-timeout 1"
        assert peak < 200, f"{env}: the controller peaked at {peak} MiB"


def test_a_long_transform_holds_no_other_hosts_transform(tmp_path: Path, host_env):
    """Transforms shared by a fleet's hosts (shared_transforms) run side by side: a host whose file
    takes long to transform holds only the hosts with that same file. Under one lock for all, a
    healthy host waited out another's whole parse (64 s behind a 2 MB file)."""
    import threading

    from patcher.patchset.registry import load_patches
    from patcher.transform.transforms import shared_transforms, transform_source
    from tests.support.files import GENERATOR, WORKER
    from workbench.envs import site_file

    python = host_env()
    patches = load_patches()

    def steps(rel: str) -> list:
        return [(p, p.edits) for p in patches if p.target.path == rel]

    transform_source("x = 0\n", steps(GENERATOR), "warm.py")  # libcst imported before anything is watched
    fillers = "".join(f"\ndef filler_{i}(a, b):\n    return a + b * {i}\n" for i in range(150))
    long = site_file(python, GENERATOR).read_text() + fillers
    done: dict[str, bool] = {}
    with shared_transforms():
        slow = threading.Thread(target=lambda: done.setdefault("slow", bool(transform_source(long, steps(GENERATOR)))))
        slow.start()
        time.sleep(0.2)  # the slow host's transform is under way
        transform_source(site_file(python, WORKER).read_text(), steps(WORKER), WORKER)  # another host's file
        still_running = slow.is_alive()
        slow.join()
    assert done == {"slow": True}
    assert still_running, "the other host's transform waited for the long one to end"


class ChunkedReader:
    """A pipe's reader that hands out given pieces: read1() returns one piece a call."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = list(pieces)

    def read1(self, _size: int) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


def split_with_readlines(data: bytes, mark: bytes, answer_limit: int) -> list:
    """What the answers are, line by line: the reference the bulk splitter must agree with."""
    out: list = []
    for line in data.splitlines(keepends=True):
        if line.startswith(mark):
            out.append("too long" if len(line) > answer_limit else line)
    return [*out, None]


def test_the_bulk_splitter_finds_every_answer_wherever_the_reads_break():
    """Answers are the lines that start with the mark, whatever the read boundaries: a mark split
    across reads, lines that start like the mark and are not, an answer over the limit, an answer
    without its line end at the end of output. Checked against a line-by-line split at every cut."""
    mark = b"patcher-answer:0a1b "
    data = (
        b"banner\npatcher-answer:0a1 no\n"
        + b'patcher-answer:0a1b {"ok": true}\n'
        + b"p\npatcher-answer\n"
        + b"y\n" * 50
        + b"patcher-answer:0a1b "
        + b"x" * 90
        + b"\n"  # over the limit of 64
        + b"noise patcher-answer:0a1b inside a line\n"
        + b'patcher-answer:0a1b {"last": 1}'
    )
    expected = split_with_readlines(data, mark, 64)
    for size in (1, 2, 3, 7, 19, 20, 21, 64, len(data)):
        pieces = [data[i : i + size] for i in range(0, len(data), size)]
        lines: queue.Queue = queue.Queue()
        noise: collections.deque[str] = collections.deque(maxlen=5)
        pump_answers(ChunkedReader(pieces), mark, 64, 1 << 20, lines, noise)
        got = [lines.get_nowait() for _ in range(lines.qsize())]
        got = ["too long" if isinstance(item, TooLong) else item for item in got]
        assert got == expected, size
        assert noise and noise[-1] == "noise patcher-answer:0a1b inside a line", (size, noise)


def test_the_bulk_splitter_stops_at_the_noise_limit():
    """Past the noise limit: TooNoisy, and nothing more is read."""
    reader = ChunkedReader([b"y\n" * 1000] * 100)
    lines: queue.Queue = queue.Queue()
    pump_answers(reader, b"patcher-answer:0a1b ", 1 << 20, 20_000, lines, collections.deque(maxlen=5))
    assert isinstance(lines.get_nowait(), TooNoisy) and lines.empty()
    assert len(reader.pieces) == 100 - 11  # 11 reads of 2000 bytes pass 20,000
