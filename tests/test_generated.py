"""Every generated artefact (scripts/generate.py: the help text and the docs' generated pages) is
what the code and the records render now; the golden JSON files are tests/test_contract.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def generate():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import generate

        return generate
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_every_generated_artefact_is_current(generate):
    stale = generate.out_of_date()
    assert not stale, f"out of date: {', '.join(stale)}: run python scripts/generate.py"


def test_a_changed_declaration_changes_its_page(generate, monkeypatch):
    import dataclasses

    from patcher.patchset import registry

    page = generate.ARTEFACTS["docs/reference/patches.md"]()
    patches = registry.import_patches()
    changed = (dataclasses.replace(patches[0], without_it="without it nothing works at all"), *patches[1:])
    monkeypatch.setattr(registry, "import_patches", lambda *a, **k: changed)
    again = generate.ARTEFACTS["docs/reference/patches.md"]()
    assert again != page and "without it nothing works at all" in again
    monkeypatch.setattr(registry, "import_patches", lambda *a, **k: (dataclasses.replace(patches[0], without_it=""),))
    with pytest.raises(SystemExit, match=f"{patches[0].id} declares no without_it="):
        generate.ARTEFACTS["docs/reference/patches.md"]()


def test_the_check_names_the_command_and_writes_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--check", "--no-golden"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    bad = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--chek"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown argument --chek" in bad.stderr
