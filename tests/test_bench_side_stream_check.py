"""bench/gpu/side_stream_check.py's loop on the CPU (the demo environment's torch): v21's helpers as
the patch writes them, driven step by step, an interrupted call among whole ones; and the check
fails where the helpers hand over other rows. The side stream itself runs only on the GPU machine
(no record of it yet: docs/extraction-speed.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu" / "side_stream_check.py"
SMALL = ["--device", "cpu", "--hidden", "64", "--prompts", "6", "--prompt-len", "40", "--step-tokens", "64"]
SMALL += ["--calls", "1"]


def test_the_cpu_loop_checks_every_prompt_and_times_three_ways(tmp_path: Path, demo_python: Path):
    done = subprocess.run(
        [str(demo_python), str(SCRIPT), "--out", str(tmp_path), *SMALL], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "side-stream-check.json").read_text())
    assert record["passed"] and record["problems"] == [], record
    assert record["prompts_checked"] == 3 * 6  # calls 0, 2 and 3 whole; call 1 interrupted
    assert set(record["tokens_per_s"]) == {"compute", "current-stream", "side-stream"}
    assert all(len(seconds) == 1 for seconds in record["seconds_per_call"].values())
    assert record["files_left"] == [] and not record["steps_left"]
    tails = record["after_the_last_step"]
    assert set(tails) == {"current-stream", "side-stream"}, tails
    assert all(len(values) == 1 and values[0] >= 0 for tail in tails.values() for values in tail.values()), tails


def test_rows_other_than_the_devices_fail_the_check(tmp_path: Path, demo_python: Path):
    program = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("side_stream_check", {str(SCRIPT)!r})
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
shipped = check.helpers_source
copy = "owned.copy_(layer[span[0] : span[1]])"  # _rows_into's: every copy-out, the step path's included
assert shipped().count(copy) == 1
check.helpers_source = lambda: shipped().replace(copy, copy.replace("])", "].flip(0))"))
sys.exit(check.main(sys.argv[1:]))
"""
    done = subprocess.run(
        [str(demo_python), "-c", program, "--out", str(tmp_path), *SMALL], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stdout + done.stderr
    record = json.loads((tmp_path / "side-stream-check.json").read_text())
    assert not record["passed"]
    assert "call 0, prompt 0: rows differ from the device's" in record["problems"], record["problems"]
