"""Local benchmarks, each a ratio against a named baseline measured in the same run (absolute
times on shared machines are noise). Targets from issue 7:

- full apply --no-verify        <= 1.5x FLOOR (one process: read the target files, one libcst
                                  parse and code generation each); measured without the transform
                                  cache, and once more with it (files met before: no libcst at all)
- second apply, nothing to do   <= 0.5x FLOOR
- patcher --version / --help    <= 2x `python -c pass`
- verification                  its cost beyond importing the target modules <= 10%
                                  (needs the demo environment; skipped with a note otherwise)

    python bench/local.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # workbench/ builds the light target environments

import record  # noqa: E402  (bench/record.py, beside this script)

from patcher.patchset.registry import load_patches  # noqa: E402
from workbench.envs import light_env, site_file  # noqa: E402

# What users run: the console script installed beside this interpreter.
SCRIPT = Path(sys.executable).parent / "patcher"
PATCHER = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "patcher.cli.entry"]
TARGETS = sorted({p.target.path for p in load_patches()})


def once(command: list[str], before=None, env=None) -> float:
    """Wall time of one run of `command` (`before` runs first, untimed)."""
    if before:
        before()
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 6):
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return elapsed


def timed(command: list[str], repeat: int, before=None, env=None) -> float:
    """Median wall time of `command` over `repeat` runs."""
    return statistics.median(once(command, before, env) for _ in range(repeat))


def floor_command(python_files: list[Path]) -> list[str]:
    code = (
        "import sys, libcst\n"
        "for path in sys.argv[1:]:\n"
        "    source = open(path, encoding='utf-8').read()\n"
        "    libcst.parse_module(source).code\n"
    )
    return [sys.executable, "-c", code, *map(str, python_files)]


FLOOR = "FLOOR: read the target files, one libcst parse + codegen each"
IMPORTS = "importing the patched modules themselves"


def row(name: str, value: float, baseline: float, target: str, ok: bool, against: str) -> dict:
    ratio = value / baseline
    print(f"{name:<34} {value * 1000:8.0f} ms  {ratio:5.2f}x   target {target:<8} {'ok' if ok else 'MISSED'}")
    return {
        "name": name,
        "seconds": value,
        "ratio": ratio,
        "target": target,
        "ok": ok,
        "baseline": against,
        "baseline_seconds": baseline,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--record", action="store_true", help="also record them: bench/results/benchmarks/local.json")
    args = parser.parse_args()
    # patcher's own bytecode, as an installed wheel has it (an editable install under
    # PYTHONDONTWRITEBYTECODE would compile every module on every run; the floor's libcst is
    # installed, compiled).
    import compileall

    for folder in ("patcher", "patches", "remote"):
        compileall.compile_dir(str(ROOT / folder), quiet=1)
    work = Path(tempfile.mkdtemp(prefix="patcher-bench-"))
    python = light_env(work)
    files = [site_file(python, rel) for rel in TARGETS]
    pristine = {path: path.read_bytes() for path in files}
    state = python.parent.parent / "share" / "patcher"

    def reset() -> None:
        for path, data in pristine.items():
            path.write_bytes(data)
        subprocess.run(["rm", "-rf", str(state)], check=True)

    results = []
    print(f"{'measure':<34} {'median':>11}  {'ratio':>6}")
    apply = [*PATCHER, "apply", "--python", str(python), "--no-verify", "--quiet"]
    # The codemods run every time: no transform cache (it would answer from an earlier run).
    cold = {**os.environ, "PATCHER_NO_TRANSFORM_CACHE": "1"}
    # The floor and the full apply alternate, so a drift of the machine's speed hits both alike.
    floors, fulls = [], []
    for _ in range(args.repeat):
        floors.append(once(floor_command(files)))
        fulls.append(once(apply, before=reset, env=cold))
    floor, full = statistics.median(floors), statistics.median(fulls)
    print(f"{'FLOOR: read + parse + codegen':<34} {floor * 1000:8.0f} ms  (baseline)")
    results.append(row("apply --no-verify (all patches)", full, floor, "<= 1.5x", full <= 1.5 * floor, FLOOR))
    # The same files met before (another environment, the next batch): transforms from the cache.
    cache = {**os.environ, "PATCHER_CACHE": tempfile.mkdtemp(prefix="patcher-bench-cache-")}
    reset()
    subprocess.run(apply, check=True, capture_output=True, env=cache)
    cached = timed(apply, args.repeat, before=reset, env=cache)
    results.append(row("apply, transforms cached", cached, floor, "(none)", True, FLOOR))
    reset()
    subprocess.run(apply, check=True, capture_output=True, env=cold)
    again = timed(apply, args.repeat, env=cold)
    results.append(row("apply again, nothing to do", again, floor, "<= 0.5x", again <= 0.5 * floor, FLOOR))

    bare = timed([sys.executable, "-c", "pass"], args.repeat * 2)
    print(f"{'BARE: python -c pass':<34} {bare * 1000:8.0f} ms  (baseline)")
    for flag in ("--version", "--help"):
        t = timed([*PATCHER, flag], args.repeat * 2)
        results.append(row(f"patcher {flag}", t, bare, "<= 2x", t <= 2 * bare, "python -c pass"))

    results += verification(args.repeat)
    record.write("local", results, args.json, args.record)
    return 0


def verification(repeat: int) -> list[dict]:
    """Verification against importing the patched modules themselves, in the demo environment."""
    from patcher.demo.environment import demo_env_dir, env_python, is_built

    env_dir = demo_env_dir()
    if not is_built(env_dir):
        print("verification: skipped (no demo environment; `patcher demo` builds it)")
        return []
    from patcher.demo.overlay import make_overlay

    target = make_overlay(env_python(env_dir), Path(tempfile.mkdtemp(prefix="patcher-bench-v-")) / "t")
    done = subprocess.run([*PATCHER, "apply", "--python", str(target), "--no-verify", "--quiet"])
    assert done.returncode == 0
    modules = [p.target.module for p in load_patches()]
    imports = [str(target), "-c", "".join(f"import {m}\n" for m in dict.fromkeys(modules))]
    baseline = timed(imports, repeat)
    print(f"{'IMPORTS: the patched modules':<34} {baseline * 1000:8.0f} ms  (baseline)")
    # The verifier itself, as apply runs it: the agent's verify operation in a fresh interpreter.
    from patcher.plan.planning import condition_names, target_files
    from patcher.plan.target_plan import plan_target
    from patcher.transport.local import LocalTransport

    with LocalTransport(str(target)) as transport:
        facts = transport.call(
            {
                "op": "facts",
                "names": condition_names(load_patches()),
                "files": target_files(p.spec() for p in load_patches()),
            }
        )
        plan = plan_target(facts, load_patches())
        spec = {"files": plan.verify_files, "import_prefixes": ["vllm"]}
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            answer = transport.call({"op": "verify", "spec": spec})
            times.append(time.perf_counter() - start)
            assert answer["ok"], answer
    verify = statistics.median(times)
    return [row("verification (fresh interpreter)", verify, baseline, "<= 1.10x", verify <= 1.10 * baseline, IMPORTS)]


if __name__ == "__main__":
    sys.exit(main())
