"""On the GPU machine: bench/extract.py's extraction speed, in one call, with patcher's own install.

    python3 bench/gpu/extract_gpu.py --stage /tmp/stage --run-dir .gpu/run --out "$OUT" [--budget-s 520]
                                     [--also-speculators 0.4.0.1|''] [--shapes llama-1b,wide-7168|none]
                                     [--no-native] [--no-after-steps] [--no-leave-outs] [--no-e2e] [--mla]
                                     [--profile]
                                     [--leave-out vN] [--leave-out-prompts N] [--leave-out-repeats N]

Runs under the machine's own python3 (its torch, CUDA build), from the checkout the device tool
sends; standard library only here (the phases run in bench/extract.py, in that python3 with
PYTHONPATH=/tmp/site). Every phase times 3 passes over its prompts after a warm-up call (SETTINGS'
repeats), and the same prompts for every phase of a model. Steps, most telling first, each result
saved as soon as it is known:
1. join and install the staged wheels and this checkout's patcher wheel (bench/gpu/gpu_run.py);
2. `patcher status`, then `patcher apply` WITH verification (exit 0 and v21 applied required);
3. the models, random weights, in one process: `llama-1b` (issue 26's: hidden 2048, 16 layers,
   bf16), `wide-7168` (Kimi-K2.5's hidden size, 4 layers) and the demo's tiny model;
4. each model of --shapes (llama-1b: 512 prompts of 1024 tokens, 64 a call; wide-7168: 128 prompts
   of 1024 tokens, 64 a call; layers 1,2,3): the generator (speculators 0.3.0, v21), the same with
   the states moved after the last step (`generator-after-steps`: v21's step path off, the tensors
   compared; --no-after-steps leaves it out), vLLM's own
   prefill with the generator's settings (`vllm-eager`), vLLM's native extract_hidden_states
   path (`native`, vLLM 0.17+, timed until every prompt's states are CPU tensors; --no-native
   leaves it out) and vLLM's prefill with its defaults (`vllm-default`: the longest start,
   compilation and CUDA graphs; with it, the ratios over the faster of the two prefills,
   `.../faster-prefill`);
5. the second install, in the same call (--also-speculators, default 0.4.0.1: its wheel in
   --run-dir, `fetch.py --run-only --speculators 0.4.0.1`): `patcher rollback` (every target file
   back to its pristine bytes, checked), that release in place of the staged one, `patcher apply`
   with verification (v26 applied required); its generator on each model's same prompts, each
   prompt checked whole and in order (phase generator-speculators-0.4.0.1, and the ratio
   generator-speculators-0.4.0.1/generator: issue 39 asks for 0.9 or more); on llama-1b, the same
   without v26 (the RPC queue, 64 prompts) and the equality check (not with --no-leave-outs);
   rolled back and checked; then 0.3.0 again (rollback, the staged wheel, apply) where anything
   below follows and the budget leaves room;
6. llama-1b without v21 (old throughput, 64 prompts, and the same first call for the equality
   check against the v21 run; not with --no-leave-outs);
7. the end-to-end check of gpu_run.py (patcher/run_check/extract.py against transformers, TP 1; not
   with --no-e2e);
8. wide-7168 without v21 (old throughput, 64 prompts; equality; not with --no-leave-outs);
9. with --mla: the tiny DeepSeek-V3 (MLA; workbench/tiny_moe.py): vLLM's native path on it
   (the connector refuses MLA verifiers: recorded as not run, with vLLM's words) beside patcher's
   end-to-end check of the same model (record deepseek-v3-mla, e2e-deepseek-v3-tp1.json);
10. `patcher rollback`: every target file's sha256 equal to its pristine one.
A phase that cannot start before --budget-s has passed is skipped (and named so); the rollback and
the summary always run. $OUT gets at most 11 files: log.txt, summary.json, extract-<model>.json and
.md for each model (the second release's phases are in each model's, on the same prompts),
phases.tar.gz (every phase's output), e2e-tp1.json, e2e-deepseek-v3-tp1.json.

The issue-42 measurement in three calls of at most 10 minutes (the GPU session's commands are in
docs/extraction-speed.md): `--shapes llama-1b --no-leave-outs --no-e2e`, then `--shapes wide-7168
--no-leave-outs --no-e2e`, then `--shapes none --no-e2e --mla`.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_run  # noqa: E402  (beside this file)

spec = importlib.util.spec_from_file_location("extract_bench", HERE.parent / "extract.py")
assert spec is not None and spec.loader is not None
extract = importlib.util.module_from_spec(spec)
sys.modules["extract_bench"] = extract
spec.loader.exec_module(extract)

MODELS = Path("/tmp/models")
LOGS = Path("/tmp/extract-logs")
SETTINGS = {
    "llama-1b": {
        "prompts": 512,
        "prompt_len": 1024,
        "per_call": 64,
        "repeats": 3,
        "layers": [1, 2, 3],
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.8,
        "dump_prompts": 8,
        "leave_out": "v21",
        "leave_out_prompts": 64,
    },
    "wide-7168": {
        "prompts": 128,
        "prompt_len": 1024,
        "per_call": 64,
        "repeats": 3,
        "layers": [1, 2, 3],
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.8,
        "dump_prompts": 2,
        "leave_out": "v21",
        "leave_out_prompts": 64,
    },
}
# --mla: the tiny DeepSeek-V3 (4 layers, MLA), vLLM's native path beside patcher's end-to-end check
MLA_SETTINGS = {
    "prompts": 16,
    "prompt_len": 256,
    "per_call": 8,
    "repeats": 1,
    "layers": [1, 2, 3],
    "max_model_len": 2048,
    "gpu_memory_utilization": 0.5,
    "dump_prompts": 0,
    "leave_out": "",
    "leave_out_prompts": 0,
}


# What each speculators release's patch set must have applied for its generator to be the one measured
FAST_PATH = {"0.3.0": "v21-shared-memory-states", "0.4.0.1": "v26-shared-memory-request-states"}


class Installed:
    """The speculators release in SITE now, its target files' pristine sha256 (from `patcher
    status` before apply) and every rollback's verdict so far (summary["rollbacks"], in order)."""

    def __init__(self, run: gpu_run.Run, version: str) -> None:
        self.run = run
        self.version = version
        self.pristine: dict[str, str] = {}

    def apply(self) -> bool:
        """status (the pristine hashes), then apply with verification; True when it exited 0 and
        the release's fast path is applied. The patch states go to summary["patches"] (0.3.0's)
        or summary["patches-speculators-V"]."""
        suffix = "" if self.version == "0.3.0" else f"-speculators-{self.version}"
        code, status = gpu_run.patcher_json(self.run, "status" + suffix, "status")
        self.pristine = gpu_run.target_hashes(status)
        code, applied = gpu_run.patcher_json(self.run, "apply" + suffix, "apply")
        states = {p["id"]: p["state"] for p in (applied or {}).get("targets", [{}])[0].get("patches", [])}
        self.run.summary["patches" + suffix] = states
        ok = code == 0 and states.get(FAST_PATH[self.version]) == "applied"
        self.run.summary["apply_ok" + suffix] = ok
        self.run.save()
        if not ok:
            self.run.say(f"apply failed (exit {code}) or {FAST_PATH[self.version]} not applied: {states}")
        return ok

    def rollback(self) -> bool:
        """patcher rollback; True when every target file is back to its pristine bytes (and to the
        wheel's RECORD)."""
        code, _ = gpu_run.patcher_json(self.run, f"rollback-speculators-{self.version}", "rollback")
        after = {path: gpu_run.sha256(gpu_run.SITE / path) for path in self.pristine}
        identical = (
            code == 0
            and after == self.pristine
            and bool(self.pristine)
            and gpu_run.pristine_matches_record(self.pristine)
        )
        self.run.summary.setdefault("rollbacks", []).append({"speculators": self.version, "identical": identical})
        self.run.save()
        return identical

    def replace_with(self, version: str, wheel: Path) -> bool:
        """Roll back, then `version` (its wheel) in place of the installed speculators; True when
        both worked (apply() is the caller's)."""
        if not self.rollback():
            self.run.say(f"rollback of speculators {self.version} not byte-identical: not replaced")
            return False
        for old in [gpu_run.SITE / "speculators", *gpu_run.SITE.glob("speculators-*.dist-info")]:
            shutil.rmtree(old, ignore_errors=True)
        done = self.run.step(
            f"install-speculators-{version}",
            [
                *gpu_run.PIP_INSTALL,
                str(wheel),
            ],
        )
        if done.returncode != 0:
            self.run.say(done.stderr[-3000:])
            return False
        self.version = version
        return True


def wheel_of(folder: Path, version: str) -> Path | None:
    found = sorted(folder.glob(f"speculators-{version}-*.whl"))
    return found[0] if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=Path, required=True, help="folder holding manifest.json and the staged folders")
    parser.add_argument("--release", help="which staged release to install (default: the only one staged)")
    parser.add_argument(
        "--run-dir", type=Path, required=True, help="folder holding the patcher wheel (fetch.py's run/)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=520, help="no phase starts after this (default 520 s)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a rehearsal of every step where no GPU is: the tiny model for both records, 8 prompts of 64 tokens",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp"), help="where site/, wheels/, the models go (/tmp)")
    parser.add_argument("--aux", action="store_true", help=argparse.SUPPRESS)  # the native phase is on by default now
    parser.add_argument(
        "--no-native",
        action="store_true",
        help="leave out vLLM's native extract_hidden_states path (bench/extract.py's native phase, vLLM 0.17+), "
        "which runs on each model after its generator and vLLM's prefill by default",
    )
    parser.add_argument(
        "--shapes",
        default="llama-1b,wide-7168",
        help=f"the models measured, in order: {', '.join(SETTINGS)}, or none (default both)",
    )
    parser.add_argument(
        "--no-after-steps",
        action="store_true",
        help="leave out the generator with v21's step path off (generator-after-steps) and its equality check",
    )
    parser.add_argument("--no-leave-outs", action="store_true", help="no generator without v21 / v26 (and equality)")
    parser.add_argument("--no-e2e", action="store_true", help="no end-to-end check against transformers")
    parser.add_argument(
        "--profile", action="store_true", help="each generator phase also profiles one more call, untimed (cProfile)"
    )
    parser.add_argument("--leave-out", help="the patch the leave-out runs leave out (default: v21, the RPC queue)")
    parser.add_argument("--leave-out-prompts", type=int, help="prompts of the leave-out runs (default: 64)")
    parser.add_argument("--leave-out-repeats", type=int, help="timed passes of the leave-out runs (default: 1)")
    parser.add_argument(
        "--mla",
        action="store_true",
        help="also the tiny DeepSeek-V3 (MLA): vLLM's native path on it beside patcher's end-to-end check",
    )
    parser.add_argument(
        "--also-speculators",
        default="0.4.0.1",
        choices=["0.4.0.1", ""],
        help="the release whose generator also runs on each model's prompts, a second install in the same call "
        "(its wheel in --run-dir: fetch.py --run-only --speculators 0.4.0.1); '' for 0.3.0 alone",
    )
    args = parser.parse_args()
    also = args.also_speculators
    shapes = [] if args.shapes == "none" else [name for name in args.shapes.split(",") if name]
    unknown = [name for name in shapes if name not in SETTINGS]
    if unknown:
        print(f"--shapes: unknown {', '.join(unknown)}; name {', '.join(SETTINGS)} or none", file=sys.stderr)
        return 2
    if also and shapes and wheel_of(args.run_dir, also) is None:
        print(
            f"--also-speculators {also}: no speculators-{also}-*.whl in {args.run_dir} "
            f"(python bench/gpu/fetch.py --run-only --speculators {also}; or --also-speculators '')",
            file=sys.stderr,
        )
        return 2
    global MODELS, LOGS
    # read by gpu_run's Run (PYTHONPATH), install, its end-to-end check and the rollback check
    gpu_run.SITE, gpu_run.WHEELS, gpu_run.MODEL = args.work / "site", args.work / "wheels", args.work / "model"
    MODELS, LOGS = args.work / "models", args.work / "extract-logs"
    gpu_run.MODELS = MODELS  # the tiny DeepSeek-V3 of --mla goes beside the shapes' models
    started = time.monotonic()
    deadline = started + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    run = gpu_run.Run(args.out)

    import torch  # the machine's own

    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    run.summary["machine"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dev_shm_free_gib": round(shm.free / 2**30, 1) if shm else None,
    }
    run.say(f"machine: {run.summary['machine']}")
    if not gpu_run.install(run, args.stage, args.release, args.run_dir, None):
        return 1
    installed = Installed(run, "0.3.0")
    if not installed.apply():
        installed.rollback()
        return 1

    bench = extract.Bench(
        sys.executable, [sys.executable, "-m", "patcher.cli"], LOGS, run.env, run.say, deadline=deadline
    )
    records = {}
    for shape in shapes:
        settings = SETTINGS[shape]
        if args.smoke:
            settings = dict(settings, prompts=8, prompt_len=64, per_call=4, leave_out_prompts=4, dump_prompts=2)
            settings.update(gpu_memory_utilization=0.1, layers=[0, 2, 3], repeats=2)
        if args.profile:
            settings = dict(settings, profile=True)
        for key in ("leave_out", "leave_out_prompts", "leave_out_repeats"):
            if getattr(args, key) is not None:
                settings = dict(settings, **{key: getattr(args, key)})
        records[shape] = extract.new_record(shape, str(gpu_run.MODEL if args.smoke else MODELS / shape), settings)

    def save() -> None:
        for record in records.values():
            extract.write_record(extract.finish(record), args.out)
        run.summary["records"] = {
            shape: {
                "ratios": r.get("ratios"),
                "faster_prefill": r.get("faster_prefill"),
                **{key: value for key, value in r.items() if key.startswith("equality")},
                "passed": r.get("passed"),
            }
            for shape, r in records.items()
        }
        run.save()

    # the tiny model is gpu_run's end-to-end check's (its MODEL folder)
    models = {"tiny": str(gpu_run.MODEL), **({} if args.smoke else {shape: str(MODELS / shape) for shape in shapes})}
    made = bench.phase("make-model", {"models": models}, "make-models")
    run.summary["models"] = made
    plan = Plan(args, run, bench, installed, records, save, deadline)
    try:
        if made.get("ok"):
            plan.run_all()
    finally:
        installed.rollback()
        run.summary["rollback_identical"] = bool(run.summary.get("rollbacks")) and all(
            r["identical"] for r in run.summary["rollbacks"]
        )
        save()
        with tarfile.open(args.out / "phases.tar.gz", "w:gz") as tar:
            for path in sorted(LOGS.glob("*.log")):
                tar.add(path, arcname=path.name)
        run.summary["minutes"] = round((time.monotonic() - started) / 60, 2)
        run.save()
    for record in records.values():
        run.say(extract.markdown(record))
    ok = run.summary["rollback_identical"] and all(r.get("passed") for r in records.values())
    run.say(f"rollback byte-identical: {run.summary['rollback_identical']}; {run.summary['minutes']} min in all")
    return 0 if ok else 1


class Plan:
    """The steps of main()'s docstring, in order, each skipped where the budget or the options say."""

    def __init__(self, args, run, bench, installed: Installed, records: dict, save, deadline: float) -> None:
        self.args, self.run, self.bench, self.installed = args, run, bench, installed
        self.records, self.save, self.deadline = records, save, deadline
        self.native = [] if args.no_native else ["native"]
        self.after_steps = [] if args.no_after_steps else [extract.AFTER_STEPS]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run_all(self) -> None:
        records, bench = self.records, self.bench
        # what the issue-42 ratios need first, speculators 0.3.0 installed: the generator and both of
        # vLLM's prefills (vllm-default's compiled start is the longest) and vLLM's native path
        for record in records.values():
            phases = ["generator", *self.after_steps, "vllm-eager", *self.native, "vllm-default"]
            extract.run_with(bench, record, phases, LOGS)
            self.save()
        if self.args.also_speculators and records:
            self.second_release()
        if self.installed.version != "0.3.0" or not self.run.summary.get("apply_ok"):
            return
        if "llama-1b" in records and not self.args.no_leave_outs:
            with bench.without(records["llama-1b"]["config"]["leave_out"]):
                extract.run_without(bench, records["llama-1b"], LOGS)
            self.save()
        if not self.args.no_e2e:
            self.e2e([("tp1", gpu_run.MODEL, 1)])
        if "wide-7168" in records and not self.args.no_leave_outs:
            patch = records["wide-7168"]["config"]["leave_out"]
            if self.left() > 90:
                with bench.without(patch):
                    extract.run_without(bench, records["wide-7168"], LOGS)
            else:
                self.run.say(f"wide-7168 without {patch}: skipped, out of time")
            self.save()
        if self.args.mla:
            self.mla()

    def more_with_0_3_0(self) -> bool:
        """Whether anything after the second release needs speculators 0.3.0 back."""
        return not (self.args.no_leave_outs and self.args.no_e2e) or self.args.mla

    def second_release(self) -> None:
        """The second release on the same prompts: its generator on each model, and (leave-outs)
        the 1B without its transfer; then 0.3.0 again where the budget leaves room."""
        also, installed, bench = self.args.also_speculators, self.installed, self.bench
        staged = wheel_of(gpu_run.WHEELS, "0.3.0")
        wheel = wheel_of(self.args.run_dir, also)
        assert staged is not None and wheel is not None
        if installed.replace_with(also, wheel) and installed.apply():
            for record in self.records.values():
                extract.run_with(bench, record, ["generator"], LOGS, speculators=also)
                self.save()
            if "llama-1b" in self.records and not self.args.no_leave_outs:
                with bench.without("v26"):
                    extract.run_without(bench, self.records["llama-1b"], LOGS, speculators=also, patch="v26")
                self.save()
        if not self.more_with_0_3_0():
            return  # the last rollback checks the release installed now against its own wheel
        if self.left() > 150 and installed.replace_with("0.3.0", staged):
            installed.apply()
        else:
            self.run.say("0.3.0's other phases: skipped, out of time (or the switch back failed)")

    def e2e(self, jobs: list) -> None:
        if self.left() > 90:
            left = int(min(300, self.left()))
            options = argparse.Namespace(parallel=1, noise=False, reference_device="cpu", timeout=left)
            gpu_run.extract_all(self.run, jobs, "all", self.args.out, options)
        else:
            self.run.say(f"e2e-{jobs[0][0]}: skipped, out of time")

    def mla(self) -> None:
        """The tiny DeepSeek-V3: vLLM's native path on it (expected: its connector refuses MLA
        verifiers, recorded as not run with vLLM's words) beside patcher's end-to-end check."""
        if self.left() < 120 or not gpu_run.make_models(self.run, ["deepseek-v3"]):
            self.run.say("deepseek-v3 (MLA): skipped, out of time or the model could not be made")
            return
        # the Triton MoE kernels: 0.22+ pick FlashInfer's, whose prebuilt kernels the staging leaves out
        self.run.env["VLLM_USE_FLASHINFER_MOE_FP16"] = "0"
        model = gpu_run.model_dir("deepseek-v3")
        record = self.records["deepseek-v3-mla"] = extract.new_record("deepseek-v3-mla", str(model), MLA_SETTINGS)
        extract.run_with(self.bench, record, ["native"], LOGS)
        self.save()
        self.e2e([("deepseek-v3-tp1", model, 1)])
        step = self.run.summary.get("steps", {}).get("e2e-deepseek-v3-tp1")
        record["patcher_e2e"] = step
        self.save()


if __name__ == "__main__":
    sys.exit(main())
