"""On the GPU machine: the captured states' transfer (v21 for speculators 0.3.0, v26 for 0.4.x) leaves
nothing behind and holds bounded memory, on CUDA, where the CPU tests cannot look (no pinning, no
streams there). Written for issue 42's second item, the copy of each step's captured rows into the
pinned buffer on a side stream: run it on the shipped transfer first (a baseline: it must pass
there too), then after that change. One release a call fits the device's 10 minutes (each check
starts vLLM once).

    python3 bench/gpu/transfer_check.py --stage /tmp/stage --run-dir /tmp/run --out "$OUT" \\
        [--release 0.26.0] [--speculators 0.3.0,0.4.0.1] [--checks probe,run,worker-error,sigint,loop,rpc-equal]
        [--calls 12] [--budget-s 540]

Under the machine's own python3 (its torch), from the checkout the device tool sends; the standard
library here. It installs the staged release with this checkout's patcher wheel (gpu_run.install),
applies every patch WITH verification, makes the tiny Llama (gpu_run.make_models), and for each
speculators release of --speculators (0.4.0.1: its wheel in --run-dir, `fetch.py --run-only
--speculators 0.4.0.1`; switched after a byte-checked rollback, as extract_gpu.py does) runs:
- probe: --calls generate() calls in one generator, the sizes alternating small and large (the
  buffer made, reused, remade larger, then reused), each result checked whole, in order and owning
  its storage; after every call: no transfer file (speculators-states-*) left in /dev/shm or the
  temp folder; the transfer's mappings in the generator's and the worker's /proc/PID/maps (one
  each once the call is over: an old buffer unmapped when a larger one is made); the worker's
  torch.cuda.memory_allocated() back to where it was after the first call of that size (nothing
  of a call, no staging copy or event, kept on the device); whether the worker's buffer is pinned;
  anything the worker keeps of a call for its side-stream copies (_speculators_steps, attributes
  named _speculators_stag*: none once the call is over); that a pinned buffer was written on the
  side stream (the worker's _speculators_copy_stream); the summed Pss of the generator and its workers (bench/extract.py's
  HostMemory): no growth after the largest call. After shutdown: the worker's process is gone,
  nvidia-smi lists none of the probe's processes, no transfer file is left;
- run, worker-error, sigint, loop: tests/support/shared_states_driver.py's situations (the CPU
  suite's, tests/test_patch_v21_shared_states.py and test_patch_v26_...), on the GPU: three calls each owning
  its storage and valid after the generator is gone; an exception in the worker inside the
  transfer; a SIGINT before the request, while the caller waits, after the reply; Ctrl-C in a loop
  of calls; after each, no transfer file and no new /dev/shm entry (tests/support/shared_states.py's
  Leftovers);
- rpc-equal: the run's first call again with the transfer patch left out (`patcher apply --skip
  v21` / v26: vLLM's RPC queue), compared bit for bit (the same device tensors copied two ways).
Everything goes to $OUT/transfer-check.json (each check's verdict and figures) and $OUT/log.txt;
exit 0 when every check passed and every rollback was byte-identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import gpu_run  # noqa: E402  (beside this file)

CHECKS = ("probe", "run", "worker-error", "sigint", "loop", "rpc-equal")
WRITE_PATCH = {"0.3.0": "v21", "0.4.0.1": "v26"}
MAPPED = re.compile(r"speculators-states-")
PROBE_REPORT = "TRANSFER-PROBE "


# --- inside the target interpreter: the probe --------------------------------------------------


def worker_state(worker) -> dict:
    """In the worker (collective_rpc sends it by value): what it holds for the transfer now."""
    import os

    import torch

    inner = getattr(worker, "worker", None)
    worker = inner if inner is not None and hasattr(inner, "_reset_capture") else worker
    buffer = getattr(worker, "_speculators_shared_states", None) or {}
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1] for line in maps}
    staging = {
        name: (len(value) if hasattr(value, "__len__") else repr(value)[:80])
        for name, value in vars(worker).items()
        if name.startswith(("_speculators_stag", "_speculators_steps")) and value is not None
    }
    return {
        "pid": os.getpid(),
        "cuda_allocated": torch.cuda.memory_allocated() if torch.cuda.is_available() else None,
        "cuda_reserved": torch.cuda.memory_reserved() if torch.cuda.is_available() else None,
        "buffer_bytes": buffer.get("size"),
        "pinned": buffer.get("pinned"),
        "mappings": sorted(path for path in mapped if "speculators-states-" in path),
        "captured_left": getattr(worker, "_captured_states", None) is not None,
        "staging": staging,
        "copy_stream": getattr(worker, "_speculators_copy_stream", None) is not None,
    }


def transfer_files() -> list[str]:
    import tempfile

    folders = {"/dev/shm", tempfile.gettempdir()}
    return sorted(
        os.path.join(folder, name)
        for folder in folders
        if os.path.isdir(folder)
        for name in os.listdir(folder)
        if name.startswith("speculators-states-")
    )


def own_mappings() -> list[str]:
    with open("/proc/self/maps") as maps:
        return sorted({line.split(None, 5)[-1].strip() for line in maps if MAPPED.search(line)})


def probe(model: str, calls: int) -> dict:
    import random

    import torch
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    spec = importlib.util.spec_from_file_location("extract_bench", HERE.parent / "extract.py")
    assert spec is not None and spec.loader is not None
    extract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extract)

    rng = random.Random(42)
    sizes = [(8, 64), (32, 1000), (8, 64), (32, 1000), (48, 1000), (8, 64), (48, 1000)]  # (prompts, tokens)
    generator = VllmHiddenStatesGenerator(model, layer_ids=[0, 2, 3], max_model_len=1024, gpu_memory_utilization=0.3)
    report: dict = {"calls": [], "problems": []}
    # v21's writes while stepping (speculators 0.3.0): a pinned buffer is written on a side stream
    stepping = hasattr(sys.modules[VllmHiddenStatesGenerator.__module__], "_states_while_stepping")
    settled: dict = {}  # prompts of a size -> the worker's device memory after its first call
    largest_pss = 0
    for number in range(calls):
        count, length = sizes[number % len(sizes)]
        batch = [[rng.randrange(3, 512) for _ in range(rng.randint(length // 2, length))] for _ in range(count)]
        results = generator.generate(batch)
        whole = extract.whole_each(batch, results)
        owned = all(
            h.untyped_storage().nbytes() == h.numel() * h.element_size() for r in results for h in r["hidden_states"]
        )
        result_bytes = sum(h.numel() * h.element_size() for r in results for h in r["hidden_states"])
        del results
        state = generator.executor.collective_rpc(worker_state, unique_reply_rank=0)
        state = state[0] if isinstance(state, list) else state
        pss = extract.HostMemory.now()
        seen = {
            "prompts": count,
            "result_mib": round(result_bytes / 2**20, 1),
            "whole": sum(whole),
            "own_storage": owned,
            "files": transfer_files(),
            "generator_mappings": own_mappings(),
            "worker": state,
            "pss_mib": round(pss / 2**20, 1),
        }
        report["calls"].append(seen)
        problems = []
        if sum(whole) != count or not owned:
            problems.append("a result not whole, out of order, or not owning its storage")
        if seen["files"]:
            problems.append(f"transfer files left: {seen['files']}")
        if len(seen["generator_mappings"]) > 1 or len(state["mappings"]) > 1:
            problems.append("more than one transfer buffer mapped after the call")
        if state["captured_left"] or state["staging"]:
            problems.append(f"the worker keeps a call's states or staging: {state['staging']}")
        if state["pinned"] and stepping and not state["copy_stream"]:
            problems.append("a pinned buffer but no side stream: the steps' copies did not run on it")
        allocated = state["cuda_allocated"]
        if count in settled and allocated is not None and abs(allocated - settled[count]) > 2**20:
            problems.append(f"device memory {allocated} after a call of {count}, {settled[count]} after the first")
        settled.setdefault(count, allocated)
        if number >= len(sizes) and pss > largest_pss + 64 * 2**20:
            problems.append(f"host memory grew after every size was seen: {pss >> 20} MiB > {largest_pss >> 20} MiB")
        largest_pss = max(largest_pss, pss) if number < len(sizes) else largest_pss
        report["problems"] += [f"call {number + 1}: {p}" for p in problems]
    report["pinned"] = report["calls"][-1]["worker"]["pinned"]
    worker_pid = report["calls"][-1]["worker"]["pid"]
    generator.executor.shutdown()
    del generator
    import gc

    gc.collect()
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{worker_pid}") and time.monotonic() < deadline:
        time.sleep(0.5)
    report["worker_gone"] = not os.path.exists(f"/proc/{worker_pid}")
    report["files_after_shutdown"] = transfer_files()
    report["generator_mappings_after_shutdown"] = own_mappings()
    report["worker_pid"] = worker_pid
    if not report["worker_gone"]:
        report["problems"].append(f"the worker {worker_pid} is still there a minute after shutdown")
    if report["files_after_shutdown"] or report["generator_mappings_after_shutdown"]:
        report["problems"].append("a transfer file or mapping left after shutdown")
    report["cuda"] = torch.cuda.is_available()
    report["ok"] = not report["problems"]
    return report


# --- the orchestrator (the machine's python3, standard library) --------------------------------


def gpu_processes() -> list[int]:
    """The processes nvidia-smi lists on the GPUs (none where there is no nvidia-smi: a CPU rehearsal)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return []
    return [int(x) for x in done.stdout.split() if x.strip().isdigit()] if done.returncode == 0 else []


