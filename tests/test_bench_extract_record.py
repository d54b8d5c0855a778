"""bench/extract.py's record without running vLLM: the ratios (each over what its key names, the
faster prefill among them), what each means in words, the table, the verdict where the native path
is not run on a release that cannot run it, and the command lines it and extract_gpu.py refuse.
The phases themselves run in tests/test_bench_extract.py (vLLM 0.16.0, CPU build)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

spec = importlib.util.spec_from_file_location("extract_bench_record", ROOT / "bench" / "extract.py")
assert spec is not None and spec.loader is not None
extract = importlib.util.module_from_spec(spec)
spec.loader.exec_module(extract)


def phase(tokens_per_s: float, **more) -> dict:
    return {"ok": True, "tokens": 1000, "tokens_per_s": tokens_per_s, "seconds": 1.0, **more}


def generator(tokens_per_s: float, transfer: float) -> dict:
    split = {"execute": 0.5, "transfer": transfer, "assemble": 0.1}
    return phase(tokens_per_s, prompts=8, prompts_whole_in_order=8, split_s=split, timed_calls=4, pass_s=[0.5, 0.5])


def record(**phases: dict) -> dict:
    made = extract.new_record("r", "/model", {"prompts": 8, "repeats": 2})
    made["phases"].update({name.replace("_", "-"): value for name, value in phases.items()})
    return made


def test_every_ratio_is_over_what_its_key_names_the_faster_prefill_too():
    phases = {
        "generator": generator(100.0, 0.01),
        "generator-speculators-0.4.0.1": generator(110.0, 0.01),
        "vllm-eager": phase(200.0),
        "vllm-default": phase(250.0),
        "native": phase(50.0, prompts=8, prompts_whole_in_order=8),
        "generator-without-v21": generator(10.0, 0.5),
    }
    made = record(**{k.replace("-", "_"): v for k, v in phases.items()})
    made["equality"] = {"equal_within_spread": True}  # the run without v21 gave the same tensors
    done = extract.finish(made)
    ratios = done["ratios"]
    assert done["faster_prefill"] == "vllm-default"
    assert ratios["generator/vllm-eager"] == 0.5 and ratios["generator/vllm-default"] == 0.4
    assert ratios["generator/faster-prefill"] == 0.4 and ratios["generator/native"] == 2.0
    assert ratios["generator-speculators-0.4.0.1/faster-prefill"] == 0.44
    assert ratios["generator-speculators-0.4.0.1/native"] == 2.2
    assert ratios["generator-speculators-0.4.0.1/generator"] == 1.1
    assert ratios["native/vllm-eager"] == 0.25 and ratios["native/faster-prefill"] == 0.2
    assert ratios["generator/generator-without-v21"] == 10.0
    assert ratios["transfer-without-v21/transfer"] == 50.0
    meanings = done["ratio_meanings"]
    assert set(meanings) == set(ratios)
    assert "faster of vLLM's two prefills" in meanings["generator/faster-prefill"]
    assert "native extract_hidden_states" in meanings["generator/native"]
    assert "speculators 0.4.0.1" in meanings["generator-speculators-0.4.0.1/native"]
    assert "without v21" in meanings["generator/generator-without-v21"]
    assert done["passed"]
    assert not extract.finish(dict(made, equality={"equal_within_spread": False}))["passed"]
    text = extract.markdown(done)
    assert "split: total over the timed calls (s)" in text and "faster prefill in this run: vllm-default" in text
    assert all(f"- {key}: " in text for key in ratios), text


def test_no_faster_prefill_unless_both_prefills_ran():
    phases = {"generator": generator(100.0, 0.01), "vllm-eager": phase(200.0)}
    done = extract.finish(record(**phases))
    assert "faster_prefill" not in done and "generator/faster-prefill" not in done["ratios"]
    assert done["ratios"] == {"generator/vllm-eager": 0.5}


def test_a_native_path_the_release_cannot_run_is_not_run_not_failed():
    reason = "vLLM 0.16.0 has no extract_hidden_states / ExampleHiddenStatesConnector (vLLM 0.17+)"
    unsupported = {"ok": False, "unsupported": reason, "exit": 0}
    done = extract.finish(record(generator=generator(100.0, 0.01), native=unsupported))
    assert done["passed"] and done["ratios"] == {}
    text = extract.markdown(done)
    assert f"| native | not run | | | | | {reason} | |" in text and "ratios: none" in text
    assert extract.summary_line(unsupported) == f"NOT RUN: {reason}"
    # a native path that ran and failed, or lost a prompt, fails the record
    failed = {"ok": False, "error": "RuntimeError: Engine core initialization failed", "exit": 1}
    assert not extract.finish(record(generator=generator(100.0, 0.01), native=failed))["passed"]
    short = phase(50.0, prompts=8, prompts_whole_in_order=7)
    assert not extract.finish(record(generator=generator(100.0, 0.01), native=short))["passed"]


def test_the_command_lines_it_refuses():
    def args(**changes) -> argparse.Namespace:
        base = {
            "phases": ["generator", "native"],
            "leave_out": "",
            "target": None,
            "vllm": extract.DEFAULT_VLLM,
            "also_speculators": "",
            "speculators": "0.3.0",
            "repeats": 2,
        }
        return argparse.Namespace(**{**base, **changes})

    assert extract.refused(args()) is None
    assert extract.PHASE_ALIASES["vllm-aux"] == "native"  # the native phase's first name is still read
    assert "unknown vllm-fast" in extract.refused(args(phases=["vllm-fast"]))
    assert "--vllm and --also-speculators" in extract.refused(args(target="/usr/bin/python3", vllm="0.32.0"))
    assert "already" in extract.refused(args(also_speculators="0.3.0"))
    assert "--repeats" in extract.refused(args(repeats=0))


def test_extract_gpu_refuses_an_unknown_shape_before_it_installs_anything(tmp_path: Path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu" / "extract_gpu.py"),
            "--stage",
            str(tmp_path / "stage"),
            "--run-dir",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "out"),
            "--shapes",
            "llama-1b,llama-70b",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--shapes: unknown llama-70b" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_failed_phase_names_the_error_vllm_logged_beneath_its_wrapper():
    # vLLM's engine core says the error; the phase sees only the wrapper (the 0.16 CPU build on a
    # host with AMX, measured 2026-12-05); a traceback logged as a WARNING is not the cause
    output = "\n".join(
        [
            "(MainProcess pid=1) WARNING 12-05 00:05:43 [base.py:380] ValueError: Tokenizer not available",
            "(EngineCore_DP0 pid=2) ERROR [core.py:1008] RuntimeError: Unsupported CPU attention configuration: "
            + "head_dim=64 isa=0",
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above)",
            extract.RESULT_PREFIX + '{"ok": false, "error": "EngineDeadError: EngineCore encountered an issue."}',
        ]
    )
    cause = extract.root_cause(output)
    assert cause == "RuntimeError: Unsupported CPU attention configuration: head_dim=64 isa=0"
    failed = {"ok": False, "exit": 1, "error": "EngineDeadError: EngineCore encountered an issue.", "root_cause": cause}
    assert extract.summary_line(failed).endswith(f"(root cause: {cause})")
    assert extract.root_cause("EngineDeadError: EngineCore encountered an issue. See stack trace (above)") is None


def test_the_recorded_runs_still_read_and_give_their_own_ratios():
    # the records written before the native phase, the passes and the faster prefill (GPU and CPU)
    records = sorted(ROOT.glob("bench/gpu/results/extract-*/extract-*.json"))
    records += sorted(ROOT.glob("bench/results/extract/extract-*.json"))
    assert len(records) >= 7, records
    for path in records:
        stored = json.loads(path.read_text())
        again = extract.finish(json.loads(path.read_text()))
        assert again["ratios"].items() >= stored["ratios"].items(), path
        text = extract.markdown(again)
        assert text.startswith(f"## {stored['label']}") and all(f"- {key}: " in text for key in again["ratios"]), path


def test_transfer_check_refuses_an_unknown_check_before_it_installs_anything(tmp_path: Path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu" / "transfer_check.py"),
            "--stage",
            str(tmp_path / "stage"),
            "--run-dir",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "out"),
            "--checks",
            "probe,leaks",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "leaks" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_extract_gpu_runs_issue_42s_phases_first_and_switches_back_only_for_what_needs_0_3_0(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    try:
        spec = importlib.util.spec_from_file_location("extract_gpu_plan", ROOT / "bench" / "gpu" / "extract_gpu.py")
        assert spec is not None and spec.loader is not None
        extract_gpu = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(extract_gpu)
    finally:
        sys.path.remove(str(ROOT / "bench" / "gpu"))
    ran: list[str] = []

    class Bench:
        def phase(self, name, config, label, timeout=1800):
            ran.append(label)
            return {"ok": True, "tokens": 1, "tokens_per_s": 1.0, "prompts": 1, "prompts_whole_in_order": 1}

        def without(self, patch):
            import contextlib

            ran.append(f"without {patch}")
            return contextlib.nullcontext()

    class Installed:
        version = "0.3.0"

        def replace_with(self, version, wheel):
            ran.append(f"install {version}")
            self.version = version
            return True

        def apply(self):
            return True

    class Run:
        def __init__(self) -> None:
            self.summary = {"apply_ok": True, "steps": {}}

        def say(self, text):
            ran.append(text)

    monkeypatch.setattr(extract_gpu, "wheel_of", lambda folder, version: tmp_path / f"speculators-{version}.whl")
    monkeypatch.setattr(extract_gpu.gpu_run, "extract_all", lambda run, jobs, *rest: ran.append(f"e2e {jobs[0][0]}"))

    def plan(**options) -> list[str]:
        ran.clear()
        base = {"no_native": False, "no_after_steps": False, "no_leave_outs": True, "no_e2e": True, "mla": False}
        args = argparse.Namespace(**{**base, **options}, also_speculators="0.4.0.1", run_dir=tmp_path, out=tmp_path)
        records = {"llama-1b": extract.new_record("llama-1b", "/m", {"prompts": 1, "leave_out": "v21"})}
        extract_gpu.Plan(args, Run(), Bench(), Installed(), records, lambda: None, 10**12).run_all()
        return list(ran)

    # the issue-42 call: 0.3.0's generator (with its step path and without), vLLM's three
    # baselines, then 0.4.0.1, and no switch back
    assert plan() == [
        "llama-1b-generator",
        "llama-1b-generator-after-steps",
        "llama-1b-vllm-eager",
        "llama-1b-native",
        "llama-1b-vllm-default",
        "install 0.4.0.1",
        "llama-1b-generator-speculators-0.4.0.1",
    ]
    full = plan(no_leave_outs=False, no_e2e=False)
    assert full[5:] == [
        "install 0.4.0.1",
        "llama-1b-generator-speculators-0.4.0.1",
        "without v26",
        "llama-1b-generator-speculators-0.4.0.1-without-v26",
        "install 0.3.0",
        "without v21",
        "llama-1b-generator-without-v21",
        "e2e tp1",
    ], full
    assert "llama-1b-native" not in plan(no_native=True)
    assert "llama-1b-generator-after-steps" not in plan(no_after_steps=True)


def test_a_phase_stopped_by_its_limit_or_the_budget_says_which_first(tmp_path):
    # a target that never ends: the phase runs it with bench/extract.py's phase arguments
    target = tmp_path / "python"
    target.write_text("#!/bin/sh\nexec sleep 600\n")
    target.chmod(0o755)
    seen: list[str] = []
    bench = extract.Bench(str(target), [], tmp_path, {"PATH": "/usr/bin:/bin"}, seen.append)
    result = bench.phase("vllm", {}, "slow", timeout=1)
    assert not result["ok"] and result["stopped"] and result["exit"] == 124, result
    assert result["error"] == "stopped after 1 s: the phase's time limit; slow.log has its output"
    assert (tmp_path / "slow.log").is_file()

    bench.shortest_phase_s = 0.5
    bench.deadline = time.monotonic() + 1.5
    result = bench.phase("vllm", {}, "budget", timeout=600)
    assert result["error"].startswith("stopped after 1 s: the run's budget (--budget-s) ran out"), result
    bench.deadline = time.monotonic()
    assert bench.phase("vllm", {}, "late")["error"] == "skipped: out of time"
