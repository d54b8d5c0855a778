"""On the GPU machine: install one release's wheels, patch, check end to end at TP 1 and 2, roll back.

    python3 gpu_run.py --stage /tmp/stage --out "$OUT" [--release 0.20.0] [--tp 1,2] [--leave-out v18]
    python3 gpu_run.py --stage /tmp/stage --out "$OUT" --models deepseek-v3,kimi-k25,kimi-k25-int4 \
        --tp 1 --parallel 3 --noise --leave-out v20      # the DeepSeek-V3 / Kimi-K2.5 family

Runs under the machine's own python3 (its torch, CUDA build); standard library only. Steps, each
timed, each result written under --out (at most 8 files come back from the device tool):
1. join the staged parts (manifest.json from fetch.py), check every wheel's sha256;
2. `pip install --no-index --no-deps --target /tmp/site` (PYTHONPATH=/tmp/site for what follows:
   where the wheels were installed, the only variable the run sets besides the machine's own);
3. make the tiny models (--models: llama, patcher/run_check/tiny_model.py; deepseek-v3, kimi-k25,
   kimi-k25-int4, workbench/tiny_moe.py, which fetch.py carries in the run folder), random weights,
   no download;
4. `patcher status`, then `patcher apply` WITH verification: exit 0 required, no hand edit;
5. the end-to-end check of tests/test_e2e_vllm.py (patcher/run_check/extract.py: five generate() calls,
   hidden states against transformers) for each model at each tensor parallel size, --parallel of
   them at once on the same GPUs (each vLLM takes a tenth of the memory); --noise adds
   transformers' own bfloat16-vs-float32 band on the same prompts;
6. `patcher rollback`: every target file's sha256 must equal its pristine one (and speculators' RECORD);
7. optionally the check with one patch left out (`--leave-out v18`: the fork failure; `v20` for the
   Kimi-K2.5 wrappers; a comma list runs each in turn), each model's first call (`--leave-out-calls`
   names others: 3 for v28's long batch), rolled back again.
`--speculators 0.4.0.1` installs that release (its wheel in the run folder: fetch.py --speculators)
instead of the staged one; the rest of the staging is unchanged (0.4's generator path imports
nothing 0.3.0's does not).
summary.json holds every figure; the last lines printed are a table. What comes back stays within
the device tool's 8 files: summary.json, log.txt, one e2e-*.json per model and size (the Llama's keep
their old names, e2e-tp1.json), and without-<patch>.json with the leave-one-out reports of all models.
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
MODEL = Path("/tmp/model")  # the tiny Llama; the others under MODELS/<name>
MODELS = Path("/tmp/models")
EXTRA = Path("/tmp/gpu-extra")  # reports that do not come back as files of their own
HERE = Path(__file__).resolve().parent
# Wheels into SITE as carried: no index (the machine has no network), no dependencies (each list is whole)
PIP_INSTALL = (
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
)
MOE_KINDS = ("deepseek-v3", "kimi-k25", "kimi-k25-int4")


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


def install(run: Run, stage: Path, release: str | None, run_dir: Path, speculators: str | None) -> bool:
    """Join and check the staged wheels, then install them and run_dir's patcher wheel into SITE
    (and run_dir's speculators wheel instead of the staged one, where --speculators names it)."""
    wheels = join_wheels(stage, release, run)
    wheels += sorted(run_dir.glob("patcher-*.whl"))  # this checkout's patcher, carried with the script
    if speculators:
        chosen = sorted(run_dir.glob(f"speculators-{speculators}-*.whl"))
        if not chosen:
            sys.exit(f"--speculators {speculators}: no such wheel in {run_dir} (fetch.py --speculators {speculators})")
        wheels = [w for w in wheels if not w.name.startswith("speculators-")] + chosen
    run.summary["speculators"] = speculators or "staged"
    if SITE.exists():
        shutil.rmtree(SITE)
    done = run.step(
        "install",
        [
            *PIP_INSTALL,
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


def model_dir(name: str) -> Path:
    return MODEL if name == "llama" else MODELS / name


def runner_name(runner: str | None) -> str:
    """V1 or V2 for the table, from the runner's module (the class name is GPUModelRunner in both)."""
    if not runner:
        return "-"
    return "V2" if ".worker.gpu.model_runner." in runner else "V1" if "_model_runner." in runner else runner


def e2e_label(name: str, tp: int) -> str:
    return f"tp{tp}" if name == "llama" else f"{name}-tp{tp}"


class Extraction:
    """One extract.py process (started at once, collected by finish())."""

    def __init__(self, run: Run, label: str, model: Path, tp: int, calls: str, report_dir: Path, options) -> None:
        self.run, self.label, self.tp = run, label, tp
        self.report_path = report_dir / f"e2e-{label}.json"
        env = dict(run.env)
        if tp > 1:
            # The device runs with NVLink multicast off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1), which
            # vLLM's symmetric-memory all-reduce needs: a rule of this machine, not of the patches.
            env.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
        command = [
            sys.executable,
            str(SITE / "patcher" / "run_check" / "extract.py"),
            "--model",
            str(model),
            "--calls",
            calls,
            "--tensor-parallel-size",
            str(tp),
            "--report",
            str(self.report_path),
            "--reference-device",
            options.reference_device,
        ]
        if options.noise and calls == "all":
            command.append("--noise")
        self.timeout = options.timeout if calls == "all" else min(options.timeout, 300)
        run.say(f"== e2e-{label}: {' '.join(command)}")
        self.started = time.monotonic()
        self.stdout = (EXTRA / f"{label}.out").open("w+")
        self.process = subprocess.Popen(
            command, stdout=self.stdout, stderr=subprocess.STDOUT, text=True, env=env, cwd=tempfile.gettempdir()
        )

    def finish(self) -> dict:
        run = self.run
        try:
            code = self.process.wait(timeout=max(1.0, self.timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = 124
        seconds = time.monotonic() - self.started
        self.stdout.seek(0)
        output = self.stdout.read()
        self.stdout.close()
        run.log.write(f"-- e2e-{self.label} output (last 20000 characters)\n{output[-20000:]}\n")
        run.say(f"   e2e-{self.label}: exit {code} in {seconds:.1f}s")
        try:
            report = json.loads(self.report_path.read_text())
        except (OSError, ValueError):
            lines = output.strip().splitlines()
            report = (
                json.loads(lines[-1])
                if lines and lines[-1].startswith("{")
                else {"ok": False, "error": {"message": output[-2000:] + ("\ntimed out" if code == 124 else "")}}
            )
        # Keep what comes back small: the per-prompt rows stay in the file, the summary keeps figures.
        error = report.get("error") or {}
        run.summary["steps"][f"e2e-{self.label}"] = {
            "exit": code,
            "seconds": round(seconds, 1),
            "ok": report.get("ok"),
            "tensor_parallel_size": self.tp,
            # the runner vLLM picked for the workers (V1: vllm.v1.worker.gpu_model_runner; Model
            # Runner V2: vllm.v1.worker.gpu.model_runner), as the driver read it from them
            "model_runner": report.get("model_runner"),
            "max_rel_diff": report.get("max_rel_diff"),
            "median_rel_diff": report.get("median_rel_diff"),
            "median_tolerance": report.get("median_tolerance"),
            "median_ok": report.get("median_ok"),
            "noise": report.get("noise"),
            "max_abs_diff": report.get("max_abs_diff"),
            "prompts_ok": report.get("prompts_ok"),
            "prompts_checked": report.get("prompts_checked"),
            "timings": report.get("timings"),
            "error": f"{error.get('type')}: {error.get('message', '')[:300]} ({error.get('phase')} at {error.get('where')})"
            if error
            else None,
        }
        run.save()
        return report


def extract_all(run: Run, jobs: list[tuple[str, Path, int]], calls: str, report_dir: Path, options) -> dict:
    """Run extract.py for every (label, model, tp), options.parallel at a time; {label: report}."""
    EXTRA.mkdir(parents=True, exist_ok=True)
    reports: dict[str, dict] = {}
    pending = list(jobs)
    running: list[Extraction] = []
    while pending or running:
        while pending and len(running) < max(1, options.parallel):
            label, model, tp = pending.pop(0)
            running.append(Extraction(run, label, model, tp, calls, report_dir, options))
            if pending:
                time.sleep(3)  # vLLM picks free ports at start: do not start two in the same instant
        done = running.pop(0)
        reports[done.label] = done.finish()
    return reports


def tiny_moe_script(run_dir: Path) -> Path:
    """workbench/tiny_moe.py: fetch.py's copy in the run folder (beside the patcher wheel; a copy of
    that folder, /tmp/run, has no checkout around it), else the checkout's around this file."""
    carried = run_dir / "tiny_moe.py"
    return carried if carried.is_file() else HERE.parent.parent / "workbench" / "tiny_moe.py"


def make_models(run: Run, names: list[str], run_dir: Path) -> bool:
    tiny_model = SITE / "patcher" / "run_check" / "tiny_model.py"
    for name in names:
        target = model_dir(name)
        if target.exists():
            shutil.rmtree(target)
        if name == "llama":
            command = [sys.executable, str(tiny_model), str(target)]
        else:
            command = [sys.executable, str(tiny_moe_script(run_dir)), name, str(target), str(tiny_model)]
        done = run.step("tiny-model" if name == "llama" else f"tiny-{name}", command)
        if done.returncode != 0:
            run.say(done.stderr[-3000:])
            return False
    return True


def run_check(run: Run, key: str, step: str) -> None:
    """patcher's own run check (remote/run_check_driver.py) in this CUDA target: its verdict and figures."""
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


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


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
        "--leave-out",
        default="",
        help="then check with this patch left out (e.g. v18; a comma list: each in turn), and roll back again",
    )
    parser.add_argument(
        "--leave-out-calls",
        default="1",
        help="the generate() calls each leave-one-out runs (extract.py --calls; default 1: the first; "
        "3 for a symptom the long batch shows, as v28's)",
    )
    parser.add_argument(
        "--speculators",
        metavar="VERSION",
        help="install this speculators release from --run-dir (fetch.py --speculators)",
    )
    parser.add_argument(
        "--run-check", action="store_true", help="also `patcher verify --run` once applied (the run check, on CUDA)"
    )
    parser.add_argument(
        "--models",
        default="llama",
        help=f"tiny models to check, comma-separated: llama, {', '.join(MOE_KINDS)} (default llama)",
    )
    parser.add_argument("--parallel", type=int, default=1, help="extractions run at once (default 1)")
    parser.add_argument("--noise", action="store_true", help="measure transformers' own bf16-vs-fp32 band too")
    parser.add_argument(
        "--reference-device", default="cpu", help="where transformers' reference runs: cpu (default) or cuda"
    )
    parser.add_argument("--timeout", type=int, default=420, help="seconds one extraction may take (default 420)")
    parser.add_argument(
        "--moe-backend",
        choices=("auto", "triton"),
        default="auto",
        help="vLLM's unquantized MoE kernels: auto (vLLM's choice) or triton, for releases (0.22+) that pick "
        "FlashInfer's CUTLASS MoE, whose prebuilt kernels (flashinfer-cubin, 361 MB) the staging leaves out; "
        "without them FlashInfer compiles its kernels on the spot, for longer than --timeout",
    )
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - {"llama", *MOE_KINDS})
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; known: llama, {', '.join(MOE_KINDS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out)
    if args.moe_backend == "triton":
        run.env["VLLM_USE_FLASHINFER_MOE_FP16"] = "0"  # the Triton MoE 0.20 picks by itself
    run.summary["moe_backend"] = args.moe_backend
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

    if not install(run, args.stage, args.release, args.run_dir, args.speculators):
        return 1
    run.summary["models"] = names
    if not make_models(run, names, args.run_dir):
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

    results: dict[str, bool] = {}
    if code == 0:
        jobs = []
        for tp in [int(x) for x in args.tp.split(",") if x]:
            for name in names:
                label = e2e_label(name, tp)
                if tp > gpus:
                    run.say(f"{label}: skipped, {gpus} GPU(s) here")
                    run.summary["steps"][f"e2e-{label}"] = {"skipped": f"{gpus} GPU(s)"}
                    continue
                jobs.append((label, model_dir(name), tp))
        reports = extract_all(run, jobs, "all", args.out, args)
        results = {label: bool(report.get("ok")) for label, report in reports.items()}

    if args.run_check and code == 0:
        run_check(run, "run_check", "verify-run")

    code_back, _ = patcher_json(run, "rollback", "rollback")
    after = {path: sha256(SITE / path) for path in pristine}
    run.summary["rollback_identical"] = code_back == 0 and after == pristine and bool(pristine)
    run.summary["pristine_matches_record"] = pristine_matches_record(pristine)

    for left_out in [p for p in args.leave_out.split(",") if p] if code == 0 else []:
        # The symptom the left-out patch answers, on this machine; then back to pristine again.
        left, _ = patcher_json(run, f"apply-without-{left_out}", "apply", "--skip", left_out)
        if left == 0 and args.run_check:
            # the run check must catch the half-patched state on CUDA too
            run_check(run, f"run_check_without_{left_out}", f"verify-run-without-{left_out}")
        elif left == 0:
            # each model's first call (or --leave-out-calls); the reports travel in one file (the
            # device returns 8 files)
            jobs = [(f"{name}-without-{left_out}", model_dir(name), 1) for name in names]
            if names == ["llama"]:
                jobs = [(f"without-{left_out}", MODEL, 1)]
            reports = extract_all(run, jobs, args.leave_out_calls, EXTRA, args)
            (args.out / f"without-{left_out}.json").write_text(json.dumps(reports, indent=1) + "\n")
        again, _ = patcher_json(run, f"rollback-after-{left_out}", "rollback")
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

    run.say(
        "\nmodel | release | GPUs | TP | runner | patches applied | verdict | largest rel. error (median) | "
        "bf16 noise band (max; median) | minutes"
    )
    applied_ids = ",".join(p.split("-")[0] for p, s in states.items() if s == "applied")
    for label, ok in results.items():
        step = run.summary["steps"][f"e2e-{label}"]
        noise = step.get("noise") or {}
        band = f"{fmt(noise.get('max_rel_diff'))}; {fmt(noise.get('median_rel_diff'))}" if noise else "-"
        model = label.rsplit("-tp", 1)[0] if "-tp" in label else "llama"
        run.say(
            f"{model} | {run.summary['release']} | {gpus} | {step['tensor_parallel_size']} | "
            f"{runner_name(step.get('model_runner'))} | {applied_ids} | "
            f"{'match' if ok else 'FAIL'} {step.get('prompts_ok')}/{step.get('prompts_checked')} | "
            f"{fmt(step.get('max_rel_diff'))} ({fmt(step.get('median_rel_diff'))}) | {band} | "
            f"{step['seconds'] / 60:.1f}"
        )
    for label, step in run.summary["steps"].items():
        if "-without-" in label or label.startswith("e2e-without-"):
            run.say(f"{label}: {'ok' if step.get('ok') else step.get('error')}")
    run.say(
        f"rollback byte-identical: {run.summary['rollback_identical']}; all ok: {run.summary['ok']}; "
        f"{run.summary['minutes']} min in all"
    )
    return 0 if run.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
