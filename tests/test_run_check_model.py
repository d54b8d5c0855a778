"""The run check on a checkpoint the user already has (`patcher verify --run --model DIR`,
`apply --run-check --model DIR`), on the real vLLM 0.16.0 CPU build.

The tiny Llama with its transformers reference is `apply --run-check --model DIR` in
tests/test_run_check.py (that test's one vLLM run covers both). Here: the tiny Kimi-K2.5 wrapper
of workbench/tiny_moe.py with vLLM's MLA off (the CPU build has none; as test_e2e_moe_cpu.py
runs it), with PATCHER_RUN_CHECK_MEMORY_MIB lowered below what its reference needs, so the rows
are checked whole, in order and finite without transformers, and the output says why; and the
bad inputs, each one line and exit 2, found before vLLM starts (seconds each: `apply` on a
target already patched goes straight to the run check, without a verification).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import patcher

pytestmark = pytest.mark.vllm

TIMINGS: dict[str, float] = {}
# the reference's parameters as safetensors itself reads them
COUNT_PARAMETERS = "import sys\nfrom safetensors.torch import load_file\nprint(sum(t.numel() for t in load_file(sys.argv[1]).values()))"
CPU_ENV = {"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}  # as tests/test_e2e_moe_cpu.py


@pytest.fixture(scope="module")
def target(tmp_path_factory, demo_python: Path):
    """The demo environment's vLLM under a pristine speculators 0.3.0, patched."""
    from workbench.envs import overlay_env

    python = overlay_env(tmp_path_factory.mktemp("model"), demo_python)
    code, _, err = patcher("apply", "--python", str(python), "--json", timeout=900)
    assert code == 0, err
    return python


