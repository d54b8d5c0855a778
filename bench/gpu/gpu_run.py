"""On the GPU machine: install one release's wheels, patch, check end to end at TP 1 and 2, roll back.

    python3 gpu_run.py --stage /tmp/stage --out "$OUT" [--release 0.20.0] [--tp 1,2] [--leave-out v18]

Runs under the machine's own python3 (its torch, CUDA build); standard library only. Steps, each
timed, each result written under --out (at most 8 files come back from the device tool):
1. join the staged parts (manifest.json from fetch.py), check every wheel's sha256;
2. `pip install --no-index --no-deps --target /tmp/site` (PYTHONPATH=/tmp/site for what follows:
   where the wheels were installed, the only variable the run sets besides the machine's own);
3. make the tiny model (patcher/demo/tiny_model.py), random weights, no download;
4. `patcher status`, then `patcher apply` WITH verification: exit 0 required, no hand edit;
5. the end-to-end check of tests/test_e2e_vllm.py (patcher/demo/extract.py: four generate() calls,
   hidden states against transformers) at each tensor parallel size;
6. `patcher rollback`: every target file's sha256 must equal its pristine one (and speculators' RECORD);
7. optionally the check with one patch left out (`--leave-out v18`: the fork failure), rolled back again.
summary.json holds every figure; the last lines printed are a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SITE = Path("/tmp/site")
WHEELS = Path("/tmp/wheels")
MODEL = Path("/tmp/model")
HERE = Path(__file__).resolve().parent


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Run:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.summary: dict = {"steps": {}, "ok": False}
        self.log = (out / "log.txt").open("a")
        self.env = dict(os.environ, PYTHONPATH=str(SITE), PYTHONUNBUFFERED="1")
        self.env.setdefault("NCCL_NVLS_ENABLE", "0")  # the device's rule: NVLink multicast stays off

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def step(
        self, name: str, command: list[str], env: dict | None = None, timeout: int = 900
    ) -> subprocess.CompletedProcess:
        self.say(f"== {name}: {' '.join(command)}")
        started = time.monotonic()
        try:
            # Out of the device tool's checkout: there `python3 -m patcher.cli` would import the
            # source folder patcher/ (no patcher.remote in it) instead of the installed wheel.
            done = subprocess.run(
                command, capture_output=True, text=True, env=env or self.env, timeout=timeout, cwd=tempfile.gettempdir()
            )
        except subprocess.TimeoutExpired as error:
            done = subprocess.CompletedProcess(command, 124, error.stdout or "", (error.stderr or "") + "\ntimed out")
        seconds = time.monotonic() - started
        self.summary["steps"][name] = {"exit": done.returncode, "seconds": round(seconds, 1)}
        self.log.write(f"-- stdout\n{done.stdout[-20000:]}\n-- stderr\n{done.stderr[-20000:]}\n")
        self.log.flush()
        self.say(f"   exit {done.returncode} in {seconds:.1f}s")
        self.save()
        return done

    def save(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, sort_keys=True) + "\n")


def join_wheels(stage: Path, release: str | None, run: Run) -> list[Path]:
    manifest = json.loads((stage / "manifest.json").read_text())
    releases = manifest["releases"]
    if release is None and len(releases) == 1:
        release = next(iter(releases))
    if release not in releases:
        sys.exit(f"--release: name one of {', '.join(sorted(releases))} (the releases staged)")
    started = time.monotonic()
    WHEELS.mkdir(parents=True, exist_ok=True)
    joined = []
    for name in releases[release]:
        entry = manifest["wheels"][name]
        target = WHEELS / name
        with target.open("wb") as out:
            for part in entry["parts"]:
                source = stage / part
                if not source.is_file():
                    sys.exit(f"missing part {source}: stage every folder of fetch.py's output first")
                with source.open("rb") as fh:
                    shutil.copyfileobj(fh, out)
        if sha256(target) != entry["sha256"]:
            sys.exit(f"{name}: sha256 differs from the manifest (a part is damaged or from another fetch)")
        joined.append(target)
    run.summary["release"] = release
    run.summary["steps"]["join"] = {"exit": 0, "seconds": round(time.monotonic() - started, 1), "wheels": len(joined)}
    run.say(f"joined and checked {len(joined)} wheels")
    return joined


def install(run: Run, stage: Path, release: str | None, run_dir: Path) -> bool:
    """Join and check the staged wheels, then install them and run_dir's patcher wheel into SITE."""
    wheels = join_wheels(stage, release, run)
    wheels += sorted(run_dir.glob("patcher-*.whl"))  # this checkout's patcher, carried with the script
    if SITE.exists():
        shutil.rmtree(SITE)
    done = run.step(
        "install",
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--disable-pip-version-check",
            "--target",
            str(SITE),
            *map(str, wheels),
        ],
    )
    if done.returncode != 0:
        run.say(done.stderr[-3000:])
    return done.returncode == 0


