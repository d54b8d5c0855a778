"""What patcher says when a write fails under it: a full disk and an immutable target, made for
real (a small tmpfs filled to the last byte, chattr +i), each one line that names the path, the
cause and what to do; every file stays its old or its new bytes and the next apply completes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher, patcher_argv, patcher_env
from tests.support.files import GENERATOR
from workbench.envs import light_env, site_file

TARGETS = sorted({p.target.path for p in load_patches()})
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and chattr +i need root")


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def message(doc: dict | None) -> str:
    assert doc is not None
    return doc["targets"][0]["message"]


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> None:
    """Every free byte of the filesystem taken."""
    with open(folder / "filler", "wb", buffering=0) as fh:
        for size in (1 << 20, 4096, 1):
            try:
                while fh.write(b"\0" * size):
                    pass
            except OSError:
                pass


@needs_root
def test_a_full_disk_names_the_file_and_what_to_do(small_disk: Path):
    python = light_env(small_disk)
    pristine = files(python)
    fill(small_disk)
    code, doc, err = patcher("apply", "--no-verify", "--python", str(python), "--json")
    assert code == 1, err
    text = message(doc)
    assert "None" not in text and "\n" not in text, text
    assert str(small_disk) in text and "No space left on device" in text and "free space" in text, text
    assert files(python) == pristine
    (small_disk / "filler").unlink()
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert code == 0, err


@needs_root
def test_an_immutable_target_is_named_with_the_attribute_and_the_fix(tmp_path: Path):
    python = light_env(tmp_path)
    target = site_file(python, GENERATOR)
    pristine = files(python)
    subprocess.run(["chattr", "+i", str(target)], check=True)
    try:
        code, doc, err = patcher("apply", "--no-verify", "--python", str(python), "--json")
        assert code == 1, err
        text = message(doc)
        assert f"cannot replace {target}: it is immutable (chattr +i)" in text, text
        assert f"chattr -i {target}" in text and ".patcher-" not in text, text
        assert files(python) == pristine
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)


@needs_root
def test_a_target_made_immutable_mid_apply_is_named_and_the_next_apply_completes(tmp_path: Path):
    python = light_env(tmp_path)
    target = site_file(python, GENERATOR)
    pristine = files(python)
    release = tmp_path / "release"
    fault = {"at": "intent-recorded", "action": "pause", "until": str(release), "seconds": 60}
    proc = subprocess.Popen(
        patcher_argv("apply", "--no-verify", "--python", str(python), "--json"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=patcher_env({"PATCHER_FAULT": json.dumps(fault)}),
    )  # fmt: skip
    record = python.parent.parent / "share" / "patcher" / "state.json"
    deadline = time.monotonic() + 60
    while not (record.exists() and "pending" in record.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    subprocess.run(["chattr", "+i", str(target)], check=True)  # after every check, before the write
    try:
        release.touch()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        text = message(json.loads(out))
        assert f"cannot replace {target}: it is immutable (chattr +i)" in text and ".patcher-" not in text, text
        assert "every file is its old or its new bytes" in text, text
        assert target.read_bytes() == pristine[GENERATOR]
        assert not [p for p in target.parent.iterdir() if p.name.startswith(".patcher-")]
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    code, _, err = patcher("rollback", "--python", str(python))
    assert code == 0, err
    assert files(python) == pristine
    shutil.rmtree(tmp_path / "env", ignore_errors=True)


@pytest.mark.parametrize("stdout", ["/dev/full", "closed pipe"])
def test_a_report_that_cannot_be_written_after_a_successful_apply_is_exit_8_not_1(tmp_path: Path, stdout: str):
    python = light_env(tmp_path)
    argv = patcher_argv("apply", "--no-verify", "--python", str(python), "--json")
    if stdout == "/dev/full":
        with open("/dev/full", "wb") as full:
            proc = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, env=patcher_env(), timeout=300)
    else:
        read, write = os.pipe()
        os.close(read)  # nobody reads what patcher writes: EPIPE
        try:
            proc = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, env=patcher_env(), timeout=300)
        finally:
            os.close(write)
    assert proc.returncode == 8, proc.stderr  # 1 would say "everything rolled back"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("patcher: ")]
    assert len(lines) == 1, proc.stderr
    assert "its report could not be written to stdout" in lines[0] and "ended with exit 0 (success)" in lines[0]
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert code == 0, err
    assert {p["state"] for p in doc["targets"][0]["patches"]} <= {"applied", "not-selected"}


def test_a_fleets_report_that_cannot_be_written_is_exit_8_and_its_retry_file_is_still_written(tmp_path: Path):
    """A host where nothing listens (exit 4): the JSON goes to /dev/full, the retry file is still
    written, and the one line gives the fleet's own code."""
    from workbench.sshd import SshClient, free_port

    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        pytest.skip("the OpenSSH client (ssh, ssh-keygen) is missing")
    host = f"root@127.0.0.1:{free_port('127.0.0.1')}"
    argv = patcher_argv("status", "--host", host, *SshClient(tmp_path / "client").args(), "--json")
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(
            [*argv, "--retry-file", "failed.retry"], stdout=full, stderr=subprocess.PIPE, text=True,
            env=patcher_env(clean_ssh=True), cwd=tmp_path, timeout=300,
        )  # fmt: skip
    assert proc.returncode == 8, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "its report could not be written to stdout (No space left on device)" in proc.stderr
    assert "ended with exit 4 (target unreachable" in proc.stderr, proc.stderr
    assert (tmp_path / "failed.retry").exists()
