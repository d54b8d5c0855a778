"""The state folder (`<sys.prefix>/share/patcher`, where the originals rollback restores are kept)
is trusted only when it is owned like the files it guards, and an original is restored only when
it is the bytes pip's RECORD gives, or the record says it was adopted with `apply --force`, or
`rollback --force` asks for it. Real environments, a real second user (setpriv), real files."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher
from tests.support.files import GENERATOR
from tests.support.state import NOBODY, PLANTED, plant_original, state_dir
from workbench.envs import site_file

TARGETS = sorted({p.target.path for p in load_patches()})


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


def message(doc: dict | None) -> str:
    assert doc is not None
    return doc["targets"][0]["message"]


def rollback_refused(python: Path, *, expect_in_message: str) -> None:
    patched = files(python)
    for command in (("status",), ("plan",), ("rollback",)):
        code, doc, err = patcher(*command, "--python", str(python), "--json")
        assert code == 3, (command, err)
        assert expect_in_message in message(doc), (command, message(doc))
        assert "\n" not in message(doc)
        assert files(python) == patched, command
    assert not Path("/tmp/owned-by-the-state-folder").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's state folder needs root to make")
def test_a_state_folder_another_user_owns_is_refused_before_rollback_restores_from_it(shared_env: Path):
    python = shared_env
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    folder = state_dir(python)
    for path in [folder, *folder.rglob("*")]:  # the folder handed to another user
        os.chown(path, NOBODY, NOBODY)
    plant_original(python, as_nobody=True)
    rollback_refused(python, expect_in_message=f"belongs to uid {NOBODY}, not to root or the environment's owner")


@pytest.mark.skipif(os.geteuid() != 0, reason="the attack is made as another user")
def test_a_state_folder_others_can_write_is_refused_after_another_user_planted_an_original(shared_env: Path):
    python = shared_env
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    folder = state_dir(python)
    for path in [folder, folder / "backups"]:
        os.chmod(path, 0o777)
    plant_original(python, as_nobody=True)
    rollback_refused(python, expect_in_message="writable by group and others")


@pytest.mark.parametrize("where", ["", "backups", "state.json", "lock"])
def test_each_state_entry_others_can_write_is_refused(host_env, where: str):
    python = host_env()
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    entry = state_dir(python) / where
    os.chmod(entry, 0o775 if entry.is_dir() else 0o664)  # group-writable is enough to refuse
    patched = files(python)
    for command in (("status",), ("rollback",), ("forget", "--all")):
        code, doc, err = patcher(*command, "--python", str(python), "--json")
        assert code == 3, (command, err)
        assert f"refusing {str(entry).rstrip('/')}: it is writable by its group (mode" in message(doc), message(doc)
        assert files(python) == patched, command


def test_an_original_that_is_not_pips_bytes_is_not_restored_without_force(host_env):
    """The state folder passes its owner and mode checks (root planted it), the record was edited:
    pip's RECORD still says what the original was, and the planted one is not it."""
    python = host_env()
    pristine = files(python)
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    plant_original(python, as_nobody=False)
    patched = files(python)
    code, doc, err = patcher("rollback", "--python", str(python), "--json")
    assert code == 3, err
    text = message(doc)
    assert "is not the" in text and "pip's RECORD gives" in text and "rollback --force" in text, text
    assert files(python) == patched
    code, _, err = patcher("rollback", "--force", "--python", str(python))  # what --force is for
    assert code == 0, err
    assert site_file(python, GENERATOR).read_bytes() == PLANTED
    assert {k: v for k, v in files(python).items() if k != GENERATOR} == {
        k: v for k, v in pristine.items() if k != GENERATOR
    }


def test_an_original_adopted_with_force_is_restored_and_dropping_its_mark_is_refused(host_env):
    python = host_env()
    target = site_file(python, GENERATOR)
    edited = target.read_bytes() + b"# a hand edit, adopted\n"
    target.write_bytes(edited)
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 3, err  # changed by hand: refused without --force
    code, _, err = patcher("apply", "--no-verify", "--force", "--python", str(python))
    assert code == 0, err
    record_file = state_dir(python) / "state.json"
    record = json.loads(record_file.read_text())
    assert record["files"][GENERATOR]["original_adopted"] is True
    others = [rel for rel in record["files"] if rel != GENERATOR]
    assert all(record["files"][rel]["original_adopted"] is False for rel in others)
    snapshot = record_file.read_bytes()
    # a record without the mark (an older patcher's, or edited): the adopted original is refused
    record["files"][GENERATOR].pop("original_adopted")
    record_file.write_text(json.dumps(record))
    code, doc, err = patcher("rollback", "--python", str(python), "--json")
    assert code == 3 and "rollback --force" in message(doc), err
    assert target.read_bytes() != edited
    record_file.write_bytes(snapshot)
    code, _, err = patcher("rollback", "--python", str(python))
    assert code == 0, err
    assert target.read_bytes() == edited


def test_a_pip_reinstall_between_apply_and_rollback_is_not_clobbered(host_env):
    from workbench.envs import reinstall_speculators

    python = host_env()
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    reinstall_speculators(python)
    target = site_file(python, GENERATOR)
    target.write_bytes(target.read_bytes() + b"# what the reinstall brought (a local build)\n")
    reinstalled = files(python)
    code, _, err = patcher("rollback", "--python", str(python))
    assert code in (0, 3), err
    assert files(python) == reinstalled


def test_a_fifo_at_the_lock_is_refused_at_once(host_env):
    python = host_env()
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    lock = state_dir(python) / "lock"
    lock.unlink()
    os.mkfifo(lock)
    for command in (("status",), ("plan",), ("apply", "--no-verify")):
        started = time.monotonic()
        code, doc, err = patcher(*command, "--python", str(python), "--json", timeout=60)
        assert time.monotonic() - started < 8, command  # it used to wait out the lock and exit 4
        assert code == 3, (command, err)
        assert f"refusing {lock}: it is not a plain file" in message(doc), message(doc)


def test_a_sparse_gigabyte_state_record_is_refused_before_it_is_read(host_env):
    import resource

    python = host_env()
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 0, err
    record = state_dir(python) / "state.json"
    with open(record, "r+b") as fh:
        fh.truncate(3 << 30)

    def cap_memory() -> None:  # the agent inherits it: reading 3 GB would be a MemoryError
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    for command in ("status", "rollback"):
        proc = subprocess.run(
            [str(Path(__file__).resolve().parents[1] / ".venv/bin/python"), "-m", "patcher", command,
             "--python", str(python), "--json"],
            capture_output=True, text=True, timeout=120, preexec_fn=cap_memory,
        )  # fmt: skip
        assert proc.returncode == 3, proc.stderr
        text = message(json.loads(proc.stdout))
        assert "3072 MiB, more than patcher ever writes there (64 MiB)" in text, text
        assert "MemoryError" not in proc.stdout + proc.stderr
