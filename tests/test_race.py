"""Runs at once on one environment: each run is one transaction, from the facts it plans on to
the record it leaves. The interleavings that once left a silent half-patch (an apply that exits
0 with the worker original) are made deterministic with the agent's pause point; the stress
test below (its long form: bench/race.py) starts runs at random offsets, locally and over ssh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from patcher.plan.planning import condition_names, target_files
from patcher.plan.target_plan import plan_target
from patcher.transport.local import AgentFailure, LocalTransport
from tests.support.cli import patcher_env
from workbench.envs import light_env, site_file
from workbench.sshd import ensure_user, spec, why_no_sshd

PATCHES = load_patches()
GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"
WORKER = "speculators/data_generation/custom_worker.py"
TARGETS = (GENERATOR, WORKER)


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def lock_path(python: Path) -> Path:
    return python.parent.parent / "share" / "patcher" / "lock"


def holders(path: Path) -> list[int]:
    """Pids of the processes that have `path` open: agents holding or waiting for the lock."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == str(path) for fd in (proc / "fd").iterdir()):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def start(*args: str, fault: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in patcher_env(clean_ssh=True).items() if k != "PATCHER_FAULT"}  # nor the user's cache
    if fault:
        env["PATCHER_FAULT"] = json.dumps(fault)
    return subprocess.Popen(
        [sys.executable, "-m", "patcher.cli", *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen) -> tuple[int, dict, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, (json.loads(out) if out.strip() else {}), err


def wait_for(condition, what: str, timeout: float = 60, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited while waiting for {what}: {proc.communicate()}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Pristine and fully patched bytes of both files."""
    python = light_env(tmp_path_factory.mktemp("reference"))
    pristine = files(python)
    assert run_cli("apply", "--python", str(python), "--no-verify")[0] == 0
    return {"pristine": pristine, "patched": files(python)}


def run_cli(*args: str) -> tuple[int, dict, str]:
    return finish(start(*args))


def applied(doc: dict) -> dict[str, str]:
    """State of each selected patch (v12 is not selected on vLLM 0.16)."""
    return {p["id"]: p["state"] for p in doc["targets"][0]["patches"] if p["state"] != "not-selected"}


def paused_at(point: str, release: Path) -> dict:
    """A fault that holds the agent at `point` until the file `release` exists."""
    return {"at": point, "action": "pause", "until": str(release), "seconds": 30}


def test_apply_that_waited_for_a_rollback_leaves_every_patch_in_place(tmp_path: Path, reference: dict):
    """The half-patch: apply read its facts while a rollback had restored the generator but not
    yet the worker, planned the generator alone, waited for the lock, wrote it, exited 0."""
    python = light_env(tmp_path)
    target = ("--python", str(python))
    assert run_cli("apply", *target, "--no-verify")[0] == 0
    release = tmp_path / "release"
    rollback = start("rollback", *target, fault=paused_at(f"file-written:{GENERATOR}", release))
    wait_for(
        lambda: files(python)[GENERATOR] == reference["pristine"][GENERATOR], "the generator restored", proc=rollback
    )
    assert files(python)[WORKER] == reference["patched"][WORKER]  # the rollback is half way
    apply = start("apply", *target, "--no-verify", "--lock-timeout", "60")
    # Its agent has opened the lock (it waits for it): whatever it read, it read by now.
    wait_for(lambda: len(holders(lock_path(python))) >= 2, "the apply's agent at the lock", proc=apply)
    release.touch()
    code, doc, err = finish(rollback)
    assert code == 0, err
    code, doc, err = finish(apply)
    assert code == 0, err
    assert files(python) == reference["patched"], doc["targets"][0]["message"]
    code, status, err = run_cli("status", *target)
    assert code == 0, err
    assert set(applied(status).values()) == {"applied"}, applied(status)


def test_status_during_a_run_does_not_take_its_temporary_file_for_an_interrupted_runs(tmp_path: Path, reference: dict):
    """A live run's temporary file (written, not yet renamed) was reported as left by an
    interrupted run, and the half-written transaction as interrupted: status waits for the run."""
    python = light_env(tmp_path)
    target = ("--python", str(python))
    assert run_cli("apply", *target, "--no-verify")[0] == 0
    release = tmp_path / "release"
    rollback = start("rollback", *target, fault=paused_at(f"temp-written:{Path(WORKER).name}", release))
    folder = site_file(python, WORKER).parent
    wait_for(lambda: list(folder.glob(".patcher-*.tmp")), "the worker's temporary file", proc=rollback)
    status = start("status", *target)
    # Released once status waits at the lock, or after a while if it does not wait at all.
    deadline = time.monotonic() + 5
    while len(holders(lock_path(python))) < 2 and time.monotonic() < deadline and status.poll() is None:
        time.sleep(0.02)
    # A second writer in the meantime gives up on the lock and touches nothing of the live run.
    code, doc, err = run_cli("apply", *target, "--no-verify", "--lock-timeout", "0.3")
    assert code == 5, err
    assert list(folder.glob(".patcher-*.tmp")), "the live run's temporary file was removed"
    release.touch()
    assert finish(rollback)[0] == 0
    code, doc, err = finish(status)
    assert code == 0, err
    notes = doc["targets"][0]["notes"]
    assert not [n for n in notes if "interrupted" in n], notes
    assert set(applied(doc).values()) == {"pending"}, applied(doc)  # the rollback's end state
    assert files(python) == reference["pristine"]
    assert not list(folder.glob(".patcher-*.tmp"))


def test_status_reads_anyway_and_says_so_when_a_run_keeps_the_lock(tmp_path: Path):
    """status waits for a writer (10 s) rather than show its work half done, but never blocks
    on one that does not finish: it reads the files as they are and says so."""
    import fcntl

    python = light_env(tmp_path)
    assert run_cli("apply", "--python", str(python), "--no-verify")[0] == 0
    with open(lock_path(python), "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # a run that does not finish
        code, doc, err = run_cli("status", "--python", str(python))
    assert code == 0, err
    notes = [n for n in doc["targets"][0]["notes"] if not n.startswith("model runner:")]
    assert notes[0].startswith("another patcher run held the lock for 10s"), notes
    assert set(applied(doc).values()) == {"applied"}
    code, doc, err = run_cli("status", "--python", str(python))
    assert code == 0 and [n for n in doc["targets"][0]["notes"] if not n.startswith("model runner:")] == [], doc


def test_the_agent_refuses_a_plan_made_before_any_file_of_the_selection_changed(tmp_path: Path, reference: dict):
    """Defence in depth behind the lock: an apply request carries the facts it was planned on
    (every target file and the record), not only the files it writes; if any differs under the
    lock, nothing is written (stale-plan) and the controller plans again."""
    python = light_env(tmp_path)
    target = ("--python", str(python))
    worker_patches = [arg for p in PATCHES if p.target.path == WORKER for arg in ("--only", p.id)]
    assert run_cli("apply", *target, "--no-verify", *worker_patches)[0] == 0
    worker_patched = files(python)[WORKER]
    with LocalTransport(str(python)) as session:
        # Facts read without the lock, as `status` reads them when the lock stays busy.
        facts = session.call(
            {"op": "facts", "names": condition_names(PATCHES), "files": target_files(p.spec() for p in PATCHES)}
        )
        plan = plan_target(facts, PATCHES, "apply")
        assert [c.path for c in plan.changes] == [GENERATOR]  # the worker is patched already
        assert run_cli("rollback", *target)[0] == 0  # another run takes the worker's patches out
        request = {
            "op": "apply",
            "files": [c.as_request() for c in plan.changes],
            "expect": facts.get("snapshot"),
            "lock_timeout": 10,
            "declared": target_files(p.spec() for p in PATCHES),
        }
        with pytest.raises(AgentFailure) as failure:
            session.call(request)
    assert failure.value.kind == "stale-plan"
    assert WORKER in failure.value.message
    assert files(python) == reference["pristine"]  # nothing written
    assert worker_patched != reference["pristine"][WORKER]


@pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")
def test_a_user_who_cannot_write_reads_under_the_lock_and_succeeds_with_nothing_to_do(
    tmp_path: Path, client, servers, shared_env
):
    """A run that would write takes the lock before its facts; a login user who may not write
    the environment (cannot open the lock for writing) still reads under a shared lock: an apply
    with nothing to do succeeds as before, one that must write fails as not writable."""
    assert run_cli("apply", "--python", str(shared_env), "--no-verify")[0] == 0  # as root, locally
    patched = files(shared_env)
    ensure_user("patcher-plain")
    server = servers(users=("patcher-plain",))
    via = ("--host", spec(server, "patcher-plain"), "--python", str(shared_env), *client.args())
    code, doc, err = run_cli("apply", "--no-verify", *via)
    assert code == 0, err
    assert doc["targets"][0]["message"].startswith("nothing to do"), doc["targets"][0]["message"]
    code, doc, err = run_cli("rollback", *via)
    assert code == 1, err
    assert doc["targets"][0]["message"].endswith("try --sudo")
    assert files(shared_env) == patched


# ------------------------------------------------------------------ stress (short form)

STRESS_ROUNDS = int(os.environ.get("PATCHER_RACE_ROUNDS", "10"))  # per kind; bench/race.py: hundreds


def stress(python: Path, vias: dict[str, list[str]], plan: list[tuple[int, list[str]]]) -> None:
    """`plan`: (rounds, ways) in turn, on one environment."""
    from workbench.race_stress import Stress

    seed = int(os.environ.get("PATCHER_RACE_SEED", str(time.time_ns() % 100000)))
    harness = Stress(python, vias, seed)
    for rounds, ways in plan:
        for _ in range(rounds):
            harness.round(ways)
    print(f"seed {seed}: {harness.summary()}")
    assert not harness.bad, f"seed {seed} (PATCHER_RACE_SEED reruns it):\n" + "\n".join(harness.bad)


def test_stress_runs_at_random_offsets_locally(tmp_path: Path):
    stress(light_env(tmp_path), {"local": []}, [(STRESS_ROUNDS, ["local"])])


@pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")
def test_stress_runs_at_random_offsets_over_ssh_and_locally_at_once(tmp_path: Path, client, servers):
    server = servers()
    python = light_env(tmp_path)
    via = ["--host", spec(server), *client.args()]
    assert run_cli("status", *via, "--python", str(python))[0] == 0  # its host key is known from here on
    rounds = max(1, STRESS_ROUNDS // 2)
    stress(python, {"ssh": via, "local": []}, [(rounds, ["ssh"]), (rounds, ["ssh", "local"])])
