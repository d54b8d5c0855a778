"""The documented contract, pinned: "Exit codes" and "JSON" (README, docs/usage.md) for the main commands.

Each scenario runs the real command line on a light target environment and compares the whole
JSON document (paths and hashes replaced by placeholders) with tests/golden/<name>.json, and
the exit code with the document's and README's. A change to the contract shows here as a diff;
regenerate on purpose with `python scripts/generate.py` (which runs this module with
PATCHER_UPDATE_GOLDEN=1), e.g. after adding a patch: the documents list every patch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.support.cli import patcher
from workbench.envs import fabricate_dist, light_env, site_file

GOLDEN = Path(__file__).parent / "golden"
GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"

# "Exit codes" (patcher/core/errors.py EXIT_MEANINGS: README and docs/reference/exit-codes.md).
EXIT = {"ok": 0, "failed": 1, "usage": 2, "conflict": 3, "unreachable": 4, "locked": 5, "pending": 6}
TARGET_KEYS = {
    "target",
    "python",
    "versions",
    "distributions",
    "status",
    "exit_code",
    "message",
    "notes",
    "problems",
    "state_dir",
    "files",
    "patches",
}
STATUSES = {"ok", "changed", "failed", "unreachable", "rolled-back", "skipped"}
STATES = {"applied", "pending", "not-selected", "already-satisfied", "modified", "anchor-missing", "stale", "failed"}


def normalise(doc: dict, env: Path) -> dict:
    """The document with what differs from run to run (temporary paths, hashes) as placeholders."""
    text = json.dumps(doc, indent=1, sort_keys=True)
    root = str(env.parent.parent)
    text = text.replace(root, "<env>")
    text = re.sub(r"[0-9a-f]{64}", "<sha256>", text)
    text = re.sub(r"python3\.[0-9]+", "python3.X", text)
    return json.loads(text)


def check(name: str, code: int, doc: dict | None, err: str, env: Path, expected_code: int) -> dict:
    assert doc is not None, err
    assert code == doc["exit_code"] == expected_code, (code, err)
    assert doc["schema_version"] == 1
    for target in doc["targets"]:
        assert TARGET_KEYS <= set(target), set(target) ^ TARGET_KEYS
        assert target["status"] in STATUSES
        assert {p["state"] for p in target["patches"]} <= STATES
        assert all(set(p) == {"id", "state", "reason", "file"} for p in target["patches"])
    assert doc["exit_code"] == max((t["exit_code"] for t in doc["targets"]), default=0)
    got = normalise(doc, env)
    path = GOLDEN / f"{name}.json"
    if os.environ.get("PATCHER_UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    assert path.exists(), f"no golden file {path.name}: run python scripts/generate.py"
    assert got == json.loads(path.read_text(encoding="utf-8")), (
        f"{name}: the documented JSON changed (on purpose, e.g. a new patch: run python scripts/generate.py)"
    )
    return doc


@pytest.fixture
def env(tmp_path: Path) -> Path:
    return light_env(tmp_path)


def run(name: str, env: Path, *args: str, code: int) -> dict:
    got, doc, err = patcher(*args, "--python", str(env), "--json")
    return check(name, got, doc, err, env, code)


def test_list(tmp_path: Path):
    code, doc, err = patcher("list", "--json")
    assert code == 0, err
    golden = GOLDEN / "list.json"
    if os.environ.get("PATCHER_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    assert doc == json.loads(golden.read_text(encoding="utf-8"))


def test_lifecycle(env: Path):
    run("status-pristine", env, "status", code=EXIT["ok"])
    run("plan-pristine", env, "plan", code=EXIT["pending"])
    run("apply", env, "apply", "--no-verify", code=EXIT["ok"])
    run("apply-again", env, "apply", "--no-verify", code=EXIT["ok"])
    run("plan-applied", env, "plan", code=EXIT["ok"])
    run("rollback-only-v10", env, "rollback", "--only", "v10", code=EXIT["ok"])
    run("apply-skip-v10", env, "apply", "--no-verify", "--skip", "v10", code=EXIT["ok"])
    run("rollback", env, "rollback", code=EXIT["ok"])
    run("forget", env, "forget", code=EXIT["ok"])


def test_stale_after_a_vllm_downgrade(env: Path):
    run("apply", env, "apply", "--no-verify", code=EXIT["ok"])
    fabricate_dist(env.parent.parent, "vllm", "0.11.0")
    run("status-stale", env, "status", code=EXIT["ok"])
    run("apply-removes-stale", env, "apply", "--no-verify", code=EXIT["ok"])


def test_conflicts_and_usage(env: Path, tmp_path: Path):
    # A usage error caught before any target is read: one line on stderr, no document.
    code, doc, err = patcher("apply", "--only", "v99", "--python", str(env), "--json")
    assert (code, doc) == (EXIT["usage"], None) and err.startswith("error: unknown patch id 'v99'"), err
    assert len(err.strip().splitlines()) == 1
    run("apply", env, "apply", "--no-verify", code=EXIT["ok"])
    path = site_file(env, GENERATOR)
    path.write_text(path.read_text() + "# a hand edit\n")
    run("apply-modified", env, "apply", "--no-verify", code=EXIT["conflict"])
    code, doc, err = patcher("status", "--python", str(tmp_path / "no-python"), "--json")
    check("status-no-python", code, doc, err, tmp_path / "x" / "y", EXIT["usage"])


def test_locked(env: Path):
    import fcntl

    state = env.parent.parent / "share" / "patcher"
    state.mkdir(parents=True)
    with open(state / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run("apply-locked", env, "apply", "--no-verify", "--lock-timeout", "0.2", code=EXIT["locked"])
