"""The copy-out under a busy-waiting thread: v21's per-prompt copies against the way they were made before.

    python bench/copy_contention.py [--python PYTHON] [--hidden 2048] [--prompts 64] [--rounds 9]
                                    [--threads 1] [--out bench/results/copy-contention.json]

While a generate() call steps, the generator's main thread waits for the worker's reply in vLLM's
shm_broadcast loop (sched_yield and a few Python calls, the GIL taken back after each), and the
pool's threads copy the finished prompts' rows out of the shared buffer (`_owned_rows` of
patcher/shared_states.py's BUFFER_SOURCE). Each time a copy thread gives up the GIL, it may have to
wait for that loop to give it back. This bench runs, in one process of the target interpreter
(torch on one thread, as vLLM sets it in the generator's process):
- `current`: BUFFER_SOURCE's `_owned_rows`, as the patches write it;
- `lookup-each`: the baseline, the copy-out as it was before: ctypes.CDLL(None).madvise looked up
  for every tensor (a dlopen) and called with the GIL released;
each over one call's rows (--prompts prompts of 1024 rows, three bf16 layers of --hidden), in a pool
of --threads threads, first alone (`idle`), then with the main thread busy-waiting (`busy`), the ways
interleaved over --rounds rounds of each (each first in turn). It prints and writes the medians
(seconds a call) and the ratios lookup-each/current; some of each call's copies are checked equal
to the source's bytes. Nothing asserts speed.

Without --python: the demo environment (vLLM 0.16.0, the CPU build; built the first time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs in the target interpreter: BUFFER_SOURCE is executed into TIMED's namespace first.
TIMED = """
import ctypes, json, os, statistics, sys, time
from concurrent.futures import ThreadPoolExecutor

torch.set_num_threads(1)
hidden, prompts, rounds, threads = (int(x) for x in sys.argv[1:5])
ROWS = 1024
layers = [torch.randn(prompts * ROWS, hidden).to(torch.bfloat16) for _ in range(3)]
spans = [(i * ROWS, (i + 1) * ROWS) for i in range(prompts)]


def lookup_each(layers, span):
    rows = []
    for layer in layers:
        part = layer[span[0] : span[1]]
        owned = torch.empty(part.shape, dtype=part.dtype)
        huge = 2 << 20
        start = -(-owned.data_ptr() // huge) * huge
        stop = (owned.data_ptr() + owned.numel() * owned.element_size()) // huge * huge
        if stop > start:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), 14)
        owned.copy_(part)
        rows.append(owned)
    return rows


WAYS = {"current": _owned_rows, "lookup-each": lookup_each}


def one_call(copy, busy):
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        copies = [pool.submit(copy, layers, span) for span in spans]
        while busy and not all(c.done() for c in copies):
            for _ in range(50):  # shm_broadcast's wait: yield the CPU, look at the clock
                os.sched_yield()
                time.monotonic()
        results = [c.result() for c in copies]
    seconds = time.perf_counter() - started
    for span, rows in zip(spans[:: max(1, prompts // 4)], results[:: max(1, prompts // 4)]):
        if not all(torch.equal(r, layer[span[0] : span[1]]) for r, layer in zip(rows, layers)):
            raise SystemExit(f"the copy of rows {span} differs from the buffer's")
    return seconds


times = {f"{way}-{load}": [] for way in WAYS for load in ("idle", "busy")}
one_call(_owned_rows, False)  # warm-up: the first faults and lookups
ways = list(WAYS)
for load in ("idle", "busy"):  # all idle calls first: a busy-waiting run slows the idle calls after it
    for round_ in range(rounds):  # each way first in turn: none always follows the other
        for way in ways[round_ % len(ways) :] + ways[: round_ % len(ways)]:
            times[f"{way}-{load}"].append(one_call(WAYS[way], load == "busy"))
print(json.dumps({key: statistics.median(values) for key, values in times.items()}))
"""


def demo_python() -> str:
    sys.path.insert(0, str(ROOT))
    from patcher.demo.environment import build_demo_env

    return str(build_demo_env(progress=lambda line: print(line, file=sys.stderr)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the interpreter with torch (default: the demo environment's)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="copy threads (v21 uses up to 8)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "copy-contention.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from patcher.shared_states import BUFFER_SOURCE

    python = args.python or demo_python()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write("import torch\n" + BUFFER_SOURCE + TIMED)
    try:
        done = subprocess.run(
            [python, script.name, str(args.hidden), str(args.prompts), str(args.rounds), str(args.threads)],
            capture_output=True,
            text=True,
        )
    finally:
        Path(script.name).unlink()
    if done.returncode != 0:
        print(f"error: the timed run exited {done.returncode}: {done.stderr.strip()[-400:]}", file=sys.stderr)
        return 1
    medians = json.loads(done.stdout.strip().splitlines()[-1])
    import os
    import platform

    record = {
        "config": {"hidden": args.hidden, "prompts": args.prompts, "rounds": args.rounds, "threads": args.threads},
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "seconds_a_call": {key: round(value, 6) for key, value in medians.items()},
        "ratios": {
            f"lookup-each/current ({load})": round(medians[f"lookup-each-{load}"] / medians[f"current-{load}"], 3)
            for load in ("idle", "busy")
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for key, value in record["seconds_a_call"].items():
        print(f"{key:>18}: {value:.4f} s a call")
    for key, value in record["ratios"].items():
        print(f"{key}: {value}")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
