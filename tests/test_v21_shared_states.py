"""v21 on the real vLLM 0.16.0 (CPU build): the captured states come back through the shared host
buffer, the same tensors to the last bit as through the RPC queue without v21, each result
owning its storage and valid after later calls and after the generator is gone; and no file of
the transfer, nor any new shared-memory segment, is left after a run, after an exception raised in
the worker during the transfer, or after a SIGINT at any moment of it (before the request, while
the caller waits, after the reply) or in the middle of a loop of calls.

The driver (tests/support/shared_states_driver.py) runs in a throwaway target over the demo
environment, patched through the real CLI as tests/test_e2e_vllm.py does; one vLLM at a time
(one run for every moment of the SIGINT, one with v21 for two tests). Every process a test sends
SIGINT to starts with it default-handled (sigint_as_at_a_terminal), however the suite was started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.support.e2e import patch_as, rolled_back_overlay
from tests.support.shared_states_driver import MOMENTS
from tests.support.terminal import sigint_as_at_a_terminal

pytestmark = pytest.mark.vllm

DRIVER = Path(__file__).resolve().parent / "support" / "shared_states_driver.py"
REPORT = "SHARED-STATES-REPORT "
FOLDERS = ("/dev/shm", tempfile.gettempdir())


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    with rolled_back_overlay(tmp_path_factory.mktemp("v21"), demo_python) as python:
        yield python


def transfer_files() -> set[str]:
    """The transfer's files (v21 names them speculators-states-*), in both folders it may use."""
    return {str(p) for folder in FOLDERS if os.path.isdir(folder) for p in Path(folder).glob("speculators-states-*")}


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class Leftovers:
    """What a block leaves behind: transfer files and /dev/shm entries that were not there before."""

    def __enter__(self) -> Leftovers:
        self.files, self.shm = transfer_files(), shm_entries()
        return self

    def __exit__(self, *exc) -> None:
        self.new_files = transfer_files() - self.files
        self.new_shm = shm_entries() - self.shm


def drive(target: Path, model: Path, mode: str, *extra: str) -> dict:
    done = subprocess.run(
        [str(target), str(DRIVER), mode, "--model", str(model), *extra],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(target.parent.parent),
        preexec_fn=sigint_as_at_a_terminal,  # the sigint mode interrupts itself
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(REPORT)]
    assert lines, f"no report (exit {done.returncode}); stderr:\n{done.stderr[-3000:]}"
    report = json.loads(lines[-1][len(REPORT) :])
    report["stderr"] = done.stderr
    return report


def equal_in_target(target: Path, a: Path, b: Path) -> dict:
    code = (
        "import json, sys, torch\n"
        "a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])\n"
        "pairs = [(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb)]\n"
        "print(json.dumps({'tensors': len(pairs), 'same_count': len(a) == len(b),\n"
        "    'bit_equal': all(torch.equal(x, y) for x, y in pairs),\n"
        "    'max_abs': max(float((x.float() - y.float()).abs().max()) for x, y in pairs)}))\n"
    )
    done = subprocess.run([str(target), "-c", code, str(a), str(b)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def with_v21(target: Path, model: Path, tmp_path_factory) -> dict:
    """One run with every patch: its report, what it left, its first call's tensors (--dump)."""
    patch_as(target)
    dump = tmp_path_factory.mktemp("with-v21") / "with.pt"
    with Leftovers() as left:
        report = drive(target, model, "run", "--dump", str(dump))
    return {"report": report, "left": left, "dump": dump}


def test_v21_states_own_their_storage_stay_valid_and_leave_nothing(with_v21: dict):
    report, left = with_v21["report"], with_v21["left"]
    assert report["ok"], report
    assert report["transfer"] == {"path": "shared memory", "calls": 3}, report["transfer"]
    assert report["devices"] == ["cpu"]
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)


def test_without_v21_the_rpc_queue_carries_the_same_tensors(target: Path, model: Path, tmp_path: Path, with_v21):
    """The leave-one-out: the old path, and bit for bit the tensors v21 returns (CPU build)."""
    assert with_v21["report"]["ok"], with_v21["report"]
    states = patch_as(target, "v21")
    assert states["v21"] != "applied", states
    report = drive(target, model, "run", "--dump", str(tmp_path / "without.pt"))
    assert report["ok"], report
    assert report["transfer"]["path"] == "RPC queue", report["transfer"]
    compared = equal_in_target(target, with_v21["dump"], tmp_path / "without.pt")
    assert compared["same_count"] and compared["tensors"] == 7 * 3, compared
    assert compared["bit_equal"], compared


def test_an_exception_in_the_worker_during_the_transfer_leaves_nothing(target: Path, model: Path):
    # the driver sends the step's request metadata one token short: the worker's
    # request-by-request check (v10) raises inside the transfer
    patch_as(target)
    with Leftovers() as left:
        report = drive(target, model, "worker-error")
    assert report["ok"], report
    assert report["error"]["type"] == "RuntimeError", report["error"]
    assert "captured 999 rows of hidden states, expected 1000" in report["error"]["message"], report["error"]
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)