def patcher_json(run: Run, name: str, *args: str) -> tuple[int, dict | None]:
    done = run.step(name, [sys.executable, "-m", "patcher.cli", *args, "--python", sys.executable, "--json"])
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        return done.returncode, None


def target_hashes(doc: dict | None) -> dict[str, str]:
    """sha256 of every file a patch targets, read from disk (the paths come from patcher's report)."""
    out = {}
    for patch in (doc or {}).get("targets", [{}])[0].get("patches", []):
        path = SITE / patch["file"]
        if path.is_file():
            out[patch["file"]] = sha256(path)
    return out


def pristine_matches_record(pristine: dict[str, str]) -> bool:
    """Are the files rollback restored the ones pip installed (the sha256 in speculators' RECORD)?"""
    import base64

    record = {}
    for info in SITE.glob("speculators-*.dist-info"):
        for line in (info / "RECORD").read_text().splitlines():
            path, digest, _ = line.rsplit(",", 2)
            if digest.startswith("sha256="):
                raw = digest[len("sha256=") :]
                record[path] = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
    return bool(pristine) and all(record.get(path) == digest for path, digest in pristine.items())


def extract(run: Run, label: str, tp: int, calls: str = "all", timeout: int = 420) -> dict:
    report_path = run.out / f"e2e-{label}.json"
    env = dict(run.env)
    if tp > 1:
        # The device runs with NVLink multicast off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1), which
        # vLLM's symmetric-memory all-reduce needs: a rule of this machine, not of the patches.
        env.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
    command = [
        sys.executable,
        str(SITE / "patcher" / "demo" / "extract.py"),
        "--model",
        str(MODEL),
        "--calls",
        calls,
        "--tensor-parallel-size",
        str(tp),
        "--report",
        str(report_path),
    ]
    done = run.step(f"e2e-{label}", command, env=env, timeout=timeout)
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError):
        lines = (done.stdout or "").strip().splitlines()
        report = (
            json.loads(lines[-1])
            if lines and lines[-1].startswith("{")
            else {"ok": False, "error": {"message": done.stderr[-2000:]}}
        )
    # Keep what comes back small: the per-prompt rows stay in the file, the summary keeps figures.
    error = report.get("error") or {}
    run.summary["steps"][f"e2e-{label}"].update(
        ok=report.get("ok"),
        tensor_parallel_size=tp,
        max_rel_diff=report.get("max_rel_diff"),
        max_abs_diff=report.get("max_abs_diff"),
        prompts_ok=report.get("prompts_ok"),
        prompts_checked=report.get("prompts_checked"),
        timings=report.get("timings"),
        error=f"{error.get('type')}: {error.get('message', '')[:300]} ({error.get('phase')} at {error.get('where')})"
        if error
        else None,
    )
    run.save()
    return report


