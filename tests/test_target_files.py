"""Target files patcher will not read (issue 38): a fifo or a device where a target file belongs,
a file over the size limit (PATCHER_TARGET_FILE_LIMIT_MIB, 0.25 MiB: patcher's are a few dozen
KiB, and the codemods' cost grows faster than the file), a file that is not UTF-8. Each is one
line naming the file (and the limit, or the byte and its offset), exit 3, nothing written, and
`status` still reports every other file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher
from tests.support.files import GENERATOR, WORKER
from workbench.envs import light_env, site_file

TARGETS = sorted({p.target.path for p in load_patches()})


def files(python: Path) -> dict[str, bytes | None]:
    return {rel: site_file(python, rel).read_bytes() if site_file(python, rel).is_file() else None for rel in TARGETS}


def others_reported(doc: dict, refused: str) -> None:
    """Every patch is reported; those of the other files as the light environment has them."""
    patches = doc["targets"][0]["patches"]
    assert {p["id"] for p in patches} == {p.id for p in load_patches()}
    assert {p["state"] for p in patches if p["file"] == refused} == {"modified"}
    assert {p["state"] for p in patches if p["file"] != refused} >= {"pending"}


@pytest.fixture
def python(tmp_path: Path) -> Path:
    return light_env(tmp_path)


def test_a_fifo_as_a_target_file_is_refused_and_nothing_written(python: Path):
    worker = site_file(python, WORKER)
    worker.unlink()
    os.mkfifo(worker)
    before = files(python)
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert code == 3, err
    assert doc is not None
    assert doc["targets"][0]["message"] == (
        f"{worker} is not a regular file (a fifo): patcher reads plain files only; put the package's own file "
        "back (pip install --force-reinstall the package) and run patcher again"
    )
    others_reported(doc, WORKER)
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 3, err
    assert "is not a regular file (a fifo)" in err.strip().splitlines()[-1]
    assert files(python) == before  # the other files were once patched, exit 0


def test_a_target_file_over_the_size_limit_names_the_file_and_the_limit(python: Path):
    """The limit lowered to 10 KiB: the 11 KiB generator is over it (no need for a huge file)."""
    before = files(python)
    generator = site_file(python, GENERATOR)
    small = {"PATCHER_TARGET_FILE_LIMIT_MIB": str(10 / 1024)}
    code, doc, err = patcher("status", "--python", str(python), "--json", env=small)
    assert code == 3, err
    assert doc is not None
    assert doc["targets"][0]["message"].startswith(
        f"{generator} is {generator.stat().st_size} bytes, over the 0.00976562 MiB a target file may have"
    )
    assert doc["targets"][0]["message"].endswith(
        "or set PATCHER_TARGET_FILE_LIMIT_MIB where patcher runs to a larger number of MiB"
    )
    others_reported(doc, GENERATOR)
    code, _, err = patcher("plan", "--python", str(python), env=small)
    assert code == 3, err
    assert files(python) == before
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))  # the default limit: applies
    assert code == 0, err


def test_a_byte_that_is_not_utf8_names_the_file_and_its_offset(python: Path):
    generator = site_file(python, GENERATOR)
    data = generator.read_bytes()
    offset = data.index(b"import")
    generator.write_bytes(data[:offset] + b"\xff" + data[offset + 1 :])
    before = files(python)
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert code == 3, err
    assert doc is not None
    assert doc["targets"][0]["message"] == (
        f"{generator} is not UTF-8 text (byte 0xff at offset {offset}): it is not the package's Python source; "
        "put the package's own file back (pip install --force-reinstall the package) and run patcher again"
    )
    others_reported(doc, GENERATOR)
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 3 and "Traceback" not in err and "UnicodeDecodeError" not in err, err
    assert files(python) == before


def test_planning_refuses_an_oversized_text_whatever_the_target_says():
    """The controller's own check (a target whose agent reads more than it should)."""
    from patcher.plan.target_plan import within_limit

    facts = {
        "distributions": {},
        "state": {"files": {}},
        "files": {GENERATOR: {"exists": True, "root": "/r", "content": "x" * 2000, "sha256": "0" * 64}},
    }
    refused = within_limit(facts, 1000)["files"][GENERATOR]
    assert refused == {"exists": True, "root": "/r", "refused": refused["refused"]}
    assert refused["refused"].startswith(f"/r/{GENERATOR} is 2000 bytes, over the 0.000953674 MiB a target file")
    assert within_limit(facts, 2000) == facts