def test_kimi_k25_rows_whole_in_order_and_finite_reference_over_the_memory_limit(target: Path, demo_python: Path):
    from workbench.tiny_moe import ensure_tiny_moe

    model = ensure_tiny_moe(demo_python, "kimi-k25", progress=lambda message: None)
    started = time.monotonic()
    code, doc, err = patcher(
        "verify",
        "--run",
        "--model",
        str(model),
        "--tensor-parallel",
        "1",
        "--python",
        str(target),
        "--json",
        env={**CPU_ENV, "PATCHER_RUN_CHECK_MEMORY_MIB": "1000"},
        timeout=900,
    )
    TIMINGS["verify --run --model kimi-k25, no reference"] = time.monotonic() - started
    assert code == 0, err[-3000:]
    report = doc["targets"][0]
    check = report["run_check"]
    assert check["ok"] and check["problems"] == [] and check["usage_error"] is None, check
    assert check["model"] == str(model) and check["tensor_parallel_size"] == 1
    assert check["whole_and_in_order"] is True and check["compared"] is False and check["reference"] is None
    assert check["calls"] == 5 and check["prompts"] == check["prompts_ok"] == 97  # 70 in the fifth call
    # its transformers reference is reference/ (tiny-model.json), sized from its safetensors header
    parameters = json.loads(
        subprocess.run(
            [
                str(demo_python),
                "-c",
                COUNT_PARAMETERS,
                str(model / "reference" / "model.safetensors"),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout
    )
    assert check["reference_memory_mib"] == int(parameters * 4 * 1.2 / 2**20) + 2048
    reason = check["reference_reason"]
    assert reason.startswith(f"not compared with transformers: its float32 copy of {model / 'reference'} needs about ")
    assert reason.endswith("1000 MiB available (PATCHER_RUN_CHECK_MEMORY_MIB)"), reason
    assert f"run check passed on cpu with {model} at tensor parallel 1: " in report["message"]
    assert "came back whole, in order and finite; not compared with transformers: " in report["message"]
    print(f"\nrun check --model: {check['timings']}, peak {check['peak_rss_mib']} MiB")


def usage(target: Path, *args: str, env: dict | None = None) -> tuple[str, dict]:
    """`apply --run-check ARGS` on the patched target (nothing to write: straight to the run check):
    exit 2 and one line on stderr; (that line, the target's run_check or {})."""
    code, doc, err = patcher("apply", "--python", str(target), "--run-check", *args, "--json", env=env, timeout=300)
    assert code == 2, err
    report = doc["targets"][0]
    assert report["exit_code"] == 2 and report["status"] == "failed"
    assert "\n" not in report["message"]
    assert "extract_s" not in (report.get("run_check") or {}).get("timings", {})  # before vLLM starts
    return report["message"], report.get("run_check") or {}


def test_bad_model_inputs_are_one_line_and_exit_2(target: Path, tmp_path: Path):
    missing = tmp_path / "missing"
    line, check = usage(target, "--model", str(missing))
    assert (
        line
        == f"run check: --model {missing}: does not exist on the target (a checkpoint directory with config.json, never downloaded)"
    )
    assert check["usage_error"] and check["model"] == str(missing)

    empty = tmp_path / "empty"
    empty.mkdir()
    line, _ = usage(target, "--model", str(empty))
    assert line == f"run check: --model {empty}: no config.json there: not a Hugging Face checkpoint directory"

    # a relative path is the local target's, from where patcher runs
    line, check = usage(target, "--model", os.path.relpath(empty))
    assert check["model"] == str(empty), line

    (empty / "config.json").write_text("{}")
    cpus = len(os.sched_getaffinity(0))
    line, check = usage(target, "--model", str(empty), "--tensor-parallel", str(cpus + 1))
    assert line == (
        f"run check: --tensor-parallel {cpus + 1}: vLLM's CPU build here can split the model over at most "
        f"{cpus} (the CPUs this process may run on, one rank each at least)"
    )
    assert check["tensor_parallel_size"] == cpus + 1 and check["device"] == "cpu"

    line, _ = usage(target, "--model", str(empty), env={"PATCHER_RUN_CHECK_MEMORY_MIB": "lots"})
    assert line == "run check: PATCHER_RUN_CHECK_MEMORY_MIB='lots': give a positive number of MiB"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (("verify", "--model", "/srv/kimi"), "error: --model names the checkpoint --run runs: add --run"),
        (("apply", "--model", "/srv/kimi"), "error: --model names the checkpoint --run-check runs: add --run-check"),
        (
            ("verify", "--run", "--tensor-parallel", "2"),
            "error: --tensor-parallel splits --model's checkpoint: add --model DIR",
        ),
        (
            ("verify", "--run", "--model", "/srv/kimi", "--tensor-parallel", "0"),
            "Error: Invalid value for '--tensor-parallel': 0 is not in the range x>=1.",
        ),
        (
            ("verify", "--run", "--model", "/srv/kimi", "--tensor-parallel", "two"),
            "Error: Invalid value for '--tensor-parallel': 'two' is not a valid integer range.",
        ),
    ],
)
def test_model_options_without_their_check_are_usage_errors(args, line):
    code, _, err = patcher(*args, timeout=60)
    assert code == 2 and line in err.splitlines(), err


def test_over_ssh_the_model_path_is_the_targets(target: Path, tmp_path: Path):
    """Over ssh DIR is the remote host's: a relative one is refused there (patcher cannot resolve
    it), and a missing one is said as the target found it. Same agent session as locally."""
    from workbench.sshd import SshClient, SshServer, why_no_sshd

    why = why_no_sshd()
    if why:
        pytest.skip(why)
    client = SshClient(tmp_path / "client")
    server = SshServer(tmp_path / "sshd", "127.0.0.62", {"root": client.public_key}).start()
    try:
        for model, line in (
            ("models/kimi", "run check: --model models/kimi: give the checkpoint's absolute path on the target"),
            (
                "/nonexistent/kimi",
                (
                    "run check: --model /nonexistent/kimi: does not exist on the target (a checkpoint directory "
                    "with config.json, never downloaded)"
                ),
            ),
        ):
            code, doc, err = patcher(
                "apply",
                "--run-check",
                "--model",
                model,
                "--host",
                f"root@{server.spec}",
                "--python",
                str(target),
                *client.args(),
                "--json",
                timeout=300,
                cwd=tmp_path,
                clean_ssh=True,  # nor the user's cache: the retry file (the host fails) goes to the session's
            )
            assert code == 2, err
            report = doc["targets"][0]
            assert report["exit_code"] == 2 and report["message"] == line, report["message"]
            assert report["run_check"]["model"] == model
    finally:
        server.remove()
