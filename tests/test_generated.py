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
    # said once, in the section's sentence, and the table's cell (whose column says "without it")
    assert again != page and "\nWithout it nothing works at all\n" in again
    assert "| nothing works at all |" in again and "Without it: without it" not in again
    monkeypatch.setattr(registry, "import_patches", lambda *a, **k: (dataclasses.replace(patches[0], without_it=""),))
    with pytest.raises(SystemExit, match=f"{patches[0].id} declares no without_it="):
        generate.ARTEFACTS["docs/reference/patches.md"]()


def test_the_patch_reference_shows_each_patchs_code(generate):
    """Each example as a diff, each near miss as the code left alone."""
    from patcher.patchset.registry import import_patches

    page = generate.ARTEFACTS["docs/reference/patches.md"]()
    for patch in import_patches():
        section = page.split(f"\n## {patch.id}\n", 1)[1].split("\n## ", 1)[0]
        assert section.count("```diff\n") == len(patch.examples), patch.id
        for example in patch.examples:
            removed = [line for line in example.before.splitlines() if line not in example.after.splitlines()]
            assert all(f"\n-{line}\n" in section for line in removed), patch.id
        assert section.count("```python\n") == len(patch.near_misses), patch.id
        assert ("### Left alone" in section) == bool(patch.near_misses), patch.id


def test_which_patches_a_run_needs_is_the_declared_leave_one_outs(generate, monkeypatch):
    import dataclasses

    from patcher.model import LeaveOneOut
    from patcher.patchset import registry

    text = generate.ARTEFACTS["docs/patches.md"]()
    assert "- vLLM 0.16.0, CPU build, speculators 0.3.0: needed: " in text
    patches = registry.import_patches()
    v2 = next(p for p in patches if p.short_id == "v2")
    changed = tuple(
        dataclasses.replace(p, leave_one_out=(*p.leave_one_out, LeaveOneOut("0.99.0", None))) if p is v2 else p
        for p in patches
    )
    monkeypatch.setattr(registry, "import_patches", lambda *a, **k: changed)
    assert "- vLLM 0.99.0, CPU build, speculators 0.3.0: not needed: v2\n" in generate.ARTEFACTS["docs/patches.md"]()


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
