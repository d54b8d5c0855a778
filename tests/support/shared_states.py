"""The test side of the shared-memory transfer's checks (tests/test_patch_v21_shared_states.py for
speculators 0.3.0, tests/test_patch_v26_shared_states.py for 0.4.x): the driver run in a target and its
report read, what a block leaves behind, tensors compared in the target, a loop's calls read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.support.terminal import sigint_as_at_a_terminal

DRIVER = Path(__file__).resolve().parent / "shared_states_driver.py"
REPORT = "SHARED-STATES-REPORT "
FOLDERS = ("/dev/shm", tempfile.gettempdir())


def transfer_files() -> set[str]:
    """The transfer's files (v21 and v26 name them speculators-states-*), in both folders it may use."""
    return {str(p) for folder in FOLDERS if os.path.isdir(folder) for p in Path(folder).glob("speculators-states-*")}


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def shm_in_use() -> set[str]:
    """The /dev/shm entries a live process maps or holds open: those of other vLLM runs on a shared
    machine, which a block's own processes, gone by its end, cannot have left."""
    used = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                used |= {line.split()[-1] for line in maps if "/dev/shm/" in line}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                used.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return {os.path.basename(path) for path in used if path.startswith("/dev/shm/")}


class Leftovers:
    """What a block leaves behind: transfer files and /dev/shm entries that were not there before,
    are still there a few seconds on (what another run on a shared machine has for a moment, a
    transfer file in flight, a semaphore multiprocessing's resource tracker removes, is gone by
    then; what a run leaks stays), and that no live process uses."""

    SETTLE_S = 5.0

    def __enter__(self) -> Leftovers:
        self.files, self.shm = transfer_files(), shm_entries()
        return self

    def __exit__(self, *exc) -> None:
        deadline = time.monotonic() + self.SETTLE_S
        while True:
            self.new_files = transfer_files() - self.files
            self.new_shm = shm_entries() - self.shm - shm_in_use()
            if not (self.new_files or self.new_shm) or time.monotonic() > deadline:
                return
            time.sleep(0.2)


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


def read_calls(stdout, calls: list[dict]) -> None:
    """The loop's "calls N {transfer}" lines, as they come."""
    for line in stdout:
        if line.startswith("calls "):
            calls.append(json.loads(line.split(" ", 2)[2]))


def interrupt_a_loop(target: Path, model: Path) -> dict:
    """The driver's loop mode, sent SIGINT as soon as a transfer is in flight after two calls (the
    buffer made, then reused): {"calls": each call's transfer, "code": its exit status, "left":
    its Leftovers}."""
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
            # the transfer's file's name exists only while a call's reply is on its way
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
    return {"calls": calls, "code": code, "left": left}