def run_check(run: Run, key: str, step: str) -> None:
    """patcher's own run check (remote/runcheck.py) in this CUDA target: its verdict and figures."""
    checked, verified = patcher_json(run, step, "verify", "--run")
    target = (verified or {}).get("targets", [{}])[0]
    check = target.get("run_check") or {}
    run.summary[key] = {
        "exit": checked,
        "message": target.get("message"),
        **{
            k: check.get(k)
            for k in (
                "ok",
                "device",
                "max_rel_diff",
                "whole_and_in_order",
                "prompts",
                "prompts_ok",
                "problems",
                "cannot_run",
                "timings",
                "peak_rss_mib",
            )
        },
    }
    run.say(f"{key}: exit {checked}, {run.summary[key]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=Path, required=True, help="folder holding manifest.json and the staged folders")
    parser.add_argument("--release", help="which staged release to install (default: the only one staged)")
    parser.add_argument(
        "--run-dir", type=Path, default=HERE, help="folder holding the patcher wheel (default: this script's)"
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-out")))
    parser.add_argument(
        "--tp", default="1,2", help="tensor parallel sizes to check (default 1,2; those over the GPU count are skipped)"
    )
    parser.add_argument(
        "--leave-out", default="", help="then check with this patch left out (e.g. v18), and roll back again"
    )
    parser.add_argument(
        "--run-check", action="store_true", help="also `patcher verify --run` once applied (the run check, on CUDA)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out)
    started = time.monotonic()

    import torch  # the machine's own

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    run.summary["machine"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpus": gpus,
        "gpu_name": torch.cuda.get_device_name(0) if gpus else None,
    }
    run.say(f"machine: {run.summary['machine']}")

    if not install(run, args.stage, args.release, args.run_dir):
        return 1
    if MODEL.exists():
        shutil.rmtree(MODEL)
    done = run.step("tiny-model", [sys.executable, str(SITE / "patcher" / "demo" / "tiny_model.py"), str(MODEL)])
    if done.returncode != 0:
        run.say(done.stderr[-3000:])
        return 1

    code, status = patcher_json(run, "status", "status")
    target = (status or {}).get("targets", [{}])[0]
    run.summary["versions"] = target.get("versions")
    pristine = target_hashes(status)
    run.summary["pristine"] = pristine

    code, applied = patcher_json(run, "apply", "apply")
    states = {p["id"]: p["state"] for p in (applied or {}).get("targets", [{}])[0].get("patches", [])}
    run.summary["patches"] = states
    run.summary["apply_ok"] = code == 0
    if code != 0:
        run.say(f"apply failed (exit {code}): {(applied or {}).get('targets', [{}])[0].get('message')}")

    results = {}
    if code == 0:
        for tp in [int(x) for x in args.tp.split(",") if x]:
            if tp > gpus:
                run.say(f"tensor parallel {tp}: skipped, {gpus} GPU(s) here")
                run.summary["steps"][f"e2e-tp{tp}"] = {"skipped": f"{gpus} GPU(s)"}
                continue
            results[tp] = extract(run, f"tp{tp}", tp).get("ok")

    if args.run_check and code == 0:
        run_check(run, "run_check", "verify-run")

    code_back, _ = patcher_json(run, "rollback", "rollback")
    after = {path: sha256(SITE / path) for path in pristine}
    run.summary["rollback_identical"] = code_back == 0 and after == pristine and bool(pristine)
    run.summary["pristine_matches_record"] = pristine_matches_record(pristine)

    if args.leave_out and code == 0:
        # The symptom the left-out patch answers, on this machine; then back to pristine again.
        left, _ = patcher_json(run, f"apply-without-{args.leave_out}", "apply", "--skip", args.leave_out)
        if left == 0 and args.run_check:
            # the run check must catch the half-patched state on CUDA too
            run_check(run, f"run_check_without_{args.leave_out}", f"verify-run-without-{args.leave_out}")
        elif left == 0:
            extract(run, f"without-{args.leave_out}", 1, calls="1", timeout=300)
        again, _ = patcher_json(run, "rollback-again", "rollback")
        identical = again == 0 and {path: sha256(SITE / path) for path in pristine} == pristine
        run.summary["rollback_identical"] = run.summary["rollback_identical"] and identical

    run.summary["results"] = results
    checked = run.summary.get("run_check", {}).get("ok") if args.run_check else None
    ran = bool(results) or checked is not None  # `--tp ""` with --run-check: the run check alone
    run.summary["ok"] = bool(
        run.summary["apply_ok"]
        and ran
        and all(results.values())
        and checked is not False
        and run.summary["rollback_identical"]
    )
    run.summary["minutes"] = round((time.monotonic() - started) / 60, 2)
    run.save()

    run.say("\nrelease | GPUs | TP | patches applied | verdict | largest rel. error | minutes")
    applied_ids = ",".join(p.split("-")[0] for p, s in states.items() if s == "applied")
    for tp, ok in results.items():
        step = run.summary["steps"][f"e2e-tp{tp}"]
        run.say(
            f"{run.summary['release']} | {gpus} | {tp} | {applied_ids} | {'match' if ok else 'FAIL'} | "
            f"{step.get('max_rel_diff')} | {step['seconds'] / 60:.1f}"
        )
    run.say(
        f"rollback byte-identical: {run.summary['rollback_identical']}; all ok: {run.summary['ok']}; "
        f"{run.summary['minutes']} min in all"
    )
    return 0 if run.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
