"""A patch set from outside patcher's package, through the command line as users run it: the
Flask 2.2 / Werkzeug 3 set of tests/support/flask_werkzeug3 on real Flask and Werkzeug releases,
given as a folder (--patches DIR) and installed from a wheel built here (entry point
`patcher.patch_sets`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import patcher, run_patcher, sha, states
from tests.support.patch_sets import FILES, IDS, SET_SOURCE, copy_of_set, flask_works
from workbench.envs import flask_env, site_file
from workbench.sshd import why_no_sshd


@pytest.fixture
def flask_target(tmp_path):
    python = flask_env(tmp_path)
    return python, {rel: site_file(python, rel).read_bytes() for rel in FILES}


@pytest.fixture(scope="module")
def installed_set(tmp_path_factory) -> dict:
    """The set built into a wheel here (setuptools, entry point patcher.patch_sets) and installed
    with pip where the controller finds it: the environment patcher runs with."""
    root = tmp_path_factory.mktemp("installed-set")
    project = root / "project"
    shutil.copytree(SET_SOURCE, project / "flask_werkzeug3", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "flask-werkzeug3-patches"\nversion = "1.0"\n\n'
        '[project.entry-points."patcher.patch_sets"]\nflask-werkzeug3 = "flask_werkzeug3"\n\n'
        '[tool.setuptools]\npackages = ["flask_werkzeug3"]\n'
    )
    wheels = root / "wheels"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "-w", str(wheels), str(project)], check=True, capture_output=True, timeout=600
    )
    site = root / "controller-site"
    built = [str(w) for w in wheels.glob("*.whl")]
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), *built], check=True, capture_output=True, timeout=600
    )
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))}


@pytest.fixture(params=["folder", "installed"])
def team_set(request, tmp_path) -> tuple[list[str], dict]:
    """The Flask set as a run takes it: (options before the command, environment): given with
    --patches DIR, or installed from a wheel."""
    if request.param == "folder":
        return ["--patches", str(copy_of_set(tmp_path))], {}
    return [], request.getfixturevalue("installed_set")


def test_a_set_goes_through_status_plan_apply_and_rollback(flask_target, team_set):
    python, pristine = flask_target
    given, env = team_set
    broken = flask_works(python)
    assert broken.returncode != 0 and "cannot import name 'url_quote' from 'werkzeug.urls'" in broken.stderr

    code, doc, err = patcher(*given, "status", "--python", str(python), "--json", env=env)
    assert code == 0, err
    assert states(doc) == dict.fromkeys(IDS, "pending")  # patcher's own patches have nothing here
    assert any("patcher's own patches: not used here" in n for n in doc["targets"][0]["notes"])

    code, doc, err = patcher(*given, "plan", "--python", str(python), "--json", env=env)
    assert code == 6, err

    code, doc, err = patcher(*given, "apply", "--python", str(python), "--json", env=env)
    assert code == 0, err
    assert states(doc) == dict.fromkeys(IDS, "applied")
    assert flask_works(python).stdout.strip() == "hi"
    patched = {rel: sha(site_file(python, rel)) for rel in FILES}

    code, doc, err = patcher(*given, "apply", "--python", str(python), "--json", env=env)
    assert code == 0 and doc["targets"][0]["status"] == "ok", err  # nothing to do: a fixed point
    assert {rel: sha(site_file(python, rel)) for rel in FILES} == patched

    code, doc, err = patcher(
        *given, "rollback", "--only", "flask-werkzeug3:v1", "--python", str(python), "--json", env=env
    )
    assert code == 0, err
    assert site_file(python, "flask/app.py").read_bytes() == pristine["flask/app.py"]
    assert sha(site_file(python, "flask/testing.py")) == patched["flask/testing.py"]
    code, doc, err = patcher(*given, "rollback", "--python", str(python), "--json", env=env)
    assert code == 0, err
    assert {rel: site_file(python, rel).read_bytes() for rel in FILES} == pristine


def test_a_set_serves_only_the_releases_its_gates_and_lines_name(tmp_path):
    folder = copy_of_set(tmp_path)
    # Werkzeug 2.3 still has url_quote: Flask 2.2.2 runs as it is, nothing is selected
    python = flask_env(tmp_path / "a", werkzeug="2.3.8")
    code, doc, err = patcher("--patches", str(folder), "status", "--python", str(python), "--json")
    assert code == 0, err
    assert set(states(doc).values()) == {"not-selected"}
    assert flask_works(python).stdout.strip() == "hi"
    # Flask 2.2.5 is on the set's unpatched line: nothing to do, and status says why
    python = flask_env(tmp_path / "b", flask="2.2.5")
    code, doc, err = patcher("--patches", str(folder), "status", "--python", str(python), "--json")
    assert code == 0, err
    assert "Flask 2.2.4 and later import nothing Werkzeug 3.0 removed" in doc["targets"][0]["message"], doc
    # Flask 2.1.3 is on no line the set declares: refused (exit 7), never "ok"
    python = flask_env(tmp_path / "c", flask="2.1.3")
    code, doc, err = patcher("--patches", str(folder), "apply", "--python", str(python), "--json")
    assert code == 7, err
    assert "flask 2.1.3 is not a release patcher covers" in doc["targets"][0]["message"], doc


def test_list_names_the_sets_in_use(team_set):
    given, env = team_set
    proc = run_patcher(*given, "list", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert [p["id"] for p in listed["patches"] if p["set"] == "flask-werkzeug3"] == IDS
    assert "v1-block-hasher" in [p["id"] for p in listed["patches"] if p["set"] == "speculators"]
    assert [x["name"] for x in listed["sets"]] == ["speculators", "flask-werkzeug3"]


def test_a_bare_id_two_sets_share_is_refused(tmp_path, flask_target):
    python, _ = flask_target
    folder = copy_of_set(tmp_path)
    proc = run_patcher("--patches", str(folder), "apply", "--only", "v1", "--python", str(python))
    assert proc.returncode == 2
    assert "names a patch of several sets (flask-werkzeug3:v1, v1): qualify it as SET:vN" in proc.stderr
    proc = run_patcher("--patches", str(folder), "plan", "--only", "v1-url-quote", "--python", str(python))
    assert proc.returncode == 6, proc.stderr  # a bare form only one set has is enough


@pytest.mark.parametrize(
    "arrange,expected",
    [
        (lambda folder: folder.chmod(0o775), "is writable by its group"),
        (lambda folder: (folder / "v1_url_quote.py").chmod(0o666), "v1_url_quote.py is writable by others"),
        (lambda folder: [p.unlink() for p in folder.glob("v*.py")], "no patch module (vN_slug.py) in it"),
        (lambda folder: shutil.rmtree(folder), "not a folder"),
    ],
    ids=["group-writable", "file-writable-by-others", "no-patch-modules", "missing"],
)
def test_a_folder_that_cannot_be_used_is_refused_in_one_line(tmp_path, arrange, expected):
    folder = copy_of_set(tmp_path)
    arrange(folder)
    proc = run_patcher("--patches", str(folder), "list")
    assert proc.returncode == 2
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")
def test_a_fleet_applies_a_set_over_ssh(tmp_path, client, servers, team_set):
    # two hosts (sshd on two loopback addresses), each with its own Flask environment
    given, env = team_set
    pythons = [flask_env(tmp_path / "h0"), flask_env(tmp_path / "h1")]
    pristine = {rel: site_file(pythons[0], rel).read_bytes() for rel in FILES}
    inventory = tmp_path / "hosts.ini"
    lines = [
        f"h{i} ansible_host={server.address} ansible_port={server.port} ansible_user=root "
        f"ansible_python_interpreter={python}"
        for i, (server, python) in enumerate(zip((servers(), servers()), pythons))
    ]
    inventory.write_text("[gpu]\n" + "\n".join(lines) + "\n")
    common = ["-i", str(inventory), *client.args(), "--no-retry-file", "--json"]
    code, doc, err = patcher(*given, "apply", *common, clean_ssh=True, env=env)
    assert code == 0, err
    assert [t["status"] for t in doc["targets"]] == ["changed", "changed"], doc
    assert all(flask_works(python).stdout.strip() == "hi" for python in pythons)
    code, doc, err = patcher(*given, "rollback", *common, clean_ssh=True, env=env)
    assert code == 0, err
    for python in pythons:
        assert {rel: site_file(python, rel).read_bytes() for rel in FILES} == pristine


def test_a_bundle_carries_a_set_and_only_the_sets_it_is_asked_for(tmp_path, flask_target, team_set):
    python, pristine = flask_target
    given, env = team_set
    out = tmp_path / "flask-bundle.py"
    code, _, err = patcher(*given, "bundle", "--set", "flask-werkzeug3", "-o", str(out), env=env)
    assert code == 0, err
    info = subprocess.run([str(python), str(out), "info"], capture_output=True, text=True, timeout=300).stdout
    assert "flask 2.2.2, werkzeug >= 3.0.0: flask-werkzeug3:v1, flask-werkzeug3:v2" in info, info
    assert "speculators" not in info  # only the set it was asked for
    apply = subprocess.run([str(python), str(out), "apply"], capture_output=True, text=True, timeout=300)
    assert apply.returncode == 0, apply.stderr + apply.stdout
    assert flask_works(python).stdout.strip() == "hi"
    rollback = subprocess.run([str(python), str(out), "rollback"], capture_output=True, text=True, timeout=300)
    assert rollback.returncode == 0, rollback.stderr + rollback.stdout
    assert {rel: site_file(python, rel).read_bytes() for rel in FILES} == pristine

    code, _, err = patcher(*given, "bundle", "--set", "flask", "-o", str(tmp_path / "x.py"), env=env)
    assert code == 2 and "no patch set named flask is in use; in use: speculators, flask-werkzeug3" in err, err


def test_new_writes_a_skeleton_that_test_patches_passes(tmp_path):
    folder = tmp_path / "team_set"
    for name, target in (("url-quote", "flask:flask/app.py"), ("url_parse", "flask:flask/testing.py")):
        proc = run_patcher("new", name, "--target", target, "--into", str(folder))
        assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in folder.glob("v*.py")) == ["v1_url_quote.py", "v2_url_parse.py"]
    targets = (folder / "targets.py").read_text()
    assert (
        'APP = TargetFile("flask", "flask/app.py")' in targets
        and 'TESTING = TargetFile("flask", "flask/testing.py")' in targets
    )
    proc = run_patcher("test-patches", str(folder))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok   team-set:v1-url-quote: 5 of 5 checks hold" in proc.stdout

    for args, expected in (
        (["new", "Url Quote", "--target", "flask:flask/app.py"], "name the patch in lowercase letters"),
        (["new", "x", "--target", "flask/app.py"], "expected DIST:PATH"),
        (["new", "x", "--target", "flask:../../etc/passwd.py"], "expected DIST:PATH"),
    ):
        proc = run_patcher(*args, "--into", str(folder))
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert len(list(folder.glob("v*.py"))) == 2  # nothing written


def test_test_patches_says_which_check_fails(tmp_path):
    folder = copy_of_set(tmp_path)
    module = folder / "v1_url_quote.py"
    source = module.read_text()
    # an after that is not what the codemod writes, and a near miss the codemod does rewrite
    module.write_text(
        source.replace(
            'rv = f"{rv}#{_anchor}"\n\n            return rv',
            "rv = f\"{rv}#{_anchor}\"\n\n            return rv + ''",
            1,
        )
        .replace("from werkzeug.urls import iri_to_uri", "from werkzeug.urls import url_quote")
        .replace("return iri_to_uri(self.build(endpoint))", 'rv = f"{rv}#{url_quote(_anchor)}"')
    )
    proc = run_patcher("test-patches", str(folder))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL flask-werkzeug3:v1-url-quote" in proc.stdout
    assert "example 1: before does not become after:" in proc.stdout and "-        return rv + ''" in proc.stdout
    assert "near miss 1: reads applied, not anchor-missing" in proc.stdout
    assert "ok   flask-werkzeug3:v2-url-parse" in proc.stdout

    module.write_text(source.replace("PATCH = Patch(", "PATCH = Patch(unknown=1,", 1))
    proc = run_patcher("test-patches", str(folder))
    assert proc.returncode == 2 and "its patch modules do not load: TypeError" in proc.stderr, proc.stderr


def test_the_docs_show_the_sets_files_as_they_are():
    # docs/writing-a-patch-set.md shows targets.py, v1 and release_lines.py whole: each block is the file
    import re

    page = (Path(__file__).parent.parent / "docs" / "writing-a-patch-set.md").read_text(encoding="utf-8")
    shown = dict(re.findall(r"<!-- tests/support/flask_werkzeug3/(\S+) -->\n```python\n(.*?)```", page, re.DOTALL))
    assert sorted(shown) == ["release_lines.py", "targets.py", "v1_url_quote.py"]
    for name, text in shown.items():
        assert text == (SET_SOURCE / name).read_text(encoding="utf-8"), f"{name}: the page shows another text"


def test_check_upstream_reads_a_sets_own_distributions(tmp_path, team_set):
    # the matrix on Flask releases (2.2.4 is upstream's fix), the gates on Werkzeug's (3.0.0 removed
    # the helpers); nothing of vLLM is read for a set whose gates and facts do not name it
    given, env = team_set
    releases = ["--release", "flask=2.2.2,2.2.4", "--release", "werkzeug=2.3.8,3.0.0"]
    args = [*given, "check-upstream", "--set", "flask-werkzeug3", *releases, "--json", "-q"]
    code, doc, err = patcher(*args, env=env)
    assert code == 0, err
    cells = {(c["patch"], c["version"]): c["status"] for c in doc["matrix"]}
    assert cells[("flask-werkzeug3:v1-url-quote", "2.2.2")] == "applies"
    assert cells[("flask-werkzeug3:v1-url-quote", "2.2.4")] == "not-selected"
    assert {g["first_release"] for g in doc["gates"]} == {"3.0.0"} and {g["status"] for g in doc["gates"]} == {"ok"}
    assert set(doc["releases_read"]) == {"werkzeug"} and not doc["bindings"], doc["releases_read"]  # no vLLM

    # a gate one release too early is what the check is for: exit 1, naming the patch and the release
    folder = copy_of_set(tmp_path, "flask_werkzeug3_early")
    args = ["--patches", str(folder), "check-upstream", "--set", "flask-werkzeug3-early", *releases, "--json", "-q"]
    targets = folder / "targets.py"
    targets.write_text(
        targets.read_text().replace('WERKZEUG_3 = {"werkzeug": ">=3.0.0"}', 'WERKZEUG_3 = {"werkzeug": ">=2.3.0"}')
    )
    code, doc, err = patcher(*args)
    assert code == 1, err
    assert any(g["status"] != "ok" and "2.3.8" in json_text(g) for g in doc["gates"]), doc["gates"]


def json_text(value) -> str:
    import json

    return json.dumps(value)


def test_new_from_edit_captures_a_hand_edit_that_apply_then_writes_byte_for_byte(tmp_path):
    # the seeds' story: an edit made by hand in site-packages, captured as a patch; the release
    # reinstalled, `apply` writes exactly the hand-edited bytes, and rollback the release's own
    python = flask_env(tmp_path)
    app = site_file(python, "flask/app.py")
    pristine = app.read_bytes()
    edited = (
        pristine.decode()
        .replace("from werkzeug.urls import url_quote\n", "from urllib.parse import quote as url_quote\n", 1)
        .replace(
            '            rv = f"{rv}#{url_quote(_anchor)}"\n',
            "            # as Flask 2.2.4 quotes it\n"
            "            rv = f\"{rv}#{url_quote(_anchor, safe='%!#$&()*+,/:;=?@')}\"\n",
            1,
        )
    )
    app.write_text(edited)
    imports = [str(python), "-c", "import flask"]
    assert subprocess.run(imports, capture_output=True, timeout=120).returncode == 0  # the edit works
    folder = tmp_path / "hand_edits"
    proc = run_patcher("new", "url-quote", "--from-edit", "flask", "--python", str(python), "--into", str(folder))
    assert proc.returncode == 0, proc.stderr
    module = (folder / "v1_url_quote.py").read_text()
    assert 'requires={"flask": "==2.2.2"}' in module and "SCOPE = ('Flask', 'url_for')" in module
    proc = run_patcher("test-patches", str(folder))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    code, doc, err = patcher("--patches", str(folder), "status", "--python", str(python), "--json")
    assert code == 3 and states(doc) == {"hand-edits:v1-url-quote": "modified"}, err  # not patcher's bytes yet
    app.write_bytes(pristine)  # what reinstalling Flask 2.2.2 does to the file
    code, doc, err = patcher("--patches", str(folder), "apply", "--python", str(python), "--json")
    assert code == 0, err
    assert app.read_text() == edited
    code, doc, err = patcher("--patches", str(folder), "rollback", "--python", str(python), "--json")
    assert code == 0 and app.read_bytes() == pristine, err

    # nothing edited any more (rolled back), and wrong uses: exit 2, nothing written
    for args, expected in (
        (["--from-edit", "flask", "--python", str(python)], "no file of flask in"),
        (["--from-edit", "no-such-dist", "--python", str(python)], "no-such-dist is not installed in"),
        (["--from-edit", "flask"], "--from-edit needs --python PATH"),
        (["--target", "flask:flask/app.py", "--from-edit", "flask"], "give either --target"),
    ):
        proc = run_patcher("new", "again", *args, "--into", str(folder))
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
