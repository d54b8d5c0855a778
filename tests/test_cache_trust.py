"""The controller's cache is trusted only when it is the running user's own (patcher.cache), and
what its declaration index names can only be patcher's own codemods."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from patcher.cache import untrusted_reason
from patcher.patchset.registry import load_patches
from tests.support.cli import patcher
from workbench.envs import site_file

TARGETS = sorted({p.target.path for p in load_patches()})
NOBODY = 65534


def contents(python: Path) -> dict[str, str]:
    return {rel: site_file(python, rel).read_text() for rel in TARGETS}


def test_a_cache_another_user_can_write_puts_nothing_of_theirs_into_a_target(tmp_path: Path, host_env):
    cache = tmp_path / "cache"
    env = {"PATCHER_CACHE": str(cache)}
    first, second = host_env(), host_env()
    code, _, err = patcher("plan", "--python", str(first), env=env)
    assert code == 6, err
    transforms = list((cache / "transforms").glob("*.json"))
    assert transforms, "plan keeps its transform results in the cache"
    for path in transforms:  # what another user with write access to the folder would do
        data = json.loads(path.read_text())
        data["result"] = data["result"] + "\nimport os; os.system('id > /tmp/owned')  # planted\n"
        path.write_text(json.dumps(data))
    os.chmod(cache / "transforms", 0o777)
    code, _, err = patcher("apply", "--no-verify", "--python", str(second), env=env)
    assert code == 0, err
    assert "warning: not using the cache" in err and "writable by group and others" in err, err
    assert all("# planted" not in text for text in contents(second).values())
    assert "already in place" not in err


@pytest.mark.skipif(os.geteuid() != 0, reason="a cache of another user needs root to make")
def test_a_cache_of_another_user_is_not_used(tmp_path: Path, host_env):
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chown(cache, NOBODY, NOBODY)
    os.chmod(tmp_path, 0o755)
    code, _, err = patcher("plan", "--python", str(host_env()), env={"PATCHER_CACHE": str(cache)})
    assert code == 6, err
    assert f"{cache} belongs to uid {NOBODY}" in err
    assert list(cache.iterdir()) == []  # nothing written into it either


def test_the_declaration_index_names_only_patchers_own_codemods(tmp_path: Path, host_env):
    cache = tmp_path / "cache"
    env = {"PATCHER_CACHE": str(cache), "PATCHER_NO_TRANSFORM_CACHE": "1"}
    python = host_env()
    assert patcher("status", "--python", str(python), env=env)[0] == 0
    (index,) = (cache / "declarations").glob("*.json")
    text = index.read_text()
    for planted in ('{"@codemod": ["os", "system"]}', '{"@codemod": ["patcher.patches.v1_block_hasher", "os.system"]}'):
        doc = json.loads(text)
        edits = doc["patches"][0]["edits"]["@tuple"]
        edits[0]["codemod"] = json.loads(planted)
        index.write_text(json.dumps(doc))
        code, _, err = patcher("plan", "--python", str(python), env=env)
        assert code == 6, err  # the index is read as stale: the patch modules are imported instead
        assert "Traceback" not in err


def test_untrusted_reasons(tmp_path: Path):
    root = tmp_path / "cache"
    (root / "transforms").mkdir(parents=True)
    os.chmod(root, 0o755)
    assert untrusted_reason(root / "transforms" / "x.json", root) is None
    os.chmod(root / "transforms", 0o775)
    assert untrusted_reason(root / "transforms" / "x.json", root) == f"{root / 'transforms'} is writable by its group"
    os.chmod(root / "transforms", 0o755)
    (root / "transforms" / "x.json").symlink_to("/etc/passwd")
    assert (
        untrusted_reason(root / "transforms" / "x.json", root) == f"{root / 'transforms' / 'x.json'} is a symbolic link"
    )
    outside = tmp_path / "elsewhere"
    assert "not inside the cache" in (untrusted_reason(outside, root) or "")


def test_the_demo_refuses_a_cache_others_can_write(tmp_path: Path):
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    code, _, err = patcher("demo", env={"PATCHER_CACHE": str(cache)})
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith("error: the cache"), err
    assert "chmod go-w" in err
