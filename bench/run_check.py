"""The run check on named half-patched states, with its time and memory: what the test suite
leaves out (each state is one vLLM run, a minute or more on 2 CPUs).

    python bench/run_check.py                         # the vLLM 0.16.0 CPU demo environment
    python bench/run_check.py --python ENV/bin/python # another environment (0.32, a CUDA host)
    python bench/run_check.py --states all,-v6,-v11

Each state is made on a throwaway overlay of the environment (its own pristine speculators
0.3.0; the environment itself is never patched): `patcher rollback`, `patcher apply --no-verify
--skip ...`, then `patcher verify --run`. `pristine` applies nothing. Prints, per state: exit
code, the run check's verdict line, the largest relative error, wall time and peak memory.
With --python, the overlay is made on top of that environment (it must have pip).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def patcher(*args: str) -> tuple[int, dict | None, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "patcher.cli", *args, "--json"], capture_output=True, text=True, timeout=2400
    )
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout.strip() else None), proc.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the environment to overlay (default: the demo environment)")
    parser.add_argument("--states", default="all,-v6,-v11,pristine", help="all, -vN (all but vN), pristine")
    args = parser.parse_args()
    from patcher.demo.environment import build_demo_env
    from workbench.envs import overlay_env

    base = Path(args.python) if args.python else build_demo_env(progress=lambda m: None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="patcher-bench-runcheck-") as tmp:
        target = overlay_env(Path(tmp), base)
        for state in args.states.split(","):
            code, _, err = patcher("rollback", "--python", str(target))
            if code != 0:
                print(err, file=sys.stderr)
                return code
            if state != "pristine":
                skips = [] if state == "all" else ["--skip", state.lstrip("-")]
                code, _, err = patcher("apply", "--python", str(target), "--no-verify", *skips)
                if code != 0:
                    print(err, file=sys.stderr)
                    return code
            started = time.monotonic()
            code, doc, err = patcher("verify", "--run", "--python", str(target))
            wall = time.monotonic() - started
            report = doc["targets"][0] if doc else {}
            check = report.get("run_check") or {}
            rows.append((state, code, check, wall, report.get("message", err.strip()[-300:])))
            print(f"\n[{state}] exit {code}, {wall:.0f}s: {report.get('message', '')}", flush=True)
            for problem in check.get("problems", [])[:6]:
                print(f"    - {problem}", flush=True)
    print("\n| state | exit | run check | largest relative error | wall | model + extraction | peak RSS |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for state, code, check, wall, _ in rows:
        timings = check.get("timings", {})
        verdict = "passed" if check.get("ok") else (check.get("problems") or [check.get("cannot_run") or "?"])[0]
        rel = check.get("max_rel_diff")
        print(
            f"| {state} | {code} | {verdict[:90]} | {'' if rel is None else f'{rel:.3f}'} | {wall:.0f} s | "
            f"{timings.get('model_s', '?')} s + {timings.get('extract_s', '?')} s | {check.get('peak_rss_mib', '?')} MiB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
