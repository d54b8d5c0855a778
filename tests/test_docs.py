"""The docs site (mkdocs.yml, docs/) builds with --strict: a broken link or anchor, or a page in
docs/ that the navigation leaves out, fails here; README stays short and keeps the quick start's
commands, the test command being exactly what .ci/run runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_LIMIT = 15 * 1024  # bytes: the five-minute read; the rest is the docs site's


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_the_docs_build_strictly(tmp_path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "patches" / "index.html").is_file()
    assert (tmp_path / "site" / "writing-a-patch" / "index.html").is_file()


def test_a_broken_link_or_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    for change, said in (
        (lambda docs: (docs / "usage.md").open("a").write("\n[gone](no-such-page.md)\n"), "no-such-page.md"),
        (lambda docs: (docs / "usage.md").open("a").write("\n[gone](patches.md#no-such-heading)\n"), "no-such-heading"),
        (lambda docs: (docs / "orphan.md").write_text("# Orphan\n"), "orphan.md"),
    ):
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(ROOT / "docs", copy / "docs")
        shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
        change(copy / "docs")
        done = build(copy / "mkdocs.yml", copy / "site")
        assert done.returncode != 0 and said in done.stderr, done.stderr[-2000:]


def test_readme_is_short_and_its_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= README_LIMIT, f"README.md is {len(readme.encode())} bytes: move detail to docs/"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci == ".ci/bootstrap && .venv/bin/python -m pytest", ci
    assert f"```\n{ci}\n```" in readme
    assert "```\n.ci/bootstrap && .venv/bin/patcher demo\n```" in readme


FIGURE = re.compile(r"\b\d+(?:\.\d+)?(?:\s*(?:–|-|to)\s*\d+(?:\.\d+)?)?\s*(?:GB|MB|minutes|min|s)\b")


def first_run_figures() -> set[str]:
    """The figures a newcomer reads about the first run, as they follow from the record they were
    measured into (bench/results/first-run.json): every other figure in those texts is a defect."""
    record = json.loads((ROOT / "bench" / "results" / "first-run.json").read_text(encoding="utf-8"))
    runs = sorted(record["tests"]["ci_seconds"].values())
    return {
        f"{round(record['demo']['seconds'] / 60)} minutes",
        f"{round(record['demo']['cache_gb'])} GB",
        f"{round(runs[0] / 60)} to {round(runs[-1] / 60)} minutes",
        f"{round(record['tests']['cache_gb'])} GB",
    }


def stated_figures(text: str) -> set[str]:
    return {" ".join(m.group(0).split()) for m in FIGURE.finditer(text)}


def test_the_first_run_figures_are_the_recorded_ones():
    figures = first_run_figures()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = readme[readme.index("## Quick start") : readme.index("## Everyday commands")]
    stated = stated_figures(quick_start)
    assert stated == figures, (
        f"README's quick start states {sorted(stated - figures)}; the record says {sorted(figures)}"
    )
    development = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    budget = development[development.index("- CI budget") : development.index("## Lint and types")]
    assert stated_figures(budget) - {"60 minutes", "90", "15 GB"} <= figures, stated_figures(budget)
    assert {f for f in figures if "to" in f} <= stated_figures(budget)


def ansible_figures() -> str:
    """README's Ansible sentence as both recorded runs (bench/results/benchmarks/ansible.json, the
    docs' benchmark page; bench/results/ansible-single-run-with-pyinfra.json, docs/ansible.md's
    table) give it: the collection's time over patcher's runner, Ansible copy's over the collection."""
    results = ROOT / "bench" / "results"
    loaded = json.loads((results / "benchmarks" / "ansible.json").read_text(encoding="utf-8"))["results"]["points"]
    single = json.loads((results / "ansible-single-run-with-pyinfra.json").read_text(encoding="utf-8"))["points"]
    points = [(p["runner_s"], p["collection_s"], p["ansible_copy_s"]) for p in loaded]
    points += [(p["runner"]["s"], p["collection"]["s"], p["ansible_copy"]["s"]) for p in single]
    cost = sorted(collection / runner for runner, collection, _ in points)
    faster = sorted(copy / collection for _, collection, copy in points)
    return (
        f"{cost[0]:.1f}x to {cost[-1]:.1f}x the time of patcher's own runner and "
        f"{faster[0]:.0f}x to {faster[-1]:.0f}x faster than Ansible's `copy`"
    )


def test_the_ansible_figures_are_the_recorded_ones():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert ansible_figures() in readme, f"README's Ansible figures: the records say {ansible_figures()!r}"


def test_a_figure_the_record_does_not_hold_is_found():
    # what README said before the figures were measured: "about 8 GB, 3–5 minutes"
    assert stated_figures("about 8 GB, 3–5 minutes; cached") - first_run_figures() == {"3–5 minutes"}


def test_the_speculators_0_4_rows_the_docs_name_are_recorded_passing_and_current():
    from patcher.upstream.release_rows import row_is_current
    from workbench.release_matrix import recorded_rows, row_passed, speculators_of

    page = (ROOT / "docs" / "speculators-releases.md").read_text(encoding="utf-8")
    named = page[page.index("The rows recorded for 0.4.0.1") : page.index("- Leave-one-out rows")]
    releases = set(re.findall(r"\b0\.[0-9]+\.[0-9]+(?:\.post[0-9]+)?(?![.0-9])", named)) - {"0.4.0.1"}
    rows = {r["release"]: r for r in recorded_rows() if speculators_of(r) == "0.4.0.1"}
    assert releases, "docs/speculators-releases.md names no 0.4.0.1 row"
    problems = {
        release: "not recorded" if release not in rows else "fails" if not row_passed(rows[release]) else "stale"
        for release in releases
        if release not in rows or not row_passed(rows[release]) or not row_is_current(rows[release])
    }
    assert not problems, f"docs/speculators-releases.md names these 0.4.0.1 rows: {problems}"