class Checks:
    def __init__(self, args, run, installed, extract_gpu, patcher: list[str] | None = None) -> None:
        self.args, self.run, self.installed, self.extract_gpu = args, run, installed, extract_gpu
        self.patcher = patcher or [sys.executable, "-m", "patcher.cli"]  # the install's own
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict = run.summary.setdefault("checks", {})

    def record(self, name: str, verdict: dict) -> None:
        self.results[name] = verdict
        said = (
            "passed" if verdict.get("ok") else f"skipped ({verdict['skipped']})" if "skipped" in verdict else "FAILED"
        )
        self.run.say(f"   {name}: {said}")
        self.run.save()
        (self.args.out / "transfer-check.json").write_text(json.dumps(self.results, indent=1, sort_keys=True) + "\n")

    def probe(self, release: str) -> None:
        before = set(gpu_processes())
        done = self.run.step(
            f"probe-{release}",
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--probe",
                str(gpu_run.MODEL),
                "--calls",
                str(self.args.calls),
            ],
            timeout=int(max(60, min(600, self.deadline - time.monotonic()))),
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith(PROBE_REPORT)]
        report = json.loads(lines[-1][len(PROBE_REPORT) :]) if lines else {"ok": False, "error": done.stderr[-2000:]}
        time.sleep(2)
        left = sorted(set(gpu_processes()) - before)
        report["gpu_processes_left"] = left
        report["ok"] = bool(report.get("ok")) and not left
        self.record(f"probe-{release}", report)

    def driver(self, release: str, mode: str, dump: Path | None = None) -> None:
        from tests.support.shared_states import Leftovers, drive

        extra = ("--dump", str(dump)) if dump else ()
        with Leftovers() as left:
            report = drive(Path(sys.executable), gpu_run.MODEL, mode, *extra)
        report.pop("stderr", None)
        report["files_left"], report["shm_left"] = sorted(left.new_files), sorted(left.new_shm)
        report["ok"] = bool(report.get("ok")) and not left.new_files and not left.new_shm
        self.record(f"{mode}-{release}", report)

    def loop(self, release: str) -> None:
        from tests.support.shared_states import interrupt_a_loop

        outcome = interrupt_a_loop(Path(sys.executable), gpu_run.MODEL)
        left = outcome.pop("left")
        verdict = {
            "calls": len(outcome["calls"]),
            "exit": outcome["code"],
            "files_left": sorted(left.new_files),
            "shm_left": sorted(left.new_shm),
        }
        verdict["ok"] = outcome["code"] not in (0, None) and not left.new_files and not left.new_shm
        self.record(f"loop-{release}", verdict)

    def rpc_equal(self, release: str, with_dump: Path) -> None:
        from tests.support.shared_states import drive, equal_in_target

        bench = self.extract_gpu.extract.Bench(sys.executable, self.patcher, self.args.out, self.run.env, self.run.say)
        without = self.args.out / f"without-{release}.pt"
        with bench.without(WRITE_PATCH[release]):
            report = drive(Path(sys.executable), gpu_run.MODEL, "run", "--dump", str(without))
        compared = equal_in_target(Path(sys.executable), with_dump, without) if report.get("ok") else {}
        verdict = {"rpc_run_ok": report.get("ok"), "transfer": report.get("transfer"), **compared}
        verdict["ok"] = bool(report.get("ok")) and bool(compared.get("bit_equal")) and bool(compared.get("same_count"))
        self.record(f"rpc-equal-{release}", verdict)
        for path in (with_dump, without):
            path.unlink(missing_ok=True)

    def release(self, release: str, checks: list[str]) -> None:
        dump = self.args.out / f"with-{release}.pt"
        for check in checks:
            if self.deadline - time.monotonic() < 60:
                self.record(f"{check}-{release}", {"ok": False, "skipped": "out of time"})
                continue
            if check == "probe":
                self.probe(release)
            elif check == "run":
                self.driver(release, "run", dump)
            elif check in ("worker-error", "sigint"):
                self.driver(release, check)
            elif check == "loop":
                self.loop(release)
            elif check == "rpc-equal" and dump.is_file():
                self.rpc_equal(release, dump)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # inside the target: the model folder
    parser.add_argument("--calls", type=int, default=12, help="generate() calls of the probe (default 12)")
    parser.add_argument("--stage", type=Path)
    parser.add_argument("--release", help="which staged release (default: the only one staged)")
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--speculators", default="0.3.0,0.4.0.1", help="the releases checked, in order")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"which of {', '.join(CHECKS)} (default all)")
    parser.add_argument("--budget-s", type=float, default=540, help="no check starts after this (default 540 s)")
    parser.add_argument("--work", type=Path, default=Path("/tmp"), help="where site/, wheels/, the model go (/tmp)")
    args = parser.parse_args()
    if args.probe:
        try:
            report = probe(args.probe, args.calls)
        except Exception as error:  # the failure is the report  # noqa: BLE001
            import traceback

            traceback.print_exc()
            report = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:2000]}"}
        print("\n" + PROBE_REPORT + json.dumps(report), flush=True)
        os._exit(0 if report.get("ok") else 1)
    checks = [c for c in args.checks.split(",") if c]
    releases = [r for r in args.speculators.split(",") if r]
    unknown = [c for c in checks if c not in CHECKS] + [r for r in releases if r not in WRITE_PATCH]
    if unknown or not (args.stage and args.run_dir and args.out):
        print(f"unknown {unknown}, or --stage/--run-dir/--out missing", file=sys.stderr)
        return 2
    import extract_gpu

    gpu_run.SITE, gpu_run.WHEELS, gpu_run.MODEL = args.work / "site", args.work / "wheels", args.work / "model"
    args.out.mkdir(parents=True, exist_ok=True)
    run = gpu_run.Run(args.out)
    os.environ.update(run.env)  # the driver's processes (tests/support/shared_states.py) inherit it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not gpu_run.install(run, args.stage, args.release, args.run_dir, None):
        return 1
    installed = extract_gpu.Installed(run, "0.3.0")
    checker = Checks(args, run, installed, extract_gpu)
    try:
        if not installed.apply() or not gpu_run.make_models(run, ["llama"], args.run_dir):
            return 1
        for release in releases:
            if release != installed.version:
                wheel = extract_gpu.wheel_of(args.run_dir if release != "0.3.0" else gpu_run.WHEELS, release)
                if wheel is None or not installed.replace_with(release, wheel) or not installed.apply():
                    checker.record(f"install-{release}", {"ok": False, "wheel": str(wheel)})
                    continue
            checker.release(release, checks)
    finally:
        installed.rollback()
        run.summary["rollback_identical"] = all(r["identical"] for r in run.summary.get("rollbacks", [{}]))
        run.save()
    ok = run.summary["rollback_identical"] and all(v.get("ok") for v in checker.results.values())
    run.say(
        f"transfer check: {'passed' if ok else 'FAILED'}; rollback byte-identical: {run.summary['rollback_identical']}"
    )
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM starts its workers with spawn
    sys.exit(main())
