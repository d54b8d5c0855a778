"""The end-to-end pieces the vLLM modules use (tests/test_e2e_vllm.py on 0.16,
tests/test_e2e_vllm_032.py on 0.32, the speculators 0.4, MoE and v21 modules): a target that ends
rolled back, patched as asked, the extraction driver run in it, its report read. TIMINGS collects
each extraction's wall time for test_e2e_vllm's summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tests.support.cli import patcher
from workbench.envs import overlay_env, site_file

GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"
WORKER = "speculators/data_generation/custom_worker.py"
PRISTINE = {
    GENERATOR: "514f3f585afa335b558f98c1954a1dc5b804003cd7b08aeeac7c4cd333cd5106",
    WORKER: "e9a95cf6422fa3e3efb3edb658e4898ba23ee141619f58d7096ea7fbde8af548",
}
EXTRACT = Path(__file__).resolve().parent.parent.parent / "patcher" / "run_check" / "extract.py"
TIMINGS: dict[str, float] = {}


def sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# The target files of each throwaway target with another speculators release than 0.3.0, as pip
# installed them (rolled_back_overlay): it is pristine when its files are these.
INSTALLED: dict[Path, dict[str, str]] = {}


def pristine(target: Path) -> bool:
    expected = INSTALLED.get(target, PRISTINE)
    return all(sha(site_file(target, rel)) == digest for rel, digest in expected.items())


def patch_as(target: Path, *skip: str) -> dict[str, str]:
    """Roll back to pristine, then apply every patch but `skip`; the patches' states."""
    code, doc, err = patcher("rollback", "--python", str(target), "--json")
    assert code == 0, err
    assert pristine(target)
    skips = [arg for short in skip for arg in ("--skip", short)]
    code, doc, err = patcher("apply", "--python", str(target), "--no-verify", *skips, "--json")
    assert code == 0, err
    states = {p["id"].split("-", 1)[0]: p["state"] for p in doc["targets"][0]["patches"]}
    for short in skip:
        assert states[short] != "applied", states
    return states


@contextmanager
def rolled_back_overlay(folder: Path, base_python: Path, speculators: str = "0.3.0") -> Iterator[Path]:
    """A throwaway target over a real vLLM environment (workbench.envs.overlay_env), its python;
    whatever happened, its speculators files end as pip installed them."""
    python = overlay_env(folder, base_python, speculators=speculators)
    if speculators != "0.3.0":  # 0.3.0's are known (PRISTINE)
        INSTALLED[python] = {rel: sha(site_file(python, rel)) for rel in PRISTINE}
    try:
        yield python
    finally:
        patcher("rollback", "--python", str(python), "--json")


def extract(
    target: Path,
    model: Path,
    calls: str,
    label: str,
    env: Mapping[str, str] | None = None,
    tensor_parallel: int = 1,
) -> dict:
    """Run the driver in the target (with `env` over this process's environment), its model split
    over `tensor_parallel` ranks; its report is the last line of its stdout."""
    started = time.monotonic()
    ranks = ["--tensor-parallel-size", str(tensor_parallel)] if tensor_parallel != 1 else []
    proc = subprocess.run(
        [str(target), str(EXTRACT), "--model", str(model), "--calls", calls, *ranks],
        capture_output=True,
        text=True,
        timeout=900 * tensor_parallel,
        cwd=str(target.parent.parent),
        env={**os.environ, **(env or {})},
    )
    TIMINGS[label] = time.monotonic() - started
    # the report is the driver's last JSON line; vLLM 0.32's workers may still log after it
    lines = [line for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert lines, f"no report; stderr:\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert proc.returncode == (0 if report["ok"] else 1)
    return report


def error_of(report: dict) -> dict:
    error = report["error"]
    assert error is not None, f"expected a failure, the run passed: {summary(report)}"
    return error


def report_of(error: dict) -> dict:
    return {"error": error, "calls": []}


def prompts(report: dict, call: int) -> list[dict]:
    return next(c for c in report["calls"] if c["call"] == call)["prompts"]


# What a library adds to its messages that says nothing a reader of the run needs: pydantic's link
# and its [type=..., input_value=...] detail, vLLM's pointer to a stack trace the driver does not print.
_BOILERPLATE = re.compile(
    r"\s*(For further information visit \S+|\[type=[^\]]*\]|,? please check the stack trace above[^.]*)"
)


def one_line(message: str, width: int = 160) -> str:
    """A message on one line: its lines joined with "; ", boilerplate dropped, cut between words."""
    parts = [" ".join(line.split()) for line in _BOILERPLATE.sub("", message).splitlines()]
    text = "; ".join(part for part in parts if part)
    if len(text) <= width:
        return text
    return text[:width].rsplit(" ", 1)[0] + " ..."


def summary(report: dict) -> str:
    """The run in one line: its error (type, phase, where, message), or each call's prompts."""
    if report["error"]:
        e = report["error"]
        said = one_line(e["message"])
        return f"{e['type']} in {e['phase']} at {e['where']}" + (f": {said}" if said else "")
    return "; ".join(
        f"call {c['call']}: " + ", ".join(f"{p['prompt_tokens']}->{p['rows'][0]}:{p['status']}" for p in c["prompts"])
        for c in report["calls"]
    )


def assert_all_correct(report: dict) -> None:
    assert report["error"] is None, summary(report)
    assert report["planned_calls"] == len(report["calls"]) >= 3
    for call in report["calls"]:
        for p in call["prompts"]:
            assert p["rows"] == [p["prompt_tokens"]] * len(report["layer_ids"]), (call["call"], p)
            assert p["input_ids_ok"], (call["call"], p)
            assert p["max_rel_diff"] <= report["tolerance"], (call["call"], p)
            assert p["status"] == "ok", (call["call"], p)
    assert report["ok"]


def leave_out(target: Path, model: Path, patch, run) -> tuple[list[str], str]:
    """A declared leave-one-out run (patcher.model.LeaveOneOut) on this target: every patch but
    the ones it leaves out, then the extraction (or, for a 'verify' symptom, apply with its
    verification). What the run lacks of the declared symptom ([] when it shows), and its summary.
    A run that needs no patch (symptom None) is test_e2e_vllm's, all of them left out at once."""
    from tests.support.declared import apply_refusal_shows, left_out, report_shows

    skipped = left_out(patch, run)
    if run.symptom is not None and run.symptom.phase == "verify":
        code, doc, err = patcher("rollback", "--python", str(target), "--json")
        assert code == 0 and pristine(target), err
        skips = [arg for short in skipped for arg in ("--skip", short)]
        code, doc, err = patcher("apply", "--python", str(target), *skips, "--json")
        entry = doc["targets"][0] if doc else {"status": "?", "message": err}
        return apply_refusal_shows(run.symptom, code, entry["status"], entry["message"]), entry["message"]
    patch_as(target, *skipped)
    report = extract(target, model, run.calls, "without " + "+".join(skipped))
    return report_shows(run.symptom, report), summary(report)


def assert_every_selected_patch_applies(target: Path) -> dict[str, str]:
    """Apply every patch: the ones the declarations select on the target's versions are applied,
    the others not selected (no list of ids kept here)."""
    from tests.support.declared import selected_ids

    code, doc, err = patcher("status", "--python", str(target), "--json")
    assert code == 0, err
    versions = doc["targets"][0]["versions"]
    expected = selected_ids(versions)
    states = patch_as(target)
    assert {short for short, state in states.items() if state == "applied"} == expected, (versions, states)
    assert all(state == "not-selected" for short, state in states.items() if short not in expected), states
    return states
