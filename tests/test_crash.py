"""Kill the agent with SIGKILL at every step that writes, during apply and during rollback, and
check the promise after each: every file is exactly its original or its fully patched bytes,
status tells which, apply completes, rollback restores the original bytes."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher as run_patcher
from tests.support.files import GENERATOR, WORKER
from workbench.envs import light_env, site_file
from workbench.sshd import spec, why_no_sshd

# Without the user's ssh agent or cache: a killed remote run writes its retry file into the cache.
patcher = functools.partial(run_patcher, clean_ssh=True)
TARGETS = sorted({p.target.path for p in load_patches()})


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def leftovers(python: Path) -> list[str]:
    package = site_file(python, "speculators")
    return [str(p) for p in package.rglob(".patcher-*")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Pristine and fully patched bytes, and the write steps of apply and rollback."""
    root = tmp_path_factory.mktemp("reference")
    python = light_env(root)
    original = files(python)
    code, doc, err = patcher(
        "apply",
        "--python",
        str(python),
        "--no-verify",
        "--json",
        env={"PATCHER_FAULT": json.dumps({"at": "(enumerate)"})},
    )
    assert code == 0, err
    apply_points = doc["targets"][0]["checkpoints"]
    patched = files(python)
    code, doc, err = patcher(
        "rollback", "--python", str(python), "--json", env={"PATCHER_FAULT": json.dumps({"at": "(enumerate)"})}
    )
    assert code == 0, err
    return {
        "original": original,
        "patched": patched,
        "apply": apply_points,
        "rollback": doc["targets"][0]["checkpoints"],
        "template": python.parent.parent,
    }


def occurrences(points: list[str]) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    out = []
    for point in points:
        seen[point] = seen.get(point, 0) + 1
        out.append((point, seen[point]))
    return out


def test_the_write_steps_are_enumerated(reference):
    # Every kind of write is among the injection points, for every file this environment's
    # selection writes (on vLLM 0.16 without torch or transformers: the generator and the worker).
    written = [rel for rel in TARGETS if reference["original"][rel] != reference["patched"][rel]]
    assert {GENERATOR, WORKER} <= set(written), written
    for rel in written:
        assert f"file-written:{rel}" in reference["apply"]
        assert f"backup-written:{rel}" in reference["apply"]
        assert f"bytecode-removed:{rel}" in reference["apply"]
        assert f"file-written:{rel}" in reference["rollback"]
    for step in ("locked", "intent-recorded", "result-recorded"):
        assert step in reference["apply"] and step in reference["rollback"]
    assert any(p.startswith("temp-written:") for p in reference["apply"])


def check_after_kill(python: Path, reference: dict, via: tuple[str, ...] = ()) -> None:
    """`via`: how to reach the target (--host ... for a remote one); its --python is added."""
    target = (*via, "--python", str(python))
    now = files(python)
    for rel in TARGETS:
        assert now[rel] in (reference["original"][rel], reference["patched"][rel]), rel
    code, doc, err = patcher("status", *target, "--json")
    assert code == 0, err
    states = {p["file"]: p["state"] for p in doc["targets"][0]["patches"] if p["state"] != "not-selected"}
    for rel, state in states.items():
        expected = "applied" if now[rel] == reference["patched"][rel] else "pending"
        assert state == expected, (rel, state, doc["targets"][0]["notes"])
    code, _, err = patcher("apply", *target, "--no-verify")
    assert code == 0, err
    assert files(python) == reference["patched"]
    assert leftovers(python) == []
    code, _, err = patcher("rollback", *target)
    assert code == 0, err
    assert files(python) == reference["original"]


def fresh(tmp_path: Path, reference: dict) -> Path:
    env = tmp_path / "env"
    shutil.copytree(reference["template"], env, symlinks=True)
    return env / "bin" / "python"


def test_kill_during_apply(tmp_path: Path, reference: dict):
    points = occurrences(reference["apply"])
    for number, (point, nth) in enumerate(points):
        python = fresh(tmp_path / str(number), reference)
        fault = json.dumps({"at": point, "nth": nth})
        code, _, err = patcher("apply", "--python", str(python), "--no-verify", env={"PATCHER_FAULT": fault})
        assert code == 4 and "killed by signal 9" in err, (point, nth, err)
        check_after_kill(python, reference)
    print(f"apply: killed at {len(points)} write steps: {points}")


def test_kill_during_rollback(tmp_path: Path, reference: dict):
    points = occurrences(reference["rollback"])
    for number, (point, nth) in enumerate(points):
        python = fresh(tmp_path / str(number), reference)
        assert patcher("apply", "--python", str(python), "--no-verify")[0] == 0
        fault = json.dumps({"at": point, "nth": nth})
        code, _, err = patcher("rollback", "--python", str(python), env={"PATCHER_FAULT": fault})
        assert code == 4 and "killed by signal 9" in err, (point, nth, err)
        check_after_kill(python, reference)
    print(f"rollback: killed at {len(points)} write steps: {points}")


# ------------------------------------------------------------------ on a remote host


@pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")
def test_kill_during_apply_and_rollback_on_a_remote_host(tmp_path: Path, reference: dict, client, servers):
    """The same kills, the agent running behind a real sshd on loopback: the fault travels in
    the request, so the remote agent kills itself at the same write steps."""
    server = servers()
    via = ("--host", spec(server), *client.args())
    tested = 0
    for phase in ("apply", "rollback"):
        for number, (point, nth) in enumerate(occurrences(reference[phase])):
            python = fresh(tmp_path / f"{phase}{number}", reference)
            if phase == "rollback":
                assert patcher("apply", *via, "--python", str(python), "--no-verify")[0] == 0
            fault = json.dumps({"at": point, "nth": nth})
            args = [phase, *via, "--python", str(python)] + (["--no-verify"] if phase == "apply" else [])
            code, _, err = patcher(*args, env={"PATCHER_FAULT": fault})
            assert code == 4, (phase, point, nth, err)
            check_after_kill(python, reference, via)
            tested += 1
    print(f"remote: killed at {tested} write steps")