@pytest.mark.parametrize("mode", ["sigint", "loop"])
def test_the_driver_refuses_to_send_a_sigint_that_would_interrupt_nothing(target: Path, model: Path, mode: str):
    """Started with SIGINT ignored (as by `nohup ... &`), the driver says so and exits 2 before
    vLLM starts, rather than reporting calls that its SIGINT never interrupted."""
    done = subprocess.run(
        [str(target), str(DRIVER), mode, "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(target.parent.parent),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        (
            f"shared_states_driver: {mode} needs SIGINT default-handled, and this process inherited it ignored "
            "(as a background job of a shell without job control does); start it with "
            "preexec_fn=tests.support.terminal.sigint_as_at_a_terminal"
        )
    ], done.stderr
    assert not done.stdout


@pytest.fixture(scope="module")
def interrupted(target: Path, model: Path) -> dict:
    """One driver run that interrupts a call at each of MOMENTS in turn (one vLLM start for all)."""
    patch_as(target)
    with Leftovers() as left:
        report = drive(target, model, "sigint")
    return {"report": report, "left": left}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_sigint_during_the_transfer_leaves_nothing(interrupted: dict, moment: str):
    report, left = interrupted["report"], interrupted["left"]
    assert moment in report.get("moments", {}), report
    seen = report["moments"][moment]
    assert seen.get("interrupted"), report
    assert seen["rpc_file"] and not seen["file_left"], seen
    if moment == "during-rpc":  # the worker went on after the caller had removed the name: it made none
        assert seen["late_reply"]["reply"]["unavailable"].startswith("FileNotFoundError"), seen
    if moment == "after-reply":
        assert seen["reply_made_file"], seen  # the worker had sized and mapped the file
    # the one run's leftovers (the moments share one generator and one vLLM)
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)


def test_ctrl_c_in_a_loop_of_calls_leaves_nothing(target: Path, model: Path):
    patch_as(target)
    with Leftovers() as left:
        proc = subprocess.Popen(
            [str(target), str(DRIVER), "loop", "--model", str(model)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(target.parent.parent),
            start_new_session=True,  # its own process group: the test cleans up only what it started
            preexec_fn=sigint_as_at_a_terminal,  # noqa: PLW1509
        )
        calls: list[dict] = []
        stderr: list[str] = []
        readers = [
            threading.Thread(target=read_calls, args=(proc.stdout, calls), daemon=True),
            threading.Thread(target=stderr.extend, args=(proc.stderr,), daemon=True),
        ]
        for reader in readers:
            reader.start()
        try:
            # after two calls (the buffer made, then reused), SIGINT as soon as a transfer is in
            # flight: its file's name exists only while a call's reply is on its way
            deadline = time.monotonic() + 600
            while len(calls) < 2:
                assert proc.poll() is None, "".join(stderr)[-3000:]
                assert time.monotonic() < deadline, "no second call in 10 minutes"
                time.sleep(0.05)
            before = transfer_files()
            while not transfer_files() - before:
                assert proc.poll() is None, "".join(stderr)[-3000:]
                assert time.monotonic() < deadline, "no transfer file seen in 10 minutes"
                time.sleep(0.0005)  # a transfer's file lives for milliseconds: look often
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for reader in readers:
            reader.join(30)
    assert calls and calls[-1]["path"] == "shared memory", calls
    assert code != 0  # KeyboardInterrupt
    assert not left.new_files and not left.new_shm, (left.new_files, left.new_shm)


def read_calls(stdout, calls: list[dict]) -> None:
    """The loop's "calls N {transfer}" lines, as they come."""
    for line in stdout:
        if line.startswith("calls "):
            calls.append(json.loads(line.split(" ", 2)[2]))
