"""Files patcher writes outside a target (a bundle, a retry file, a --markdown report) cannot be
redirected or kept by another user, never replace a device or a folder, and leave nothing behind."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from patcher.frontends.bundle import write as write_bundle
from patcher.output_files import OutputFileError, write_output_file
from tests.support.cli import patcher

NOBODY = 65534


def leftovers(folder: Path, name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}"))


def test_a_link_at_the_old_temporary_name_is_never_written_through(tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret\n")
    victim.chmod(0o600)
    out = tmp_path / "patcher-bundle.py"
    (tmp_path / f".{out.name}.tmp").symlink_to(victim)  # another user's link, made beforehand
    write_bundle(out, "print('bundle')\n")
    assert victim.read_bytes() == b"secret\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert out.read_text() == "print('bundle')\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_file_someone_made_beforehand_never_becomes_the_bundle(tmp_path: Path):
    out = tmp_path / "patcher-bundle.py"
    planted = tmp_path / f".{out.name}.tmp"
    planted.write_bytes(b"")
    os.chown(planted, NOBODY, NOBODY)
    write_bundle(out, "print('bundle')\n")
    assert out.stat().st_uid == os.geteuid()
    assert planted.read_bytes() == b""


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_device_or_a_folder_is_refused_and_nothing_is_left(tmp_path: Path):
    device = tmp_path / "null"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a copy of /dev/null
    folder = tmp_path / "folder"
    folder.mkdir()
    for target, kind in ((device, "a character device"), (folder, "a folder")):
        code, _, err = patcher("bundle", "-o", str(target))
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"{target} is {kind}" in lines[0], err
        assert leftovers(tmp_path, target.name) == []
    assert stat.S_ISCHR(device.lstat().st_mode)
    assert list(folder.iterdir()) == []


def test_a_missing_folder_is_one_line_before_any_work(tmp_path: Path):
    code, _, err = patcher("bundle", "-o", str(tmp_path / "nowhere" / "b.py"))
    assert code == 2
    assert "the folder" in err and "does not exist; create it first" in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path):
    out = tmp_path / "report.md"
    out.write_bytes(b"old\n")
    with pytest.raises(TypeError):
        write_output_file(out, "not bytes")  # type: ignore[arg-type]
    assert out.read_bytes() == b"old\n"
    assert leftovers(tmp_path, out.name) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a sticky folder shared with another user needs root")
def test_another_users_file_in_a_sticky_folder_is_one_line():
    shared = Path(tempfile.mkdtemp(prefix="patcher-sticky-", dir="/tmp"))  # reachable by that user
    shared.chmod(0o1777)
    theirs = shared / "report.md"
    theirs.write_bytes(b"theirs\n")
    os.chown(theirs, NOBODY, NOBODY)
    pid = os.fork()
    if pid == 0:  # as another ordinary user, who may not replace nobody's file there
        os.setgid(NOBODY - 1)
        os.setuid(NOBODY - 1)
        try:
            write_output_file(theirs, b"mine\n")
        except OutputFileError as error:
            os._exit(0 if "another user" in str(error) else 3)
        os._exit(4)
    _, status = os.waitpid(pid, 0)
    try:
        assert os.waitstatus_to_exitcode(status) == 0
        assert theirs.read_bytes() == b"theirs\n"
        assert leftovers(shared, theirs.name) == []
    finally:
        shutil.rmtree(shared)
